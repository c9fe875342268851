//! A scope's limits as a decision applies them, what a replica's slice holds, and the headroom a
//! decision leaves (the `x-ratelimit-*` headers).

use std::num::NonZeroU64;

use super::{BudgetKey, BudgetLimits, Measure, Period};
use crate::config::{Limits, per_ms};

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
    /// Prompt tokens alone, and output tokens alone: buckets of one minute's refill.
    pub input: Option<Bucket>,
    pub output: Option<Bucket>,
    /// Requests: a bucket of one minute's requests, refilled over the minute.
    pub requests: Option<Bucket>,
    pub max_concurrency: Option<NonZeroU64>,
    /// Period budgets by [`BudgetKey::index`]; money in nanos; `0`: none.
    pub budgets: BudgetLimits,
    /// Soft budgets (the tenant's scope only): past one a request is admitted all the same, one
    /// tier lower and marked.
    pub soft: BudgetLimits,
}

impl ScopeLimits {
    /// These limits with every bucket refilling at `share` of its rate, as a pool's provider
    /// limits do while its provider's 429s throttle it.
    pub fn slowed(mut self, share: f64) -> Self {
        for bucket in [&mut self.tokens, &mut self.input, &mut self.output, &mut self.requests].into_iter().flatten() {
            bucket.per_ms *= share;
        }
        self
    }

    /// A period budget's limit, if the scope has it.
    pub fn budget(&self, key: BudgetKey) -> Option<NonZeroU64> {
        self.budgets.get(key.index()).copied().and_then(NonZeroU64::new)
    }

    /// The cheapest budget in money, if any (nanos).
    pub fn tightest_cost(&self) -> Option<u64> {
        Period::ALL.into_iter().filter_map(|p| self.budget(BudgetKey::new(Measure::Cost, p))).map(NonZeroU64::get).min()
    }

    /// Whether every limit the scope has is one leasing decides from slices: no bucket of one
    /// side, no budget but tokens and money per day and month.
    pub fn leasable(&self) -> bool {
        self.input.is_none()
            && self.output.is_none()
            && self.soft.iter().all(|&n| n == 0)
            && BudgetKey::all().all(|k| k.leasable() || self.budget(k).is_none())
    }
}

impl From<&Limits> for ScopeLimits {
    fn from(l: &Limits) -> Self {
        let nonzero = |n: Option<u64>| n.and_then(NonZeroU64::new);
        let bucket = |capacity: Option<u64>, per_ms: f64| nonzero(capacity).map(|capacity| Bucket { capacity, per_ms });
        let mut budgets = BudgetLimits::default();
        for (key, limit) in l.budgets() {
            if let Some(b) = budgets.get_mut(key.index()) {
                *b = limit;
            }
        }
        ScopeLimits {
            tokens: bucket(l.token_capacity(), l.tokens_per_ms()),
            input: bucket(l.input_tokens_per_minute, per_ms(l.input_tokens_per_minute)),
            output: bucket(l.output_tokens_per_minute, per_ms(l.output_tokens_per_minute)),
            requests: bucket(l.requests_per_minute, l.requests_per_ms()),
            max_concurrency: nonzero(l.max_concurrency),
            budgets,
            soft: BudgetLimits::default(),
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
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Headroom {
    pub tokens: Option<Window>,
    pub requests: Option<Window>,
    /// The buckets of one side, when a scope has either (an admission's only; boxed, so that a
    /// decision stays small for the many that have none).
    pub sides: Option<Box<Sides>>,
}

/// The tightest bucket of prompt tokens alone, and of output tokens alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sides {
    pub input: Option<Window>,
    pub output: Option<Window>,
}

impl Headroom {
    /// The side windows as a pair (`None` where there is none).
    pub fn sides(&self) -> Sides {
        self.sides.as_deref().copied().unwrap_or_default()
    }

    /// `sides` boxed only when there is one.
    pub fn with_sides(self, sides: Sides) -> Headroom {
        let any = sides.input.is_some() || sides.output.is_some();
        Headroom { sides: any.then(|| Box::new(sides)), ..self }
    }
}
