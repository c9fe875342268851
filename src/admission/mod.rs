//! Attributes + policy + store → [`Decision`]. Plain Rust types only: the gRPC edge converts to and
//! from these, and nothing here knows about tonic.
//!
//! Everything that can be decided without the store is decided first (identity, model, bounds,
//! unsatisfiable size), so a bad request costs no round trip and can never charge anything. Each
//! decision plans from one snapshot of the policy and carries it to the end.
//!
//! By phase:
//! - `plan`: what a request holds where, decided without the store.
//! - `reserve`: the pool leg and the tenant leg, run to completion on a task of their own (its doc
//!   has "Two key spaces" and "Nobody waiting").
//! - `leasing`: decisions from this replica's slices, and the lease windows; `lease`, the slices
//!   themselves.
//! - `store_down`: what a tenant's `on_store_error` does when the store cannot be reached, and the
//!   heartbeat that counts the replicas sharing its limits (and learns whether all of them read
//!   compact records); `local`, those limits in memory.
//! - `settle`: commit, renew and release, routed to where the hold lives (the store, this
//!   replica's slice, or another replica).
//! - `pools`, `estimates`: a pool's status, throttle, calibration and live streams' progress; the
//!   learned output estimates. [`fleet`]: what this replica learned of the fleet's speeds and its
//!   tenants' output lengths, which capacity admission predicts from.
//! - `sweeper`: every expired hold settled within a bound, even of a tenant that never calls again.
//! - `batch`: commits from responses, batched by tenant.
//! - [`retry`]: settlements that could not reach the store, tried again.

// Token arithmetic: no unchecked +, -, * (see Cargo.toml's [lints] for the casts).
#![warn(clippy::arithmetic_side_effects)]

mod batch;
mod budgets;
mod claims;
mod decision;
mod denials;
mod estimates;
pub mod fleet;
mod lease;
mod leasing;
mod local;
pub mod log;
mod plan;
mod pools;
mod reserve;
pub mod retry;
mod settle;
mod short;
mod soft;
mod store_down;
mod sweeper;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use tokio_util::task::TaskTracker;

pub use decision::{Admitted, Decision, Denial, Forecast, Reason, Unmetered};

pub use crate::config::Priority;
use crate::config::{Policy, TenantPolicy};
use crate::estimate::PromptSize;
use crate::hold::id as ids;
pub use crate::hold::{KeyRepeat, MAX_TOKEN_COUNT};
use crate::metrics::Metrics;
use crate::store::clock::{Clock, SystemClock};
pub use crate::store::phase::budget::Adjusted;
use crate::store::{Protocol, Store, StoreError};
pub use budgets::{Adjustment, ScopeBudget};
use lease::Leases;
use local::LocalLimits;
pub use plan::MAX_PROMPT_BYTES;
pub use pools::PoolStatus;
pub use store_down::{HEARTBEAT_MS, HEARTBEAT_TTL_MS, OLDER_REPLICA_MEMORY_MS};
pub use sweeper::SWEEP_MS;

/// One request, as admission sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attributes {
    /// Verified tenant identity; `None` when the request carried none.
    pub tenant: Option<String>,
    /// The plan a trusted header names (`server.plan_header`): a tenant the policy does not list
    /// is admitted under it (a listed tenant goes by its own policy whatever this says).
    pub plan: Option<String>,
    pub user: Option<String>,
    pub model: Option<String>,
    /// The claimed tier; `None` takes the tenant's default.
    pub priority: Option<Priority>,
    /// Relative deadline (ms); `None` takes the tenant's default.
    pub deadline_ms: Option<u64>,
    /// How long the caller lets admission wait for a slot of a pool that queues in tollgate (its
    /// gRPC deadline, less a margin); `None`: the pool's `max_queue_delay_ms`.
    pub wait_ms: Option<u64>,
    pub idempotency: Option<IdempotencyKey>,
    pub prompt: PromptSize,
    /// The caller's output ceiling.
    pub max_tokens: Option<u64>,
    pub stream: bool,
    /// Nothing is generated (embeddings): the input alone is held, and `max_tokens` is not read.
    pub input_only: bool,
    /// How many outputs the request generates, each up to `max_tokens` (OpenAI's `n`, Gemini's
    /// `candidateCount`): the output held is the ceiling this many times. 0 is taken as 1.
    pub outputs: u64,
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

impl AdmissionError {
    /// The store could not be reached, or did not answer in time: the same call may land later.
    pub fn is_transient(&self) -> bool {
        matches!(self, AdmissionError::Store(e) if e.is_transient())
    }
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
    /// Tenants this replica last saw past a soft budget, and when its period ends (ms).
    soft_past: RwLock<HashMap<String, u64>>,
    /// What the responses this replica watched showed of its pools' speeds and its tenants'
    /// output lengths: capacity admission predicts from it.
    fleet: fleet::Fleet,
    /// This replica's slices and leased holds, when the policy leases.
    leases: Option<Leases>,
    /// This replica's name: in leased reservation ids, and in its heartbeat.
    replica: String,
    /// Admission from memory while the store is unreachable (`on_store_error: local`).
    local: LocalLimits,
    /// Whether reserves write compact records: the last heartbeat heard only replicas that read
    /// them (false until one has).
    compact_records: std::sync::atomic::AtomicBool,
    /// Settlements that could not reach the store, for the retry worker; its inbox until the worker
    /// takes it ([`Admission::run_retries`]).
    retries: retry::Retries,
    retry_inbox: std::sync::Mutex<Option<retry::Inbox>>,
    /// Commits from responses waiting for their tenant's batch (`store.commit_window_ms`).
    batches: batch::Batches,
    /// Tenants served since the sweeper last wrote its notes, with the longest lease noted.
    noted: RwLock<HashMap<String, u64>>,
    /// The sweeper's next shard to look at (starting where the replica's name says, so replicas
    /// look at different shards in the same period).
    sweep_turn: std::sync::atomic::AtomicU32,
    /// The reserves running on tasks of their own (see the reserve phase's "Nobody waiting"):
    /// the drain waits for them, so a hold nobody received is given back before the process ends.
    tasks: TaskTracker,
    metrics: Metrics,
    /// The wall clock: the store's on the embedded store (its day, for local budgets).
    clock: Arc<dyn Clock>,
    /// The plans unlisted tenants were last admitted under, by their plan header.
    claims: claims::Claims,
    /// Told whenever this replica gives a pool hold back: requests waiting in tollgate for a slot
    /// look again at once rather than at their next poll.
    pool_freed: tokio::sync::Notify,
}

/// Tenants whose last output estimate this replica remembers, at most.
const MAX_SEEN_ESTIMATES: usize = 100_000;

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
        let leases = policy.leasing.map(|settings| {
            let ledger = policy.ledger.as_ref().map(|l| l.terms);
            Leases::new(replica.clone(), settings, Arc::clone(&clock), policy.record_retention_ms, ledger)
        });
        let local = LocalLimits::new(policy.store.local_factor);
        let claims = claims::Claims::new(policy.server.claimed_tenants);
        let (retries, retry_inbox) = retry::Retries::new();
        let sweep_turn = crate::store::keys::sweep_shard_of(&replica);
        Admission {
            policy: RwLock::new(policy),
            protocol,
            seen_estimates: RwLock::new(HashMap::new()),
            soft_past: RwLock::new(HashMap::new()),
            pool_freed: tokio::sync::Notify::new(),
            fleet: fleet::Fleet::default(),
            leases,
            replica,
            local,
            compact_records: std::sync::atomic::AtomicBool::new(false),
            noted: RwLock::new(HashMap::new()),
            sweep_turn: std::sync::atomic::AtomicU32::new(sweep_turn),
            retries,
            retry_inbox: std::sync::Mutex::new(Some(retry_inbox)),
            batches: batch::Batches::default(),
            tasks: TaskTracker::new(),
            metrics: Metrics::disabled(),
            clock,
            claims,
        }
    }

    /// The policy `tenant`'s holds go by: its own, else the plan its plan header last admitted it
    /// under (as this replica remembers), else `default_tenant`'s.
    pub fn tenant_policy<'p>(&self, policy: &'p Policy, tenant: &str) -> Option<&'p Arc<TenantPolicy>> {
        if let Some(tp) = policy.tenants.get(tenant) {
            return Some(tp);
        }
        // (Plans are noted only where the policy reads them from identity: no lock otherwise.)
        let claimed = policy.server.plan_header.as_ref().and_then(|_| self.claims.plan_of(tenant));
        claimed.and_then(|plan| policy.plans.get(&plan)).or(policy.default_tenant.as_ref())
    }

    /// Whether [`Admission::tenant_policy`] finds `tenant`'s own terms: it is listed, the policy
    /// reads no plan from identity, or this replica remembers the plan its token named.
    pub(crate) fn plan_known(&self, policy: &Policy, tenant: &str) -> bool {
        policy.tenants.contains_key(tenant)
            || policy.server.plan_header.is_none()
            || self.claims.plan_of(tenant).is_some()
    }

    /// The terms a call settling `tenant`'s hold (renew, forward) goes by: its policy as
    /// [`Admission::tenant_policy`] finds it; for a tenant this replica has not seen admitted
    /// under a plan header (another replica admitted it, or this one restarted since), the most
    /// generous of the plans and `default_tenant`, so that its hold is still renewed and
    /// forwarded, never left to expire for want of a name.
    pub fn settling_policy<'p>(&self, policy: &'p Policy, tenant: &str) -> Option<&'p Arc<TenantPolicy>> {
        if self.plan_known(policy, tenant) {
            return self.tenant_policy(policy, tenant);
        }
        policy.plans.values().chain(policy.default_tenant.iter()).max_by_key(|t| (t.lease_ttl_ms, t.idle_ttl_ms))
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

    /// The sequence number of this replica's lease call on a tenant whose answer never came (it
    /// goes again, as it was, before the tenant's next call), if there is one.
    pub fn unanswered_lease_call(&self, tenant: &str) -> Option<u64> {
        self.leases.as_ref().and_then(|l| l.unanswered(tenant))
    }

    /// This replica's name in leased reservation ids, when the policy leases.
    pub fn replica(&self) -> Option<&str> {
        self.leases.as_ref().map(|l| l.replica.as_str())
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
        new.fit_commit_window();
        new.leasing = old.leasing;
        new.ledger = old.ledger.clone();
        let new = Arc::new(new);
        *self.policy.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::clone(&new);
        if let Some(leases) = &self.leases {
            leases.policy_changed(|tenant| self.tenant_policy(&new, tenant));
        }
        self.fleet.retain(|pool, model| new.models.get(model).and_then(|m| m.pool.as_deref()) == Some(pool));
        self.metrics.policy_loaded(&new);
        kept
    }

    /// Settlements kept for the retry worker that the store has not taken yet.
    pub fn retries_waiting(&self) -> u64 {
        self.retries.waiting()
    }

    /// Keeps a settlement whose store call failed, for the retry worker.
    pub fn retry(&self, settlement: retry::Settlement) {
        self.retries.push(settlement);
    }

    /// Runs the worker that retries what [`Admission::retry`] kept, until `shutdown` (then one
    /// last try). `None` if it already runs.
    pub fn run_retries(
        self: &Arc<Self>,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>>
    where
        S: Store,
    {
        let inbox = self.retry_inbox.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()?;
        Some(retry::Retries::run(Arc::clone(self), inbox, shutdown))
    }

    /// Reserves still running on their own tasks: answered or not, their tidying up (giving back
    /// what a failed store call may have held) not yet done.
    pub fn reserves_running(&self) -> usize {
        self.tasks.len()
    }

    /// Waits for every reserve still running on its own task (their callers may be gone), once no
    /// new one can start: the server has drained. Then commits every batch of commits waiting for
    /// its window (see `batch`), and waits for those too.
    pub async fn finish_tasks(self: &Arc<Self>) {
        self.tasks.close();
        self.tasks.wait().await;
        self.flush_batches().await;
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
}

fn parse_id(reservation_id: &str) -> Result<ids::ReservationRef<'_>, AdmissionError> {
    ids::parse_reservation_id(reservation_id)
        .ok_or_else(|| AdmissionError::BadReservationId(reservation_id.to_string()))
}
