//! The plans tenants the policy does not list were last admitted under, by the plan their trusted
//! plan header named (`server.plan_header`). A reserve carries the header; a commit, renew or
//! release carries only the reservation id, so this replica remembers which plan's terms (lease,
//! learning, leasing) the tenant's holds go by. Bounded: past `server.claimed_tenants`, the tenant
//! noted longest ago is forgotten, and goes by `default_tenant` until its next reserve notes it
//! again. The counters are the store's, per tenant, whatever is remembered here.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

#[derive(Debug)]
pub struct Claims {
    most: usize,
    inner: Mutex<Noted>,
}

#[derive(Debug, Default)]
struct Noted {
    /// Tenant → (plan, when it was noted: the position of its entry in `order`).
    plans: HashMap<String, (String, u64)>,
    /// Tenants in the order they were noted, with that position; an entry whose tenant was noted
    /// again since is stale, and skipped when it comes up.
    order: VecDeque<(u64, String)>,
    next: u64,
}

impl Claims {
    pub fn new(most: usize) -> Claims {
        Claims { most, inner: Mutex::new(Noted::default()) }
    }

    /// `tenant` was admitted under `plan`. Nothing is allocated when that is already noted and
    /// was noted within the last half of the bound: a tenant that keeps reserving is moved to the
    /// back of the line at least that often, so the tenant forgotten first is one gone quiet.
    pub fn note(&self, tenant: &str, plan: &str) {
        let mut n = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let recent = u64::try_from(self.most / 2).unwrap_or(u64::MAX);
        let next = n.next;
        if n.plans.get(tenant).is_some_and(|(p, at)| p == plan && next.wrapping_sub(*at) <= recent) {
            return;
        }
        let at = n.next;
        n.next = n.next.wrapping_add(1);
        n.plans.insert(tenant.to_string(), (plan.to_string(), at));
        n.order.push_back((at, tenant.to_string()));
        while n.plans.len() > self.most {
            let Some((at, oldest)) = n.order.pop_front() else { break };
            if n.plans.get(&oldest).is_some_and(|(_, noted)| *noted == at) {
                n.plans.remove(&oldest);
            }
        }
        // Stale entries are dropped once they outnumber the live ones, so `order` stays bounded.
        if n.order.len() > self.most.max(1).saturating_mul(2) {
            let Noted { plans, order, .. } = &mut *n;
            order.retain(|(at, t)| plans.get(t).is_some_and(|(_, noted)| noted == at));
        }
    }

    /// The plan `tenant` was last admitted under, if it is remembered.
    pub fn plan_of(&self, tenant: &str) -> Option<String> {
        let n = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        n.plans.get(tenant).map(|(plan, _)| plan.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_plan_is_remembered_and_the_oldest_tenant_forgotten_past_the_bound() {
        let claims = Claims::new(2);
        claims.note("a", "gold");
        claims.note("b", "free");
        claims.note("a", "silver");
        assert_eq!(claims.plan_of("a").as_deref(), Some("silver"));
        // "b" was noted longest ago ("a" again since).
        claims.note("c", "free");
        let remembered = |c: &Claims| c.inner.lock().unwrap().plans.len();
        assert_eq!((claims.plan_of("b"), remembered(&claims)), (None, 2));
        assert_eq!(claims.plan_of("a").as_deref(), Some("silver"));
        for i in 0..1000 {
            claims.note(&format!("t{i}"), "free");
            claims.note("a", if i % 2 == 0 { "gold" } else { "silver" });
        }
        assert_eq!(remembered(&claims), 2);
        let order = claims.inner.lock().unwrap().order.len();
        assert!(order <= 4, "stale entries are dropped: {order}");
    }

    #[test]
    fn a_tenant_that_keeps_reserving_is_not_the_one_forgotten() {
        let claims = Claims::new(100);
        for i in 0..10_000 {
            claims.note("busy", "gold");
            claims.note(&format!("once{i}"), "free");
        }
        assert_eq!(claims.plan_of("busy").as_deref(), Some("gold"), "noted all along, never forgotten");
        assert!(claims.inner.lock().unwrap().order.len() <= 200);
    }
}
