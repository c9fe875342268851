//! The Budgets API's scripts: `budget_get.lua`, what a tenant's scopes have used, hold and have
//! left; `budget_adjust.lua`, a credit, debit or reset of one period budget.

use super::reserve::{SCOPE_ARGV, push_limits};
use super::{Argv, Fields};
use crate::hold::{BudgetKey, ScopeLimits};
use crate::store::{Protocol, Reply, Store, StoreError, keys};

/// `budget_get.lua`'s fixed `ARGV`; ten limits per scope follow ([`SCOPE_ARGV`]).
pub(crate) const GET_ARGV: [&str; 3] = ["count held", "record key prefix", "the tenant's time zone"];

/// `budget_adjust.lua`'s `ARGV`, in order.
pub(crate) const ADJUST_ARGV: [&str; 9] = [
    "the budget's counter",
    "the credit",
    "reset",
    "the request's fingerprint",
    "how long the request id is remembered",
    "idle TTL of the scope hash",
    "the usage ledger's terms",
    "the ledger entry",
    "the tenant's time zone",
];

/// One adjustment, as `budget_adjust.lua` takes it.
#[derive(Debug, Clone, Copy)]
pub struct AdjustCall<'a> {
    pub tenant: &'a str,
    pub scope_key: &'a str,
    pub budget: BudgetKey,
    /// Taken off what the period counted; below zero, added to it.
    pub credit: i64,
    pub reset: bool,
    pub request_id: &'a str,
    /// Everything the request asked, so a request id reused for another is refused.
    pub fingerprint: &'a str,
    pub remember_ms: u64,
    pub idle_ttl_ms: u64,
    pub ledger: Option<crate::config::LedgerTerms>,
    /// The ledger entry's user, model, who asked and why.
    pub entry: [&'a str; 4],
    /// The tenant's time zone's offset from UTC now, in minutes east.
    pub zone_offset_min: i32,
}

/// What an adjustment did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adjusted {
    /// Applied now: what the period counted before and after.
    Applied { before: u64, after: u64 },
    /// The request id's first answer: nothing changed again.
    Repeated { before: u64, after: u64 },
    /// The request id was first used for another adjustment; nothing changed.
    Conflict,
}

/// A bucket as it stands: what it holds now, and how long until it is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketLevel {
    pub level: i64,
    pub full_in_ms: u64,
}

/// What one period budget has counted this period (tokens, or nanos of money), how much of it
/// live holds hold (not yet settled; counted in it), and when the period ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeriodUse {
    pub counted: u64,
    pub held: u64,
    pub ends_in_ms: u64,
}

/// One scope as the store has it now (a bucket the scope does not have reads as 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeUse {
    pub tokens: BucketLevel,
    pub requests: BucketLevel,
    pub input: BucketLevel,
    pub output: BucketLevel,
    pub in_flight: u64,
    /// Every budget the scope has, and the tokens and money of the day and month, which every
    /// scope counts.
    pub periods: Vec<(BudgetKey, PeriodUse)>,
}

impl ScopeUse {
    /// What one budget's period has counted (zeros when the store did not say).
    pub fn period(&self, key: BudgetKey) -> PeriodUse {
        self.periods.iter().find(|(k, _)| *k == key).map(|(_, u)| *u).unwrap_or_default()
    }
}

impl<S: Store> Protocol<S> {
    /// What each of `tenant`'s `scopes` (key and limits, as a reserve sends them) has used, holds
    /// (when `count_held`: it reads every live hold of the tenant; else 0) and has left. Reads only.
    pub async fn budget(
        &self,
        tenant: &str,
        scopes: &[(String, ScopeLimits)],
        count_held: bool,
        zone_offset_min: i32,
    ) -> Result<Vec<ScopeUse>, StoreError> {
        let holds = (keys::holds(tenant), keys::record_prefix(tenant));
        self.read_scopes(holds, scopes, count_held, zone_offset_min).await
    }

    /// What a pool's provider scope (`provider_limits`) has used and has left, in UTC periods.
    /// Reads only.
    pub async fn provider_budget(&self, pool: &str, limits: &ScopeLimits) -> Result<ScopeUse, StoreError> {
        // (The pool's holds hash stands where a tenant's is read: a provider scope counts no
        // live hold apart, so it is never read; it keeps the keys on the pool's slot.)
        let holds = (keys::pool_holds(pool), String::new());
        let scope = [(keys::pool_provider(pool), *limits)];
        let mut used = self.read_scopes(holds, &scope, false, 0).await?;
        used.pop().ok_or(StoreError::BadReply { script: self.scripts.budget_get.name, reply: Reply::Nil })
    }

    /// `budget_get.lua` over `scopes`, beside a holds hash and record prefix.
    async fn read_scopes(
        &self,
        (holds, record_prefix): (String, String),
        scopes: &[(String, ScopeLimits)],
        count_held: bool,
        zone_offset_min: i32,
    ) -> Result<Vec<ScopeUse>, StoreError> {
        let script = &self.scripts.budget_get;
        let mut a = Argv::grouped("budget_get", &GET_ARGV, &SCOPE_ARGV, scopes.len());
        a.push("count held", if count_held { "1" } else { "0" }.to_string());
        a.push("record key prefix", record_prefix);
        a.push("the tenant's time zone", zone_offset_min.to_string());
        let mut keys = Vec::with_capacity(scopes.len().saturating_add(1));
        keys.push(holds);
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

impl<S: Store> Protocol<S> {
    /// Credits, debits or resets one period budget of one scope, once per request id, entered in
    /// the tenant's ledger.
    pub async fn adjust_budget(&self, call: &AdjustCall<'_>) -> Result<Adjusted, StoreError> {
        let script = &self.scripts.budget_adjust;
        let clean = |v: &str| v.replace(['\t', '\n', '\r'], " ");
        let mut a = Argv::new("budget_adjust", &ADJUST_ARGV, 0);
        a.push("the budget's counter", call.budget.counter());
        a.push("the credit", call.credit.to_string());
        a.push("reset", if call.reset { "1" } else { "0" }.to_string());
        a.push("the request's fingerprint", call.fingerprint.to_string());
        a.push("how long the request id is remembered", call.remember_ms.to_string());
        a.push("idle TTL of the scope hash", call.idle_ttl_ms.to_string());
        a.push(
            "the usage ledger's terms",
            call.ledger.map_or_else(String::new, |l| format!("{} {}", l.max_len, l.retention_ms)),
        );
        let [user, model, by, why] = call.entry.map(clean);
        let name = call.budget.name();
        a.push(
            "the ledger entry",
            [clean(call.request_id), call.tenant.to_string(), user, model, by, why, name].join("\t"),
        );
        a.push("the tenant's time zone", call.zone_offset_min.to_string());
        let keys =
            vec![call.scope_key.to_string(), keys::adjustment(call.tenant, call.request_id), keys::ledger(call.tenant)];
        let reply = self.store.eval(script, keys, a.finish()).await?;
        let r = Fields::of(script, &reply)?;
        Ok(match r.text(0)? {
            "adjusted" => Adjusted::Applied { before: r.uint(1)?, after: r.uint(2)? },
            "repeated" => Adjusted::Repeated { before: r.uint(1)?, after: r.uint(2)? },
            "conflict" => Adjusted::Conflict,
            _ => return Err(r.bad()),
        })
    }
}

fn scope_use(script: &crate::store::Script, reply: &Reply) -> Result<ScopeUse, StoreError> {
    let r = Fields::of(script, reply)?;
    let bucket = |level: usize| -> Result<BucketLevel, StoreError> {
        Ok(BucketLevel { level: r.int(level)?, full_in_ms: r.uint(level.saturating_add(1))? })
    };
    let list = r.get(9).ok_or_else(|| r.bad())?;
    let p = Fields::of(script, list)?;
    let mut periods = Vec::new();
    for i in (0..p.len()).step_by(4) {
        let at = |n: usize| i.saturating_add(n);
        let key = BudgetKey::from_counter(p.text(i)?).ok_or_else(|| p.bad())?;
        periods.push((key, PeriodUse { counted: p.uint(at(1))?, held: p.uint(at(2))?, ends_in_ms: p.uint(at(3))? }));
    }
    Ok(ScopeUse {
        tokens: bucket(0)?,
        requests: bucket(2)?,
        in_flight: r.uint(4)?,
        input: bucket(5)?,
        output: bucket(7)?,
        periods,
    })
}
