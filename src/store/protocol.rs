//! The phases as typed calls over any [`Store`]: this is the only Rust that knows the
//! `KEYS`/`ARGV` layout and the reply shape each script documents in its header. Replies are
//! parsed here, once, into enums; nothing above matches a script's text.

use super::{Reply, Script, Store, StoreError, keys, scripts::Scripts};
use crate::config::{ExpiredUsage, LedgerTerms, Limits, Price, Priority};

fn expired_usage_lua(e: ExpiredUsage) -> &'static str {
    match e {
        ExpiredUsage::ChargeReserved => "charge",
        ExpiredUsage::Refund => "refund",
    }
}

/// The limits of one scope as the reserve script takes them; zero means "no such limit".
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ScopeLimits {
    pub token_capacity: u64,
    pub tokens_per_ms: f64,
    pub request_capacity: u64,
    pub requests_per_ms: f64,
    pub max_concurrency: u64,
    pub daily_budget: u64,
    pub monthly_budget: u64,
    /// Budgets in money, in nanos.
    pub daily_cost: u64,
    pub monthly_cost: u64,
}

impl From<&Limits> for ScopeLimits {
    fn from(l: &Limits) -> Self {
        ScopeLimits {
            token_capacity: l.token_capacity().unwrap_or(0),
            tokens_per_ms: l.tokens_per_ms(),
            request_capacity: l.requests_per_minute.unwrap_or(0),
            requests_per_ms: l.requests_per_ms(),
            max_concurrency: l.max_concurrency.unwrap_or(0),
            daily_budget: l.tokens_per_day.unwrap_or(0),
            monthly_budget: l.tokens_per_month.unwrap_or(0),
            daily_cost: l.cost_per_day.map_or(0, |m| m.0),
            monthly_cost: l.cost_per_month.map_or(0, |m| m.0),
        }
    }
}

/// What a second reserve under the same idempotency key means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyRepeat {
    /// The caller lost the answer (`Admission/Reserve`): give back the key's live hold, charging
    /// nothing new.
    ReturnHold,
    /// A retried request (Envoy's `Check`): it will reach the backend too, so it is a new attempt
    /// with a hold of its own.
    NewAttempt,
}

/// An idempotency key as the reserve script takes it.
#[derive(Debug, Clone)]
pub struct KeyCall<'a> {
    pub key: &'a str,
    pub repeat: KeyRepeat,
    /// The request it stands for (user, model, size); the key is refused for any other.
    pub fingerprint: &'a str,
}

/// Everything one reserve needs. Scope keys come from [`keys`]; the tenant's scope is first.
#[derive(Debug, Clone)]
pub struct ReserveCall<'a> {
    pub tenant: &'a str,
    pub model: &'a str,
    pub id: &'a str,
    pub prompt_tokens: u64,
    /// The output held unless the estimate says less: the request's max_tokens or the model's.
    pub output_ceiling: u64,
    /// Learn and reserve the output estimate: (samples needed, quantile); `None` holds the ceiling.
    pub adaptive: Option<(u64, f64)>,
    pub lease_ms: u64,
    pub idle_ttl_ms: u64,
    pub retention_ms: u64,
    pub expired_usage: ExpiredUsage,
    pub sweep_batch: u32,
    pub idempotency: Option<KeyCall<'a>>,
    pub max_attempts: u32,
    pub concurrency_retry_cap_ms: u64,
    pub scopes: Vec<(String, ScopeLimits)>,
    /// The tenant's limits are measured, not enforced: a hold they would refuse is made anyway,
    /// and the reply says what they would have said.
    pub shadow: bool,
    /// Who the hold is for, as the ledger enters it.
    pub user: Option<&'a str>,
    pub tier: Priority,
    /// The usage ledger the hold is entered in when it settles; `None`: there is none.
    pub ledger: Option<LedgerTerms>,
    /// The model's price (zero when it has none): the hold is charged its cost.
    pub price: Price,
}

/// What the limits would have said of a hold made in shadow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WouldRefuse {
    pub reason: Refusal,
    /// Index into [`ReserveCall::scopes`].
    pub scope: usize,
    pub retry_after_ms: u64,
}

/// Tokens, request permits and concurrency slots: what a replica's slice of a scope holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Amounts {
    pub tokens: u64,
    pub requests: u64,
    pub slots: u64,
}

/// One scope of a lease call: what the replica gives back, the slots it keeps, and what it asks for.
#[derive(Debug, Clone)]
pub struct LeaseScope {
    pub key: String,
    pub limits: ScopeLimits,
    /// Tokens given back (negative: debt its holds ran up, charged now).
    pub back_tokens: i64,
    /// The day the tokens given back were drawn on (they come off that day's usage only).
    pub back_day: u64,
    /// Tokens given back to the bucket only: refunds of holds drawn on an earlier day, whose
    /// budget that day keeps.
    pub back_bucket_tokens: u64,
    pub back_requests: u64,
    /// Slots the replica holds after its return: the slots of its live holds.
    pub held_slots: u64,
    /// At least this, or nothing: what the request that asked needs beyond the slice it has.
    pub need: Amounts,
    /// As much as this, as far as the scope has it.
    pub want: Amounts,
}

/// One lease call of a replica on one tenant's scopes.
#[derive(Debug, Clone)]
pub struct LeaseCall<'a> {
    pub tenant: &'a str,
    pub replica: &'a str,
    /// How long the lease record lives unrenewed: the tenant's hold lease.
    pub lease_ms: u64,
    pub idle_ttl_ms: u64,
    pub sweep_batch: u32,
    pub concurrency_retry_cap_ms: u64,
    /// The replica leaves the tenant: drop its record if it holds no slot.
    pub ending: bool,
    pub scopes: Vec<LeaseScope>,
}

/// The store's answer to a lease call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseReply {
    pub outcome: LeaseOutcome,
    /// The store's day number (UTC days since the epoch).
    pub day: u64,
    pub headroom: Headroom,
    /// Operations other replicas forwarded for this replica's holds, now this replica's to apply.
    pub forwarded: Vec<(String, Forwarded)>,
    /// Ids of expired store holds the sweep settled (their pool legs are still to be released).
    pub swept: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseOutcome {
    /// Drawn, per scope in call order.
    Granted(Vec<Amounts>),
    /// Nothing drawn: a scope cannot give what the asking request needs.
    Refused { reason: Refusal, scope: usize, retry_after_ms: u64 },
}

/// An operation on a leased hold that reached another replica, handed to the one that holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forwarded {
    Commit(Counted),
    Release,
    Renew { lease_ms: u64 },
}

impl Forwarded {
    fn encode(self) -> String {
        let count = |n: Option<u64>| n.map_or_else(|| "-".to_string(), |n| n.to_string());
        match self {
            Forwarded::Commit(Counted::Exact { prompt, output }) => {
                format!("commit {prompt} {output} exact")
            }
            Forwarded::Commit(Counted::Metered { output }) => format!("commit - {} metered", count(Some(output))),
            Forwarded::Commit(Counted::AsHeld) => "commit - - metered".to_string(),
            Forwarded::Release => "release".to_string(),
            Forwarded::Renew { lease_ms } => format!("renew {lease_ms}"),
        }
    }

    fn decode(op: &str) -> Option<Forwarded> {
        let words: Vec<&str> = op.split(' ').collect();
        let count = |w: &str| if w == "-" { Ok(None) } else { w.parse::<u64>().map(Some) };
        Some(match words.as_slice() {
            ["release"] => Forwarded::Release,
            ["renew", ms] => Forwarded::Renew { lease_ms: ms.parse().ok()? },
            ["commit", prompt, output, measure] => match (count(prompt).ok()?, count(output).ok()?, *measure) {
                (Some(prompt), Some(output), "exact") => Forwarded::Commit(Counted::Exact { prompt, output }),
                (None, Some(output), "metered") => Forwarded::Commit(Counted::Metered { output }),
                (None, None, "metered") => Forwarded::Commit(Counted::AsHeld),
                _ => return None,
            },
            _ => return None,
        })
    }
}

/// Remaining / limit / reset of the tightest scope, for the `x-ratelimit-*` headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub remaining: i64,
    pub limit: u64,
    pub reset_ms: u64,
}

/// The tightest token and request windows after a decision; `None` where no scope limits them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Headroom {
    pub tokens: Option<Window>,
    pub requests: Option<Window>,
}

/// Which budget is spent: tokens or money, for the UTC day or the calendar month.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    DayTokens,
    DayCost,
    MonthTokens,
    MonthCost,
}

impl Budget {
    pub fn describe(self) -> &'static str {
        match self {
            Budget::DayTokens => "daily token budget",
            Budget::DayCost => "daily cost budget",
            Budget::MonthTokens => "monthly token budget",
            Budget::MonthCost => "monthly cost budget",
        }
    }
}

/// Which limit a reserve script refused on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    TokenRate,
    RequestRate,
    Concurrency,
    Budget(Budget),
    /// The idempotency key has made its most reserves.
    Attempts,
    /// The idempotency key was first used for a different request.
    Conflict,
    /// The hold is larger than a scope's whole capacity.
    Unsatisfiable,
}

impl Refusal {
    fn parse(s: &str) -> Option<Refusal> {
        Some(match s {
            "token_rate" => Refusal::TokenRate,
            "request_rate" => Refusal::RequestRate,
            "concurrency" => Refusal::Concurrency,
            "budget" => Refusal::Budget(Budget::DayTokens),
            "cost_budget" => Refusal::Budget(Budget::DayCost),
            "monthly_budget" => Refusal::Budget(Budget::MonthTokens),
            "monthly_cost_budget" => Refusal::Budget(Budget::MonthCost),
            "attempts" => Refusal::Attempts,
            "conflict" => Refusal::Conflict,
            "unsatisfiable" => Refusal::Unsatisfiable,
            _ => return None,
        })
    }
}

/// The store's answer to a reserve: its verdict, and the expired holds its sweep settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveReply {
    pub outcome: ReserveOutcome,
    /// Ids of the expired holds this call settled: their pool legs, on another slot, are still to
    /// be taken off their pools.
    pub swept: Vec<String>,
}

/// The store's verdict on a reserve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveOutcome {
    Admitted {
        id: String,
        held: u64,
        attempts: u32,
        headroom: Headroom,
        /// The output part of the hold when it came from the estimate.
        estimated_output: Option<u64>,
        /// An idempotency key gave back its earlier live hold: nothing new was charged.
        replayed: bool,
        /// In shadow, the refusal the limits would have made.
        shadowed: Option<WouldRefuse>,
    },
    Denied {
        reason: Refusal,
        /// Index into [`ReserveCall::scopes`] of the scope that refused.
        scope: usize,
        retry_after_ms: u64,
        headroom: Headroom,
    },
}

/// A state a hold has been settled in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    Committed,
    LateCommitted,
    Released,
    Expired,
}

impl Settled {
    fn parse(s: &str) -> Option<Settled> {
        Some(match s {
            "committed" => Settled::Committed,
            "late_committed" => Settled::LateCommitted,
            "released" => Settled::Released,
            "expired" => Settled::Expired,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Settled::Committed => "committed",
            Settled::LateCommitted => "late_committed",
            Settled::Released => "released",
            Settled::Expired => "expired",
        }
    }
}

/// What a commit is told was used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// Counts the response (or the caller) reported.
    Exact { prompt: u64, output: u64 },
    /// Counted by tollgate from the text that passed; the prompt is the one held at admission.
    Metered { output: u64 },
    /// Not countable (a compressed body, a format tollgate does not read): the hold is charged as
    /// it was made, prompt and output.
    AsHeld,
}

/// What a commit charged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    /// The hold had expired before its usage arrived.
    pub late: bool,
    /// An earlier commit of this id charged it; this is that commit's result.
    pub duplicate: bool,
    /// The counts charged were metered by tollgate, not reported.
    pub metered: bool,
    pub used: u64,
    pub held: u64,
    pub refunded: u64,
    pub overrun: u64,
    /// The model the request named (none for a hold whose record predates it).
    pub model: Option<String>,
    /// The output part of what was held (the rest was the prompt estimate), when known.
    pub output_held: Option<u64>,
    /// What the usage cost at the model's price when the hold was made (nanos; 0 unpriced).
    pub cost_nanos: u64,
}

/// The store's answer to a commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitOutcome {
    Committed(Usage),
    /// The hold was released; it cannot be committed, and nothing was charged.
    Released,
    NotFound,
    /// A leased hold of another replica: the commit was left for it, which applies it within one
    /// lease window.
    Forwarded,
}

impl CommitOutcome {
    /// `committed`, `late_committed`, `released` or `not_found`, as the API names them.
    pub fn state(&self) -> &'static str {
        match self {
            CommitOutcome::Committed(u) if u.late => "late_committed",
            CommitOutcome::Committed(_) => "committed",
            CommitOutcome::Released => "released",
            CommitOutcome::NotFound => "not_found",
            CommitOutcome::Forwarded => "forwarded",
        }
    }

    pub fn usage(&self) -> Option<&Usage> {
        match self {
            CommitOutcome::Committed(u) => Some(u),
            _ => None,
        }
    }
}

/// The store's answer to a renew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenewOutcome {
    Renewed {
        lease_remaining_ms: u64,
    },
    /// Too late: the hold was already settled (or expired as this call found it).
    Settled(Settled),
    NotFound,
    /// Left for the replica that holds the leased hold.
    Forwarded,
}

impl RenewOutcome {
    pub fn state(&self) -> &'static str {
        match self {
            RenewOutcome::Renewed { .. } => "reserved",
            RenewOutcome::Settled(s) => s.as_str(),
            RenewOutcome::NotFound => "not_found",
            RenewOutcome::Forwarded => "forwarded",
        }
    }
}

/// The store's answer to a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// Released; `repeated` when an earlier call did it (the refund is that call's, given once).
    Released {
        refunded: u64,
        repeated: bool,
    },
    /// Settled otherwise before this call (or expired as this call found it).
    Settled(Settled),
    NotFound,
    /// Left for the replica that holds the leased hold.
    Forwarded,
}

impl ReleaseOutcome {
    pub fn state(&self) -> &'static str {
        match self {
            ReleaseOutcome::Released { .. } => "released",
            ReleaseOutcome::Settled(s) => s.as_str(),
            ReleaseOutcome::NotFound => "not_found",
            ReleaseOutcome::Forwarded => "forwarded",
        }
    }
}

/// What a commit teaches the output estimate of a hold that learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Learning {
    /// How long the estimate outlives its last commit (ms).
    pub ttl_ms: u64,
    /// Samples kept before every count is halved.
    pub window: u64,
}

/// A tenant's learned output length for one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EstimateView {
    pub samples: u64,
    /// The tracked quantile, in tokens (0 before the first sample).
    pub quantile_tokens: u64,
    pub used_tokens: u64,
    /// Tokens used beyond their hold: the estimator's error, as overrun / used.
    pub overrun_tokens: u64,
}

/// Everything one pool reserve needs.
#[derive(Debug, Clone)]
pub struct PoolCall<'a> {
    pub pool: &'a str,
    pub id: &'a str,
    /// Predicted slot time of the request (ms).
    pub work_ms: u64,
    pub kv_tokens: u64,
    pub lease_ms: u64,
    pub idle_ttl_ms: u64,
    pub sweep_batch: u32,
    pub slots: u64,
    pub tier_slots: u64,
    pub max_queue_delay_ms: u64,
    /// `None` when the pool sets no KV limit.
    pub tier_kv_tokens: Option<u64>,
    pub deadline_ms: Option<u64>,
    /// Recovery per ms of the share the provider's 429s left the pool (0 without a throttle).
    pub recover_per_ms: f64,
}

/// What a pool holds, and how far its provider's 429s throttle it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolView {
    pub holds: u64,
    pub work_ms: u64,
    pub kv_tokens: u64,
    /// The share of the pool admitted: 1 unthrottled, down to the throttle's lowest.
    pub share: f64,
    /// Nothing new is admitted for this long (the provider's Retry-After).
    pub resumes_in_ms: u64,
}

/// A provider's refusal as `pool_throttle.lua` takes it.
#[derive(Debug, Clone, Copy)]
pub struct ThrottleCall<'a> {
    pub pool: &'a str,
    pub retry_after_ms: u64,
    pub decrease: f64,
    pub min_share: f64,
    pub recover_per_ms: f64,
    pub cooldown_ms: u64,
    pub idle_ttl_ms: u64,
}

/// Why a pool refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolRefusal {
    /// The predicted finish is past the caller's deadline.
    Deadline,
    /// The tier's share of the pool is full: its predicted queue delay is past the max.
    QueueFull,
    /// The provider behind the pool refused with a Retry-After that has not passed.
    Throttled,
}

/// The pool's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolOutcome {
    Admitted { start_delay_ms: u64, holds: u64, work_ms: u64 },
    Denied { reason: PoolRefusal, retry_after_ms: u64, start_delay_ms: u64 },
}

/// The protocol over a store.
#[derive(Debug)]
pub struct Protocol<S> {
    store: S,
    scripts: Scripts,
}

impl<S: Store> Protocol<S> {
    /// Loads every phase script into the store: a script the store cannot compile fails here.
    pub async fn new(store: S) -> Result<Self, StoreError> {
        let scripts = Scripts::new();
        for script in scripts.all() {
            store.load(script).await?;
        }
        Ok(Protocol { store, scripts })
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    pub async fn reserve(&self, call: &ReserveCall<'_>) -> Result<ReserveReply, StoreError> {
        let tenant = call.tenant;
        let key = call.idempotency.as_ref();
        let mut keys = Vec::with_capacity(call.scopes.len().saturating_add(6));
        keys.push(keys::leases(tenant));
        keys.push(keys::record(tenant, call.id));
        keys.push(keys::idempotency(tenant, key.map_or("", |k| k.key)));
        keys.push(keys::output_estimate(tenant, call.model));
        keys.push(keys::holds(tenant));
        keys.push(keys::ledger(tenant));
        let (min_samples, quantile) = call.adaptive.unwrap_or((0, 0.0));
        let repeat = match key.map(|k| k.repeat) {
            None => "",
            Some(KeyRepeat::ReturnHold) => "same",
            Some(KeyRepeat::NewAttempt) => "new",
        };
        let mut args = Vec::with_capacity(call.scopes.len().saturating_mul(9).saturating_add(23));
        args.extend([
            call.id.to_string(),
            keys::record_prefix(tenant),
            call.prompt_tokens.to_string(),
            call.lease_ms.to_string(),
            call.idle_ttl_ms.to_string(),
            call.retention_ms.to_string(),
            expired_usage_lua(call.expired_usage).to_string(),
            call.sweep_batch.to_string(),
            repeat.to_string(),
            call.max_attempts.to_string(),
            call.concurrency_retry_cap_ms.to_string(),
            call.output_ceiling.to_string(),
            min_samples.to_string(),
            quantile.to_string(),
            key.map_or_else(String::new, |k| k.fingerprint.to_string()),
            if call.shadow { "1" } else { "0" }.to_string(),
            call.model.to_string(),
            tenant.to_string(),
            call.user.unwrap_or("").to_string(),
            call.tier.as_str().to_string(),
            call.ledger.map_or_else(String::new, |l| format!("{} {}", l.max_len, l.retention_ms)),
            call.price.input_nanos.to_string(),
            call.price.output_nanos.to_string(),
        ]);
        for (key, limits) in &call.scopes {
            keys.push(key.clone());
            args.extend([
                limits.token_capacity.to_string(),
                limits.tokens_per_ms.to_string(),
                limits.request_capacity.to_string(),
                limits.requests_per_ms.to_string(),
                limits.max_concurrency.to_string(),
                limits.daily_budget.to_string(),
                limits.monthly_budget.to_string(),
                limits.daily_cost.to_string(),
                limits.monthly_cost.to_string(),
            ]);
        }
        let script = &self.scripts.reserve;
        let reply = self.store.eval(script, keys, args).await?;
        let r = Fields::of(script, &reply)?;
        match r.uint(0)? {
            1 => Ok(ReserveReply {
                outcome: ReserveOutcome::Admitted {
                    id: r.text(1)?.to_string(),
                    held: r.uint(2)?,
                    attempts: r.count(3)?,
                    headroom: Headroom { tokens: r.window([4, 5, 6])?, requests: r.window([7, 8, 9])? },
                    estimated_output: r.flag(11)?.then(|| r.uint(10)).transpose()?,
                    replayed: r.flag(12)?,
                    shadowed: r.would_refuse(14)?,
                },
                swept: r.texts(13)?,
            }),
            0 => Ok(ReserveReply {
                outcome: ReserveOutcome::Denied {
                    reason: Refusal::parse(r.text(1)?).ok_or_else(|| r.bad())?,
                    scope: usize::try_from(r.uint(2)?.saturating_sub(1)).map_err(|_| r.bad())?,
                    retry_after_ms: r.uint(3)?,
                    headroom: Headroom { tokens: r.window([4, 5, 6])?, requests: None },
                },
                swept: r.texts(7)?,
            }),
            _ => Err(r.bad()),
        }
    }

    /// A replica's lease call on one tenant (see `lua/lease.lua`).
    pub async fn lease(&self, call: &LeaseCall<'_>) -> Result<LeaseReply, StoreError> {
        let tenant = call.tenant;
        let mut keys = Vec::with_capacity(call.scopes.len().saturating_add(5));
        keys.extend([
            keys::leases(tenant),
            keys::holds(tenant),
            keys::lease_record(tenant, call.replica),
            keys::forwarded(tenant, call.replica),
            keys::ledger(tenant),
        ]);
        let mut args = Vec::with_capacity(call.scopes.len().saturating_mul(17).saturating_add(7));
        args.extend([
            keys::lease_member(call.replica),
            keys::record_prefix(tenant),
            call.lease_ms.to_string(),
            call.idle_ttl_ms.to_string(),
            call.sweep_batch.to_string(),
            call.concurrency_retry_cap_ms.to_string(),
            if call.ending { "end" } else { "keep" }.to_string(),
        ]);
        for s in &call.scopes {
            keys.push(s.key.clone());
            let l = &s.limits;
            args.extend([
                l.token_capacity.to_string(),
                l.tokens_per_ms.to_string(),
                l.request_capacity.to_string(),
                l.requests_per_ms.to_string(),
                l.max_concurrency.to_string(),
                l.daily_budget.to_string(),
                s.back_tokens.to_string(),
                s.back_day.to_string(),
                s.back_bucket_tokens.to_string(),
                s.back_requests.to_string(),
                s.held_slots.to_string(),
                s.need.tokens.to_string(),
                s.need.requests.to_string(),
                s.need.slots.to_string(),
                s.want.tokens.to_string(),
                s.want.requests.to_string(),
                s.want.slots.to_string(),
            ]);
        }
        let script = &self.scripts.lease;
        let reply = self.store.eval(script, keys, args).await?;
        let r = Fields::of(script, &reply)?;
        let outcome = match r.uint(0)? {
            1 => {
                let Some(Reply::Array(rows)) = r.items.get(11) else { return Err(r.bad()) };
                let granted = rows
                    .iter()
                    .map(|row| match row {
                        Reply::Array(n) => {
                            let at = |i: usize| n.get(i).and_then(Reply::as_int).and_then(|v| u64::try_from(v).ok());
                            Some(Amounts { tokens: at(0)?, requests: at(1)?, slots: at(2)? })
                        }
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| r.bad())?;
                if granted.len() != call.scopes.len() {
                    return Err(r.bad());
                }
                LeaseOutcome::Granted(granted)
            }
            0 => LeaseOutcome::Refused {
                reason: Refusal::parse(r.text(1)?).ok_or_else(|| r.bad())?,
                scope: usize::try_from(r.uint(2)?.saturating_sub(1)).map_err(|_| r.bad())?,
                retry_after_ms: r.uint(3)?,
            },
            _ => return Err(r.bad()),
        };
        let ops = r.texts(12)?;
        let forwarded = ops
            .chunks(2)
            .filter_map(|pair| match pair {
                [id, op] => match Forwarded::decode(op) {
                    Some(f) => Some((id.clone(), f)),
                    None => {
                        tracing::warn!(reservation = %id, op = %op, "a forwarded operation could not be read; dropped");
                        None
                    }
                },
                _ => None,
            })
            .collect();
        Ok(LeaseReply {
            outcome,
            day: r.uint(4)?,
            headroom: Headroom { tokens: r.window([5, 6, 7])?, requests: r.window([8, 9, 10])? },
            forwarded,
            swept: r.texts(13)?,
        })
    }

    /// Leaves an operation on a leased hold for the replica that holds it. `Ok(false)`: that
    /// replica holds no lease on the tenant any more (it stopped; its holds settle as expired).
    pub async fn forward(
        &self,
        tenant: &str,
        replica: &str,
        id: &str,
        op: Forwarded,
        ttl_ms: u64,
    ) -> Result<bool, StoreError> {
        let script = &self.scripts.lease_forward;
        let keys = vec![keys::forwarded(tenant, replica), keys::lease_record(tenant, replica)];
        let reply = self.store.eval(script, keys, vec![id.to_string(), op.encode(), ttl_ms.to_string()]).await?;
        match reply.as_text() {
            Some("forwarded") => Ok(true),
            Some("gone") => Ok(false),
            _ => Err(StoreError::BadReply { script: script.name, reply }),
        }
    }

    /// `learning` is `None` when the hold's tenant no longer learns.
    pub async fn commit(
        &self,
        tenant: &str,
        id: &str,
        counted: Counted,
        learning: Option<Learning>,
    ) -> Result<CommitOutcome, StoreError> {
        let script = &self.scripts.commit;
        let (prompt, output, measure) = match counted {
            Counted::Exact { prompt, output } => (prompt.to_string(), output.to_string(), "exact"),
            Counted::Metered { output } => (String::new(), output.to_string(), "metered"),
            Counted::AsHeld => (String::new(), String::new(), "metered"),
        };
        let args = vec![
            id.to_string(),
            prompt,
            output,
            learning.map_or(0, |l| l.ttl_ms).to_string(),
            learning.map_or(0, |l| l.window).to_string(),
            measure.to_string(),
        ];
        let reply = self.store.eval(script, hold_keys(tenant, id), args).await?;
        let r = Fields::of(script, &reply)?;
        Ok(match r.text(0)? {
            "not_found" => CommitOutcome::NotFound,
            "released" => CommitOutcome::Released,
            state @ ("committed" | "late_committed") => CommitOutcome::Committed(Usage {
                late: state == "late_committed",
                duplicate: r.flag(1)?,
                metered: r.flag(6)?,
                used: r.uint(2)?,
                held: r.uint(3)?,
                refunded: r.uint(4)?,
                overrun: r.uint(5)?,
                model: r.text(7).ok().filter(|m| !m.is_empty()).map(str::to_string),
                output_held: r.int(8).ok().and_then(|n| u64::try_from(n).ok()),
                cost_nanos: r.uint(9).unwrap_or(0),
            }),
            _ => return Err(r.bad()),
        })
    }

    pub async fn renew(
        &self,
        tenant: &str,
        id: &str,
        lease_ms: u64,
        idle_ttl_ms: u64,
    ) -> Result<RenewOutcome, StoreError> {
        let script = &self.scripts.renew;
        let args = vec![id.to_string(), lease_ms.to_string(), idle_ttl_ms.to_string()];
        let reply = self.store.eval(script, hold_keys(tenant, id), args).await?;
        let r = Fields::of(script, &reply)?;
        Ok(match r.text(0)? {
            "reserved" => RenewOutcome::Renewed { lease_remaining_ms: r.uint(1)? },
            "not_found" => RenewOutcome::NotFound,
            other => RenewOutcome::Settled(Settled::parse(other).ok_or_else(|| r.bad())?),
        })
    }

    pub async fn release(&self, tenant: &str, id: &str) -> Result<ReleaseOutcome, StoreError> {
        let script = &self.scripts.release;
        let reply = self.store.eval(script, hold_keys(tenant, id), vec![id.to_string()]).await?;
        let r = Fields::of(script, &reply)?;
        Ok(match r.text(0)? {
            "released" => ReleaseOutcome::Released { refunded: r.uint(1)?, repeated: r.flag(2)? },
            "not_found" => ReleaseOutcome::NotFound,
            other => ReleaseOutcome::Settled(Settled::parse(other).ok_or_else(|| r.bad())?),
        })
    }

    /// A tenant's output estimate for a model, and its error so far.
    pub async fn output_estimate(&self, tenant: &str, model: &str) -> Result<EstimateView, StoreError> {
        let script = &self.scripts.estimate;
        let reply = self.store.eval(script, vec![keys::output_estimate(tenant, model)], vec![]).await?;
        let r = Fields::of(script, &reply)?;
        Ok(EstimateView {
            samples: r.uint(0)?,
            quantile_tokens: r.uint(1)?,
            used_tokens: r.uint(2)?,
            overrun_tokens: r.uint(3)?,
        })
    }

    /// Says this replica is alive (for `ttl_ms`), and returns how many replicas are.
    pub async fn heartbeat(&self, replica: &str, ttl_ms: u64) -> Result<u64, StoreError> {
        let script = &self.scripts.heartbeat;
        let reply =
            self.store.eval(script, vec![keys::replicas()], vec![replica.to_string(), ttl_ms.to_string()]).await?;
        match reply {
            Reply::Int(n) => u64::try_from(n).map_err(|_| StoreError::BadReply { script: script.name, reply }),
            reply => Err(StoreError::BadReply { script: script.name, reply }),
        }
    }

    pub async fn pool_reserve(&self, call: &PoolCall<'_>) -> Result<PoolOutcome, StoreError> {
        let script = &self.scripts.pool_reserve;
        let args = vec![
            call.id.to_string(),
            call.work_ms.to_string(),
            call.kv_tokens.to_string(),
            call.lease_ms.to_string(),
            call.idle_ttl_ms.to_string(),
            call.sweep_batch.to_string(),
            call.slots.to_string(),
            call.tier_slots.to_string(),
            call.max_queue_delay_ms.to_string(),
            call.tier_kv_tokens.unwrap_or(0).to_string(),
            call.deadline_ms.unwrap_or(0).to_string(),
            call.recover_per_ms.to_string(),
        ];
        let reply = self.store.eval(script, pool_keys(call.pool), args).await?;
        let r = Fields::of(script, &reply)?;
        match r.uint(0)? {
            1 => Ok(PoolOutcome::Admitted { start_delay_ms: r.uint(1)?, holds: r.uint(2)?, work_ms: r.uint(3)? }),
            0 => {
                let reason = match r.text(1)? {
                    "deadline" => PoolRefusal::Deadline,
                    "queue_full" => PoolRefusal::QueueFull,
                    "throttled" => PoolRefusal::Throttled,
                    _ => return Err(r.bad()),
                };
                Ok(PoolOutcome::Denied { reason, retry_after_ms: r.uint(2)?, start_delay_ms: r.uint(3)? })
            }
            _ => Err(r.bad()),
        }
    }

    /// A provider refused a request of this pool: throttle it. Returns the share of the pool left
    /// and how long admission pauses (ms).
    pub async fn pool_throttle(&self, call: &ThrottleCall<'_>) -> Result<(f64, u64), StoreError> {
        let script = &self.scripts.pool_throttle;
        let args = vec![
            call.retry_after_ms.to_string(),
            call.decrease.to_string(),
            call.min_share.to_string(),
            call.recover_per_ms.to_string(),
            call.cooldown_ms.to_string(),
            call.idle_ttl_ms.to_string(),
        ];
        let reply = self.store.eval(script, vec![keys::pool_state(call.pool)], args).await?;
        let r = Fields::of(script, &reply)?;
        Ok((thousandths(r.uint(0)?), r.uint(1)?))
    }

    /// What a pool holds and how far it is throttled. Reads only.
    pub async fn pool_status(&self, pool: &str, recover_per_ms: f64) -> Result<PoolView, StoreError> {
        let script = &self.scripts.pool_status;
        let reply = self.store.eval(script, vec![keys::pool_state(pool)], vec![recover_per_ms.to_string()]).await?;
        let r = Fields::of(script, &reply)?;
        Ok(PoolView {
            holds: r.uint(0)?,
            work_ms: r.uint(1)?,
            kv_tokens: r.uint(2)?,
            share: thousandths(r.uint(3)?),
            resumes_in_ms: r.uint(4)?,
        })
    }

    /// Takes a hold off its pool; `false` when the pool did not hold it. Idempotent.
    pub async fn pool_release(&self, pool: &str, id: &str) -> Result<bool, StoreError> {
        let script = &self.scripts.pool_release;
        let reply = self.store.eval(script, pool_keys(pool), vec![id.to_string()]).await?;
        Fields::of(script, &reply)?.flag(0)
    }

    /// Extends a pool hold's lease; `false` when the pool does not hold it.
    pub async fn pool_renew(&self, pool: &str, id: &str, lease_ms: u64, idle_ttl_ms: u64) -> Result<bool, StoreError> {
        let script = &self.scripts.pool_renew;
        let args = vec![id.to_string(), lease_ms.to_string(), idle_ttl_ms.to_string()];
        let reply = self.store.eval(script, pool_keys(pool), args).await?;
        match reply {
            Reply::Int(n @ (0 | 1)) => Ok(n == 1),
            _ => Err(StoreError::BadReply { script: script.name, reply }),
        }
    }
}

/// KEYS of commit, renew and release: the record, the lease index, the holds hash, the ledger.
fn hold_keys(tenant: &str, id: &str) -> Vec<String> {
    vec![keys::record(tenant, id), keys::leases(tenant), keys::holds(tenant), keys::ledger(tenant)]
}

/// A share the scripts send in thousandths (at most 1,000).
#[allow(clippy::cast_precision_loss)]
fn thousandths(n: u64) -> f64 {
    n.min(1_000) as f64 / 1000.0
}

fn pool_keys(pool: &str) -> Vec<String> {
    vec![keys::pool_state(pool), keys::pool_holds(pool), keys::pool_leases(pool)]
}

/// A script's array reply, read field by field; any field of the wrong shape is a [`StoreError::BadReply`]
/// naming the script and the whole reply.
struct Fields<'a> {
    script: &'static str,
    reply: &'a Reply,
    items: &'a [Reply],
}

impl<'a> Fields<'a> {
    fn of(script: &Script, reply: &'a Reply) -> Result<Self, StoreError> {
        match reply {
            Reply::Array(items) => Ok(Fields { script: script.name, reply, items }),
            _ => Err(StoreError::BadReply { script: script.name, reply: reply.clone() }),
        }
    }

    fn bad(&self) -> StoreError {
        StoreError::BadReply { script: self.script, reply: self.reply.clone() }
    }

    fn int(&self, i: usize) -> Result<i64, StoreError> {
        self.items.get(i).and_then(Reply::as_int).ok_or_else(|| self.bad())
    }

    /// A count: never negative.
    fn uint(&self, i: usize) -> Result<u64, StoreError> {
        u64::try_from(self.int(i)?).map_err(|_| self.bad())
    }

    fn count(&self, i: usize) -> Result<u32, StoreError> {
        u32::try_from(self.int(i)?).map_err(|_| self.bad())
    }

    /// A 0 / 1 field.
    fn flag(&self, i: usize) -> Result<bool, StoreError> {
        match self.int(i)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(self.bad()),
        }
    }

    fn text(&self, i: usize) -> Result<&'a str, StoreError> {
        self.items.get(i).and_then(Reply::as_text).ok_or_else(|| self.bad())
    }

    /// A list of texts. An empty Lua table arrives as an empty array (or, from the embedded
    /// store, as nothing at all past the last field).
    fn texts(&self, i: usize) -> Result<Vec<String>, StoreError> {
        match self.items.get(i) {
            None => Ok(Vec::new()),
            Some(Reply::Array(items)) => {
                items.iter().map(|t| t.as_text().map(str::to_string).ok_or_else(|| self.bad())).collect()
            }
            Some(_) => Err(self.bad()),
        }
    }

    /// `{reason, scope (1-based), retry after ms}`, or an empty table (or nothing) for none.
    fn would_refuse(&self, i: usize) -> Result<Option<WouldRefuse>, StoreError> {
        match self.items.get(i) {
            None => Ok(None),
            Some(Reply::Array(items)) if items.is_empty() => Ok(None),
            Some(Reply::Array(items)) => {
                let inner = Fields { script: self.script, reply: self.reply, items };
                Ok(Some(WouldRefuse {
                    reason: Refusal::parse(inner.text(0)?).ok_or_else(|| self.bad())?,
                    scope: usize::try_from(inner.uint(1)?.saturating_sub(1)).map_err(|_| self.bad())?,
                    retry_after_ms: inner.uint(2)?,
                }))
            }
            Some(_) => Err(self.bad()),
        }
    }

    /// Remaining / limit / reset at these fields: the scripts send a limit of -1 for "no scope
    /// limits this".
    fn window(&self, [remaining, limit, reset]: [usize; 3]) -> Result<Option<Window>, StoreError> {
        let limit = self.int(limit)?;
        if limit < 0 {
            return Ok(None);
        }
        Ok(Some(Window {
            remaining: self.int(remaining)?,
            limit: limit.unsigned_abs(),
            reset_ms: self.int(reset)?.max(0).unsigned_abs(),
        }))
    }
}
