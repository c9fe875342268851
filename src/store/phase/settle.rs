//! The scripts that settle a hold kept in the store: `commit.lua`, `renew.lua`, `release.lua`.

use super::{Argv, Fields};
use crate::hold::{CommitOutcome, Counted, Detail, Ending, ReleaseOutcome, RenewOutcome, Usage};
use crate::store::{Protocol, Store, StoreError, keys};

/// `commit.lua`'s `ARGV`, in order.
pub(crate) const COMMIT_ARGV: [&str; 13] = [
    "reservation id",
    "prompt tokens used",
    "output tokens used",
    "TTL of the output estimate",
    "samples the estimate keeps",
    "exact | metered",
    "the tenant's settled-bucket prefix",
    "retention of settled records",
    "cache reads",
    "cache writes",
    "reasoning tokens",
    "how the request ended",
    "the tenant's time zone",
];

/// `commit_many.lua`'s `ARGV`: the tenant's terms, then [`COMMIT_MANY_GROUP`] for each commit.
pub(crate) const COMMIT_MANY_ARGV: [&str; 5] = [
    "TTL of the output estimate",
    "samples the estimate keeps",
    "the tenant's settled-bucket prefix",
    "retention of settled records",
    "the tenant's time zone",
];

/// `commit_many.lua`'s `ARGV` for each commit of the batch.
pub(crate) const COMMIT_MANY_GROUP: [&str; 8] = [
    "reservation id",
    "prompt tokens used",
    "output tokens used",
    "exact | metered",
    "cache reads",
    "cache writes",
    "reasoning tokens",
    "how the request ended",
];

/// `renew.lua`'s `ARGV`, in order.
pub(crate) const RENEW_ARGV: [&str; 5] =
    ["reservation id", "new lease", "idle TTL", "the tenant's settled-bucket prefix", "retention of settled records"];

/// `release.lua`'s `ARGV`.
pub(crate) const RELEASE_ARGV: [&str; 5] = [
    "reservation id",
    "the tenant's settled-bucket prefix",
    "retention of settled records",
    "how the request ended",
    "whether the reserve went unanswered",
];

/// What a commit teaches the output estimate of a hold that learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Learning {
    /// How long the estimate outlives its last commit (ms).
    pub ttl_ms: u64,
    /// Samples kept before every count is halved.
    pub window: u64,
}

/// What a commit needs beside the hold and its counts: the tenant's terms now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitTerms {
    /// `None` when the hold's tenant no longer learns.
    pub learning: Option<Learning>,
    /// How long the settled hold answers repeats.
    pub retention_ms: u64,
    /// The tenant's zone's offset from UTC now (minutes east): debt counts in its periods. `None`
    /// when the policy no longer has the tenant (the hold's own offset is used).
    pub zone_offset_min: Option<i32>,
}

/// One commit of a batch (see [`Protocol::commit_many`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitCall {
    pub id: String,
    pub counted: Counted,
    pub ending: Ending,
}

/// A commit's counts as its script takes them: prompt and output ('' where the hold stands for
/// them), exact | metered, and the detail beside reported counts.
fn counts(counted: Counted) -> (String, String, &'static str, Detail) {
    match counted {
        Counted::Exact { prompt, output, detail } => (prompt.to_string(), output.to_string(), "exact", detail),
        Counted::Metered { output } => (String::new(), output.to_string(), "metered", Detail::default()),
        Counted::AsHeld => (String::new(), String::new(), "metered", Detail::default()),
    }
}

/// What may be unsaid (a count the response did not give, the zone of a tenant the policy no
/// longer has), as a script takes it: '' when unsaid.
fn said<T: ToString>(n: Option<T>) -> String {
    n.map_or_else(String::new, |n| n.to_string())
}

/// The fields of `commit.lua`'s reply: `commit_many.lua` replies with each commit's, one after the
/// other.
pub(super) const COMMIT_REPLY_FIELDS: usize = 11;

/// What `commit.lua` replied (or `commit_many.lua`, for each of its commits).
fn commit_outcome(r: &Fields<'_>) -> Result<CommitOutcome, StoreError> {
    Ok(match r.text(0)? {
        "not_found" => CommitOutcome::NotFound,
        "released" => CommitOutcome::Released,
        state @ ("committed" | "late_committed") => CommitOutcome::Committed(Usage {
            late: state == "late_committed",
            duplicate: r.flag(1)?,
            metered: r.flag(6)?,
            used: r.uint(2)?,
            held: r.uint(3)?,
            refunded: r.uint(4)?,
            overrun: r.uint(5)?,
            model: r.text(7).ok().filter(|m| !m.is_empty()).map(str::to_string),
            output_held: r.int(8).ok().and_then(|n| u64::try_from(n).ok()),
            cost_nanos: r.uint(9).unwrap_or(0),
            ending: r.text(10).ok().and_then(Ending::parse),
        }),
        _ => return Err(r.bad()),
    })
}

impl<S: Store> Protocol<S> {
    /// Charges a hold what it used and refunds the rest (or charges the overrun as debt), once,
    /// and keeps how its request ended. A repeat within `retention_ms` of the first is answered with the first's result (as
    /// are those of renew and release).
    pub async fn commit(
        &self,
        tenant: &str,
        id: &str,
        counted: Counted,
        ending: Ending,
        terms: CommitTerms,
    ) -> Result<CommitOutcome, StoreError> {
        let CommitTerms { learning, retention_ms, zone_offset_min } = terms;
        let script = &self.scripts.commit;
        let (prompt, output, measure, detail) = counts(counted);
        let mut a = Argv::new("commit", &COMMIT_ARGV, 0);
        a.push("reservation id", id.to_string());
        a.push("prompt tokens used", prompt);
        a.push("output tokens used", output);
        a.push("TTL of the output estimate", learning.map_or(0, |l| l.ttl_ms).to_string());
        a.push("samples the estimate keeps", learning.map_or(0, |l| l.window).to_string());
        a.push("exact | metered", measure.to_string());
        push_settled(&mut a, tenant, retention_ms);
        a.push("cache reads", said(detail.cache_read));
        a.push("cache writes", said(detail.cache_write));
        a.push("reasoning tokens", said(detail.reasoning));
        a.push("how the request ended", ending.as_str().to_string());
        a.push("the tenant's time zone", said(zone_offset_min));
        let reply = self.store.eval(script, hold_keys(tenant, id), a.finish()).await?;
        commit_outcome(&Fields::of(script, &reply)?)
    }

    /// Commits a batch of `tenant`'s holds in one call, each as [`Protocol::commit`] would alone,
    /// in order, at one time: the outcomes in the order of `commits`. (One reply for all: a call
    /// that fails, fails for every commit of the batch, and none of them is known to have run.)
    pub async fn commit_many(
        &self,
        tenant: &str,
        commits: &[CommitCall],
        terms: CommitTerms,
    ) -> Result<Vec<CommitOutcome>, StoreError> {
        let CommitTerms { learning, retention_ms, zone_offset_min } = terms;
        let script = &self.scripts.commit_many;
        let mut a = Argv::grouped("commit_many", &COMMIT_MANY_ARGV, &COMMIT_MANY_GROUP, commits.len());
        a.push("TTL of the output estimate", learning.map_or(0, |l| l.ttl_ms).to_string());
        a.push("samples the estimate keeps", learning.map_or(0, |l| l.window).to_string());
        push_settled(&mut a, tenant, retention_ms);
        a.push("the tenant's time zone", said(zone_offset_min));
        let mut keys = Vec::with_capacity(commits.len().saturating_add(3));
        keys.extend([keys::leases(tenant), keys::holds(tenant), keys::ledger(tenant)]);
        for c in commits {
            let (prompt, output, measure, detail) = counts(c.counted);
            a.push("reservation id", c.id.clone());
            a.push("prompt tokens used", prompt);
            a.push("output tokens used", output);
            a.push("exact | metered", measure.to_string());
            a.push("cache reads", said(detail.cache_read));
            a.push("cache writes", said(detail.cache_write));
            a.push("reasoning tokens", said(detail.reasoning));
            a.push("how the request ended", c.ending.as_str().to_string());
            keys.push(keys::record(tenant, &c.id));
        }
        let reply = self.store.eval(script, keys, a.finish()).await?;
        let r = Fields::of(script, &reply)?;
        if r.len() != commits.len().saturating_mul(COMMIT_REPLY_FIELDS) {
            return Err(r.bad());
        }
        r.chunks(COMMIT_REPLY_FIELDS).map(|one| commit_outcome(&one)).collect()
    }

    /// Extends a live hold's lease to `lease_ms` from now.
    pub async fn renew(
        &self,
        tenant: &str,
        id: &str,
        lease_ms: u64,
        idle_ttl_ms: u64,
        retention_ms: u64,
    ) -> Result<RenewOutcome, StoreError> {
        let script = &self.scripts.renew;
        let mut a = Argv::new("renew", &RENEW_ARGV, 0);
        a.push("reservation id", id.to_string());
        a.push("new lease", lease_ms.to_string());
        a.push("idle TTL", idle_ttl_ms.to_string());
        push_settled(&mut a, tenant, retention_ms);
        let reply = self.store.eval(script, hold_keys(tenant, id), a.finish()).await?;
        let r = Fields::of(script, &reply)?;
        Ok(match r.text(0)? {
            "reserved" => RenewOutcome::Renewed { lease_remaining_ms: r.uint(1)? },
            "not_found" => RenewOutcome::NotFound,
            other => RenewOutcome::Settled(r.settled(other)?),
        })
    }

    /// Gives a hold back without usage: every token refunded, the slot freed, once; `ending` says
    /// why.
    pub async fn release(
        &self,
        tenant: &str,
        id: &str,
        ending: Ending,
        retention_ms: u64,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.release_call(tenant, id, ending, retention_ms, false).await
    }

    /// Gives back a hold whose reserve nobody received the answer of, as `release` does, and
    /// leaves a note at its record for a re-send of that reserve, which may still arrive: it then
    /// answers as its first run did and holds nothing (see `release.lua`).
    pub async fn release_unanswered(
        &self,
        tenant: &str,
        id: &str,
        retention_ms: u64,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.release_call(tenant, id, Ending::Released, retention_ms, true).await
    }

    async fn release_call(
        &self,
        tenant: &str,
        id: &str,
        ending: Ending,
        retention_ms: u64,
        unanswered: bool,
    ) -> Result<ReleaseOutcome, StoreError> {
        let script = &self.scripts.release;
        let mut a = Argv::new("release", &RELEASE_ARGV, 0);
        a.push("reservation id", id.to_string());
        push_settled(&mut a, tenant, retention_ms);
        a.push("how the request ended", ending.as_str().to_string());
        a.push("whether the reserve went unanswered", if unanswered { "1" } else { "" }.to_string());
        let reply = self.store.eval(script, hold_keys(tenant, id), a.finish()).await?;
        let r = Fields::of(script, &reply)?;
        Ok(match r.text(0)? {
            "released" => ReleaseOutcome::Released { refunded: r.uint(1)?, repeated: r.flag(2)? },
            "not_found" => ReleaseOutcome::NotFound,
            other => ReleaseOutcome::Settled(r.settled(other)?),
        })
    }
}

/// KEYS of commit, renew and release: the record, the lease index, the holds hash, the ledger.
fn hold_keys(tenant: &str, id: &str) -> Vec<String> {
    vec![keys::record(tenant, id), keys::leases(tenant), keys::holds(tenant), keys::ledger(tenant)]
}

/// Where a settled hold of `tenant` is filed and looked for: its settled buckets, one per
/// `retention_ms`.
fn push_settled(a: &mut Argv, tenant: &str, retention_ms: u64) {
    a.push("the tenant's settled-bucket prefix", keys::settled_prefix(tenant));
    a.push("retention of settled records", retention_ms.to_string());
}
