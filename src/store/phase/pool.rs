//! A backend pool's scripts: `pool_reserve.lua`, `pool_release.lua`, `pool_renew.lua`,
//! `pool_progress.lua`, `pool_throttle.lua` and `pool_status.lua`. A pool's keys carry the pool's hash tag, not a
//! tenant's, so these run apart from the tenant phases (see the reserve phase's "Two key spaces", `admission::reserve`).

use super::reserve::{SCOPE_ARGV, push_limits};
use super::{Argv, Fields, joined, refusal};
use crate::hold::{PoolRefusal, Refusal, ScopeLimits};
use crate::store::{Protocol, Reply, Store, StoreError, keys};

/// `pool_reserve.lua`'s `ARGV`, in order; where the pool sets provider limits, [`PROVIDER_ARGV`]
/// follow.
pub(crate) const RESERVE_ARGV: [&str; 19] = [
    "reservation id",
    "work",
    "KV-cache tokens",
    "lease (ms)",
    "idle TTL",
    "sweep batch",
    "slots of the whole pool",
    "slots this request's tier may fill",
    "max queue delay",
    "KV tokens this tier may fill",
    "deadline",
    "recovery per ms",
    "finish",
    "tier",
    "tenant",
    "the tenant's weight in its tier",
    "where the pool queues",
    "how long the caller may still wait",
    "waiter TTL",
];

/// `pool_reserve.lua`'s `ARGV` after [`RESERVE_ARGV`] where the pool sets provider limits: what the
/// request takes from them, then the limits as a scope's ([`SCOPE_ARGV`]).
pub(crate) const PROVIDER_ARGV: [&str; 15] = joined(
    [
        "the tier's part of the provider's limits",
        "prompt tokens",
        "output tokens held",
        "cost (nanos) of both",
        "the provider scope's idle TTL",
    ],
    SCOPE_ARGV,
);

/// `pool_release.lua`'s `ARGV`, in order.
pub(crate) const RELEASE_ARGV: [&str; 5] =
    ["reservation id", "how its request ended", "prompt tokens used", "output tokens used", "cost (nanos)"];

/// `pool_renew.lua`'s `ARGV`, in order.
pub(crate) const RENEW_ARGV: [&str; 3] = ["reservation id", "new lease", "idle TTL"];

/// `pool_progress.lua`'s `ARGV`, in order.
pub(crate) const PROGRESS_ARGV: [&str; 2] = ["reservation id", "the work it has left"];

/// `pool_throttle.lua`'s `ARGV`, in order.
pub(crate) const THROTTLE_ARGV: [&str; 6] = [
    "the provider's Retry-After",
    "the factor a refusal multiplies the share by",
    "the lowest share",
    "recovery of the share per ms",
    "cooldown",
    "idle TTL",
];

/// `pool_status.lua`'s `ARGV`.
pub(crate) const STATUS_ARGV: [&str; 1] = ["recovery of the share per ms"];

/// Everything one pool reserve needs.
#[derive(Debug, Clone)]
pub struct PoolCall<'a> {
    pub pool: &'a str,
    pub id: &'a str,
    /// Predicted slot time of the request (ms): the work the pool holds for it.
    pub work_ms: u64,
    /// Its predicted slot time should it run long (ms): what its deadline is judged by.
    pub finish_ms: u64,
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
    /// Whose request, at which tier, and the tenant's weight there (thousandths): a contended
    /// tier is shared by weight.
    pub tier: crate::config::Priority,
    pub tenant: &'a str,
    pub weight_milli: u64,
    /// Where the pool queues; queueing in tollgate, how long the caller may still wait for its
    /// slot, and how long its place lives without the caller's next call.
    pub queue: crate::config::PoolQueue,
    pub wait_ms: u64,
    pub waiter_ttl_ms: u64,
    /// The provider's limits, where the pool sets them.
    pub provider: Option<ProviderCall>,
}

/// What a pool reserve takes from the provider's limits, and the limits themselves.
#[derive(Debug, Clone)]
pub struct ProviderCall {
    pub limits: ScopeLimits,
    /// The part of each limit the request's tier may use (critical: all of it).
    pub tier_part: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub cost_nanos: u64,
    /// How long the provider scope outlives its last write: its longest budget's period.
    pub idle_ttl_ms: u64,
}

/// How a pool hold's request ended, which settles what it charged the provider's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolEnd {
    /// It never reached the backend (its tenant leg refused it, or nobody received the
    /// admission): everything it took is given back, its request and its queue tag too.
    Unused,
    /// Given back without usage after it was sent: its tokens and money come back, its request
    /// stays counted.
    Released,
    /// Charged as held: its tenant hold's lease ran out, it was admitted unmetered (the store
    /// failed), or it settled where its usage is not known.
    AsHeld,
    /// It ran: the charge moves to these counts (`None`: as held), refunding or charging debt.
    Used { prompt: Option<u64>, output: Option<u64>, cost_nanos: Option<u64> },
}

impl PoolEnd {
    fn as_str(self) -> &'static str {
        match self {
            PoolEnd::Unused => "unused",
            PoolEnd::Released => "released",
            PoolEnd::AsHeld => "as_held",
            PoolEnd::Used { .. } => "used",
        }
    }
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

/// The pool's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolOutcome {
    Admitted {
        start_delay_ms: u64,
        holds: u64,
        work_ms: u64,
    },
    /// Queueing in tollgate: no slot yet; call again with the same id (its place is kept while
    /// it does), or release it to give the place up.
    Waiting {
        start_delay_ms: u64,
    },
    Denied {
        reason: PoolRefusal,
        retry: PoolRetry,
        start_delay_ms: u64,
    },
}

/// When a request the pool refused would be admitted if sent again, nothing else arriving: the
/// pool's holds leaving at their predicted ends, its throttle recovering, the provider's buckets
/// refilling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolRetry {
    /// In this many ms, at the earliest.
    In(u64),
    /// It waits on a hold past its predicted end (or one with none): when that ends, nobody can
    /// say; not before `at_least` ms (the provider's Retry-After, or its limits' wait), though.
    Unpredictable { at_least: u64 },
    /// No wait helps (too large for the tier, or a deadline shorter than its own finish).
    Never,
}

impl<S: Store> Protocol<S> {
    /// Holds a request's predicted work in its pool, or refuses it (deadline, full, throttled).
    pub async fn pool_reserve(&self, call: &PoolCall<'_>) -> Result<PoolOutcome, StoreError> {
        let script = &self.scripts.pool_reserve;
        let mut a = Argv::grouped("pool_reserve", &RESERVE_ARGV, &PROVIDER_ARGV, usize::from(call.provider.is_some()));
        a.push("reservation id", call.id.to_string());
        a.push("work", call.work_ms.to_string());
        a.push("KV-cache tokens", call.kv_tokens.to_string());
        a.push("lease (ms)", call.lease_ms.to_string());
        a.push("idle TTL", call.idle_ttl_ms.to_string());
        a.push("sweep batch", call.sweep_batch.to_string());
        a.push("slots of the whole pool", call.slots.to_string());
        a.push("slots this request's tier may fill", call.tier_slots.to_string());
        a.push("max queue delay", call.max_queue_delay_ms.to_string());
        a.push("KV tokens this tier may fill", call.tier_kv_tokens.unwrap_or(0).to_string());
        a.push("deadline", call.deadline_ms.unwrap_or(0).to_string());
        a.push("recovery per ms", call.recover_per_ms.to_string());
        a.push("finish", call.finish_ms.to_string());
        a.push("tier", call.tier.as_str().to_string());
        a.push("tenant", call.tenant.to_string());
        a.push("the tenant's weight in its tier", call.weight_milli.to_string());
        a.push("where the pool queues", call.queue.as_str().to_string());
        a.push("how long the caller may still wait", call.wait_ms.to_string());
        a.push("waiter TTL", call.waiter_ttl_ms.to_string());
        if let Some(p) = &call.provider {
            a.push("the tier's part of the provider's limits", to_thousandths(p.tier_part).to_string());
            a.push("prompt tokens", p.prompt_tokens.to_string());
            a.push("output tokens held", p.output_tokens.to_string());
            a.push("cost (nanos) of both", p.cost_nanos.to_string());
            a.push("the provider scope's idle TTL", p.idle_ttl_ms.to_string());
            push_limits(&mut a, &p.limits);
        }
        let reply = self.store.eval(script, keys::pool_keys(call.pool), a.finish()).await?;
        let r = Fields::of(script, &reply)?;
        match r.uint(0)? {
            1 => Ok(PoolOutcome::Admitted { start_delay_ms: r.uint(1)?, holds: r.uint(2)?, work_ms: r.uint(3)? }),
            2 => Ok(PoolOutcome::Waiting { start_delay_ms: r.uint(1)? }),
            0 => {
                let reason = match r.text(1)? {
                    "deadline" => PoolRefusal::Deadline,
                    "queue_full" => PoolRefusal::QueueFull,
                    "throttled" => PoolRefusal::Throttled,
                    "fair_share" => PoolRefusal::FairShare,
                    other => match other.strip_prefix("provider:").and_then(refusal) {
                        Some(
                            limit @ (Refusal::TokenRate
                            | Refusal::InputRate
                            | Refusal::OutputRate
                            | Refusal::RequestRate
                            | Refusal::Budget(_)
                            | Refusal::Unsatisfiable),
                        ) => PoolRefusal::Provider(limit),
                        _ => return Err(r.bad()),
                    },
                };
                let retry = match (r.uint(2)?, r.flag(4)?) {
                    (at_least, true) => PoolRetry::Unpredictable { at_least },
                    (0, false) => PoolRetry::Never,
                    (ms, false) => PoolRetry::In(ms),
                };
                Ok(PoolOutcome::Denied { reason, retry, start_delay_ms: r.uint(3)? })
            }
            _ => Err(r.bad()),
        }
    }

    /// A provider refused a request of this pool: throttle it. Returns the share of the pool left
    /// and how long admission pauses (ms).
    pub async fn pool_throttle(&self, call: &ThrottleCall<'_>) -> Result<(f64, u64), StoreError> {
        let script = &self.scripts.pool_throttle;
        let mut a = Argv::new("pool_throttle", &THROTTLE_ARGV, 0);
        a.push("the provider's Retry-After", call.retry_after_ms.to_string());
        a.push("the factor a refusal multiplies the share by", call.decrease.to_string());
        a.push("the lowest share", call.min_share.to_string());
        a.push("recovery of the share per ms", call.recover_per_ms.to_string());
        a.push("cooldown", call.cooldown_ms.to_string());
        a.push("idle TTL", call.idle_ttl_ms.to_string());
        let reply = self.store.eval(script, vec![keys::pool_state(call.pool)], a.finish()).await?;
        let r = Fields::of(script, &reply)?;
        Ok((from_thousandths(r.uint(0)?), r.uint(1)?))
    }

    /// What a pool holds and how far it is throttled. Reads only.
    pub async fn pool_status(&self, pool: &str, recover_per_ms: f64) -> Result<PoolView, StoreError> {
        let script = &self.scripts.pool_status;
        let mut a = Argv::new("pool_status", &STATUS_ARGV, 0);
        a.push("recovery of the share per ms", recover_per_ms.to_string());
        let reply = self.store.eval(script, vec![keys::pool_state(pool)], a.finish()).await?;
        let r = Fields::of(script, &reply)?;
        Ok(PoolView {
            holds: r.uint(0)?,
            work_ms: r.uint(1)?,
            kv_tokens: r.uint(2)?,
            share: from_thousandths(r.uint(3)?),
            resumes_in_ms: r.uint(4)?,
        })
    }

    /// Takes a hold (or a place in its queue) off its pool, and settles what it charged the
    /// provider's limits by how its request ended; `false` when the pool did not hold it.
    /// Idempotent.
    pub async fn pool_release(&self, pool: &str, id: &str, end: PoolEnd) -> Result<bool, StoreError> {
        let script = &self.scripts.pool_release;
        let mut a = Argv::new("pool_release", &RELEASE_ARGV, 0);
        let count = |n: Option<u64>| n.map(|n| n.to_string()).unwrap_or_default();
        let (prompt, output, cost) = match end {
            PoolEnd::Used { prompt, output, cost_nanos } => (count(prompt), count(output), count(cost_nanos)),
            _ => (String::new(), String::new(), String::new()),
        };
        a.push("reservation id", id.to_string());
        a.push("how its request ended", end.as_str().to_string());
        a.push("prompt tokens used", prompt);
        a.push("output tokens used", output);
        a.push("cost (nanos)", cost);
        let reply = self.store.eval(script, keys::pool_keys(pool), a.finish()).await?;
        Fields::of(script, &reply)?.flag(0)
    }

    /// A live stream has `left_ms` of work left: its hold shrinks to that (never grows). Returns
    /// the work it holds now; `None` when the pool does not hold it. Safe to repeat.
    pub async fn pool_progress(&self, pool: &str, id: &str, left_ms: u64) -> Result<Option<u64>, StoreError> {
        let script = &self.scripts.pool_progress;
        let mut a = Argv::new("pool_progress", &PROGRESS_ARGV, 0);
        a.push("reservation id", id.to_string());
        a.push("the work it has left", left_ms.to_string());
        let reply = self.store.eval(script, vec![keys::pool_state(pool), keys::pool_holds(pool)], a.finish()).await?;
        let r = Fields::of(script, &reply)?;
        let held = r.uint(1)?;
        Ok(r.flag(0)?.then_some(held))
    }

    /// Extends a pool hold's lease, and keeps the provider scope its charge is in alive with it;
    /// `false` when the pool does not hold it.
    pub async fn pool_renew(&self, pool: &str, id: &str, lease_ms: u64, idle_ttl_ms: u64) -> Result<bool, StoreError> {
        let script = &self.scripts.pool_renew;
        let mut a = Argv::new("pool_renew", &RENEW_ARGV, 0);
        a.push("reservation id", id.to_string());
        a.push("new lease", lease_ms.to_string());
        a.push("idle TTL", idle_ttl_ms.to_string());
        let reply = self.store.eval(script, keys::pool_keys(pool), a.finish()).await?;
        match reply {
            Reply::Int(n @ (0 | 1)) => Ok(n == 1),
            _ => Err(StoreError::BadReply { script: script.name, reply }),
        }
    }
}

/// A share the scripts send in thousandths (at most 1,000).
#[allow(clippy::cast_precision_loss)]
fn from_thousandths(n: u64) -> f64 {
    n.min(1_000) as f64 / 1000.0
}

/// A share in (0, 1] as the scripts take it: thousandths, at least one.
// A share is in (0, 1]: the product is finite and at most 1,000.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn to_thousandths(share: f64) -> u64 {
    ((share * 1000.0).round() as u64).clamp(1, 1_000)
}
