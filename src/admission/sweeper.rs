//! The background sweeper: every expired hold is settled within a bound after its lease, with its
//! ledger entry and metric, even when its tenant never calls again (the sweep inside reserve only
//! reaches tenants that do).
//!
//! Each replica notes the tenants it serves (a hold made or renewed, a lease call) and, once a
//! period, writes them to the sweeper's index: [`keys::SWEEP_SHARDS`] sorted sets, each its own
//! hash tag, a tenant by when it may first need settling (its lease from the note, plus two
//! periods). Every period each replica also looks at one shard, the next in turn: it takes what is
//! due (claimed, so two sweepers do not work the same tenant at once), settles it on the tenant's
//! own slot (`sweep.lua`, the same sweep reserve runs), and moves the tenant to when its next lease
//! passes, or drops it when nothing is left. A replica makes, each period, one look and a note for
//! each shard whose tenants it served (at most [`keys::SWEEP_SHARDS`]), whatever its traffic, and
//! a sweep for each tenant that is due.
//!
//! The bound, with one replica: a hold whose lease passes at `E` is settled by
//! `E + (3 + SWEEP_SHARDS) × SWEEP_MS` (7 s: its tenant was noted within a period of the hold, due
//! two periods after its lease, and its shard is looked at within `SWEEP_SHARDS` periods), while at most [`TAKE`] tenants of a shard fall due between looks and
//! the store answers. A replica that dies within a period of a tenant's first hold, before its
//! note was written, leaves that tenant to its next call, as before.

// Token arithmetic: no unchecked +, -, * (see Cargo.toml's [lints] for the casts).
#![warn(clippy::arithmetic_side_effects)]

use std::collections::HashMap;
use std::sync::Arc;

use super::Admission;
use crate::store::{Store, StoreError, keys};

/// How often the sweeper writes its notes and looks at the index.
pub const SWEEP_MS: u64 = 1_000;
/// Tenants taken from one shard per look.
pub const TAKE: u32 = 64;
/// How long a taken tenant is left to the sweeper that took it.
const CLAIM_MS: u64 = 10 * SWEEP_MS;
/// How long a shard of the index lives without a note.
const SHARD_TTL_MS: u64 = 7 * crate::hold::DAY_MS;

impl<S: Store> Admission<S> {
    /// Notes that `tenant` may hold something for `lease_ms` from now; written to the index with
    /// the sweeper's next period.
    pub(super) fn note_tenant(&self, tenant: &str, lease_ms: u64) {
        // On a decision's path: a read lock, and the write lock (and the name's allocation) only
        // for a tenant's first note of a period.
        let seen = self.noted.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(tenant).copied();
        if seen.is_some_and(|noted| noted >= lease_ms) {
            return;
        }
        let mut noted = self.noted.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        match noted.get_mut(tenant) {
            Some(lease) => *lease = (*lease).max(lease_ms),
            None => {
                noted.insert(tenant.to_string(), lease_ms);
            }
        }
    }

    /// One period of the sweeper: the notes written, then the next shard's due tenants settled.
    /// Run by [`Admission::run_sweeper`]; public so tests can drive it on a manual clock. Returns
    /// the first failed call's error (the rest were still made; a note that failed is kept for the
    /// next period).
    pub async fn sweep_tick(&self) -> Result<(), StoreError> {
        let mut failed = self.write_notes().await.err();
        let policy = self.policy();
        let ledger = policy.ledger.as_ref().map(|l| l.terms);
        let shard = self.sweep_turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % keys::SWEEP_SHARDS;
        let due = match self.protocol.sweep_take(shard, TAKE, CLAIM_MS).await {
            Ok(due) => due,
            Err(e) => return Err(failed.unwrap_or(e)),
        };
        for (tenant, claimed) in due {
            let swept = match self.protocol.sweep(&tenant, policy.sweep_batch, ledger).await {
                Ok(swept) => swept,
                // Claimed: due again once the claim runs out.
                Err(e) => {
                    failed.get_or_insert(e);
                    continue;
                }
            };
            if !swept.settled.is_empty() {
                tracing::debug!(tenant = %tenant, settled = swept.settled.len(), "the sweeper settled expired holds");
            }
            self.release_swept_pool_legs(&swept.settled).await;
            if let Err(e) = self.protocol.sweep_done(shard, &tenant, claimed, swept.next_due_ms).await {
                failed.get_or_insert(e);
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Writes the tenants noted since the last period to their shards; on failure they are noted
    /// again for the next.
    async fn write_notes(&self) -> Result<(), StoreError> {
        let noted = std::mem::take(&mut *self.noted.write().unwrap_or_else(std::sync::PoisonError::into_inner));
        if noted.is_empty() {
            return Ok(());
        }
        let mut shards: HashMap<u32, Vec<(String, u64)>> = HashMap::new();
        for (tenant, lease_ms) in noted {
            shards.entry(keys::sweep_shard_of(&tenant)).or_default().push((tenant, lease_ms));
        }
        let mut failed = None;
        for (shard, tenants) in shards {
            // Due two periods after its lease: one for the note to be written, one to spare.
            let slack = SWEEP_MS.saturating_mul(2);
            let due: Vec<(String, u64)> =
                tenants.iter().map(|(t, lease)| (t.clone(), lease.saturating_add(slack))).collect();
            if let Err(e) = self.protocol.sweep_note(shard, SHARD_TTL_MS, &due).await {
                for (tenant, lease_ms) in &tenants {
                    self.note_tenant(tenant, *lease_ms);
                }
                failed.get_or_insert(e);
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Runs the sweeper every [`SWEEP_MS`] until `shutdown`, then writes its last notes, so the
    /// sweepers of other replicas know every tenant this one served.
    pub async fn run_sweeper(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        let mut ticks = tokio::time::interval(std::time::Duration::from_millis(SWEEP_MS));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {
                    if let Err(e) = self.sweep_tick().await {
                        tracing::debug!(error = %e, "a sweeper period failed in part; the next tries again");
                    }
                }
                () = shutdown.cancelled() => break,
            }
        }
        if let Err(e) = self.write_notes().await {
            tracing::warn!(error = %e, "the sweeper's last notes could not be written");
        }
    }
}
