//! Decisions from this replica's slices (`lease`), and the lease windows that keep them.

// Token arithmetic: no unchecked +, -, * (see Cargo.toml's [lints] for the casts).
#![warn(clippy::arithmetic_side_effects)]

use std::sync::Arc;

use super::denials::{scope_refusal, store_unavailable};
use super::lease::{self, Called, Local};
use super::plan::Plan;
use super::reserve::Tidy;
use super::retry::Settlement;
use super::{Admission, Admitted, Decision, Denial, Reason};
use crate::config::Policy;
use crate::hold::{Forwarded, Headroom};
use crate::store::{Store, StoreError};

impl<S: Store> Admission<S> {
    /// Quota from this replica's slices: a hit decides from memory; a miss makes one lease call
    /// (one at a time per tenant: a miss that waited for another's call looks again first).
    pub(super) async fn leased_leg(&self, plan: &Plan, tidy: &mut Tidy) -> Decision {
        let Some(leases) = &self.leases else { return self.tenant_leg(plan, tidy).await };
        let ask = plan.ask();
        let t = leases.tenant(&plan.tenant, &plan.tp);
        match leases.try_admit(&t, &ask) {
            Local::Miss => {}
            local => {
                tidy.from_lease = true;
                return self.leased_decision(plan, local);
            }
        }
        let (t, _one_call) = leases.one_call(&plan.tenant, &plan.tp).await;
        match leases.try_admit(&t, &ask) {
            Local::Miss => {}
            local => {
                tidy.from_lease = true;
                return self.leased_decision(plan, local);
            }
        }
        // The replica's lease record sits in the tenant's lease index: if it dies, a sweeper
        // settles it. Noted before the call, which may run though its answer is lost.
        self.note_tenant(&plan.tenant, plan.tp.lease_ttl_ms);
        // A call whose answer was lost goes first; then this request's own.
        let mut called =
            leases.call(&self.protocol, &plan.tenant, &t, Some(&ask), false, sweep_args(&plan.policy)).await;
        if let Ok(c) = &mut called
            && c.resent
        {
            self.follow_up(std::mem::take(&mut c.followups)).await;
            called = leases.call(&self.protocol, &plan.tenant, &t, Some(&ask), false, sweep_args(&plan.policy)).await;
        }
        match called {
            Ok(Called { refused, followups, .. }) => {
                self.follow_up(followups).await;
                match refused {
                    Some((scope, reason, retry_after_ms)) => {
                        let told_ms = retry_after_ms;
                        self.leased_decision(plan, Local::Refused { scope, reason, retry_after_ms, told_ms })
                    }
                    None => match leases.try_admit(&t, &ask) {
                        // Granted but not covered: only if the policy changed under it, or an
                        // earlier call went again in its place; the store decides.
                        Local::Miss => self.tenant_leg(plan, tidy).await,
                        local => self.leased_decision(plan, local),
                    },
                }
            }
            Err(e) => {
                tidy.store_failed = true;
                self.on_store_error(plan, store_unavailable(&e, plan))
            }
        }
    }

    /// A decision from the slices, as a [`Decision`].
    pub(super) fn leased_decision(&self, plan: &Plan, local: Local) -> Decision {
        match local {
            Local::Admitted { headroom } => Decision::Admitted(Admitted {
                reservation_id: plan.id.clone(),
                model: plan.model.clone(),
                reserved_tokens: plan.prompt.saturating_add(plan.ceiling),
                attempts: 1,
                replayed: false,
                headroom,
                shadow: None,
                soft_limit: None,
                tier: plan.tier,
                forecast: None,
                output_ceiling: plan.output_ceiling,
            }),
            Local::Refused { scope, reason, retry_after_ms, told_ms } => {
                let label = plan.scopes.get(scope).map_or("?", |s| s.label.as_str());
                let (reason, message) = scope_refusal(reason, label, &plan.policy, retry_after_ms, told_ms);
                let retry_after_ms = reason.retryable().then_some(retry_after_ms);
                Decision::Denied(Denial { reason, message, retry_after_ms, headroom: Headroom::default() })
            }
            Local::Miss => Decision::Denied(Denial::now(Reason::StoreUnavailable, "no lease could decide the request")),
        }
    }

    /// After a lease call: apply what other replicas forwarded for this replica's holds, and take
    /// settled holds' pool legs off their pools.
    pub(super) async fn follow_up(&self, f: lease::Followups) {
        self.apply_forwarded(f.forwarded).await;
        self.release_swept_pool_legs(&f.released).await;
    }

    /// Applies operations other replicas left for this replica's holds. (Before the replica's next
    /// lease call: the store keeps them with the answer that handed them over only until then.)
    /// A commit or release that fails on the way (a store hold under a leased id settles at the
    /// store) goes to the retry queue: the store handed it over once, and it is never lost.
    pub(super) async fn apply_forwarded(&self, forwarded: Vec<(String, Forwarded)>) {
        for (id, op) in forwarded {
            let result = match op {
                Forwarded::Commit(counted, ending) => self.commit_ended(&id, counted, ending).await.map(|o| o.state()),
                Forwarded::Release(ending) => self.release_ended(&id, ending).await.map(|o| o.state()),
                Forwarded::Renew { lease_ms } => self.renew(&id, lease_ms).await.map(|o| o.state()),
            };
            match result {
                Ok(state) => tracing::debug!(reservation = %id, state, "applied a forwarded operation"),
                Err(e) => {
                    tracing::warn!(reservation = %id, error = %e, "a forwarded operation failed; retried");
                    match op {
                        Forwarded::Commit(measured, ending) => self.retry(Settlement::Commit { id, measured, ending }),
                        Forwarded::Release(ending) => self.retry(Settlement::Release { id, ending }),
                        // A renewal missed costs at most the hold's lease: nothing to keep.
                        Forwarded::Renew { .. } => {}
                    }
                }
            }
        }
    }

    /// One window of leasing: for every tenant this replica serves, settle leased holds whose
    /// lease passed, give back what it will not use, draw for the next window, and apply forwarded
    /// operations. `ending` gives everything back (shutdown). Run by [`Admission::run_leases`];
    /// public so tests can drive it on a manual clock. Returns the first failed call's error (the
    /// others were still made): that call stays pending, and goes again, as it was, before the
    /// tenant's next call.
    pub async fn lease_tick(&self, ending: bool) -> Result<(), StoreError> {
        let Some(leases) = &self.leases else { return Ok(()) };
        let mut failed = None;
        let policy = self.policy();
        for tenant in leases.tenant_names() {
            // A tenant a reload removed keeps the terms it was leased under, and gives everything
            // back now.
            let (tp, removed) = match self.tenant_policy(&policy, &tenant) {
                Some(tp) => (Arc::clone(tp), false),
                None => match leases.terms(&tenant) {
                    Some(tp) => (tp, true),
                    None => continue,
                },
            };
            let (t, one_call) = leases.one_call(&tenant, &tp).await;
            let (mut released, due) = leases.upkeep(&t);
            if due.is_some() || ending || removed {
                let leaving = ending || removed || due == Some(true);
                // Forwarded operations settle holds and free what they held: a leaving replica
                // gives that back with a second call.
                // (And a call whose answer was lost goes again first.)
                // Noted before the calls, which may run though their answers are lost.
                self.note_tenant(&tenant, tp.lease_ttl_ms);
                for _ in 0..3 {
                    match leases.call(&self.protocol, &tenant, &t, None, leaving, sweep_args(&policy)).await {
                        Ok(Called { followups: f, resent, .. }) => {
                            released.extend(f.released);
                            let applied = !f.forwarded.is_empty();
                            self.apply_forwarded(f.forwarded).await;
                            if !(resent || applied && leaving) {
                                break;
                            }
                        }
                        Err(e) => {
                            tracing::warn!(tenant = %tenant, error = %e, "lease call failed; it is sent again, as it was, before the next");
                            failed.get_or_insert(e);
                            break;
                        }
                    }
                }
                if leaving && !ending {
                    leases.leave(&tenant);
                }
            }
            drop(one_call);
            self.release_swept_pool_legs(&released).await;
        }
        failed.map_or(Ok(()), Err)
    }

    /// Runs the lease windows until `shutdown`, then gives back every slice.
    pub async fn run_leases(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        let Some(window) = self.leases.as_ref().map(|l| l.settings.window_ms) else { return };
        let mut ticks = tokio::time::interval(std::time::Duration::from_millis(window));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {
                    // Failures are logged per tenant; the next window tries again.
                    let _ = self.lease_tick(false).await;
                }
                () = shutdown.cancelled() => break,
            }
        }
        if self.lease_tick(true).await.is_err() {
            tracing::warn!("some slices could not be given back at shutdown: they stay charged until their lease");
        }
    }
}

/// What a lease call's sweep takes from the policy: its batch, and the cap on a concurrency wait.
fn sweep_args(policy: &Policy) -> (u32, u64) {
    (policy.sweep_batch, policy.concurrency_retry_ms)
}
