//! A scope's limits as a decision applies them, what a replica's slice holds, and the headroom a
//! decision leaves (the `x-ratelimit-*` headers).

use std::num::NonZeroU64;

use crate::config::Limits;

/// A token or request bucket: how much it holds, and how fast it refills.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    pub capacity: NonZeroU64,
    /// Refill per millisecond.
    pub per_ms: f64,
}

/// The limits of one scope as a decision applies them; `None` where the scope sets no such limit.
/// (The scripts take `0` for "none"; only the codec writes it.)
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ScopeLimits {
    pub tokens: Option<Bucket>,
    /// Requests: a bucket of one minute's requests, refilled over the minute.
    pub requests: Option<Bucket>,
    pub max_concurrency: Option<NonZeroU64>,
    pub daily_budget: Option<NonZeroU64>,
    pub monthly_budget: Option<NonZeroU64>,
    /// Budgets in money, in nanos.
    pub daily_cost: Option<NonZeroU64>,
    pub monthly_cost: Option<NonZeroU64>,
}

impl ScopeLimits {
    /// The cheapest budget in money, if any (nanos).
    pub fn tightest_cost(&self) -> Option<u64> {
        [self.daily_cost, self.monthly_cost].into_iter().flatten().map(NonZeroU64::get).min()
    }
}

impl From<&Limits> for ScopeLimits {
    fn from(l: &Limits) -> Self {
        let nonzero = |n: Option<u64>| n.and_then(NonZeroU64::new);
        let bucket = |capacity: Option<u64>, per_ms: f64| nonzero(capacity).map(|capacity| Bucket { capacity, per_ms });
        ScopeLimits {
            tokens: bucket(l.token_capacity(), l.tokens_per_ms()),
            requests: bucket(l.requests_per_minute, l.requests_per_ms()),
            max_concurrency: nonzero(l.max_concurrency),
            daily_budget: nonzero(l.tokens_per_day),
            monthly_budget: nonzero(l.tokens_per_month),
            daily_cost: nonzero(l.cost_per_day.map(|m| m.0)),
            monthly_cost: nonzero(l.cost_per_month.map(|m| m.0)),
        }
    }
}

/// Tokens, money, request permits and concurrency slots: what a replica's slice of a scope holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Amounts {
    pub tokens: u64,
    /// Nanos of the policy's currency, for a scope with a budget in money.
    pub cost: u64,
    pub requests: u64,
    pub slots: u64,
}

/// Remaining / limit / reset of the tightest scope, for the `x-ratelimit-*` headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub remaining: i64,
    pub limit: u64,
    pub reset_ms: u64,
}

/// The tightest token and request windows after a decision; `None` where no scope limits them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Headroom {
    pub tokens: Option<Window>,
    pub requests: Option<Window>,
}
