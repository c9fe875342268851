//! The background sweeper's scripts: `sweep.lua` (one tenant's expired holds settled) and the
//! index of tenants to look at, in shards (`sweep_note.lua`, `sweep_take.lua`, `sweep_done.lua`).

use super::{Argv, Fields};
use crate::config::LedgerTerms;
use crate::store::{Protocol, Store, StoreError, keys};

/// `sweep.lua`'s `ARGV`, in order.
pub(crate) const SWEEP_ARGV: [&str; 4] = ["record key prefix", "sweep batch", "the usage ledger's terms", "the tenant"];

/// `sweep_note.lua`'s `ARGV`: the shard's TTL, then a pair per tenant.
pub(crate) const NOTE_ARGV: [&str; 1] = ["idle TTL of the shard"];
pub(crate) const NOTE_GROUP: [&str; 2] = ["a tenant", "and how long from now"];

/// `sweep_take.lua`'s `ARGV`, in order.
pub(crate) const TAKE_ARGV: [&str; 2] = ["most tenants taken", "claim"];

/// `sweep_done.lua`'s `ARGV`, in order.
pub(crate) const DONE_ARGV: [&str; 3] = ["the tenant", "the due time it was claimed at", "when its next lease passes"];

/// What a sweep of one tenant settled, and when its next lease passes (store clock, ms; `None`:
/// nothing is left in its lease index).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Swept {
    pub settled: Vec<String>,
    pub next_due_ms: Option<u64>,
}

impl<S: Store> Protocol<S> {
    /// Settles up to `batch` of the tenant's holds whose lease has passed (and dead replicas'
    /// leases), entering them in its ledger under `ledger` where their record is gone.
    pub async fn sweep(&self, tenant: &str, batch: u32, ledger: Option<LedgerTerms>) -> Result<Swept, StoreError> {
        let script = &self.scripts.sweep;
        let keys = vec![keys::leases(tenant), keys::holds(tenant), keys::ledger(tenant)];
        let mut a = Argv::new("sweep", &SWEEP_ARGV, 0);
        a.push("record key prefix", keys::record_prefix(tenant));
        a.push("sweep batch", batch.to_string());
        a.push(
            "the usage ledger's terms",
            ledger.map_or_else(String::new, |l| format!("{} {}", l.max_len, l.retention_ms)),
        );
        a.push("the tenant", tenant.to_string());
        let reply = self.store.eval(script, keys, a.finish()).await?;
        let r = Fields::of(script, &reply)?;
        let next = r.int(0)?;
        let settled = (1..r.len()).map(|i| r.text(i).map(str::to_string)).collect::<Result<_, _>>()?;
        Ok(Swept { settled, next_due_ms: u64::try_from(next).ok() })
    }

    /// Notes tenants in one shard of the index: each may need settling this long from now (ms).
    pub async fn sweep_note(&self, shard: u32, idle_ttl_ms: u64, tenants: &[(String, u64)]) -> Result<(), StoreError> {
        let script = &self.scripts.sweep_note;
        let mut a = Argv::grouped("sweep_note", &NOTE_ARGV, &NOTE_GROUP, tenants.len());
        a.push("idle TTL of the shard", idle_ttl_ms.to_string());
        for (tenant, due_in_ms) in tenants {
            a.push("a tenant", tenant.clone());
            a.push("and how long from now", due_in_ms.to_string());
        }
        let reply = self.store.eval(script, vec![keys::sweep_shard(shard)], a.finish()).await?;
        match reply.as_int() {
            Some(_) => Ok(()),
            None => Err(StoreError::BadReply { script: script.name, reply }),
        }
    }

    /// Takes up to `batch` tenants of a shard that are due now, each claimed for `claim_ms`:
    /// (tenant, the due time it was claimed at).
    pub async fn sweep_take(&self, shard: u32, batch: u32, claim_ms: u64) -> Result<Vec<(String, u64)>, StoreError> {
        let script = &self.scripts.sweep_take;
        let mut a = Argv::new("sweep_take", &TAKE_ARGV, 0);
        a.push("most tenants taken", batch.to_string());
        a.push("claim", claim_ms.to_string());
        let reply = self.store.eval(script, vec![keys::sweep_shard(shard)], a.finish()).await?;
        let r = Fields::of(script, &reply)?;
        (0..r.len()).step_by(2).map(|i| Ok((r.text(i)?.to_string(), r.uint(i.saturating_add(1))?))).collect()
    }

    /// Says what a sweep of a taken tenant left: dropped from the index when nothing is, else due
    /// when its next lease passes. `Ok(true)` when it was dropped.
    pub async fn sweep_done(
        &self,
        shard: u32,
        tenant: &str,
        claimed_ms: u64,
        next_due_ms: Option<u64>,
    ) -> Result<bool, StoreError> {
        let script = &self.scripts.sweep_done;
        let mut a = Argv::new("sweep_done", &DONE_ARGV, 0);
        a.push("the tenant", tenant.to_string());
        a.push("the due time it was claimed at", claimed_ms.to_string());
        a.push("when its next lease passes", next_due_ms.map_or_else(|| "-1".to_string(), |n| n.to_string()));
        let reply = self.store.eval(script, vec![keys::sweep_shard(shard)], a.finish()).await?;
        match reply.as_int() {
            Some(n) => Ok(n == 1),
            None => Err(StoreError::BadReply { script: script.name, reply }),
        }
    }
}
