//! A backend pool seen from admission: what it holds, and the throttle its provider's 429s set.

use super::{Admission, AdmissionError, parse_id};
use crate::store::{PoolView, Store, ThrottleCall};

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
}
