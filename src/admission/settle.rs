//! Commit, renew and release: each routed to where its hold lives, read from its id (the store,
//! this replica's slice, or another replica's, which it is forwarded to), then the pool leg.

// Token arithmetic: no unchecked +, -, * (see Cargo.toml's [lints] for the casts).
#![warn(clippy::arithmetic_side_effects)]

use super::lease::Leases;
use super::{Admission, AdmissionError, ESTIMATE_TTL_MS, MAX_TOKEN_COUNT, ids, parse_id};
use crate::config::Policy;
use crate::hold::{CommitOutcome, Counted, Detail, Ending, Forwarded, ReleaseOutcome, RenewOutcome, Settled};
use crate::metrics::Estimate;
use crate::store::{CommitTerms, Learning, PoolEnd, Store};

impl<S: Store> Admission<S> {
    /// The terms a commit of `tenant`'s hold in the store is made under: the policy's retention,
    /// debt counted in the periods the tenant's zone is in now (a tenant the policy no longer has:
    /// the zone its hold was made in), and the tenant's output estimate taught where its output
    /// adapts.
    pub(super) fn commit_terms(&self, policy: &Policy, tenant: &str) -> CommitTerms {
        let tp = self.tenant_policy(policy, tenant);
        let learning = tp.and_then(|tp| {
            tp.adaptive_output.map(|a| Learning { ttl_ms: ESTIMATE_TTL_MS.max(tp.idle_ttl_ms), window: a.window })
        });
        let zone = tp.map(|tp| tp.zone.offset_minutes_at(self.clock.now_ms()));
        CommitTerms { learning, retention_ms: policy.record_retention_ms, zone_offset_min: zone }
    }

    /// The commit phase: reconcile a hold against the usage its caller reports, then free its pool
    /// work.
    pub async fn commit(
        &self,
        reservation_id: &str,
        prompt: u64,
        output: u64,
    ) -> Result<CommitOutcome, AdmissionError> {
        self.commit_counted(reservation_id, Counted::exact(prompt, output)).await
    }

    /// The commit phase, with counts reported or metered (the request ended as its counts say:
    /// completed, metered or as held).
    pub async fn commit_counted(
        &self,
        reservation_id: &str,
        counted: Counted,
    ) -> Result<CommitOutcome, AdmissionError> {
        self.commit_ended(reservation_id, counted, Ending::of(counted)).await
    }

    /// The commit phase, with counts reported or metered, and how the request ended.
    pub async fn commit_ended(
        &self,
        reservation_id: &str,
        counted: Counted,
        ending: Ending,
    ) -> Result<CommitOutcome, AdmissionError> {
        let r = checked_commit(reservation_id, counted)?;
        let policy = self.policy();
        let at_store = || async {
            let terms = self.commit_terms(&policy, r.tenant);
            self.protocol.commit(r.tenant, reservation_id, counted, ending, terms).await
        };
        let outcome = match self.home(&r) {
            Home::Store => {
                let outcome = at_store().await?;
                self.after_store_commit(&policy, &r, reservation_id, &outcome, counted, ending).await;
                return Ok(outcome);
            }
            Home::Slice(leases) => {
                let outcome = match leases.commit(r.tenant, reservation_id, counted, ending) {
                    // Not a hold of the slices: a store hold under a leased id (see `home`).
                    CommitOutcome::NotFound => at_store().await?,
                    outcome => outcome,
                };
                self.record_commit(&policy, r.tenant, &outcome, counted, ending);
                outcome
            }
            Home::Replica(replica) => {
                match self.forward(&policy, &r, replica, reservation_id, Forwarded::Commit(counted, ending)).await? {
                    true => CommitOutcome::Forwarded,
                    false => CommitOutcome::NotFound,
                }
            }
        };
        // Release the pool leg whenever the tenant leg is settled, repeats included: an earlier
        // call may have settled the tenant leg and failed to reach the pool. Idempotent. (A
        // forwarded commit is the owner's to release, with what its tenant leg charged.)
        if let (Some(pool), Some(end)) = (r.pool, commit_end(counted, &outcome)) {
            self.release_pool_leg(pool, reservation_id, end).await;
        }
        Ok(outcome)
    }

    /// What a commit of a hold in the store does once the store answered: counts it, and releases
    /// its pool leg (see `commit_ended`).
    pub(super) async fn after_store_commit(
        &self,
        policy: &Policy,
        r: &ids::ReservationRef<'_>,
        reservation_id: &str,
        outcome: &CommitOutcome,
        counted: Counted,
        ending: Ending,
    ) {
        self.record_commit(policy, r.tenant, outcome, counted, ending);
        if let (Some(pool), Some(end)) = (r.pool, commit_end(counted, outcome)) {
            self.release_pool_leg(pool, reservation_id, end).await;
        }
    }

    /// Counts a commit that settled a hold now (not a repeat of an earlier one), and, when the
    /// counts were reported, how far each estimate behind the hold was from them: the output
    /// reservation and the prompt estimate, per tenant and model. A request that ran to its end
    /// teaches its pool's prediction its output length.
    fn record_commit(&self, policy: &Policy, tenant: &str, outcome: &CommitOutcome, counted: Counted, ending: Ending) {
        let CommitOutcome::Committed(u) = outcome else { return };
        if u.duplicate {
            return;
        }
        let output = match counted {
            Counted::Exact { output, .. } | Counted::Metered { output } => Some(output),
            Counted::AsHeld => None,
        };
        // (A count held to the request's ceiling says nothing of the real length.)
        if let (Some(output), Some(model), Ending::Completed | Ending::Metered) = (output, &u.model, ending)
            && policy.models.get(model).is_some_and(|m| m.pool.is_some())
        {
            self.fleet.observe_length(tenant, model, output);
        }
        if !self.metrics.enabled() {
            return;
        }
        self.metrics.committed(tenant, u);
        if let (Counted::Exact { prompt, output, .. }, Some(model), Some(output_held), false) =
            (counted, &u.model, u.output_held, u.late)
        {
            let model = if policy.models.contains_key(model) { model.as_str() } else { "other" };
            let prompt_held = u.held.saturating_sub(output_held);
            self.metrics.token_usage(tenant, model, prompt, output);
            self.metrics.estimated(tenant, model, Estimate::Output, output, output_held);
            self.metrics.estimated(tenant, model, Estimate::Prompt, prompt, prompt_held);
        }
    }

    /// Extends a live hold's lease by `lease_ms` (0 = the tenant's lease TTL; never more than it).
    pub async fn renew(&self, reservation_id: &str, lease_ms: u64) -> Result<RenewOutcome, AdmissionError> {
        let r = parse_id(reservation_id)?;
        let policy = self.policy();
        let Some(tp) = self.settling_policy(&policy, r.tenant) else { return Ok(RenewOutcome::NotFound) };
        let lease = if lease_ms == 0 { tp.lease_ttl_ms } else { lease_ms.min(tp.lease_ttl_ms) };
        let at_store = || async {
            self.note_tenant(r.tenant, lease);
            self.protocol.renew(r.tenant, reservation_id, lease, tp.idle_ttl_ms, policy.record_retention_ms).await
        };
        let outcome = match self.home(&r) {
            Home::Store => at_store().await?,
            Home::Slice(leases) => match leases.renew(r.tenant, reservation_id, lease) {
                RenewOutcome::NotFound => at_store().await?,
                outcome => outcome,
            },
            Home::Replica(replica) => {
                let renewal = Forwarded::Renew { lease_ms: lease };
                match self.forward(&policy, &r, replica, reservation_id, renewal).await? {
                    true => RenewOutcome::Forwarded,
                    false => RenewOutcome::NotFound,
                }
            }
        };
        if let Some(pool) = r.pool {
            match outcome {
                RenewOutcome::Renewed { .. } => {
                    if let Some(p) = policy.pools.get(pool) {
                        self.protocol.pool_renew(pool, reservation_id, lease, p.idle_ttl_ms).await?;
                    }
                }
                // Settled (perhaps expired by this very call): its pool leg goes too.
                RenewOutcome::Settled(s) => self.release_pool_leg(pool, reservation_id, settled_end(s)).await,
                // The owner renews the pool leg when it applies the renewal.
                RenewOutcome::NotFound | RenewOutcome::Forwarded => {}
            }
        }
        Ok(outcome)
    }

    /// Gives a hold back without usage, and its pool work with it: its caller says it was not used.
    pub async fn release(&self, reservation_id: &str) -> Result<ReleaseOutcome, AdmissionError> {
        self.release_ended(reservation_id, Ending::Released).await
    }

    /// Gives a hold back without usage, and its pool work with it; `ending` says why (its caller
    /// gave it back, or the backend answered with no output).
    pub async fn release_ended(&self, reservation_id: &str, ending: Ending) -> Result<ReleaseOutcome, AdmissionError> {
        let r = parse_id(reservation_id)?;
        let retention = self.policy().record_retention_ms;
        let outcome = match self.home(&r) {
            Home::Store => self.protocol.release(r.tenant, reservation_id, ending, retention).await?,
            Home::Slice(leases) => match leases.release(r.tenant, reservation_id, ending) {
                ReleaseOutcome::NotFound => self.protocol.release(r.tenant, reservation_id, ending, retention).await?,
                outcome => outcome,
            },
            Home::Replica(replica) => {
                match self.forward(&self.policy(), &r, replica, reservation_id, Forwarded::Release(ending)).await? {
                    true => ReleaseOutcome::Forwarded,
                    false => ReleaseOutcome::NotFound,
                }
            }
        };
        if let ReleaseOutcome::Released { refunded, repeated: false } = outcome {
            self.metrics.released(r.tenant, refunded, ending);
        }
        let end = match outcome {
            ReleaseOutcome::Released { .. } => Some(PoolEnd::Released),
            ReleaseOutcome::Settled(s) => Some(settled_end(s)),
            // The owner releases it when it applies the release.
            ReleaseOutcome::NotFound | ReleaseOutcome::Forwarded => None,
        };
        if let (Some(pool), Some(end)) = (r.pool, end) {
            self.release_pool_leg(pool, reservation_id, end).await;
        }
        Ok(outcome)
    }

    /// Where the hold an id names lives: the one answer commit, renew and release route by. A
    /// leased id of this replica that its slices do not know (they answer `NotFound`) is a store
    /// hold: a leased decision its slices could not cover after all (a reload took the scope out of
    /// leasing under it) was made at the store.
    pub(super) fn home<'a>(&'a self, r: &ids::ReservationRef<'a>) -> Home<'a> {
        match (r.replica, &self.leases) {
            (None, _) => Home::Store,
            (Some(replica), Some(leases)) if leases.replica == replica => Home::Slice(leases),
            (Some(replica), _) => Home::Replica(replica),
        }
    }

    /// Leaves an operation on another replica's leased hold for that replica. False when the
    /// replica no longer holds a lease on the tenant: it stopped, and its holds settle as expired.
    async fn forward(
        &self,
        policy: &Policy,
        r: &ids::ReservationRef<'_>,
        replica: &str,
        id: &str,
        op: Forwarded,
    ) -> Result<bool, AdmissionError> {
        let Some(tp) = self.settling_policy(policy, r.tenant) else { return Ok(false) };
        // Kept for the idle TTL, not the lease: an owner whose calls fail for a while takes it
        // when it is back, however long its lease record lapsed.
        Ok(self.protocol.forward(r.tenant, replica, id, op, tp.idle_ttl_ms).await?)
    }
}

/// A commit's id, read, once its counts are known to be in bounds: a count no response can have
/// is refused before anything is charged.
pub(super) fn checked_commit(
    reservation_id: &str,
    counted: Counted,
) -> Result<ids::ReservationRef<'_>, AdmissionError> {
    let (prompt, output, detail) = match counted {
        Counted::Exact { prompt, output, detail } => (prompt, output, detail),
        Counted::Metered { output } => (0, output, Detail::default()),
        Counted::AsHeld => (0, 0, Detail::default()),
    };
    let said = |n: Option<u64>| n.unwrap_or(0);
    for (what, value) in [
        ("prompt_tokens", prompt),
        ("completion_tokens", output),
        ("cache_read_tokens", said(detail.cache_read)),
        ("cache_write_tokens", said(detail.cache_write)),
        ("reasoning_tokens", said(detail.reasoning)),
    ] {
        if value > MAX_TOKEN_COUNT {
            return Err(AdmissionError::TooLarge { what, value });
        }
    }
    parse_id(reservation_id)
}

/// Where a hold lives, read from its id.
pub(super) enum Home<'a> {
    /// In the store: its scripts settle it.
    Store,
    /// In this replica's slices: settled in memory, no store call (or, when they do not know it, in
    /// the store).
    Slice(&'a Leases),
    /// In another replica's slices: the operation is left for that replica (`lease_forward.lua`),
    /// which applies it within one lease window.
    Replica(&'a str),
}

/// How a commit's request ended for its pool's provider limits, by what its tenant leg said: the
/// counts it reported (a metered stream's prompt as held) at the cost that leg charged; a hold
/// released before it, released. `None` where the pool leg is not this call's to release:
/// nothing found, or forwarded to the replica holding the lease (which releases it when it
/// applies the commit, with what its tenant leg charged).
fn commit_end(counted: Counted, outcome: &CommitOutcome) -> Option<PoolEnd> {
    let cost_nanos = match outcome {
        CommitOutcome::Committed(u) => Some(u.cost_nanos),
        CommitOutcome::Released => return Some(PoolEnd::Released),
        CommitOutcome::NotFound | CommitOutcome::Forwarded => return None,
    };
    Some(match counted {
        Counted::Exact { prompt, output, .. } => {
            PoolEnd::Used { prompt: Some(prompt), output: Some(output), cost_nanos }
        }
        Counted::Metered { output } => PoolEnd::Used { prompt: None, output: Some(output), cost_nanos },
        Counted::AsHeld => PoolEnd::Used { prompt: None, output: None, cost_nanos: None },
    })
}

/// How a hold a call found settled ended, for its pool's provider limits: given back if it was
/// released; otherwise (committed, whose own pool release this call repeats, or expired) as
/// held: the request may have run, and what it used is not this call's to say.
fn settled_end(settled: Settled) -> PoolEnd {
    match settled {
        Settled::Released => PoolEnd::Released,
        Settled::Committed | Settled::LateCommitted | Settled::Expired => PoolEnd::AsHeld,
    }
}
