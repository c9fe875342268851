//! `reserve.lua`, the admission phase: the call, its `KEYS`/`ARGV`, its reply.

use super::{Argv, Fields};
use crate::config::{ExpiredUsage, LedgerTerms, Price, Priority, TokenWeights};
use std::num::NonZeroU64;

use crate::hold::{Bucket, BudgetKey, Headroom, KeyRepeat, ReserveOutcome, ScopeLimits, Sides, WouldRefuse};
use crate::store::{Protocol, Store, StoreError, keys};

/// `reserve.lua`'s fixed `ARGV`, in order, as its header names them.
pub(crate) const ARGV: [&str; 12] = [
    "reservation id",
    "record key prefix",
    "prompt tokens",
    "output ceiling",
    "what a repeat of the idempotency key means",
    "the request's fingerprint",
    "the model the request names",
    "the tenant",
    "the user",
    "the tier",
    "the tenant's settled-bucket prefix",
    "the hold's terms",
];

/// Then this, per scope, in `KEYS` order: [`SCOPE_ARGV`] in one string ([`packed_limits`]).
pub(crate) const PACKED_SCOPE_ARGV: [&str; 1] = ["the scope's limits"];

/// The limits of a scope, in order, as lease, budget_get and a pool's provider limits take them,
/// one argument each (`0`: no such limit); and as reserve takes them, in one string.
pub(crate) const SCOPE_ARGV: [&str; 10] = [
    "token capacity",
    "tokens per ms",
    "request capacity",
    "requests per ms",
    "max concurrency",
    "input token capacity",
    "input tokens per ms",
    "output token capacity",
    "output tokens per ms",
    "period budgets",
];

/// The forms of a reservation record, as heartbeats announce the newest a replica reads: every
/// field (every version reads it), and compact (the hold's terms in one field, what a new hold
/// starts with left out; see `load` in common.lua). This version reads both, and a reserve writes
/// the compact form only while every replica heard reads it.
pub const FULL_RECORD: u64 = 1;
pub const COMPACT_RECORD: u64 = 2;

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
    /// How long a settled hold answers repeats (at least; at most twice as long).
    pub retention_ms: u64,
    /// How long an expired hold's record waits for a late commit.
    pub late_commit_ms: u64,
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
    /// What the model's cached prompt tokens and reasoning tokens count: commit charges them so.
    pub token_weights: TokenWeights,
    /// The tenant's time zone's offset from UTC now, in minutes east: its budgets' periods are
    /// numbered in it.
    pub zone_offset_min: i32,
    /// Write the hold's record in the compact form (every replica sharing the store reads it:
    /// see [`COMPACT_RECORD`]).
    pub compact_record: bool,
}

/// The store's answer to a reserve: its verdict, and the expired holds its sweep settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveReply {
    pub outcome: ReserveOutcome,
    /// Ids of the expired holds this call settled: their pool legs, on another slot, are still to
    /// be taken off their pools.
    pub swept: Vec<String>,
    /// Per scope, in call order, what its daily token budget has left after this call (`None`:
    /// it has none): what the replica's local share, should the store become unreachable, is a
    /// share of.
    pub budget_left: Vec<Option<u64>>,
}

fn expired_usage(e: ExpiredUsage) -> &'static str {
    match e {
        ExpiredUsage::ChargeReserved => "charge",
        ExpiredUsage::Refund => "refund",
    }
}

impl<S: Store> Protocol<S> {
    /// Holds budget for a request, in every scope or none, after settling the tenant's expired
    /// holds (see `lua/reserve.lua`).
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
        let repeat = match key.map(|k| k.repeat) {
            None => "",
            Some(KeyRepeat::ReturnHold) => "same",
            Some(KeyRepeat::NewAttempt) => "new",
        };
        let mut a = Argv::grouped("reserve", &ARGV, &PACKED_SCOPE_ARGV, call.scopes.len());
        a.push("reservation id", call.id.to_string());
        a.push("record key prefix", keys::record_prefix(tenant));
        a.push("prompt tokens", call.prompt_tokens.to_string());
        a.push("output ceiling", call.output_ceiling.to_string());
        a.push("what a repeat of the idempotency key means", repeat.to_string());
        a.push("the request's fingerprint", key.map_or_else(String::new, |k| k.fingerprint.to_string()));
        a.push("the model the request names", call.model.to_string());
        a.push("the tenant", tenant.to_string());
        a.push("the user", call.user.unwrap_or("").to_string());
        a.push("the tier", call.tier.as_str().to_string());
        a.push("the tenant's settled-bucket prefix", keys::settled_prefix(tenant));
        a.push("the hold's terms", hold_terms(call));
        for (key, limits) in &call.scopes {
            keys.push(key.clone());
            a.push("the scope's limits", packed_limits(limits));
        }
        let script = &self.scripts.reserve;
        let reply = self.store.eval(script, keys, a.finish()).await?;
        let r = Fields::of(script, &reply)?;
        match r.uint(0)? {
            1 => {
                let (budget_left, swept) = r.lists(25)?;
                Ok(ReserveReply {
                    outcome: ReserveOutcome::Admitted {
                        id: r.text(1)?.to_string(),
                        held: r.uint(2)?,
                        attempts: r.count(3)?,
                        headroom: Headroom {
                            tokens: r.window([4, 5, 6])?,
                            requests: r.window([7, 8, 9])?,
                            sides: None,
                        }
                        .with_sides(Sides { input: r.window([13, 14, 15])?, output: r.window([16, 17, 18])? }),
                        estimated_output: r.flag(11)?.then(|| r.uint(10)).transpose()?,
                        replayed: r.flag(12)?,
                        soft: match r.text(19)? {
                            "" => None,
                            counter => Some((BudgetKey::from_counter(counter).ok_or_else(|| r.bad())?, r.uint(20)?)),
                        },
                        shadowed: match r.text(21)? {
                            "" => None,
                            _ => Some(WouldRefuse {
                                reason: r.refusal(21)?,
                                scope: r.scope(22)?,
                                retry_after_ms: r.uint(23)?,
                            }),
                        },
                        slots_left: r.optional_uint(24)?,
                    },
                    swept,
                    budget_left,
                })
            }
            0 => {
                let (budget_left, swept) = r.lists(7)?;
                Ok(ReserveReply {
                    outcome: ReserveOutcome::Denied {
                        reason: r.refusal(1)?,
                        scope: r.scope(2)?,
                        retry_after_ms: r.uint(3)?,
                        headroom: Headroom { tokens: r.window([4, 5, 6])?, ..Headroom::default() },
                    },
                    swept,
                    budget_left,
                })
            }
            _ => Err(r.bad()),
        }
    }
}

/// The ten limits lease, budget_get and a pool's provider limits send first for a scope, in
/// their order.
pub(super) fn push_limits(a: &mut Argv, l: &ScopeLimits) {
    for (name, value) in SCOPE_ARGV.iter().zip(limits(l)) {
        a.push(name, value);
    }
}

/// A scope's ten limits in one string, space separated, the period budgets last: as reserve takes
/// them (`lua/common.lua`'s `PARSE.limits`).
fn packed_limits(l: &ScopeLimits) -> String {
    let mut packed = limits(l).join(" ");
    packed.truncate(packed.trim_end().len());
    packed
}

/// A scope's limits as the scripts take them, in [`SCOPE_ARGV`]'s order.
fn limits(l: &ScopeLimits) -> [String; 10] {
    let capacity = |b: Option<Bucket>| or_zero(b.map(|b| b.capacity));
    let per_ms = |b: Option<Bucket>| b.map_or(0.0, |b| b.per_ms).to_string();
    let hard = BudgetKey::all().filter_map(|k| l.budget(k).map(|limit| format!("{}:{limit}", k.counter())));
    let soft = BudgetKey::all()
        .filter_map(|k| l.soft.get(k.index()).filter(|&&n| n > 0).map(|limit| format!("~{}:{limit}", k.counter())));
    let budgets: Vec<String> = hard.chain(soft).collect();
    [
        capacity(l.tokens),
        per_ms(l.tokens),
        capacity(l.requests),
        per_ms(l.requests),
        or_zero(l.max_concurrency),
        capacity(l.input),
        per_ms(l.input),
        capacity(l.output),
        per_ms(l.output),
        budgets.join(" "),
    ]
}

/// `reserve.lua`'s terms of a hold, what changes only with the policy (and the record form the
/// replicas read), in one string (its header gives the order; the script reads each distinct
/// string once).
fn hold_terms(call: &ReserveCall<'_>) -> String {
    let (min_samples, quantile) = call.adaptive.unwrap_or((0, 0.0));
    let ledger = call.ledger.map_or_else(|| "- -".to_string(), |l| format!("{} {}", l.max_len, l.retention_ms));
    let weighted = match weighted_terms(call.price, call.token_weights) {
        w if w.is_empty() => "- - - - - -".to_string(),
        w => w,
    };
    format!(
        "{} {} {} {} {} {} {} {} {} {} {} {} {} {} {ledger} {weighted} {}",
        call.lease_ms,
        call.idle_ttl_ms,
        call.late_commit_ms,
        expired_usage(call.expired_usage),
        call.sweep_batch,
        call.max_attempts,
        call.concurrency_retry_cap_ms,
        min_samples,
        quantile,
        u8::from(call.shadow),
        call.price.input_nanos,
        call.price.output_nanos,
        call.retention_ms,
        call.zone_offset_min,
        if call.compact_record { COMPACT_RECORD } else { FULL_RECORD },
    )
}

/// A limit as the scripts take it: `0` for none (the one place that sentinel is written).
fn or_zero(limit: Option<NonZeroU64>) -> String {
    limit.map_or(0, NonZeroU64::get).to_string()
}

/// `reserve.lua`'s terms for weighted tokens: the weights and prices of cached prompt tokens and
/// of reasoning tokens, or nothing when every token counts whole at its side's price (the record
/// then carries no field for them).
fn weighted_terms(price: Price, weights: TokenWeights) -> String {
    let whole = weights == TokenWeights::default();
    let plain = price.cache_read_nanos == price.input_nanos
        && price.cache_write_nanos == price.input_nanos
        && price.reasoning_nanos == price.output_nanos;
    if whole && plain {
        return String::new();
    }
    format!(
        "{} {} {} {} {} {}",
        weights.read_milli,
        weights.write_milli,
        price.cache_read_nanos,
        price.cache_write_nanos,
        weights.reasoning_milli,
        price.reasoning_nanos
    )
}
