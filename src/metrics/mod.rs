//! What an operator graphs: decisions, their latency, the store's latency and errors, the tokens
//! and holds that move through the books, and the degraded mode in force. One set of
//! OpenTelemetry instruments feeds both the Prometheus endpoint ([`exposition`], on the admin
//! port) and OTLP, when an endpoint is configured.
//!
//! Tenant-labelled series are bounded: a tenant has series of its own when the policy names it
//! (or `metrics.tenants` lists it); every other tenant (those under `default_tenant`, however many)
//! is counted as `other`. Model labels are the policy's models, reasons and tiers are fixed sets.

pub mod exposition;
pub mod store;

use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter, MeterProvider as _, ObservableGauge};

use crate::config::Policy;
use crate::hold::{Ending, Usage};

/// The label a tenant outside the bounded set is counted under.
pub const OTHER_TENANT: &str = "other";

/// Decision latency buckets, in seconds: a decision takes tens of microseconds to a few
/// milliseconds, and the store's timeout bounds it at a quarter second.
const LATENCY_BUCKETS: [f64; 14] =
    [0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

/// Commits a batch carries: at most `admission::batch::MOST` (64).
const BATCH_BUCKETS: [f64; 7] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0];

/// Waits for a pool's slot, in seconds: a slot comes in milliseconds to seconds, and Envoy's
/// ext_authz timeout (5 s as shipped) bounds the wait.
const WAIT_BUCKETS: [f64; 11] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// The GenAI semantic conventions' advice for `gen_ai.client.token.usage`.
const TOKEN_BUCKETS: [f64; 14] = [
    1.0,
    4.0,
    16.0,
    64.0,
    256.0,
    1024.0,
    4096.0,
    16384.0,
    65536.0,
    262_144.0,
    1_048_576.0,
    4_194_304.0,
    16_777_216.0,
    67_108_864.0,
];

/// How far a hold's usage came from what it held (used ÷ held): 1 is a perfect estimate, below 1
/// budget held and not used, above 1 an overrun.
const RATIO_BUCKETS: [f64; 12] = [0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0];

/// How a decision went, as the `outcome` label says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Admitted,
    Denied,
    /// Admitted without a hold: the store was unreachable and the tenant's mode let it through.
    Unmetered,
    /// Admitted (and held) although the tenant's limits would have refused it: the tenant is in
    /// shadow. The reason is the refusal's.
    Shadow,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Admitted => "admitted",
            Outcome::Denied => "denied",
            Outcome::Unmetered => "unmetered",
            Outcome::Shadow => "shadow",
        }
    }
}

/// An estimate behind a hold: the output reservation, or the prompt's size in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Estimate {
    Output,
    Prompt,
}

impl Estimate {
    pub fn as_str(self) -> &'static str {
        match self {
            Estimate::Output => "output",
            Estimate::Prompt => "prompt",
        }
    }
}

/// One decision, as the metrics record it.
#[derive(Debug, Clone, Copy)]
pub struct Decided<'a> {
    pub tenant: &'a str,
    pub model: Option<&'a str>,
    pub tier: &'static str,
    pub outcome: Outcome,
    /// `ok` for an admission, else the denial's (or, in shadow, the would-be denial's) reason code.
    pub reason: &'static str,
    /// From the call's arrival to its answer, and the part of it spent waiting for a slot of a
    /// pool that queues in tollgate.
    pub took: Duration,
    pub waited: Duration,
}

/// The instruments. Cheap to clone (each is a handle); a [`Metrics::disabled`] set records nothing.
#[derive(Clone)]
pub struct Metrics {
    decisions: Counter<u64>,
    decision_duration: Histogram<f64>,
    pool_wait: Histogram<f64>,
    degraded: Counter<u64>,
    tokens: Counter<u64>,
    cost: Counter<u64>,
    holds: Counter<u64>,
    usage_ratio: Histogram<f64>,
    estimate_ratio: Histogram<f64>,
    token_usage: Histogram<u64>,
    pub(crate) store_duration: Histogram<f64>,
    pub(crate) store_errors: Counter<u64>,
    commit_batch: Histogram<u64>,
    reloads: Counter<u64>,
    /// Which tenants have series of their own, and the policy's version: both follow reloads.
    labels: Arc<RwLock<TenantLabels>>,
    version: Arc<RwLock<String>>,
    _policy_info: ObservableGauge<u64>,
    /// Each labelled tenant's period budgets as last read (`tollgate.budget.*`).
    budgets: Arc<RwLock<BudgetLevels>>,
    _budget_gauges: [ObservableGauge<f64>; 3],
    /// Each pool's calibrated speeds per model, as last learned (`tollgate.pool.*.speed`).
    speeds: Arc<RwLock<PoolSpeeds>>,
    _speed_gauges: [ObservableGauge<f64>; 2],
    /// False for [`Metrics::disabled`]: nothing is recorded, and no labels are built.
    enabled: bool,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// Pool, model → (prefill, decode) tokens a second, as calibrated.
type PoolSpeeds = std::collections::BTreeMap<(String, String), (f64, f64)>;

/// A tenant's period budgets as last read: (budget name, limit, remaining, seconds to its reset).
type BudgetLevels = std::collections::HashMap<String, Vec<(String, u64, i64, f64)>>;

/// Which tenants have series of their own: the policy's (or `metrics.tenants`), and the first
/// `metrics.unlisted_tenants` others seen (kept across reloads, so a reload never lets more in).
#[derive(Debug, Default)]
pub struct TenantLabels {
    named: std::collections::HashSet<String>,
    unlisted: RwLock<std::collections::HashSet<String>>,
    most_unlisted: usize,
}

impl TenantLabels {
    /// `metrics.tenants` if the policy lists them, else every tenant it names.
    pub fn of(policy: &Policy) -> TenantLabels {
        let named = match &policy.metrics.tenants {
            Some(listed) => listed.iter().cloned().collect(),
            None => policy.tenants.keys().cloned().collect(),
        };
        TenantLabels { named, unlisted: RwLock::default(), most_unlisted: policy.metrics.unlisted_tenants }
    }

    pub fn label<'a>(&self, tenant: &'a str) -> &'a str {
        if self.named.contains(tenant) {
            return tenant;
        }
        if self.most_unlisted == 0 {
            return OTHER_TENANT;
        }
        if self.unlisted.read().unwrap_or_else(PoisonError::into_inner).contains(tenant) {
            return tenant;
        }
        let mut unlisted = self.unlisted.write().unwrap_or_else(PoisonError::into_inner);
        if unlisted.len() < self.most_unlisted {
            unlisted.insert(tenant.to_string());
            return tenant;
        }
        if unlisted.contains(tenant) { tenant } else { OTHER_TENANT }
    }
}

impl Metrics {
    /// Instruments on `meter`, labelling tenants as `labels` says.
    pub fn new(meter: &Meter, labels: TenantLabels) -> Metrics {
        let version = Arc::new(RwLock::new(String::new()));
        let seen = Arc::clone(&version);
        let policy_info = meter
            .u64_observable_gauge("tollgate.policy.info")
            .with_description("1, labelled with the version of the policy in force")
            .with_callback(move |o| {
                let version = seen.read().unwrap_or_else(PoisonError::into_inner).clone();
                o.observe(1, &[KeyValue::new("version", version)]);
            })
            .build();
        let budgets: Arc<RwLock<BudgetLevels>> = Arc::default();
        let gauge =
            |name: &'static str, description: &'static str, unit: &'static str, pick: fn(u64, i64, f64) -> f64| {
                let seen = Arc::clone(&budgets);
                let builder = meter.f64_observable_gauge(name).with_description(description);
                let builder = if unit.is_empty() { builder } else { builder.with_unit(unit) };
                builder
                    .with_callback(move |o| {
                        let levels = seen.read().unwrap_or_else(PoisonError::into_inner);
                        for (tenant, budgets) in levels.iter() {
                            for (budget, limit, remaining, reset) in budgets {
                                let labels =
                                    [KeyValue::new("tenant", tenant.clone()), KeyValue::new("budget", budget.clone())];
                                o.observe(pick(*limit, *remaining, *reset), &labels);
                            }
                        }
                    })
                    .build()
            };
        #[allow(clippy::cast_precision_loss)]
        let budget_gauges = [
            gauge(
                "tollgate.budget.limit",
                "A period budget of a tenant's scope (tokens, or nanos for money)",
                "",
                |l, _, _| l as f64,
            ),
            gauge(
                "tollgate.budget.remaining",
                "What a period budget has left, live holds counted as used",
                "",
                |_, r, _| r as f64,
            ),
            gauge("tollgate.budget.reset", "Seconds until a period budget resets", "s", |_, _, s| s),
        ];
        let speeds: Arc<RwLock<PoolSpeeds>> = Arc::default();
        let speed_gauge = |name: &'static str, description: &'static str, pick: fn((f64, f64)) -> f64| {
            let seen = Arc::clone(&speeds);
            meter
                .f64_observable_gauge(name)
                .with_description(description)
                .with_unit("{token}/s")
                .with_callback(move |o| {
                    for ((pool, model), s) in seen.read().unwrap_or_else(PoisonError::into_inner).iter() {
                        o.observe(
                            pick(*s),
                            &[KeyValue::new("pool", pool.clone()), KeyValue::new("model", model.clone())],
                        );
                    }
                })
                .build()
        };
        let speed_gauges = [
            speed_gauge(
                "tollgate.pool.prefill.speed",
                "A pool's prefill speed for a model as its responses show it (prompt tokens over time to first token)",
                |s| s.0,
            ),
            speed_gauge(
                "tollgate.pool.decode.speed",
                "A pool's decode speed of one sequence for a model as its streams show it",
                |s| s.1,
            ),
        ];
        Metrics {
            budgets,
            _budget_gauges: budget_gauges,
            speeds,
            _speed_gauges: speed_gauges,
            decisions: meter
                .u64_counter("tollgate.decisions")
                .with_description("Admission decisions, by tenant, model, tier, outcome and reason")
                .with_unit("{decision}")
                .build(),
            decision_duration: meter
                .f64_histogram("tollgate.decision.duration")
                .with_description("Time to decide, from the request's arrival to its answer, less any wait for a pool's slot")
                .with_unit("s")
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build(),
            pool_wait: meter
                .f64_histogram("tollgate.pool.wait")
                .with_description("Time a request waited in tollgate for a slot of a pool that queues here, by tier and outcome")
                .with_unit("s")
                .with_boundaries(WAIT_BUCKETS.to_vec())
                .build(),
            degraded: meter
                .u64_counter("tollgate.degraded.decisions")
                .with_description("Decisions made while the store was unreachable, by the tenant's on_store_error mode")
                .with_unit("{decision}")
                .build(),
            cost: meter
                .u64_counter("tollgate.cost")
                .with_description("What commits charged in money at the models' prices, in nanos of the policy's currency")
                .with_unit("{nano}")
                .build(),
            tokens: meter
                .u64_counter("tollgate.tokens")
                .with_description("Tokens through the books: reserved at admission; committed, refunded or overrun at settlement")
                .with_unit("{token}")
                .build(),
            holds: meter
                .u64_counter("tollgate.holds")
                .with_description("Holds settled (state: committed, late_committed, released, expired), by how their request ended (ending: completed, metered, metered_capped, as_held, client_left, upstream_refused, upstream_error, released, expired)")
                .with_unit("{hold}")
                .build(),
            usage_ratio: meter
                .f64_histogram("tollgate.hold.usage")
                .with_description("Tokens a committed hold used over tokens it held (the estimator's error)")
                .with_unit("1")
                .with_boundaries(RATIO_BUCKETS.to_vec())
                .build(),
            estimate_ratio: meter
                .f64_histogram("tollgate.estimate.ratio")
                .with_description("Reported tokens over the estimate held for them, by estimate (output, prompt), tenant and model")
                .with_unit("1")
                .with_boundaries(RATIO_BUCKETS.to_vec())
                .build(),
            // The GenAI semantic conventions' token usage histogram (its bucket boundaries too),
            // from the counts each committed request reported.
            token_usage: meter
                .u64_histogram("gen_ai.client.token.usage")
                .with_description("Tokens a request used, by gen_ai.token.type (input, output), model and tenant")
                .with_unit("{token}")
                .with_boundaries(TOKEN_BUCKETS.to_vec())
                .build(),
            store_duration: meter
                .f64_histogram("tollgate.store.duration")
                .with_description("Store script calls, by script and result")
                .with_unit("s")
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build(),
            store_errors: meter
                .u64_counter("tollgate.store.errors")
                .with_description("Store calls that failed, by script and error (unavailable: unreachable, timed out or circuit open)")
                .with_unit("{error}")
                .build(),
            commit_batch: meter
                .u64_histogram("tollgate.commit.batch")
                .with_description("Commits from responses each batch carried to the store (store.commit_window_ms)")
                .with_unit("{commit}")
                .with_boundaries(BATCH_BUCKETS.to_vec())
                .build(),
            reloads: meter
                .u64_counter("tollgate.policy.reloads")
                .with_description("Policy reloads, by result: ok, or error (the policy in force was kept)")
                .with_unit("{reload}")
                .build(),
            labels: Arc::new(RwLock::new(labels)),
            version,
            _policy_info: policy_info,
            enabled: true,
        }
    }

    /// Instruments that record nothing: for benches and tests that do not look.
    pub fn disabled() -> Metrics {
        let meter = opentelemetry::metrics::noop::NoopMeterProvider::new().meter("tollgate");
        Metrics { enabled: false, ..Metrics::new(&meter, TenantLabels::default()) }
    }

    /// Whether anything is recorded: callers skip working out what to record when not.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    fn tenant(&self, tenant: &str) -> KeyValue {
        let labels = self.labels.read().unwrap_or_else(PoisonError::into_inner);
        KeyValue::new("tenant", labels.label(tenant).to_string())
    }

    /// A policy is in force: its version, and its tenants' labels.
    pub fn policy_loaded(&self, policy: &Policy) {
        let mut labels = self.labels.write().unwrap_or_else(PoisonError::into_inner);
        let seen = std::mem::take(&mut *labels.unlisted.write().unwrap_or_else(PoisonError::into_inner));
        *labels = TenantLabels { unlisted: RwLock::new(seen), ..TenantLabels::of(policy) };
        self.version.write().unwrap_or_else(PoisonError::into_inner).clone_from(&policy.version);
    }

    /// What `tenant`'s period budgets have left, as just read; `None`: it has none (or no longer
    /// a series of its own).
    pub fn budgets_read(&self, tenant: &str, levels: Option<Vec<(String, u64, i64, f64)>>) {
        if !self.enabled {
            return;
        }
        let mut seen = self.budgets.write().unwrap_or_else(PoisonError::into_inner);
        match levels {
            Some(levels) => seen.insert(tenant.to_string(), levels),
            None => seen.remove(tenant),
        };
    }

    /// A pool's speeds for a model, as just calibrated (tokens a second).
    pub fn pool_speeds(&self, pool: &str, model: &str, prefill: f64, decode: f64) {
        if !self.enabled {
            return;
        }
        let mut seen = self.speeds.write().unwrap_or_else(PoisonError::into_inner);
        seen.insert((pool.to_string(), model.to_string()), (prefill, decode));
    }

    /// The tenants whose budgets have series of their own: the policy's labelled tenants, and the
    /// unlisted ones that have a series of their own (`metrics.unlisted_tenants`; a tenant admitted
    /// under a plan its token names, or the default one).
    pub fn budget_tenants(&self) -> Vec<String> {
        let labels = self.labels.read().unwrap_or_else(PoisonError::into_inner);
        let mut tenants: Vec<String> = labels.named.iter().cloned().collect();
        // (Those seen before a reload to `unlisted_tenants: 0` are "other" now.)
        if labels.most_unlisted > 0 {
            let unlisted = labels.unlisted.read().unwrap_or_else(PoisonError::into_inner);
            tenants.extend(unlisted.iter().filter(|t| !labels.named.contains(*t)).cloned());
        }
        tenants
    }

    /// Forgets the budget gauges of every tenant but `tenants` (those that no longer have a
    /// series of their own).
    pub fn keep_budgets_of(&self, tenants: &[String]) {
        if !self.enabled {
            return;
        }
        let kept: std::collections::HashSet<&str> = tenants.iter().map(String::as_str).collect();
        let mut seen = self.budgets.write().unwrap_or_else(PoisonError::into_inner);
        seen.retain(|tenant, _| kept.contains(tenant.as_str()));
    }

    /// A batch of `commits` commits from responses went to the store.
    pub fn commit_batch(&self, commits: usize) {
        if self.enabled {
            self.commit_batch.record(u64::try_from(commits).unwrap_or(u64::MAX), &[]);
        }
    }

    /// A reload was tried: `ok`, or `error` when the new file was refused.
    pub fn reload_tried(&self, ok: bool) {
        self.reloads.add(1, &[KeyValue::new("result", if ok { "ok" } else { "error" })]);
    }

    /// One decision: counted, and its latency.
    pub fn decided(&self, d: &Decided<'_>) {
        if !self.enabled {
            return;
        }
        let mut attributes = vec![
            self.tenant(d.tenant),
            KeyValue::new("outcome", d.outcome.as_str()),
            KeyValue::new("reason", d.reason),
            KeyValue::new("tier", d.tier),
        ];
        if let Some(model) = d.model {
            attributes.push(KeyValue::new("gen_ai.request.model", model.to_string()));
        }
        self.decisions.add(1, &attributes);
        let outcome = KeyValue::new("outcome", d.outcome.as_str());
        self.decision_duration.record(d.took.saturating_sub(d.waited).as_secs_f64(), std::slice::from_ref(&outcome));
        if !d.waited.is_zero() {
            self.pool_wait.record(d.waited.as_secs_f64(), &[outcome, KeyValue::new("tier", d.tier)]);
        }
    }

    /// A decision the tenant's store-down mode made.
    pub fn degraded(&self, tenant: &str, mode: &'static str, outcome: Outcome) {
        if !self.enabled {
            return;
        }
        self.degraded
            .add(1, &[self.tenant(tenant), KeyValue::new("mode", mode), KeyValue::new("outcome", outcome.as_str())]);
    }

    /// Tokens held by an admission.
    pub fn reserved(&self, tenant: &str, tokens: u64) {
        if !self.enabled {
            return;
        }
        self.tokens.add(tokens, &[self.tenant(tenant), KeyValue::new("event", "reserved")]);
    }

    /// A hold settled by a commit: its state, and where its tokens went.
    pub fn committed(&self, tenant: &str, u: &Usage) {
        if !self.enabled {
            return;
        }
        let tenant = self.tenant(tenant);
        let &Usage { late, used, held, refunded, overrun, cost_nanos, .. } = u;
        if cost_nanos > 0 {
            self.cost.add(cost_nanos, std::slice::from_ref(&tenant));
        }
        let state = if late { "late_committed" } else { "committed" };
        let ending = u.ending.map_or("unknown", Ending::as_str);
        self.holds.add(1, &[tenant.clone(), KeyValue::new("state", state), KeyValue::new("ending", ending)]);
        for (event, n) in [("committed", used), ("refunded", refunded), ("overrun", overrun)] {
            if n > 0 {
                self.tokens.add(n, &[tenant.clone(), KeyValue::new("event", event)]);
            }
        }
        if held > 0 && !late {
            #[allow(clippy::cast_precision_loss)]
            self.usage_ratio.record(used as f64 / held as f64, &[tenant]);
        }
    }

    /// How far an estimate was from what the commit reported: `actual` over `estimated` tokens
    /// (nothing is recorded for an estimate of zero).
    pub fn estimated(&self, tenant: &str, model: &str, estimate: Estimate, actual: u64, estimated: u64) {
        if !self.enabled {
            return;
        }
        if estimated == 0 {
            return;
        }
        #[allow(clippy::cast_precision_loss)]
        let ratio = actual as f64 / estimated as f64;
        self.estimate_ratio.record(
            ratio,
            &[
                self.tenant(tenant),
                KeyValue::new("gen_ai.request.model", model.to_string()),
                KeyValue::new("estimate", estimate.as_str()),
            ],
        );
    }

    /// What a committed request reported it used, as the GenAI conventions count it.
    pub fn token_usage(&self, tenant: &str, model: &str, input: u64, output: u64) {
        if !self.enabled {
            return;
        }
        for (kind, n) in [("input", input), ("output", output)] {
            self.token_usage.record(
                n,
                &[
                    self.tenant(tenant),
                    KeyValue::new("gen_ai.request.model", model.to_string()),
                    KeyValue::new("gen_ai.token.type", kind),
                ],
            );
        }
    }

    /// A hold given back unused; `ending` says why.
    pub fn released(&self, tenant: &str, refunded: u64, ending: Ending) {
        if !self.enabled {
            return;
        }
        let tenant = self.tenant(tenant);
        let labels = [tenant.clone(), KeyValue::new("state", "released"), KeyValue::new("ending", ending.as_str())];
        self.holds.add(1, &labels);
        if refunded > 0 {
            self.tokens.add(refunded, &[tenant, KeyValue::new("event", "refunded")]);
        }
    }

    /// A hold whose owner never came back, settled by its lease.
    pub fn expired(&self, tenant: &str) {
        if !self.enabled {
            return;
        }
        let labels = [self.tenant(tenant), KeyValue::new("state", "expired"), KeyValue::new("ending", "expired")];
        self.holds.add(1, &labels);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_unlisted_tenants_have_series_of_their_own_and_no_more_after_a_reload() {
        let yaml = "models:\n  m: { max_output_tokens: 10 }\ntenants:\n  acme: {}\ndefault_tenant: {}\n\
                    metrics:\n  unlisted_tenants: 2\n";
        let policy = Policy::parse("m.yaml", yaml).unwrap();
        let labels = TenantLabels::of(&policy);
        let seen: Vec<&str> = ["acme", "t1", "t2", "t3", "t1"].iter().map(|t| labels.label(t)).collect();
        assert_eq!(seen, ["acme", "t1", "t2", OTHER_TENANT, "t1"]);
        let metrics = Metrics::disabled();
        *metrics.labels.write().unwrap() = labels;
        metrics.policy_loaded(&policy);
        let labels = metrics.labels.read().unwrap();
        assert_eq!((labels.label("t2"), labels.label("t4")), ("t2", OTHER_TENANT), "the reload kept who was seen");
        let none = TenantLabels::of(&Policy::parse("m.yaml", "models:\n  m: { max_output_tokens: 10 }\n").unwrap());
        assert_eq!(none.label("t1"), OTHER_TENANT, "by default, every unlisted tenant is other");
    }
}
