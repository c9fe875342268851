//! What a refusal says: its reason, its retry hint and its message. A tenant leg's refusal on a
//! scope; a pool leg's, for each refusal of `pool_reserve.lua` and for a wait for a slot that ran
//! out, its hint and message stating the same time (when the same request, sent again with nothing
//! else arriving, would be admitted as the pool's holds end when predicted; or that no time can be
//! predicted, and the back-off); the store being out of reach.

use super::plan::{Plan, PoolLeg};
use super::{Denial, Reason};
use crate::config::{Policy, PoolQueue, Priority};
use crate::hold::{PoolRefusal, Refusal};
use crate::store::{PoolRetry, StoreError};

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
    let (_, message) = refusal_reason(limit, &format!("pool {pool}'s provider"), 0);
    let message = format!("{message} for {} requests", tier.as_str());
    let reason = match limit {
        Refusal::Unsatisfiable => return Denial::now(Reason::Unsatisfiable, message),
        Refusal::Budget(_) => Reason::ProviderBudget,
        _ => Reason::ProviderRate,
    };
    // (The script always says when the provider's limits take it.)
    let retry_after_ms = match retry {
        PoolRetry::In(ms) => Some(ms),
        PoolRetry::Unpredictable { .. } | PoolRetry::Never => None,
    };
    Denial { retry_after_ms, ..Denial::now(reason, message) }
}

/// The reason and message of a store refusal on `scope`.
pub(super) fn refusal_reason(refusal: Refusal, scope: &str, max_attempts: u32) -> (Reason, String) {
    match refusal {
        Refusal::TokenRate => (Reason::TokenRate, format!("token rate limit of scope {scope} reached")),
        Refusal::InputRate => (Reason::TokenRate, format!("input token rate limit of scope {scope} reached")),
        Refusal::OutputRate => (Reason::TokenRate, format!("output token rate limit of scope {scope} reached")),
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

/// A tenant scope's refusal, as its reason and message: a concurrency refusal says when its slot
/// frees, in `retry_after_ms`, of the wait the store told (`told_ms`; see [`slot_frees`]).
pub(super) fn scope_refusal(
    refusal: Refusal,
    scope: &str,
    policy: &Policy,
    retry_after_ms: u64,
    told_ms: u64,
) -> (Reason, String) {
    let (reason, mut message) = refusal_reason(refusal, scope, policy.max_attempts);
    if reason == Reason::Concurrency {
        message.push_str(&slot_frees(retry_after_ms, told_ms, policy.concurrency_retry_ms));
    }
    (reason, message)
}

/// When a concurrency slot frees, in `retry_after_ms`, as the refusal says it: at the end of a
/// hold's lease, when the store told a wait (`told_ms`) within the back-off; else nobody can say
/// (a commit usually frees one first), and the caller backs off. (A refusal the lease slices
/// remember tells what is left of the store's wait.)
fn slot_frees(retry_after_ms: u64, told_ms: u64, back_off_ms: u64) -> String {
    if told_ms < back_off_ms {
        format!("; one frees at the latest when a hold's lease ends, in {retry_after_ms} ms")
    } else {
        format!(
            "; when one frees cannot be predicted (a commit usually frees one before a lease ends): back off {retry_after_ms} ms"
        )
    }
}

pub(super) fn store_unavailable(e: &StoreError, plan: &Plan) -> Denial {
    let mode = plan.tp.on_store_error.as_str();
    tracing::error!(error = %e, tenant = %plan.tenant, mode, "store call failed; the tenant's store-down mode answers");
    Denial { retry_after_ms: Some(1_000), ..Denial::now(Reason::StoreUnavailable, "admission store unavailable") }
}
