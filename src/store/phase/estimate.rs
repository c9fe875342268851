//! `estimate.lua`: a tenant's learned output length for one model, read.

use super::{Argv, Fields};
use crate::store::{Protocol, Store, StoreError, keys};

/// `estimate.lua` takes no `ARGV`.
pub(crate) const ARGV: [&str; 0] = [];

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

impl<S: Store> Protocol<S> {
    /// A tenant's output estimate for a model, and its error so far.
    pub async fn output_estimate(&self, tenant: &str, model: &str) -> Result<EstimateView, StoreError> {
        let script = &self.scripts.estimate;
        let args = Argv::new("estimate", &ARGV, 0).finish();
        let reply = self.store.eval(script, vec![keys::output_estimate(tenant, model)], args).await?;
        let r = Fields::of(script, &reply)?;
        Ok(EstimateView {
            samples: r.uint(0)?,
            quantile_tokens: r.uint(1)?,
            used_tokens: r.uint(2)?,
            overrun_tokens: r.uint(3)?,
        })
    }
}
