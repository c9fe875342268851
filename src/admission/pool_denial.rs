//! What a pool leg's refusal says: its reason, its retry hint and its message, for each refusal of
//! `pool_reserve.lua` and for a wait for a slot that ran out.

use super::plan::{Plan, PoolLeg};
use super::reserve::refusal_reason;
use super::{Denial, Reason};
use crate::config::Priority;
use crate::hold::{PoolRefusal, Refusal};

/// A request queueing in tollgate for which no slot came within the `may_wait` ms its caller
/// could wait; `start_delay_ms` the start predicted last.
pub(super) fn waited_out(start_delay_ms: u64, leg: &PoolLeg, may_wait: u64) -> Denial {
    Denial {
        retry_after_ms: Some(start_delay_ms),
        ..Denial::now(
            Reason::QueueFull,
            format!("no slot of pool {} came within the {may_wait} ms the caller could wait", leg.name),
        )
    }
}

/// The pool refused the request, for `refusal`, with the script's retry hint and predicted start.
pub(super) fn refused(
    refusal: PoolRefusal,
    retry_after_ms: u64,
    start_delay_ms: u64,
    leg: &PoolLeg,
    plan: &Plan,
) -> Denial {
    let (pool, tier) = (&leg.name, leg.tier.as_str());
    let (reason, message) = match refusal {
        PoolRefusal::Deadline => {
            return Denial::now(
                Reason::Deadline,
                format!(
                    "predicted to finish in {} ms (start in {start_delay_ms} ms on pool {pool}), past the {} ms deadline",
                    start_delay_ms.saturating_add(leg.finish_ms),
                    plan.deadline_ms.unwrap_or(0)
                ),
            );
        }
        PoolRefusal::Throttled => {
            (Reason::QueueFull, format!("pool {pool} is throttled: its provider refused with a Retry-After"))
        }
        PoolRefusal::FairShare => (
            Reason::QueueFull,
            format!(
                "pool {pool} is contended for {tier} requests and tenant {} holds its share of it (predicted start in {start_delay_ms} ms)",
                plan.tenant
            ),
        ),
        PoolRefusal::QueueFull => (
            Reason::QueueFull,
            format!("pool {pool} is full for {tier} requests (predicted start in {start_delay_ms} ms)"),
        ),
        PoolRefusal::Provider(limit) => return provider(limit, retry_after_ms, pool, leg.tier),
    };
    Denial { retry_after_ms: Some(retry_after_ms), ..Denial::now(reason, message) }
}

/// The denial of a pool's provider limits, `limit` as the script named it (a rate, a budget, or
/// larger than the tier may ever take), for a `tier` request: said as a scope's, under the
/// provider's reasons.
fn provider(limit: Refusal, retry_after_ms: u64, pool: &str, tier: Priority) -> Denial {
    let (reason, message) = refusal_reason(limit, &format!("pool {pool}'s provider"), 0);
    let message = format!("{message} for {} requests", tier.as_str());
    let reason = match reason {
        Reason::TokenRate | Reason::RequestRate => Reason::ProviderRate,
        Reason::Budget => Reason::ProviderBudget,
        Reason::Unsatisfiable => return Denial::now(Reason::Unsatisfiable, message),
        other => other,
    };
    Denial { retry_after_ms: Some(retry_after_ms), ..Denial::now(reason, message) }
}
