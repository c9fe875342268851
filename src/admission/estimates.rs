//! The learned estimates, as admission sees them: the output's, read from the store on request,
//! and this replica's last look at each, for the pool leg (which runs before the tenant leg, on
//! another slot); the prompt's, this replica's own (`fleet::prompts`).

use super::{Admission, AdmissionError, MAX_SEEN_ESTIMATES};
use crate::config::names;
use crate::hold::id as ids;
use crate::store::{EstimateView, Store};

impl<S: Store> Admission<S> {
    /// A response reported the prompt count of a request whose body was `bytes` long: it teaches
    /// how many bytes a prompt token of its tenant's requests to `model` takes, for the prompt
    /// estimate of the next (unless the model keeps its policy's ratio).
    pub fn observed_prompt(&self, reservation_id: &str, model: &str, bytes: u64, tokens: u64) {
        let Some(r) = ids::parse_reservation_id(reservation_id) else { return };
        if self.policy().models.get(model).is_some_and(|m| m.learn_bytes_per_token) {
            self.fleet.observe_prompt(r.tenant, model, bytes, tokens);
        }
    }

    /// What a tenant's commits have taught about one model's output lengths.
    pub async fn output_estimate(&self, tenant: &str, model: &str) -> Result<EstimateView, AdmissionError> {
        names::check_tenant(tenant).map_err(|e| AdmissionError::BadName(format!("tenant {e}")))?;
        if !self.policy().models.contains_key(model) {
            return Err(AdmissionError::BadName(format!("model {model:?} is not served here")));
        }
        Ok(self.protocol.output_estimate(tenant, model).await?)
    }
}

impl<S> Admission<S> {
    pub(super) fn seen_estimate(&self, tenant: &str, model: &str) -> Option<u64> {
        let seen = self.seen_estimates.read().unwrap_or_else(|p| p.into_inner());
        seen.get(tenant)?.get(model).copied()
    }

    /// Takes the write lock, and allocates the names, only when the estimate moved.
    pub(super) fn remember_estimate(&self, tenant: &str, model: &str, output: u64) {
        if self.seen_estimate(tenant, model) == Some(output) {
            return;
        }
        let mut seen = self.seen_estimates.write().unwrap_or_else(|p| p.into_inner());
        // Bounded under many tenants: past the bound all are forgotten, and a pool leg holds the
        // ceiling until its tenant's next reserve brings the estimate back.
        if seen.len() >= MAX_SEEN_ESTIMATES && !seen.contains_key(tenant) {
            seen.clear();
        }
        let models = match seen.get_mut(tenant) {
            Some(models) => models,
            None => seen.entry(tenant.to_string()).or_default(),
        };
        match models.get_mut(model) {
            Some(known) => *known = output,
            None => {
                models.insert(model.to_string(), output);
            }
        }
    }
}
