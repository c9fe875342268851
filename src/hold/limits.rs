//! A scope's limits as a decision applies them, what a replica's slice holds, and the headroom a
//! decision leaves (the `x-ratelimit-*` headers).

use crate::config::Limits;

/// The limits of one scope as the reserve script takes them; zero means "no such limit".
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ScopeLimits {
    pub token_capacity: u64,
    pub tokens_per_ms: f64,
    pub request_capacity: u64,
    pub requests_per_ms: f64,
    pub max_concurrency: u64,
    pub daily_budget: u64,
    pub monthly_budget: u64,
    /// Budgets in money, in nanos.
    pub daily_cost: u64,
    pub monthly_cost: u64,
}

impl From<&Limits> for ScopeLimits {
    fn from(l: &Limits) -> Self {
        ScopeLimits {
            token_capacity: l.token_capacity().unwrap_or(0),
            tokens_per_ms: l.tokens_per_ms(),
            request_capacity: l.requests_per_minute.unwrap_or(0),
            requests_per_ms: l.requests_per_ms(),
            max_concurrency: l.max_concurrency.unwrap_or(0),
            daily_budget: l.tokens_per_day.unwrap_or(0),
            monthly_budget: l.tokens_per_month.unwrap_or(0),
            daily_cost: l.cost_per_day.map_or(0, |m| m.0),
            monthly_cost: l.cost_per_month.map_or(0, |m| m.0),
        }
    }
}

/// Tokens, request permits and concurrency slots: what a replica's slice of a scope holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Amounts {
    pub tokens: u64,
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
