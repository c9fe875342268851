//! What a pool leg's refusal says: its reason, its retry hint and its message, for each refusal of
//! `pool_reserve.lua` and for a wait for a slot that ran out. The hint and the message state the
//! same time: when the same request, sent again with nothing else arriving, would be admitted as
//! the pool's holds end when predicted; or that no time can be predicted, and the back-off.

use super::plan::{Plan, PoolLeg};
use super::reserve::refusal_reason;
use super::{Denial, Reason};
use crate::config::{PoolQueue, Priority};
use crate::hold::{PoolRefusal, Refusal};
use crate::store::PoolRetry;

/// A request queueing in tollgate for which no slot came within the `may_wait` ms its caller
/// could wait; `start_delay_ms` the start predicted last, which the holds before it overran: no
/// time can be predicted, so the caller backs off.
pub(super) fn waited_out(start_delay_ms: u64, leg: &PoolLeg, may_wait: u64, plan: &Plan) -> Denial {
    let back_off = plan.policy.concurrency_retry_ms;
    Denial {
        retry_after_ms: Some(back_off),
        ..Denial::now(
            Reason::QueueFull,
            format!(
                "no slot of pool {} came within the {may_wait} ms the caller could wait (its start was last predicted in {start_delay_ms} ms); {}",
                leg.name,
                unpredictable(back_off)
            ),
        )
    }
}

/// The pool refused the request, for `refusal`, with the script's retry and predicted start.
pub(super) fn refused(
    refusal: PoolRefusal,
    retry: PoolRetry,
    start_delay_ms: u64,
    leg: &PoolLeg,
    plan: &Plan,
) -> Denial {
    let (pool, tier) = (&leg.name, leg.tier.as_str());
    let tollgate = leg.pool.queue == PoolQueue::Tollgate;
    let (reason, message) = match refusal {
        PoolRefusal::Deadline => (
            Reason::Deadline,
            format!(
                "predicted to finish in {} ms (start in {start_delay_ms} ms on pool {pool}), past the {} ms deadline",
                start_delay_ms.saturating_add(leg.finish_ms),
                plan.deadline_ms.unwrap_or(0)
            ),
        ),
        PoolRefusal::Throttled => {
            (Reason::QueueFull, format!("pool {pool} is throttled: its provider refused with a Retry-After"))
        }
        PoolRefusal::FairShare => (
            Reason::QueueFull,
            format!("pool {pool} is contended for {tier} requests and tenant {} holds its share of it", plan.tenant),
        ),
        PoolRefusal::QueueFull if tollgate => (
            Reason::QueueFull,
            format!(
                "pool {pool} is full for {tier} requests: its predicted start in {start_delay_ms} ms is later than it may wait"
            ),
        ),
        PoolRefusal::QueueFull => (Reason::QueueFull, format!("pool {pool} is full for {tier} requests")),
        PoolRefusal::Provider(limit) => return provider(limit, retry, pool, leg.tier),
    };
    let back_off = plan.policy.concurrency_retry_ms;
    let (retry_after_ms, when) = match retry {
        PoolRetry::In(ms) if tollgate && refusal != PoolRefusal::Throttled => {
            (Some(ms), format!("sent again in {ms} ms, it would wait for its slot no longer than it may"))
        }
        PoolRetry::In(ms) => {
            (Some(ms), format!("sent again in {ms} ms, as the pool's holds end when predicted, it would be admitted"))
        }
        PoolRetry::Unpredictable { at_least } => {
            let back_off = back_off.max(at_least);
            (Some(back_off), unpredictable(back_off))
        }
        PoolRetry::Never if refusal == PoolRefusal::Deadline => {
            (None, "its own predicted finish is longer than the deadline: no wait helps".to_string())
        }
        PoolRetry::Never => {
            return Denial::now(
                Reason::Unsatisfiable,
                format!("the request needs more KV-cache tokens than {tier} requests may hold in pool {pool}"),
            );
        }
    };
    Denial { retry_after_ms, ..Denial::now(reason, format!("{message}; {when}")) }
}

/// What a refusal says when the request waits on a hold past its predicted end: when that ends
/// (a commit, usually soon; at the latest its lease) nobody can say, so the caller backs off.
fn unpredictable(back_off_ms: u64) -> String {
    format!(
        "when it would be admitted cannot be predicted (it waits on a request past its predicted end): back off {back_off_ms} ms"
    )
}

/// The denial of a pool's provider limits, `limit` as the script named it (a rate, a budget, or
/// larger than the tier may ever take), for a `tier` request: said as a scope's, under the
/// provider's reasons.
fn provider(limit: Refusal, retry: PoolRetry, pool: &str, tier: Priority) -> Denial {
    let (reason, message) = refusal_reason(limit, &format!("pool {pool}'s provider"), 0);
    let message = format!("{message} for {} requests", tier.as_str());
    let reason = match reason {
        Reason::TokenRate | Reason::RequestRate => Reason::ProviderRate,
        Reason::Budget => Reason::ProviderBudget,
        Reason::Unsatisfiable => return Denial::now(Reason::Unsatisfiable, message),
        other => other,
    };
    let retry_after_ms = match retry {
        PoolRetry::In(ms) => Some(ms),
        PoolRetry::Unpredictable { at_least } => Some(at_least.max(1)),
        PoolRetry::Never => None,
    };
    Denial { retry_after_ms, ..Denial::now(reason, message) }
}
