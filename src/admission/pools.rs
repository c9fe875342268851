//! A backend pool seen from admission: what it holds, the throttle its provider's 429s set, the
//! speeds its responses show, and live streams' remaining work.

// Token arithmetic: no unchecked +, -, * (see Cargo.toml's [lints] for the casts).
#![warn(clippy::arithmetic_side_effects)]

use super::budgets::ScopeBudget;
use super::fleet::{Speeds, Timing};
use super::{Admission, AdmissionError, parse_id};
use crate::config::Policy;
use crate::hold::{ScopeLimits, id as ids};
use crate::store::{PoolView, Store, ThrottleCall};

/// What a pool holds, how far its provider's 429s throttle it, and its provider limits' use.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolStatus {
    pub load: PoolView,
    /// Scope `provider`, where the pool sets provider limits.
    pub provider: Option<ScopeBudget>,
}

/// A stream past its predicted output is expected to run on for 1/`OVERRUN_DIVISOR` of it again:
/// it holds that much work until it ends, never none while it still holds a slot.
const OVERRUN_DIVISOR: u64 = 8;

/// The pool and the policy's name of the pool serving `model`, when `reservation_id` holds work
/// in it (a reservation names its pool; the model must still be served by it).
fn pool_of<'p>(
    policy: &'p Policy,
    reservation_id: &str,
    model: &str,
) -> Option<(&'p str, &'p crate::config::PoolPolicy)> {
    let r = ids::parse_reservation_id(reservation_id)?;
    let (name, pool) = policy.pool_of(policy.models.get(model)?)?;
    (r.pool? == name).then_some((name, &**pool))
}

impl<S: Store> Admission<S> {
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

    /// What a pool holds, how far its provider's 429s throttle it, and, where the pool sets
    /// provider limits, what they have used and have left (scope `provider`; refilling at the
    /// throttle's share of their rates, as admission sees them).
    pub async fn pool_status(&self, pool: &str) -> Result<PoolStatus, AdmissionError> {
        let policy = self.policy();
        let pool_policy = policy
            .pools
            .get(pool)
            .ok_or_else(|| AdmissionError::BadName(format!("pool {pool:?} is not one of this policy's")))?;
        let recover = pool_policy.upstream_throttle.map_or(0.0, |t| t.recover_per_ms);
        let load = self.protocol.pool_status(pool, recover).await?;
        let provider = match &pool_policy.provider {
            Some(p) => {
                let limits = ScopeLimits::from(&p.limits);
                let used = self.protocol.provider_budget(pool, &limits.slowed(load.share)).await?;
                Some(ScopeBudget { scope: "provider".to_string(), limits, used })
            }
            None => None,
        };
        Ok(PoolStatus { load, provider })
    }

    /// A response the commit from the response watched to its end: its timing teaches its pool's
    /// speeds for its model. Nothing for a reservation without pool work.
    pub fn observed(&self, reservation_id: &str, model: &str, timing: Timing) {
        let policy = self.policy();
        let Some((name, pool)) = pool_of(&policy, reservation_id, model) else { return };
        let speeds = self.fleet.observe(name, model, pool, self.clock.now_ms(), timing);
        self.metrics.pool_speeds(name, model, speeds.prefill_tokens_per_second(), speeds.decode_tokens_per_second());
    }

    /// The work (ms of slot time) a live stream has left, with `passed` output tokens out of the
    /// `expected` its pool work was predicted for: the rest at the pool's decode speed, and past
    /// its prediction an eighth of it again. `None` for a reservation without pool work, or a pool
    /// that does not calibrate (its holds leave at their end, as predicted).
    // Token counts are bounded (10^9); the product is finite and `as` saturates.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    pub fn work_left(&self, reservation_id: &str, model: &str, expected: u64, passed: u64) -> Option<u64> {
        let policy = self.policy();
        let (name, pool) = pool_of(&policy, reservation_id, model).filter(|(_, p)| p.calibrate)?;
        let speeds = self.fleet.speeds(name, model, pool, self.clock.now_ms());
        let tokens = expected.saturating_sub(passed).max(expected / OVERRUN_DIVISOR).max(1);
        Some((tokens as f64 * speeds.decode_ms_per_token()).ceil() as u64)
    }

    /// A live stream has `left_ms` of work left: its pool hold shrinks to that (never grows), so
    /// the queue estimate frees as it generates. Returns the work held now; `None` when the pool
    /// no longer holds it. Safe to repeat.
    pub async fn progress(&self, reservation_id: &str, left_ms: u64) -> Result<Option<u64>, AdmissionError> {
        let r = parse_id(reservation_id)?;
        let Some(pool) = r.pool else { return Ok(None) };
        Ok(self.protocol.pool_progress(pool, reservation_id, left_ms).await?)
    }

    /// The speeds capacity admission predicts `pool` by, for each model it serves: learned from
    /// the responses this replica watched, the policy's until then.
    pub fn pool_speeds(&self, pool: &str) -> Result<Vec<(String, Speeds)>, AdmissionError> {
        let policy = self.policy();
        let pool_policy = policy
            .pools
            .get(pool)
            .ok_or_else(|| AdmissionError::BadName(format!("pool {pool:?} is not one of this policy's")))?;
        let now = self.clock.now_ms();
        let mut served: Vec<(String, Speeds)> = policy
            .models
            .iter()
            .filter(|(_, m)| m.pool.as_deref() == Some(pool))
            .map(|(model, _)| (model.clone(), self.fleet.speeds(pool, model, pool_policy, now)))
            .collect();
        served.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(served)
    }
}
