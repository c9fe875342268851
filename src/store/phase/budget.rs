//! The Budgets API's scripts: `budget_get.lua`, what a tenant's scopes have used, hold and have
//! left; `budget_adjust.lua`, a credit, debit or reset of one period budget.

use super::reserve::{SCOPE_ARGV, push_limits};
use super::{Argv, Fields};
use crate::hold::ScopeLimits;
use crate::store::{Protocol, Reply, Store, StoreError, keys};

/// `budget_get.lua`'s fixed `ARGV`; nine limits per scope follow ([`SCOPE_ARGV`]).
pub(crate) const GET_ARGV: [&str; 1] = ["count held"];

/// `budget_adjust.lua`'s `ARGV`, in order.
pub(crate) const ADJUST_ARGV: [&str; 8] = [
    "the budget",
    "the credit",
    "reset",
    "the request's fingerprint",
    "how long the request id is remembered",
    "idle TTL of the scope hash",
    "the usage ledger's terms",
    "the ledger entry",
];

/// A period budget a scope may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeriodBudget {
    TokensPerDay,
    TokensPerMonth,
    CostPerDay,
    CostPerMonth,
}

impl PeriodBudget {
    pub const ALL: [PeriodBudget; 4] = [
        PeriodBudget::TokensPerDay,
        PeriodBudget::TokensPerMonth,
        PeriodBudget::CostPerDay,
        PeriodBudget::CostPerMonth,
    ];

    /// The policy's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            PeriodBudget::TokensPerDay => "tokens_per_day",
            PeriodBudget::TokensPerMonth => "tokens_per_month",
            PeriodBudget::CostPerDay => "cost_per_day",
            PeriodBudget::CostPerMonth => "cost_per_month",
        }
    }

    pub fn parse(name: &str) -> Option<PeriodBudget> {
        PeriodBudget::ALL.into_iter().find(|b| b.as_str() == name)
    }

    /// The budget in `limits`, if the scope has it.
    pub fn of(self, limits: &ScopeLimits) -> Option<std::num::NonZeroU64> {
        match self {
            PeriodBudget::TokensPerDay => limits.daily_budget,
            PeriodBudget::TokensPerMonth => limits.monthly_budget,
            PeriodBudget::CostPerDay => limits.daily_cost,
            PeriodBudget::CostPerMonth => limits.monthly_cost,
        }
    }
}

/// One adjustment, as `budget_adjust.lua` takes it.
#[derive(Debug, Clone, Copy)]
pub struct AdjustCall<'a> {
    pub tenant: &'a str,
    pub scope_key: &'a str,
    pub budget: PeriodBudget,
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
    /// (when `count_held`: it reads every live hold of the tenant; else 0) and has left. Reads only.
    pub async fn budget(
        &self,
        tenant: &str,
        scopes: &[(String, ScopeLimits)],
        count_held: bool,
    ) -> Result<Vec<ScopeUse>, StoreError> {
        let script = &self.scripts.budget_get;
        let mut a = Argv::grouped("budget_get", &GET_ARGV, &SCOPE_ARGV, scopes.len());
        a.push("count held", if count_held { "1" } else { "0" }.to_string());
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

impl<S: Store> Protocol<S> {
    /// Credits, debits or resets one period budget of one scope, once per request id, entered in
    /// the tenant's ledger.
    pub async fn adjust_budget(&self, call: &AdjustCall<'_>) -> Result<Adjusted, StoreError> {
        let script = &self.scripts.budget_adjust;
        let clean = |v: &str| v.replace(['\t', '\n', '\r'], " ");
        let mut a = Argv::new("budget_adjust", &ADJUST_ARGV, 0);
        a.push("the budget", call.budget.as_str().to_string());
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
        a.push("the ledger entry", [clean(call.request_id), call.tenant.to_string(), user, model, by, why].join("\t"));
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
