//! `budget_get.lua`: what a tenant's scopes have used, hold and have left, for the Budgets API.

use super::reserve::{SCOPE_ARGV, push_limits};
use super::{Argv, Fields};
use crate::hold::ScopeLimits;
use crate::store::{Protocol, Reply, Store, StoreError, keys};

/// `budget_get.lua`'s fixed `ARGV`: none; nine limits per scope follow ([`SCOPE_ARGV`]).
pub(crate) const GET_ARGV: [&str; 0] = [];

/// A bucket as it stands: what it holds now, and how long until it is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketLevel {
    pub level: i64,
    pub full_in_ms: u64,
}

/// What a period's budget has counted: tokens and cost (nanos), and how much of each live holds
/// hold (not yet settled; counted in the totals).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeriodUse {
    pub tokens: u64,
    pub held_tokens: u64,
    pub cost: u64,
    pub held_cost: u64,
}

/// One scope as the store has it now (a bucket the scope does not have reads as 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScopeUse {
    pub tokens: BucketLevel,
    pub requests: BucketLevel,
    pub in_flight: u64,
    pub day: PeriodUse,
    pub month: PeriodUse,
    pub day_ends_in_ms: u64,
    pub month_ends_in_ms: u64,
}

impl<S: Store> Protocol<S> {
    /// What each of `tenant`'s `scopes` (key and limits, as a reserve sends them) has used, holds
    /// and has left. Reads only.
    pub async fn budget(&self, tenant: &str, scopes: &[(String, ScopeLimits)]) -> Result<Vec<ScopeUse>, StoreError> {
        let script = &self.scripts.budget_get;
        let mut a = Argv::grouped("budget_get", &GET_ARGV, &SCOPE_ARGV, scopes.len());
        let mut keys = Vec::with_capacity(scopes.len().saturating_add(1));
        keys.push(keys::holds(tenant));
        for (key, limits) in scopes {
            keys.push(key.clone());
            push_limits(&mut a, limits);
        }
        let reply = self.store.eval(script, keys, a.finish()).await?;
        let all = Fields::of(script, &reply)?;
        (0..all.len())
            .map(|i| {
                let one = all.get(i).ok_or_else(|| all.bad())?;
                scope_use(script, one)
            })
            .collect()
    }
}

fn scope_use(script: &crate::store::Script, reply: &Reply) -> Result<ScopeUse, StoreError> {
    let r = Fields::of(script, reply)?;
    let bucket = |level: i64, full_in_ms: u64| BucketLevel { level, full_in_ms };
    Ok(ScopeUse {
        tokens: bucket(r.int(0)?, r.uint(1)?),
        requests: bucket(r.int(2)?, r.uint(3)?),
        in_flight: r.uint(4)?,
        day: PeriodUse { tokens: r.uint(5)?, held_tokens: r.uint(6)?, cost: r.uint(9)?, held_cost: r.uint(10)? },
        month: PeriodUse { tokens: r.uint(7)?, held_tokens: r.uint(8)?, cost: r.uint(11)?, held_cost: r.uint(12)? },
        day_ends_in_ms: r.uint(13)?,
        month_ends_in_ms: r.uint(14)?,
    })
}
