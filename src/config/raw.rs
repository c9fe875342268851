//! The policy file exactly as written. Every struct denies unknown fields.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::budget::{BudgetKey, Measure, Period};
use super::{ExpiredUsage, OnStoreError, Priority};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub defaults: RawDefaults,
    #[serde(default)]
    pub models: BTreeMap<String, RawModel>,
    #[serde(default)]
    pub pools: BTreeMap<String, RawPool>,
    /// Named sets of tenant settings a tenant takes by naming one (`plan: NAME`).
    #[serde(default)]
    pub plans: BTreeMap<String, RawTenant>,
    #[serde(default)]
    pub tenants: BTreeMap<String, RawTenant>,
    pub default_tenant: Option<RawTenant>,
    pub anonymous_tenant: Option<String>,
    pub leasing: Option<RawLeasing>,
    #[serde(default)]
    pub metrics: RawMetrics,
    pub ledger: Option<RawLedger>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLedger {
    pub max_len: Option<u64>,
    pub retention_ms: Option<u64>,
    pub file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLeasing {
    pub window_ms: Option<u64>,
    pub max_share: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMetrics {
    pub tenants: Option<Vec<String>>,
    pub unlisted_tenants: Option<u64>,
    pub budget_poll_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub listen: Option<String>,
    pub health_listen: Option<String>,
    pub admin_listen: Option<String>,
    pub policy_poll_ms: Option<u64>,
    pub tenant_header: Option<String>,
    pub plan_header: Option<String>,
    /// The Gateway API Inference Extension's objectives (`x-gateway-inference-objective`), each
    /// as the tier its requests are decided at.
    #[serde(default)]
    pub objectives: BTreeMap<String, Priority>,
    pub claimed_tenants: Option<u64>,
    #[serde(default)]
    pub budget_admins: Vec<String>,
    pub drain_timeout_ms: Option<u64>,
    pub tls: Option<RawTls>,
    pub log_format: Option<super::LogFormat>,
    pub worker_threads: Option<u64>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub cert: Option<String>,
    pub key: Option<String>,
    pub client_ca: Option<String>,
    #[serde(default)]
    pub allowed_clients: Vec<String>,
    pub reload_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    pub redis_url: Option<String>,
    pub redis_cluster: Option<Vec<String>>,
    pub connect_timeout_ms: Option<u64>,
    pub command_timeout_ms: Option<u64>,
    pub breaker: Option<RawBreaker>,
    pub local_factor: Option<f64>,
    pub max_memory_mb: Option<u64>,
    pub commit_window_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBreaker {
    pub failures: Option<u32>,
    pub open_ms: Option<u64>,
    pub max_open_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDefaults {
    pub lease_ttl_ms: Option<u64>,
    pub expired_usage: Option<ExpiredUsage>,
    pub record_retention_ms: Option<u64>,
    pub sweep_batch: Option<u32>,
    pub max_attempts: Option<u32>,
    pub concurrency_retry_ms: Option<u64>,
    pub adaptive_output: Option<RawAdaptive>,
    pub on_store_error: Option<OnStoreError>,
    pub shadow: Option<bool>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdaptive {
    pub quantile: f64,
    #[serde(default = "default_min_samples")]
    pub min_samples: u64,
    #[serde(default = "default_window")]
    pub window: u64,
}

fn default_min_samples() -> u64 {
    100
}

fn default_window() -> u64 {
    2000
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawModel {
    pub max_output_tokens: u64,
    /// The backend pool that serves this model, if capacity admission applies to it.
    pub pool: Option<String>,
    #[serde(default = "default_bytes_per_token")]
    pub bytes_per_token: f64,
    /// Learn bytes per prompt token from the counts responses report.
    #[serde(default = "yes")]
    pub learn_bytes_per_token: bool,
    #[serde(default = "default_max_prompt_tokens")]
    pub max_prompt_tokens: u64,
    pub price: Option<RawPrice>,
    /// What a prompt token read from the provider's cache counts in token limits and budgets, as a
    /// share of an input token (Anthropic bills 0.1, OpenAI 0.5 or 0.25, Gemini 0.25).
    #[serde(default = "one")]
    pub cache_read_weight: f64,
    /// What a prompt token written to the provider's cache counts (Anthropic bills 1.25 or 2).
    #[serde(default = "one")]
    pub cache_write_weight: f64,
    /// What an output token spent reasoning counts, as a share of an output token.
    #[serde(default = "one")]
    pub reasoning_weight: f64,
    /// Other names requests use for this model: an Azure deployment, a Bedrock inference
    /// profile, a dated version.
    #[serde(default)]
    pub aliases: Vec<String>,
}

/// A model's price, in the policy's currency per million tokens.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPrice {
    pub input_per_million: f64,
    pub output_per_million: f64,
    /// Prompt tokens read from the provider's cache; unset: the input price.
    pub cache_read_per_million: Option<f64>,
    /// Prompt tokens written to the provider's cache; unset: the input price.
    pub cache_write_per_million: Option<f64>,
    /// Output tokens spent reasoning; unset: the output price.
    pub reasoning_per_million: Option<f64>,
}

fn one() -> f64 {
    1.0
}

/// 128 Ki tokens: the context of most current models, so a prompt of unknown size is held in full.
fn default_max_prompt_tokens() -> u64 {
    131_072
}

fn default_bytes_per_token() -> f64 {
    super::DEFAULT_BYTES_PER_TOKEN
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPool {
    pub max_sequences: u64,
    pub prefill_tokens_per_second: f64,
    pub decode_tokens_per_second: f64,
    pub max_queue_delay_ms: u64,
    pub kv_cache_tokens: Option<u64>,
    #[serde(default)]
    pub tier_shares: RawShares,
    #[serde(default)]
    pub upstream_throttle: RawThrottle,
    /// Predict from what the responses show (speeds, output lengths) rather than from the
    /// figures above and each request's ceiling alone.
    #[serde(default = "yes")]
    pub calibrate: bool,
    /// Where a request that cannot start at once waits: `backend` or `tollgate`.
    #[serde(default)]
    pub queue: crate::config::PoolQueue,
    /// The limits of the provider account behind the pool, shared by every tenant whose model
    /// it serves: a scope's limits, but concurrency (that is `max_sequences`).
    pub provider_limits: Option<Limits>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawThrottle {
    #[serde(default = "yes")]
    pub enabled: bool,
    pub decrease: Option<f64>,
    pub min_share: Option<f64>,
    pub recover_per_second: Option<f64>,
    pub cooldown_ms: Option<u64>,
    pub max_retry_after_ms: Option<u64>,
}

impl Default for RawThrottle {
    fn default() -> Self {
        RawThrottle {
            enabled: true,
            decrease: None,
            min_share: None,
            recover_per_second: None,
            cooldown_ms: None,
            max_retry_after_ms: None,
        }
    }
}

fn yes() -> bool {
    true
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawShares {
    pub standard: Option<f64>,
    pub sheddable: Option<f64>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTenant {
    /// The plan whose settings this tenant takes, its own overriding them (see [`RawTenant::over`]).
    pub plan: Option<String>,
    #[serde(default)]
    pub limits: Limits,
    pub lease_ttl_ms: Option<u64>,
    pub expired_usage: Option<ExpiredUsage>,
    pub default_priority: Option<Priority>,
    pub max_priority: Option<Priority>,
    pub default_deadline_ms: Option<u64>,
    /// Its weight among the tenants of its tier contending for a pool (1 unless set).
    pub weight: Option<f64>,
    pub adaptive_output: Option<RawAdaptive>,
    pub on_store_error: Option<OnStoreError>,
    pub shadow: Option<bool>,
    pub strict: Option<bool>,
    /// The time zone its budgets' days, weeks and months turn in: an IANA name
    /// (`America/New_York`) or a fixed offset (`+09:00`); UTC unless it says.
    pub time_zone: Option<String>,
    /// Period budgets of the tenant's scope that degrade instead of refusing: past one, a request
    /// is admitted one tier lower and marked (`x-tollgate-soft-limit`).
    pub soft_limits: Option<Limits>,
    pub default_user: Option<Limits>,
    #[serde(default)]
    pub users: BTreeMap<String, Limits>,
    #[serde(default)]
    pub models: BTreeMap<String, Limits>,
}

impl RawTenant {
    /// This tenant's settings over its plan's: every setting it gives wins, limits one by one;
    /// its users and models join the plan's, its own winning a name both give.
    pub fn over(self, plan: &RawTenant) -> RawTenant {
        let joined = |mine: BTreeMap<String, Limits>, theirs: &BTreeMap<String, Limits>| {
            let mut all = theirs.clone();
            for (name, limits) in mine {
                let base = all.remove(&name).unwrap_or_default();
                all.insert(name, limits.over(&base));
            }
            all
        };
        RawTenant {
            plan: self.plan,
            limits: self.limits.over(&plan.limits),
            lease_ttl_ms: self.lease_ttl_ms.or(plan.lease_ttl_ms),
            expired_usage: self.expired_usage.or(plan.expired_usage),
            default_priority: self.default_priority.or(plan.default_priority),
            max_priority: self.max_priority.or(plan.max_priority),
            default_deadline_ms: self.default_deadline_ms.or(plan.default_deadline_ms),
            weight: self.weight.or(plan.weight),
            adaptive_output: self.adaptive_output.or(plan.adaptive_output),
            on_store_error: self.on_store_error.or(plan.on_store_error),
            shadow: self.shadow.or(plan.shadow),
            strict: self.strict.or(plan.strict),
            time_zone: self.time_zone.or_else(|| plan.time_zone.clone()),
            soft_limits: match (self.soft_limits, &plan.soft_limits) {
                (Some(mine), Some(theirs)) => Some(mine.over(theirs)),
                (mine, theirs) => mine.or_else(|| theirs.clone()),
            },
            default_user: match (self.default_user, &plan.default_user) {
                (Some(mine), Some(theirs)) => Some(mine.over(theirs)),
                (mine, theirs) => mine.or_else(|| theirs.clone()),
            },
            users: joined(self.users, &plan.users),
            models: joined(self.models, &plan.models),
        }
    }
}

/// The limits of one scope (tenant, user or model). Every field is optional; an absent one does
/// not limit. Budgets count over calendar periods in the tenant's time zone (`time_zone`, UTC
/// unless it says).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Refill rate of the token bucket.
    pub tokens_per_minute: Option<u64>,
    /// Capacity of the token bucket; defaults to one minute of refill.
    pub burst_tokens: Option<u64>,
    /// Refill rate of a bucket of prompt tokens alone (its capacity one minute's).
    pub input_tokens_per_minute: Option<u64>,
    /// Refill rate of a bucket of output tokens alone (its capacity one minute's).
    pub output_tokens_per_minute: Option<u64>,
    pub requests_per_minute: Option<u64>,
    pub max_concurrency: Option<u64>,
    pub tokens_per_hour: Option<u64>,
    pub tokens_per_day: Option<u64>,
    /// Monday to Sunday.
    pub tokens_per_week: Option<u64>,
    pub tokens_per_month: Option<u64>,
    pub input_tokens_per_hour: Option<u64>,
    pub input_tokens_per_day: Option<u64>,
    pub input_tokens_per_week: Option<u64>,
    pub input_tokens_per_month: Option<u64>,
    pub output_tokens_per_hour: Option<u64>,
    pub output_tokens_per_day: Option<u64>,
    pub output_tokens_per_week: Option<u64>,
    pub output_tokens_per_month: Option<u64>,
    /// Budgets in money, at the models' prices.
    pub cost_per_hour: Option<Money>,
    pub cost_per_day: Option<Money>,
    pub cost_per_week: Option<Money>,
    pub cost_per_month: Option<Money>,
}

impl Limits {
    /// These limits over `base`: each one given here wins, the rest are `base`'s.
    pub fn over(self, base: &Limits) -> Limits {
        Limits {
            tokens_per_minute: self.tokens_per_minute.or(base.tokens_per_minute),
            burst_tokens: self.burst_tokens.or(base.burst_tokens),
            input_tokens_per_minute: self.input_tokens_per_minute.or(base.input_tokens_per_minute),
            output_tokens_per_minute: self.output_tokens_per_minute.or(base.output_tokens_per_minute),
            requests_per_minute: self.requests_per_minute.or(base.requests_per_minute),
            max_concurrency: self.max_concurrency.or(base.max_concurrency),
            tokens_per_hour: self.tokens_per_hour.or(base.tokens_per_hour),
            tokens_per_day: self.tokens_per_day.or(base.tokens_per_day),
            tokens_per_week: self.tokens_per_week.or(base.tokens_per_week),
            tokens_per_month: self.tokens_per_month.or(base.tokens_per_month),
            input_tokens_per_hour: self.input_tokens_per_hour.or(base.input_tokens_per_hour),
            input_tokens_per_day: self.input_tokens_per_day.or(base.input_tokens_per_day),
            input_tokens_per_week: self.input_tokens_per_week.or(base.input_tokens_per_week),
            input_tokens_per_month: self.input_tokens_per_month.or(base.input_tokens_per_month),
            output_tokens_per_hour: self.output_tokens_per_hour.or(base.output_tokens_per_hour),
            output_tokens_per_day: self.output_tokens_per_day.or(base.output_tokens_per_day),
            output_tokens_per_week: self.output_tokens_per_week.or(base.output_tokens_per_week),
            output_tokens_per_month: self.output_tokens_per_month.or(base.output_tokens_per_month),
            cost_per_hour: self.cost_per_hour.or(base.cost_per_hour),
            cost_per_day: self.cost_per_day.or(base.cost_per_day),
            cost_per_week: self.cost_per_week.or(base.cost_per_week),
            cost_per_month: self.cost_per_month.or(base.cost_per_month),
        }
    }

    /// Every limit that is not a period budget, by its name: the buckets and the concurrency.
    pub fn rates(&self) -> [(&'static str, Option<u64>); 6] {
        [
            ("tokens_per_minute", self.tokens_per_minute),
            ("burst_tokens", self.burst_tokens),
            ("input_tokens_per_minute", self.input_tokens_per_minute),
            ("output_tokens_per_minute", self.output_tokens_per_minute),
            ("requests_per_minute", self.requests_per_minute),
            ("max_concurrency", self.max_concurrency),
        ]
    }

    /// A period budget's limit (money in nanos), if these limits set it.
    pub fn budget(&self, key: BudgetKey) -> Option<u64> {
        use Measure::{Cost, Input, Output, Tokens};
        use Period::{Day, Hour, Month, Week};
        let money = |m: Option<Money>| m.map(|m| m.0);
        match (key.measure, key.period) {
            (Tokens, Hour) => self.tokens_per_hour,
            (Tokens, Day) => self.tokens_per_day,
            (Tokens, Week) => self.tokens_per_week,
            (Tokens, Month) => self.tokens_per_month,
            (Input, Hour) => self.input_tokens_per_hour,
            (Input, Day) => self.input_tokens_per_day,
            (Input, Week) => self.input_tokens_per_week,
            (Input, Month) => self.input_tokens_per_month,
            (Output, Hour) => self.output_tokens_per_hour,
            (Output, Day) => self.output_tokens_per_day,
            (Output, Week) => self.output_tokens_per_week,
            (Output, Month) => self.output_tokens_per_month,
            (Cost, Hour) => money(self.cost_per_hour),
            (Cost, Day) => money(self.cost_per_day),
            (Cost, Week) => money(self.cost_per_week),
            (Cost, Month) => money(self.cost_per_month),
        }
    }

    /// Every period budget these limits set, in [`BudgetKey::all`]'s order.
    pub fn budgets(&self) -> impl Iterator<Item = (BudgetKey, u64)> + '_ {
        BudgetKey::all().filter_map(|k| self.budget(k).map(|limit| (k, limit)))
    }
}

/// An amount of money in the policy's currency, kept in billionths (nanos) so that every sum is
/// exact: written as a number (`12.5`), at most 5,000,000, with at most nine decimals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Money(pub u64);

/// Nanos in one unit of currency.
pub const NANOS: u64 = 1_000_000_000;
/// The largest amount a budget may name: its nanos stay well inside a double's exact integers.
pub const MAX_MONEY: u64 = 5_000_000;

impl Money {
    /// From an amount in currency units; `None` if it is negative, not finite, above
    /// [`MAX_MONEY`] or finer than a nano.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    pub fn from_units(units: f64) -> Option<Money> {
        if !(units.is_finite() && (0.0..=MAX_MONEY as f64).contains(&units)) {
            return None;
        }
        let nanos = (units * NANOS as f64).round();
        ((units * NANOS as f64 - nanos).abs() < 1e-3).then_some(Money(nanos as u64))
    }
}

impl std::fmt::Display for Money {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (units, nanos) = (self.0 / NANOS, self.0 % NANOS);
        let frac = format!("{nanos:09}");
        let frac = frac.trim_end_matches('0');
        if frac.is_empty() { write!(f, "{units}") } else { write!(f, "{units}.{frac}") }
    }
}

impl<'de> Deserialize<'de> for Money {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let units = f64::deserialize(d)?;
        Money::from_units(units).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "{units} is not an amount of money: 0 to {MAX_MONEY}, at most nine decimals"
            ))
        })
    }
}
