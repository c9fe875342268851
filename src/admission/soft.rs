//! Soft budgets, as this replica last saw them. A request past its tenant's soft budget is
//! admitted all the same and marked; its tenant's later requests go to their pool one tier lower
//! until the budget's period turns. (The pool leg runs before the tenant leg, on another slot, so
//! it goes by what the tenant leg's last reply said: the request that first crosses is marked,
//! and demoted from the next one on.)

use super::{Admission, MAX_SEEN_ESTIMATES};
use crate::config::Priority;

impl<S> Admission<S> {
    /// The tier a request of `tenant` is decided at: one lower while this replica last saw the
    /// tenant past a soft budget whose period has not turned.
    pub(super) fn soft_tier(&self, tenant: &str, tier: Priority) -> Priority {
        let now = self.clock.now_ms();
        let seen = self.soft_past.read().unwrap_or_else(|p| p.into_inner());
        match seen.get(tenant) {
            Some(&until) if until > now => tier.demoted(),
            _ => tier,
        }
    }

    /// What the tenant leg's reply said: past a soft budget whose period ends in `ends_in_ms`, or
    /// past none.
    pub(super) fn remember_soft(&self, tenant: &str, ends_in_ms: Option<u64>) {
        let known = self.soft_past.read().unwrap_or_else(|p| p.into_inner()).contains_key(tenant);
        let mut seen = match (ends_in_ms, known) {
            (None, false) => return,
            _ => self.soft_past.write().unwrap_or_else(|p| p.into_inner()),
        };
        match ends_in_ms {
            Some(ms) => {
                // Bounded under many tenants, as the estimates are: past the bound all are
                // forgotten, and each tenant's next reply brings its own back.
                if seen.len() >= MAX_SEEN_ESTIMATES && !known {
                    seen.clear();
                }
                seen.insert(tenant.to_string(), self.clock.now_ms().saturating_add(ms));
            }
            None => {
                seen.remove(tenant);
            }
        }
    }
}
