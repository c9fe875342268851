//! Attributes + policy + store → [`Decision`]. Plain Rust types only: the gRPC edge converts to and
//! from these, and nothing here knows about tonic.
//!
//! Everything that can be decided without the store is decided first (identity, model, bounds,
//! unsatisfiable size), so a bad request costs no round trip and can never charge anything.
//!
//! # Two key spaces
//!
//! A tenant's keys share the tenant's hash tag; a backend pool is shared by every tenant, so its
//! keys carry the pool's tag and, on a Redis Cluster, may live on another node. No one script can
//! touch both, so a reserve runs two legs, in this order:
//!
//! 1. **Pool leg** (`pool_reserve.lua`): refuse with `deadline` or `queue_full`, or hold the
//!    request's predicted work in the pool under the new reservation id.
//! 2. **Tenant leg** (`reserve.lua`): refuse on quota, or hold the tokens.
//! 3. If the tenant leg did not hold this id (refused, failed, or returned an earlier hold for the
//!    same idempotency key), **release the pool leg** (`pool_release.lua`).
//!
//! So a tenant is never charged for a request the pool refuses, and pool capacity held for a
//! request the tenant refused is given back at once. A leg whose store call failed may still have
//! run (the reply, not the call, may be what was lost), so it is released too. If the process dies
//! between 1 and 3, the pool hold's lease (the tenant's lease TTL) reclaims it. Commit and Release
//! settle the tenant leg first, then release the pool leg by id; pool release is idempotent, so a
//! repeated commit (which retries a pool release the first could not make), a hold already swept,
//! or a retry after a crash between the two changes nothing. Renew extends the pool lease only
//! after the tenant hold was renewed.
//!
//! # Nobody waiting
//!
//! A caller may give up while the legs run (Envoy's ext_authz timeout, a gRPC deadline): tonic then
//! drops the call's future. The legs therefore run on a task of their own, to completion, and hand
//! their decision over a channel; a hold whose decision nobody received is released at once, since
//! the request it was for will never reach the backend.

// Token arithmetic: no unchecked +, -, * (see Cargo.toml's [lints] for the casts).
#![warn(clippy::arithmetic_side_effects)]

pub mod body;
mod decision;
pub mod ids;
mod lease;
mod local;
pub mod retry;
pub mod usage;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

pub use decision::{Admitted, Decision, Denial, Reason};
use tokio::sync::oneshot;

pub use crate::config::Priority;
use crate::config::names;
use crate::config::{Limits, Money, OnStoreError, Policy, PoolPolicy, Price, TenantPolicy};
use crate::estimate::{self, PromptSize};
use crate::metrics::{Decided, Estimate, Metrics, Outcome};
pub use crate::store::KeyRepeat;
use crate::store::clock::{Clock, SystemClock};
use crate::store::{
    CommitOutcome, Counted, EstimateView, Forwarded, Headroom, KeyCall, Learning, PoolCall, PoolOutcome, PoolRefusal,
    PoolView, Protocol, Refusal, ReleaseOutcome, RenewOutcome, ReserveCall, ReserveOutcome, ReserveReply, ScopeLimits,
    Store, StoreError, ThrottleCall, keys,
};
use lease::{Ask, AskScope, Leases, Local};
use local::LocalLimits;

/// The largest token count tollgate accepts anywhere: a prompt, an output, a commit's counts. Far
/// above any model's context, and small enough that no sum of them nears 2^53, the largest integer
/// Lua's numbers hold exactly.
pub const MAX_TOKEN_COUNT: u64 = 1_000_000_000;

/// The largest body size (`content-length`, `prompt_bytes`) a prompt estimate starts from: 1 TiB.
pub const MAX_PROMPT_BYTES: u64 = 1 << 40;

/// One request, as admission sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attributes {
    /// Verified tenant identity; `None` when the request carried none.
    pub tenant: Option<String>,
    pub user: Option<String>,
    pub model: Option<String>,
    /// The claimed tier; `None` takes the tenant's default.
    pub priority: Option<Priority>,
    /// Relative deadline (ms); `None` takes the tenant's default.
    pub deadline_ms: Option<u64>,
    pub idempotency: Option<IdempotencyKey>,
    pub prompt: PromptSize,
    /// The caller's output ceiling.
    pub max_tokens: Option<u64>,
    pub stream: bool,
}

/// A request's idempotency key, and what a repeat of it means on the interface it came by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey {
    pub key: String,
    pub repeat: KeyRepeat,
}

/// A Commit / Renew / Release that could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    #[error("{0:?} is not a reservation id tollgate issued")]
    BadReservationId(String),
    #[error("{0}")]
    BadName(String),
    #[error("{what} {value} is above the maximum of {MAX_TOKEN_COUNT}")]
    TooLarge { what: &'static str, value: u64 },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The admission service over a store. Shared (`Arc`) by the gRPC services, because a reserve
/// runs its legs on a task of its own.
#[derive(Debug)]
pub struct Admission<S> {
    /// The policy in force: swapped whole by [`Admission::reload`]; each decision plans from one
    /// snapshot of it.
    policy: RwLock<Arc<Policy>>,
    protocol: Protocol<S>,
    /// The latest output estimate each (tenant, model) reserve returned, for the pool leg: it runs
    /// before the tenant leg and on another slot, so it cannot read the estimate itself. The store
    /// keeps the truth; this is this replica's most recent look at it. By tenant, then model, so
    /// a lookup borrows the names instead of building a key.
    seen_estimates: RwLock<HashMap<String, HashMap<String, u64>>>,
    /// This replica's slices and leased holds, when the policy leases.
    leases: Option<Leases>,
    /// This replica's name: in leased reservation ids, and in its heartbeat.
    replica: String,
    /// Admission from memory while the store is unreachable (`on_store_error: local`).
    local: LocalLimits,
    metrics: Metrics,
}

/// Tenants whose last output estimate this replica remembers, at most.
const MAX_SEEN_ESTIMATES: usize = 100_000;

/// How often a replica says it is alive, and how long it counts after its last heartbeat.
pub const HEARTBEAT_MS: u64 = 1_000;
pub const HEARTBEAT_TTL_MS: u64 = 3 * HEARTBEAT_MS;

/// How long an output estimate outlives its last commit: a week, or the tenant's idle TTL if longer.
const ESTIMATE_TTL_MS: u64 = 7 * 86_400_000;

impl<S: Store> Admission<S> {
    pub fn new(policy: Arc<Policy>, protocol: Protocol<S>) -> Self {
        Admission::with_clock(policy, protocol, Arc::new(SystemClock))
    }

    /// With the clock leased holds keep their leases by (the embedded store's, in tests).
    pub fn with_clock(policy: Arc<Policy>, protocol: Protocol<S>, clock: Arc<dyn Clock>) -> Self {
        let replica = ids::new_replica_id().unwrap_or_else(|e| {
            // Without the OS's randomness, the process id and start time still name a replica
            // apart from its peers (ids themselves are refused without it).
            tracing::warn!(error = %e, "no randomness for the replica id; using the process id");
            format!("{:06x}{:06x}", std::process::id() & 0xff_ffff, clock.now_ms() & 0xff_ffff)
        });
        let leases = policy
            .leasing
            .map(|settings| Leases::new(replica.clone(), settings, Arc::clone(&clock), policy.record_retention_ms));
        let local = LocalLimits::new(policy.store.local_factor);
        Admission {
            policy: RwLock::new(policy),
            protocol,
            seen_estimates: RwLock::new(HashMap::new()),
            leases,
            replica,
            local,
            metrics: Metrics::disabled(),
        }
    }

    /// Records decisions and settlements into `metrics`.
    #[must_use]
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Leased holds this replica keeps in memory for a tenant: (live, settled and remembered).
    pub fn leased_holds(&self, tenant: &str) -> (usize, usize) {
        self.leases.as_ref().map_or((0, 0), |l| l.held(tenant))
    }

    /// This replica's name in leased reservation ids, when the policy leases.
    pub fn replica(&self) -> Option<&str> {
        self.leases.as_ref().map(|l| l.replica.as_str())
    }

    /// Says this replica is alive, and counts the replicas on the store, for `on_store_error:
    /// local`; returns the count. A store that does not answer keeps the last count.
    pub async fn heartbeat(&self) -> Result<u64, AdmissionError> {
        let replicas = self.protocol.heartbeat(&self.replica, HEARTBEAT_TTL_MS).await?;
        self.local.counted(replicas);
        Ok(replicas)
    }

    /// The replicas this one last counted.
    pub fn replicas(&self) -> u64 {
        self.local.replicas()
    }

    /// Heartbeats every [`HEARTBEAT_MS`] until `shutdown`.
    pub async fn run_heartbeat(&self, shutdown: tokio_util::sync::CancellationToken) {
        let mut ticks = tokio::time::interval(std::time::Duration::from_millis(HEARTBEAT_MS));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {
                    if let Err(e) = self.heartbeat().await {
                        tracing::debug!(error = %e, replicas = self.replicas(), "heartbeat failed; keeping the last count");
                    }
                }
                () = shutdown.cancelled() => break,
            }
        }
    }

    /// Puts `new` in force for every decision from now on, and returns the names of the
    /// settings it could not apply: a running tollgate keeps its ports, TLS, store and leasing
    /// until a restart. Holds already taken keep their own terms (their lease, and what their
    /// expiry charges, were fixed when they were taken); leased slices are drawn again under the
    /// new limits before the next decision from them.
    pub fn reload(&self, mut new: Policy) -> Vec<&'static str> {
        let old = self.policy();
        let kept = old.restart_only_changes(&new);
        new.server = old.server.clone();
        new.store = old.store.clone();
        new.leasing = old.leasing;
        new.ledger = old.ledger.clone();
        let new = Arc::new(new);
        *self.policy.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::clone(&new);
        if let Some(leases) = &self.leases {
            leases.policy_changed(&new);
        }
        self.metrics.policy_loaded(&new);
        kept
    }

    /// The metrics this admission records into.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The policy in force now.
    pub fn policy(&self) -> Arc<Policy> {
        Arc::clone(&self.policy.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    pub fn protocol(&self) -> &Protocol<S> {
        &self.protocol
    }

    /// The reserve phase. The legs run to completion even if the caller stops waiting, and a hold
    /// whose decision nobody received is released (see the module's "Nobody waiting").
    pub async fn reserve(self: &Arc<Self>, a: &Attributes) -> Decision {
        let start = std::time::Instant::now();
        let decision = self.decide(a).await;
        self.record(a, &decision, start.elapsed());
        decision
    }

    /// Counts a decision, under labels drawn from bounded sets: the tenant's label, a model the
    /// policy serves (any other name a client sent is `other`), the tier, the reason.
    fn record(&self, a: &Attributes, decision: &Decision, took: std::time::Duration) {
        if !self.metrics.enabled() {
            return;
        }
        let policy = self.policy();
        let tenant = a.tenant.as_deref().or(policy.anonymous_tenant.as_deref()).unwrap_or("");
        let tp = policy.tenant(tenant);
        let tier = match tp {
            Some(tp) => a.priority.unwrap_or(tp.default_priority).min(tp.max_priority),
            None => a.priority.unwrap_or(Priority::Standard),
        };
        let model = a.model.as_deref().map(|m| if policy.models.contains_key(m) { m } else { "other" });
        let (outcome, reason) = match decision {
            Decision::Admitted(admitted) => {
                if !admitted.replayed {
                    self.metrics.reserved(tenant, admitted.reserved_tokens);
                }
                match admitted.shadow {
                    Some(would) => (Outcome::Shadow, would.code()),
                    None => (Outcome::Admitted, "ok"),
                }
            }
            Decision::Unmetered => (Outcome::Unmetered, "ok"),
            Decision::Denied(d) => (Outcome::Denied, d.reason.code()),
        };
        self.metrics.decided(&Decided { tenant, model, tier: tier.as_str(), outcome, reason, took });
    }

    async fn decide(self: &Arc<Self>, a: &Attributes) -> Decision {
        let plan = match self.plan(a) {
            Ok(plan) => plan,
            Err(denial) => return Decision::Denied(denial),
        };
        // A lease hit decides here, from memory: no store call, no task, nothing to cancel.
        if let (Some(leases), true, None) = (&self.leases, plan.leased, &plan.pool) {
            let t = leases.tenant(&plan.tenant, &plan.tp);
            match leases.try_admit(&t, &plan.ask()) {
                Local::Miss => {}
                local => return self.leased_decision(&plan, local),
            }
        }
        let (answer, decision) = oneshot::channel();
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let mut tidy = Tidy::default();
            let decided = this.hold(&plan, &mut tidy).await;
            let sent = answer.send(decided);
            // Answered first: tidying up never delays a decision (nor, on a dead store, adds a
            // second timeout to it).
            this.tidy(&plan, tidy).await;
            if let Err(Decision::Admitted(undelivered)) = sent
                && !undelivered.replayed
            {
                tracing::debug!(reservation = %undelivered.reservation_id, "nobody received the hold; releasing it");
                this.give_back(&plan, &undelivered.reservation_id).await;
            }
        });
        decision.await.unwrap_or_else(|_| {
            Decision::Denied(Denial::now(Reason::StoreUnavailable, "the reserve task ended without a decision"))
        })
    }

    /// Checks everything that needs no store and works out what to hold where.
    fn plan(&self, a: &Attributes) -> Result<Plan, Denial> {
        use Reason::{InvalidRequest, Unauthenticated, Unsatisfiable};
        let policy = self.policy();
        let header = &policy.server.tenant_header;
        let tenant = a
            .tenant
            .as_deref()
            .or(policy.anonymous_tenant.as_deref())
            .ok_or_else(|| Denial::now(Unauthenticated, format!("no tenant identity: {header} is missing")))?;
        names::check_tenant(tenant).map_err(|e| Denial::now(InvalidRequest, format!("tenant id {e}")))?;
        let tp = policy
            .tenant(tenant)
            .ok_or_else(|| Denial::now(Unauthenticated, format!("tenant {tenant:?} has no policy")))?;
        if let Some(user) = &a.user {
            names::check_user(user).map_err(|e| Denial::now(InvalidRequest, format!("user id {e}")))?;
        }
        if let Some(k) = &a.idempotency {
            names::check_idempotency_key(&k.key)
                .map_err(|e| Denial::now(InvalidRequest, format!("idempotency-key {e}")))?;
        }
        let model_name = a.model.as_deref().ok_or_else(|| Denial::now(InvalidRequest, "the request names no model"))?;
        let model = policy
            .models
            .get(model_name)
            .ok_or_else(|| Denial::now(InvalidRequest, format!("model {model_name:?} is not served here")))?;
        if let Some(n) = a.max_tokens
            && (n == 0 || n > model.max_output_tokens)
        {
            return Err(Denial::now(
                InvalidRequest,
                format!("max_tokens {n} is outside 1..={} for model {model_name}", model.max_output_tokens),
            ));
        }

        let prompt = bounded_prompt(a.prompt, model)?;
        let ceiling = estimate::output_reservation(a.max_tokens, model);
        let hold = prompt.saturating_add(ceiling);
        // With a learned output the hold may be smaller than the ceiling; the script checks the
        // actual hold against every capacity. Here, only what can never fit.
        let smallest = if tp.adaptive_output.is_some() { prompt.saturating_add(1) } else { hold };
        let scopes = scopes(tenant, a.user.as_deref(), model_name, tp);
        let price = model.price.unwrap_or_default();
        let cheapest = cost_of(price, prompt, smallest.saturating_sub(prompt));
        // (In shadow the script holds it anyway, and says it would have been unsatisfiable.)
        for s in scopes.iter().filter(|_| !tp.shadow) {
            if let Some(largest) = s.largest
                && smallest > largest
            {
                return Err(Denial::now(
                    Unsatisfiable,
                    format!("request needs {hold} tokens but scope {} can never hold more than {largest}", s.label),
                ));
            }
            let dearest = [s.limits.daily_cost, s.limits.monthly_cost].into_iter().filter(|&n| n > 0).min();
            if let Some(budget) = dearest
                && cheapest > budget
            {
                return Err(Denial::now(
                    Unsatisfiable,
                    format!("request may cost {} but scope {}'s budget is {}", Money(cheapest), s.label, Money(budget)),
                ));
            }
        }
        let tier = a.priority.unwrap_or(tp.default_priority).min(tp.max_priority);
        let pool = match policy.pool_of(model) {
            Some((name, pool)) => {
                let output = match tp.adaptive_output {
                    Some(_) => self.seen_estimate(tenant, model_name).map_or(ceiling, |o| o.min(ceiling)),
                    None => ceiling,
                };
                let leg = PoolLeg {
                    name: name.to_string(),
                    pool: Arc::clone(pool),
                    tier,
                    work_ms: pool.service_ms(prompt, output),
                    kv_tokens: prompt.saturating_add(output),
                };
                if let Some(kv) = pool.kv_cache_tokens
                    && smallest > kv
                {
                    return Err(Denial::now(
                        Unsatisfiable,
                        format!("request needs {hold} KV-cache tokens but pool {name} has {kv}"),
                    ));
                }
                Some(leg)
            }
            None => None,
        };
        // Budgets over months or in money are kept at the store only.
        let leased = self.leases.is_some()
            && !tp.strict
            && !tp.shadow
            && !scopes.iter().any(|s| s.long_budgets)
            && a.idempotency.is_none()
            && tp.adaptive_output.is_none();
        let pool_name = pool.as_ref().map(|leg| leg.name.as_str());
        let id = match (&self.leases, leased) {
            (Some(leases), true) => ids::new_leased_reservation_id(tenant, pool_name, &leases.replica),
            _ => ids::new_reservation_id(tenant, pool_name),
        }
        .map_err(|e| {
            tracing::error!(error = %e, "cannot make a reservation id");
            Denial::now(Reason::StoreUnavailable, "no reservation id could be made")
        })?;
        // The request a key stands for: a key reused for another user, model or size is refused.
        let idempotency = a
            .idempotency
            .clone()
            .map(|k| (k, format!("{} {model_name} {prompt} {ceiling}", a.user.as_deref().unwrap_or(""))));
        Ok(Plan {
            id,
            tenant: tenant.to_string(),
            tp: Arc::clone(tp),
            model: model_name.to_string(),
            prompt,
            ceiling,
            scopes,
            pool,
            deadline_ms: a.deadline_ms.or(tp.default_deadline_ms),
            idempotency,
            leased,
            user: a.user.clone(),
            tier,
            price,
        })
    }

    async fn hold(&self, plan: &Plan, tidy: &mut Tidy) -> Decision {
        if let Some(leg) = &plan.pool
            && let Err(denial) = self.pool_leg(plan, leg).await
        {
            return match denial.reason {
                Reason::StoreUnavailable => {
                    // The call may have run and only its reply been lost.
                    tidy.pool_leg = true;
                    self.on_store_error(plan, denial)
                }
                _ => Decision::Denied(denial),
            };
        }
        let decision = if plan.leased { self.leased_leg(plan, tidy).await } else { self.tenant_leg(plan, tidy).await };
        let holds_this_id = matches!(&decision, Decision::Admitted(a) if a.reservation_id == plan.id);
        if let Some(leg) = &plan.pool
            && !holds_this_id
        {
            // The pool gives the work back before a refusal is answered, as the refusal says; after
            // a store failure it is tidied up later, so the answer does not wait on the store twice.
            if tidy.store_failed {
                tidy.pool_leg = true;
            } else {
                self.release_pool_leg(&leg.name, &plan.id).await;
            }
        }
        decision
    }

    /// What a decision left to tidy up, once it has been answered.
    async fn tidy(&self, plan: &Plan, tidy: Tidy) {
        if tidy.hold
            && let Err(e) = self.protocol.release(&plan.tenant, &plan.id).await
        {
            tracing::warn!(error = %e, reservation = %plan.id, "release after a failed reserve failed; its lease will reclaim it");
        }
        if let Some(leg) = &plan.pool
            && tidy.pool_leg
        {
            self.release_pool_leg(&leg.name, &plan.id).await;
        }
    }

    /// Capacity: can the pool start and finish this request in time? Holds its work if so.
    async fn pool_leg(&self, plan: &Plan, leg: &PoolLeg) -> Result<(), Denial> {
        let pool = &leg.pool;
        let call = PoolCall {
            pool: &leg.name,
            id: &plan.id,
            work_ms: leg.work_ms,
            kv_tokens: leg.kv_tokens,
            lease_ms: plan.tp.lease_ttl_ms,
            idle_ttl_ms: pool.idle_ttl_ms,
            sweep_batch: self.policy().sweep_batch,
            slots: pool.max_sequences,
            tier_slots: pool.slots_for(leg.tier),
            max_queue_delay_ms: pool.max_queue_delay_ms,
            tier_kv_tokens: pool.kv_for(leg.tier),
            deadline_ms: plan.deadline_ms,
            recover_per_ms: pool.upstream_throttle.map_or(0.0, |t| t.recover_per_ms),
        };
        match self.protocol.pool_reserve(&call).await {
            Ok(PoolOutcome::Admitted { .. }) => Ok(()),
            Ok(PoolOutcome::Denied { reason: PoolRefusal::Deadline, start_delay_ms, .. }) => Err(Denial::now(
                Reason::Deadline,
                format!(
                    "predicted to finish in {} ms (start in {start_delay_ms} ms on pool {}), past the {} ms deadline",
                    start_delay_ms.saturating_add(leg.work_ms),
                    leg.name,
                    plan.deadline_ms.unwrap_or(0)
                ),
            )),
            Ok(PoolOutcome::Denied { reason: PoolRefusal::Throttled, retry_after_ms, .. }) => Err(Denial {
                retry_after_ms: Some(retry_after_ms),
                ..Denial::now(
                    Reason::QueueFull,
                    format!("pool {} is throttled: its provider refused with a Retry-After", leg.name),
                )
            }),
            Ok(PoolOutcome::Denied { reason: PoolRefusal::QueueFull, retry_after_ms, start_delay_ms }) => Err(Denial {
                retry_after_ms: Some(retry_after_ms),
                ..Denial::now(
                    Reason::QueueFull,
                    format!(
                        "pool {} is full for {} requests (predicted start in {start_delay_ms} ms)",
                        leg.name,
                        leg.tier.as_str()
                    ),
                )
            }),
            Err(e) => Err(store_unavailable(&e, &plan.tenant)),
        }
    }

    /// A store failure, under the tenant's `on_store_error`: refuse, or admit unmetered.
    fn on_store_error(&self, plan: &Plan, denial: Denial) -> Decision {
        let decision = self.by_store_down_mode(plan, denial);
        let outcome = match &decision {
            Decision::Admitted(_) => Outcome::Admitted,
            Decision::Unmetered => Outcome::Unmetered,
            Decision::Denied(_) => Outcome::Denied,
        };
        self.metrics.degraded(&plan.tenant, plan.tp.on_store_error.as_str(), outcome);
        decision
    }

    fn by_store_down_mode(&self, plan: &Plan, denial: Denial) -> Decision {
        match plan.tp.on_store_error {
            OnStoreError::FailClosed => Decision::Denied(denial),
            OnStoreError::FailOpen => {
                tracing::warn!(tenant = %plan.tenant, "store unavailable; admitting unmetered (fail_open)");
                Decision::Unmetered
            }
            OnStoreError::Local => {
                let scopes = plan.scopes.iter().map(|s| (s.key.as_str(), &s.limits));
                match self.local.admit(scopes, plan.prompt.saturating_add(plan.ceiling), std::time::Instant::now()) {
                    Ok(()) => {
                        tracing::debug!(tenant = %plan.tenant, "store unavailable; admitted within the local share");
                        Decision::Unmetered
                    }
                    Err(refusal) => {
                        let scope = plan.scopes.get(refusal.scope).map_or("?", |s| s.label.as_str());
                        let (reason, message) = refusal_reason(refusal.reason, scope, self.policy().max_attempts);
                        Decision::Denied(Denial {
                            retry_after_ms: Some(refusal.retry_after_ms),
                            ..Denial::now(
                                reason,
                                format!("{message}: this replica's share while the store is unreachable"),
                            )
                        })
                    }
                }
            }
        }
    }

    /// Quota from this replica's slices: a hit decides from memory; a miss makes one lease call
    /// (one at a time per tenant: a miss that waited for another's call looks again first).
    async fn leased_leg(&self, plan: &Plan, tidy: &mut Tidy) -> Decision {
        let Some(leases) = &self.leases else { return self.tenant_leg(plan, tidy).await };
        let ask = plan.ask();
        let t = leases.tenant(&plan.tenant, &plan.tp);
        match leases.try_admit(&t, &ask) {
            Local::Miss => {}
            local => return self.leased_decision(plan, local),
        }
        let _one_call = t.calls.lock().await;
        // The tenant may have been left (and made anew) while this waited.
        let t = leases.tenant(&plan.tenant, &plan.tp);
        match leases.try_admit(&t, &ask) {
            Local::Miss => {}
            local => return self.leased_decision(plan, local),
        }
        match leases.call(&self.protocol, &plan.tenant, &t, Some(&ask), false, self.sweep_args()).await {
            Ok((refused, followups)) => {
                self.follow_up(followups).await;
                match refused {
                    Some((scope, reason, retry_after_ms)) => {
                        self.leased_decision(plan, Local::Refused { scope, reason, retry_after_ms })
                    }
                    None => match leases.try_admit(&t, &ask) {
                        // Granted but not covered: only if the policy changed under it; the store decides.
                        Local::Miss => self.tenant_leg(plan, tidy).await,
                        local => self.leased_decision(plan, local),
                    },
                }
            }
            Err(e) => {
                tidy.store_failed = true;
                self.on_store_error(plan, store_unavailable(&e, &plan.tenant))
            }
        }
    }

    /// A decision from the slices, as a [`Decision`].
    fn leased_decision(&self, plan: &Plan, local: Local) -> Decision {
        match local {
            Local::Admitted { headroom } => Decision::Admitted(Admitted {
                reservation_id: plan.id.clone(),
                model: plan.model.clone(),
                reserved_tokens: plan.prompt.saturating_add(plan.ceiling),
                attempts: 1,
                replayed: false,
                headroom,
                shadow: None,
            }),
            Local::Refused { scope, reason, retry_after_ms } => {
                let label = plan.scopes.get(scope).map_or("?", |s| s.label.as_str());
                let (reason, message) = refusal_reason(reason, label, self.policy().max_attempts);
                let retry_after_ms = reason.retryable().then_some(retry_after_ms);
                Decision::Denied(Denial { reason, message, retry_after_ms, headroom: Headroom::default() })
            }
            Local::Miss => Decision::Denied(Denial::now(Reason::StoreUnavailable, "no lease could decide the request")),
        }
    }

    fn sweep_args(&self) -> (u32, u64) {
        let policy = self.policy();
        (policy.sweep_batch, policy.concurrency_retry_ms)
    }

    /// After a lease call: apply what other replicas forwarded for this replica's holds, and take
    /// settled holds' pool legs off their pools.
    async fn follow_up(&self, f: lease::Followups) {
        self.apply_forwarded(f.forwarded).await;
        self.release_swept_pool_legs(&f.released).await;
    }

    async fn apply_forwarded(&self, forwarded: Vec<(String, Forwarded)>) {
        for (id, op) in forwarded {
            let result = match op {
                Forwarded::Commit(counted) => self.commit_counted(&id, counted).await.map(|o| o.state()),
                Forwarded::Release => self.release(&id).await.map(|o| o.state()),
                Forwarded::Renew { lease_ms } => self.renew(&id, lease_ms).await.map(|o| o.state()),
            };
            match result {
                Ok(state) => tracing::debug!(reservation = %id, state, "applied a forwarded operation"),
                Err(e) => tracing::warn!(reservation = %id, error = %e, "a forwarded operation failed"),
            }
        }
    }

    /// One window of leasing: for every tenant this replica serves, settle leased holds whose
    /// lease passed, give back what it will not use, draw for the next window, and apply forwarded
    /// operations. `ending` gives everything back (shutdown). Run by [`Admission::run_leases`];
    /// public so tests can drive it on a manual clock. Returns the first failed call's error (the
    /// others were still made): the slices it concerned stay as they were until their lease lapses.
    pub async fn lease_tick(&self, ending: bool) -> Result<(), StoreError> {
        let Some(leases) = &self.leases else { return Ok(()) };
        let mut failed = None;
        let policy = self.policy();
        for tenant in leases.tenant_names() {
            let Some(tp) = policy.tenant(&tenant).cloned() else { continue };
            let t = leases.tenant(&tenant, &tp);
            let one_call = t.calls.lock().await;
            let (mut released, due) = leases.upkeep(&t);
            if due.is_some() || ending {
                let leaving = ending || due == Some(true);
                // Forwarded operations settle holds and free what they held: a leaving replica
                // gives that back with a second call.
                for _ in 0..2 {
                    match leases.call(&self.protocol, &tenant, &t, None, leaving, self.sweep_args()).await {
                        Ok((_, f)) => {
                            released.extend(f.released);
                            let applied = !f.forwarded.is_empty();
                            self.apply_forwarded(f.forwarded).await;
                            if !(applied && leaving) {
                                break;
                            }
                        }
                        Err(e) => {
                            tracing::warn!(tenant = %tenant, error = %e, "lease call failed; slices kept until the lease lapses");
                            failed.get_or_insert(e);
                            break;
                        }
                    }
                }
                if leaving && !ending {
                    leases.leave(&tenant);
                }
            }
            drop(one_call);
            self.release_swept_pool_legs(&released).await;
        }
        failed.map_or(Ok(()), Err)
    }

    /// Runs the lease windows until `shutdown`, then gives back every slice.
    pub async fn run_leases(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        let Some(window) = self.leases.as_ref().map(|l| l.settings.window_ms) else { return };
        let mut ticks = tokio::time::interval(std::time::Duration::from_millis(window));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {
                    // Failures are logged per tenant; the next window tries again.
                    let _ = self.lease_tick(false).await;
                }
                () = shutdown.cancelled() => break,
            }
        }
        if self.lease_tick(true).await.is_err() {
            tracing::warn!("some slices could not be given back at shutdown: they stay charged until their lease");
        }
    }

    /// Quota: every scope of the tenant must pass.
    async fn tenant_leg(&self, plan: &Plan, tidy: &mut Tidy) -> Decision {
        let policy = self.policy();
        let call = ReserveCall {
            tenant: &plan.tenant,
            model: &plan.model,
            id: &plan.id,
            prompt_tokens: plan.prompt,
            output_ceiling: plan.ceiling,
            adaptive: plan.tp.adaptive_output.map(|a| (a.min_samples, a.quantile)),
            lease_ms: plan.tp.lease_ttl_ms,
            idle_ttl_ms: plan.tp.idle_ttl_ms,
            retention_ms: policy.record_retention_ms,
            expired_usage: plan.tp.expired_usage,
            sweep_batch: policy.sweep_batch,
            idempotency: plan.idempotency.as_ref().map(|(k, fingerprint)| KeyCall {
                key: &k.key,
                repeat: k.repeat,
                fingerprint,
            }),
            max_attempts: policy.max_attempts,
            concurrency_retry_cap_ms: policy.concurrency_retry_ms,
            scopes: plan.scopes.iter().map(|s| (s.key.clone(), s.limits)).collect(),
            shadow: plan.tp.shadow,
            user: plan.user.as_deref(),
            tier: plan.tier,
            ledger: policy.ledger.as_ref().map(|l| l.terms),
            price: plan.price,
        };
        let outcome = match self.protocol.reserve(&call).await {
            Ok(ReserveReply { outcome, swept }) => {
                self.release_swept_pool_legs(&swept).await;
                Ok(outcome)
            }
            Err(e) => Err(e),
        };
        match outcome {
            Ok(ReserveOutcome::Admitted { id, held, attempts, headroom, estimated_output, replayed, shadowed }) => {
                if let Some(output) = estimated_output
                    && plan.pool.is_some()
                {
                    self.remember_estimate(&plan.tenant, &plan.model, output);
                }
                // In shadow, what the limits would have said, as the reason a denial would carry.
                let shadow = shadowed.map(|w| {
                    let scope = plan.scopes.get(w.scope).map_or("?", |s| s.label.as_str());
                    refusal_reason(w.reason, scope, policy.max_attempts).0
                });
                Decision::Admitted(Admitted {
                    reservation_id: id,
                    model: plan.model.clone(),
                    reserved_tokens: held,
                    attempts,
                    replayed,
                    headroom,
                    shadow,
                })
            }
            Ok(ReserveOutcome::Denied { reason, scope, retry_after_ms, headroom }) => {
                let scope = plan.scopes.get(scope).map_or("?", |s| s.label.as_str());
                let (reason, message) = refusal_reason(reason, scope, policy.max_attempts);
                let retry_after_ms = reason.retryable().then_some(retry_after_ms);
                Decision::Denied(Denial { reason, message, retry_after_ms, headroom })
            }
            Err(e) => {
                // The script may have run and only its reply been lost: give back what it may hold.
                tidy.hold = true;
                tidy.store_failed = true;
                self.on_store_error(plan, store_unavailable(&e, &plan.tenant))
            }
        }
    }

    /// The tenant leg's sweep settled these expired holds; their pool legs live on other slots and
    /// are taken off here, so pool work leaves with its hold rather than with the pool's own sweep.
    async fn release_swept_pool_legs(&self, swept: &[String]) {
        for id in swept {
            let Some(r) = ids::parse_reservation_id(id) else { continue };
            self.metrics.expired(r.tenant);
            if let Some(pool) = r.pool {
                self.release_pool_leg(pool, id).await;
            }
        }
    }

    /// Releases a hold this call made but nobody received: both legs.
    async fn give_back(&self, plan: &Plan, id: &str) {
        if let (Some(leases), true) = (&self.leases, plan.leased) {
            leases.release(&plan.tenant, id);
        } else if let Err(e) = self.protocol.release(&plan.tenant, id).await {
            tracing::warn!(error = %e, reservation = id, "release of an undelivered hold failed; its lease will reclaim it");
        }
        if let Some(leg) = &plan.pool {
            self.release_pool_leg(&leg.name, id).await;
        }
    }

    /// Gives a pool leg back. A failure is logged, not returned: the pool hold's lease reclaims it.
    async fn release_pool_leg(&self, pool: &str, id: &str) {
        if let Err(e) = self.protocol.pool_release(pool, id).await {
            tracing::warn!(error = %e, pool, reservation = id, "pool release failed; its lease will reclaim it");
        }
    }

    /// The commit phase: reconcile a hold against the usage its caller reports, then free its pool
    /// work.
    pub async fn commit(
        &self,
        reservation_id: &str,
        prompt: u64,
        output: u64,
    ) -> Result<CommitOutcome, AdmissionError> {
        self.commit_counted(reservation_id, Counted::Exact { prompt, output }).await
    }

    /// The commit phase, with counts reported or metered.
    pub async fn commit_counted(
        &self,
        reservation_id: &str,
        counted: Counted,
    ) -> Result<CommitOutcome, AdmissionError> {
        let (prompt, output) = match counted {
            Counted::Exact { prompt, output } => (prompt, output),
            Counted::Metered { output } => (0, output),
            Counted::AsHeld => (0, 0),
        };
        for (what, value) in [("prompt_tokens", prompt), ("completion_tokens", output)] {
            if value > MAX_TOKEN_COUNT {
                return Err(AdmissionError::TooLarge { what, value });
            }
        }
        let r = parse_id(reservation_id)?;
        if let Some(replica) = r.replica {
            let outcome = match self.leases.as_ref().filter(|l| l.replica == replica) {
                Some(leases) => {
                    let outcome = leases.commit(r.tenant, reservation_id, counted);
                    self.record_commit(r.tenant, &outcome, counted);
                    outcome
                }
                None => match self.forward(&r, reservation_id, Forwarded::Commit(counted)).await? {
                    true => CommitOutcome::Forwarded,
                    false => CommitOutcome::NotFound,
                },
            };
            if let Some(pool) = r.pool
                && outcome != CommitOutcome::NotFound
            {
                self.release_pool_leg(pool, reservation_id).await;
            }
            return Ok(outcome);
        }
        let policy = self.policy();
        let tp = policy.tenant(r.tenant);
        let learning = tp.and_then(|tp| {
            tp.adaptive_output.map(|a| Learning { ttl_ms: ESTIMATE_TTL_MS.max(tp.idle_ttl_ms), window: a.window })
        });
        let outcome = self.protocol.commit(r.tenant, reservation_id, counted, learning).await?;
        self.record_commit(r.tenant, &outcome, counted);
        // Release the pool leg whenever the tenant leg is settled, repeats included: an earlier
        // call may have settled the tenant leg and failed to reach the pool. Idempotent.
        if let Some(pool) = r.pool
            && outcome != CommitOutcome::NotFound
        {
            self.release_pool_leg(pool, reservation_id).await;
        }
        Ok(outcome)
    }

    /// Counts a commit that settled a hold now (not a repeat of an earlier one), and, when the
    /// counts were reported, how far each estimate behind the hold was from them: the output
    /// reservation and the prompt estimate, per tenant and model.
    fn record_commit(&self, tenant: &str, outcome: &CommitOutcome, counted: Counted) {
        let CommitOutcome::Committed(u) = outcome else { return };
        if u.duplicate || !self.metrics.enabled() {
            return;
        }
        self.metrics.committed(tenant, u);
        if let (Counted::Exact { prompt, output }, Some(model), Some(output_held), false) =
            (counted, &u.model, u.output_held, u.late)
        {
            let policy = self.policy();
            let model = if policy.models.contains_key(model) { model.as_str() } else { "other" };
            let prompt_held = u.held.saturating_sub(output_held);
            self.metrics.token_usage(tenant, model, prompt, output);
            self.metrics.estimated(tenant, model, Estimate::Output, output, output_held);
            self.metrics.estimated(tenant, model, Estimate::Prompt, prompt, prompt_held);
        }
    }

    /// Extends a live hold's lease by `lease_ms` (0 = the tenant's lease TTL; never more than it).
    pub async fn renew(&self, reservation_id: &str, lease_ms: u64) -> Result<RenewOutcome, AdmissionError> {
        let r = parse_id(reservation_id)?;
        let policy = self.policy();
        let Some(tp) = policy.tenant(r.tenant) else { return Ok(RenewOutcome::NotFound) };
        let lease = if lease_ms == 0 { tp.lease_ttl_ms } else { lease_ms.min(tp.lease_ttl_ms) };
        let outcome = match r.replica {
            None => self.protocol.renew(r.tenant, reservation_id, lease, tp.idle_ttl_ms).await?,
            Some(replica) => match self.leases.as_ref().filter(|l| l.replica == replica) {
                Some(leases) => leases.renew(r.tenant, reservation_id, lease),
                None => match self.forward(&r, reservation_id, Forwarded::Renew { lease_ms: lease }).await? {
                    true => RenewOutcome::Forwarded,
                    false => RenewOutcome::NotFound,
                },
            },
        };
        if let Some(pool) = r.pool {
            match outcome {
                RenewOutcome::Renewed { .. } => {
                    if let Some(p) = policy.pools.get(pool) {
                        self.protocol.pool_renew(pool, reservation_id, lease, p.idle_ttl_ms).await?;
                    }
                }
                // Settled (perhaps expired by this very call): its pool leg goes too.
                RenewOutcome::Settled(_) => self.release_pool_leg(pool, reservation_id).await,
                // The owner renews the pool leg when it applies the renewal.
                RenewOutcome::NotFound | RenewOutcome::Forwarded => {}
            }
        }
        Ok(outcome)
    }

    /// The provider behind a hold's pool refused its request (HTTP 429): throttle the pool, so
    /// tollgate stops admitting what the provider will refuse. Nothing happens for a hold without a
    /// pool, or a pool whose policy turns the throttle off. Returns the share of the pool left.
    pub async fn upstream_refused(
        &self,
        reservation_id: &str,
        retry_after_ms: Option<u64>,
    ) -> Result<Option<f64>, AdmissionError> {
        let r = parse_id(reservation_id)?;
        let policy = self.policy();
        let Some((name, pool)) = r.pool.and_then(|p| policy.pools.get_key_value(p)) else { return Ok(None) };
        let Some(t) = pool.upstream_throttle else { return Ok(None) };
        let call = ThrottleCall {
            pool: name,
            retry_after_ms: retry_after_ms.unwrap_or(0).min(t.max_retry_after_ms),
            decrease: t.decrease,
            min_share: t.min_share,
            recover_per_ms: t.recover_per_ms,
            cooldown_ms: t.cooldown_ms,
            idle_ttl_ms: pool.idle_ttl_ms,
        };
        let (share, resumes_in_ms) = self.protocol.pool_throttle(&call).await?;
        tracing::info!(pool = %name, share, resumes_in_ms, "provider refused (429): pool throttled");
        Ok(Some(share))
    }

    /// What a pool holds, and how far its provider's 429s throttle it.
    pub async fn pool_status(&self, pool: &str) -> Result<PoolView, AdmissionError> {
        let policy = self.policy();
        let pool_policy = policy
            .pools
            .get(pool)
            .ok_or_else(|| AdmissionError::BadName(format!("pool {pool:?} is not one of this policy's")))?;
        let recover = pool_policy.upstream_throttle.map_or(0.0, |t| t.recover_per_ms);
        Ok(self.protocol.pool_status(pool, recover).await?)
    }

    /// What a tenant's commits have taught about one model's output lengths.
    pub async fn output_estimate(&self, tenant: &str, model: &str) -> Result<EstimateView, AdmissionError> {
        names::check_tenant(tenant).map_err(|e| AdmissionError::BadName(format!("tenant {e}")))?;
        if !self.policy().models.contains_key(model) {
            return Err(AdmissionError::BadName(format!("model {model:?} is not served here")));
        }
        Ok(self.protocol.output_estimate(tenant, model).await?)
    }

    /// Gives a hold back without usage, and its pool work with it.
    pub async fn release(&self, reservation_id: &str) -> Result<ReleaseOutcome, AdmissionError> {
        let r = parse_id(reservation_id)?;
        let outcome = match r.replica {
            None => self.protocol.release(r.tenant, reservation_id).await?,
            Some(replica) => match self.leases.as_ref().filter(|l| l.replica == replica) {
                Some(leases) => leases.release(r.tenant, reservation_id),
                None => match self.forward(&r, reservation_id, Forwarded::Release).await? {
                    true => ReleaseOutcome::Forwarded,
                    false => ReleaseOutcome::NotFound,
                },
            },
        };
        if let ReleaseOutcome::Released { refunded, repeated: false } = outcome {
            self.metrics.released(r.tenant, refunded);
        }
        if let Some(pool) = r.pool
            && outcome != ReleaseOutcome::NotFound
        {
            self.release_pool_leg(pool, reservation_id).await;
        }
        Ok(outcome)
    }
}

impl<S: Store> Admission<S> {
    /// Leaves an operation on another replica's leased hold for that replica. False when the
    /// replica no longer holds a lease on the tenant: it stopped, and its holds settle as expired.
    async fn forward(&self, r: &ids::ReservationRef<'_>, id: &str, op: Forwarded) -> Result<bool, AdmissionError> {
        let policy = self.policy();
        let (Some(replica), Some(tp)) = (r.replica, policy.tenant(r.tenant)) else { return Ok(false) };
        Ok(self.protocol.forward(r.tenant, replica, id, op, tp.lease_ttl_ms).await?)
    }
}

impl<S> Admission<S> {
    fn seen_estimate(&self, tenant: &str, model: &str) -> Option<u64> {
        let seen = self.seen_estimates.read().unwrap_or_else(|p| p.into_inner());
        seen.get(tenant)?.get(model).copied()
    }

    /// Takes the write lock, and allocates the names, only when the estimate moved.
    fn remember_estimate(&self, tenant: &str, model: &str, output: u64) {
        if self.seen_estimate(tenant, model) == Some(output) {
            return;
        }
        let mut seen = self.seen_estimates.write().unwrap_or_else(|p| p.into_inner());
        // Bounded under many tenants: past the bound all are forgotten, and a pool leg holds the
        // ceiling until its tenant's next reserve brings the estimate back.
        if seen.len() >= MAX_SEEN_ESTIMATES && !seen.contains_key(tenant) {
            seen.clear();
        }
        let models = match seen.get_mut(tenant) {
            Some(models) => models,
            None => seen.entry(tenant.to_string()).or_default(),
        };
        match models.get_mut(model) {
            Some(known) => *known = output,
            None => {
                models.insert(model.to_string(), output);
            }
        }
    }
}

/// Prompt tokens to hold, or a refusal when a count or size is past what tollgate accepts.
fn bounded_prompt(size: PromptSize, model: &crate::config::ModelPolicy) -> Result<u64, Denial> {
    let too_large = |what: &str, value: u64, max: u64| {
        Denial::now(Reason::InvalidRequest, format!("{what} {value} is above the maximum of {max}"))
    };
    match size {
        PromptSize::Tokens(n) if n > MAX_TOKEN_COUNT => return Err(too_large("prompt tokens", n, MAX_TOKEN_COUNT)),
        PromptSize::Bytes(b) if b > MAX_PROMPT_BYTES => return Err(too_large("body size", b, MAX_PROMPT_BYTES)),
        _ => {}
    }
    let tokens = estimate::prompt_tokens(size, model);
    if tokens > MAX_TOKEN_COUNT {
        return Err(too_large("estimated prompt tokens", tokens, MAX_TOKEN_COUNT));
    }
    Ok(tokens)
}

/// The reason and message of a store refusal on `scope`.
fn refusal_reason(refusal: Refusal, scope: &str, max_attempts: u32) -> (Reason, String) {
    match refusal {
        Refusal::TokenRate => (Reason::TokenRate, format!("token rate limit of scope {scope} reached")),
        Refusal::RequestRate => (Reason::RequestRate, format!("request rate limit of scope {scope} reached")),
        Refusal::Concurrency => (Reason::Concurrency, format!("all concurrency slots of scope {scope} are held")),
        Refusal::Budget(b) => (Reason::Budget, format!("{} of scope {scope} is spent", b.describe())),
        Refusal::Attempts => {
            (Reason::InvalidRequest, format!("idempotency key has made its most reserves ({max_attempts})"))
        }
        Refusal::Conflict => (
            Reason::InvalidRequest,
            "idempotency key was first used for a different request (user, model or size)".to_string(),
        ),
        Refusal::Unsatisfiable => {
            (Reason::Unsatisfiable, format!("the hold is larger than scope {scope} can ever hold"))
        }
    }
}

fn store_unavailable(e: &StoreError, tenant: &str) -> Denial {
    tracing::error!(error = %e, tenant, "store call failed; failing closed");
    Denial { retry_after_ms: Some(1_000), ..Denial::now(Reason::StoreUnavailable, "admission store unavailable") }
}

/// The capacity leg of a request whose model is served by a pool.
struct PoolLeg {
    name: String,
    pool: Arc<PoolPolicy>,
    tier: Priority,
    /// Predicted slot time (ms).
    work_ms: u64,
    /// KV-cache tokens it holds: the prompt and the output it is expected to produce.
    kv_tokens: u64,
}

/// What one reserve will hold, where: owned, because the legs run on a task of their own.
struct Plan {
    id: String,
    tenant: String,
    tp: Arc<TenantPolicy>,
    model: String,
    prompt: u64,
    /// The output held when no estimate applies.
    ceiling: u64,
    scopes: Vec<Scope>,
    pool: Option<PoolLeg>,
    deadline_ms: Option<u64>,
    /// The key, and the fingerprint of the request it stands for.
    idempotency: Option<(IdempotencyKey, String)>,
    /// Decided from this replica's slices (the policy leases, the tenant is not strict, and the
    /// request needs nothing only the store has: an idempotency key, a learned estimate).
    leased: bool,
    /// Who the hold is for, as the ledger enters it.
    user: Option<String>,
    tier: Priority,
    /// The model's price: the hold charges its cost.
    price: Price,
}

impl Plan {
    fn ask(&self) -> Ask<'_> {
        Ask {
            id: &self.id,
            model: &self.model,
            scopes: self.scopes.iter().map(|s| AskScope { key: &s.key, limits: s.limits }).collect(),
            hold: self.prompt.saturating_add(self.ceiling),
            prompt: self.prompt,
        }
    }
}

/// Store calls a decision leaves behind after a store failure, made once it is answered: a
/// decision waits on a failing store once, never twice.
#[derive(Debug, Default)]
struct Tidy {
    /// A store call of the tenant leg failed.
    store_failed: bool,
    /// Release the tenant leg's hold: its reserve failed, and may have run all the same.
    hold: bool,
    /// Release the pool leg's hold: its call failed, or the tenant leg's did.
    pool_leg: bool,
}

/// One scope a request charges.
struct Scope {
    /// For messages: `tenant`, `user alice`, `model gpt-4o`.
    label: String,
    key: String,
    limits: ScopeLimits,
    largest: Option<u64>,
    /// A budget over a month or in money: decided at the store, never from a leased slice.
    long_budgets: bool,
}

/// The scopes a request charges: the tenant, then its user and model where the policy limits them.
fn scopes(tenant: &str, user: Option<&str>, model: &str, tp: &TenantPolicy) -> Vec<Scope> {
    let scope = |label: String, key: String, limits: &Limits| Scope {
        label,
        key,
        limits: ScopeLimits::from(limits),
        largest: limits.largest_admissible(),
        long_budgets: limits.has_long_budgets(),
    };
    let mut out = vec![scope("tenant".into(), keys::tenant_scope(tenant), &tp.limits)];
    if let Some(user) = user
        && let Some(limits) = tp.user_limits(user)
    {
        out.push(scope(format!("user {user}"), keys::user_scope(tenant, user), limits));
    }
    if let Some(limits) = tp.models.get(model) {
        out.push(scope(format!("model {model}"), keys::model_scope(tenant, model), limits));
    }
    out
}

/// What tokens cost at a price, in nanos (saturating: far beyond any budget either way).
fn cost_of(price: Price, prompt: u64, output: u64) -> u64 {
    prompt.saturating_mul(price.input_nanos).saturating_add(output.saturating_mul(price.output_nanos))
}

fn parse_id(reservation_id: &str) -> Result<ids::ReservationRef<'_>, AdmissionError> {
    ids::parse_reservation_id(reservation_id)
        .ok_or_else(|| AdmissionError::BadReservationId(reservation_id.to_string()))
}
