//! `on_store_error: local`: while the store cannot be reached, each replica admits within its share
//! of each rate limit, from memory (the distributed rate-limiting design's default degraded mode).
//!
//! A replica's share of a scope is `limit × factor ÷ replicas`, for both its token bucket and its
//! request bucket (capacity and refill alike). The replicas count themselves through the store
//! while it is up ([`Admission::heartbeat`](super::Admission::heartbeat)); while it is down the
//! last count stands. So the replicas together admit at most `factor` of each rate limit, as long
//! as the count is right; a replica that started during the outage counts itself alone, and admits
//! as if it were. A daily token budget gets the same share of what the store last said it had
//! left (of the whole budget on a day the store has not spoken of), and what this replica admits
//! locally counts against it for the rest of the day, outage after outage. What local admission
//! does not enforce: concurrency slots, monthly and money budgets and pools (they need the store's
//! shared state), and output beyond the hold (an unmetered request is never committed, so its
//! hold, prompt plus ceiling, is what it is charged here). A scope's buckets start full at its
//! first local admission and refill at the share's rate between outages, so a store that flaps
//! never hands out a fresh burst each time it answers; nothing learned locally is written back (as
//! that design has it: counters are never repaired by hand).
//!
//! Memory is bounded: past [`MAX_BUCKETS`] scopes, those whose buckets have refilled to full are
//! forgotten (they would start full again: nothing is lost); should that not make room, every
//! scope is, and from then on a scope this replica does not know starts empty, never with a fresh
//! burst or a fresh budget.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::hold::budget::TOKENS_PER_DAY;
use crate::hold::{Bucket, DAY_MS, Refusal, ScopeLimits};

/// Scopes whose local state is kept at most (buckets, and budgets apart).
pub const MAX_BUCKETS: usize = 100_000;

/// One scope's local buckets, and their capacities (to tell when they have refilled).
#[derive(Debug, Clone, Copy)]
struct Buckets {
    tokens: f64,
    requests: f64,
    at: Instant,
    full: Share,
}

impl Buckets {
    fn refilled(self, now: Instant) -> Buckets {
        let ms = now.saturating_duration_since(self.at).as_secs_f64() * 1000.0;
        Buckets {
            tokens: (self.tokens + ms * self.full.tokens_per_ms).min(self.full.token_capacity),
            requests: (self.requests + ms * self.full.requests_per_ms).min(self.full.request_capacity),
            at: now,
            full: self.full,
        }
    }

    fn is_full(self) -> bool {
        self.tokens >= self.full.token_capacity && self.requests >= self.full.request_capacity
    }
}

/// One scope's daily budget, as this replica knows it.
#[derive(Debug, Clone, Copy, Default)]
struct DayBudget {
    /// The day (UTC days since the epoch) the figures below are of.
    day: u64,
    /// What the store last said the budget had left that day.
    store_left: Option<u64>,
    /// Tokens this replica admitted locally against it that day.
    spent: f64,
}

/// What the local share of one scope allows.
#[derive(Debug, Clone, Copy, Default)]
struct Share {
    token_capacity: f64,
    tokens_per_ms: f64,
    request_capacity: f64,
    requests_per_ms: f64,
}

impl Share {
    #[allow(clippy::cast_precision_loss)]
    fn of(limits: &ScopeLimits, share: f64) -> Share {
        let capacity = |b: Option<Bucket>| b.map_or(0.0, |b| b.capacity.get() as f64 * share);
        let per_ms = |b: Option<Bucket>| b.map_or(0.0, |b| b.per_ms * share);
        Share {
            token_capacity: capacity(limits.tokens),
            tokens_per_ms: per_ms(limits.tokens),
            request_capacity: capacity(limits.requests),
            requests_per_ms: per_ms(limits.requests),
        }
    }
}

/// A local refusal: the scope (its index in the request's scopes), why, and when to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalRefusal {
    pub scope: usize,
    pub reason: Refusal,
    pub retry_after_ms: u64,
}

/// This replica's local buckets and budgets, and its count of the replicas.
#[derive(Debug)]
pub struct LocalLimits {
    factor: f64,
    replicas: AtomicU64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    buckets: HashMap<String, Buckets>,
    budgets: HashMap<String, DayBudget>,
    /// Scopes had to be forgotten while not full: one this replica does not know starts empty.
    forgetful: bool,
}

impl State {
    /// Makes room for one more scope: forgets the buckets that have refilled to full and the
    /// budgets of past days, and failing that, everything (then unknown scopes start empty).
    fn make_room(&mut self, now: Instant, today: u64) {
        if self.buckets.len() >= MAX_BUCKETS {
            self.buckets.retain(|_, b| !b.refilled(now).is_full());
            if self.buckets.len() >= MAX_BUCKETS / 2 {
                self.buckets.clear();
                self.forgetful = true;
            }
        }
        if self.budgets.len() >= MAX_BUCKETS {
            self.budgets.retain(|_, b| b.day >= today);
            if self.budgets.len() >= MAX_BUCKETS / 2 {
                self.budgets.clear();
                self.forgetful = true;
            }
        }
    }
}

impl LocalLimits {
    pub fn new(factor: f64) -> Self {
        LocalLimits { factor, replicas: AtomicU64::new(1), state: Mutex::new(State::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What the store said each scope's daily budget has left, on day `day` (its answer to a
    /// reserve): `(scope key, left)`, under one lock for the decision.
    pub fn saw_budgets<'k>(&self, day: u64, seen: impl IntoIterator<Item = (&'k str, u64)>) {
        let mut state = self.lock();
        for (key, left) in seen {
            if let Some(b) = state.budgets.get_mut(key) {
                if b.day != day {
                    *b = DayBudget { day, ..DayBudget::default() };
                }
                b.store_left = Some(left);
                continue;
            }
            state.make_room(Instant::now(), day);
            state.budgets.insert(key.to_string(), DayBudget { day, store_left: Some(left), spent: 0.0 });
        }
    }

    /// The replicas last counted through the store (1 until the first count).
    pub fn replicas(&self) -> u64 {
        self.replicas.load(Ordering::Relaxed)
    }

    /// A count of the replicas, from a heartbeat.
    pub fn counted(&self, replicas: u64) {
        self.replicas.store(replicas.max(1), Ordering::Relaxed);
    }

    /// Admits `tokens` against every scope's local share, all or nothing. `now_ms` is the wall
    /// clock (UTC ms), for the day a budget is counted in.
    #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    pub fn admit<'a>(
        &self,
        scopes: impl Iterator<Item = (&'a str, &'a ScopeLimits)> + Clone,
        tokens: u64,
        now: Instant,
        now_ms: u64,
    ) -> Result<(), LocalRefusal> {
        let share = self.factor / self.replicas() as f64;
        let today = now_ms / DAY_MS;
        let mut state = self.lock();
        state.make_room(now, today);
        let forgetful = state.forgetful;
        let wait = |deficit: f64, per_ms: f64| if per_ms > 0.0 { (deficit / per_ms).ceil() as u64 } else { u64::MAX };
        let mut passed = Vec::new();
        for (scope, (key, limits)) in scopes.clone().enumerate() {
            let s = Share::of(limits, share);
            let start = if forgetful { 0.0 } else { 1.0 };
            let b = state
                .buckets
                .get(key)
                .map_or(
                    Buckets {
                        tokens: s.token_capacity * start,
                        requests: s.request_capacity * start,
                        at: now,
                        full: s,
                    },
                    |b| Buckets { full: s, ..*b },
                )
                .refilled(now);
            if !state.buckets.contains_key(key) && (limits.tokens.is_some() || limits.requests.is_some()) {
                // Known from now on, refused or not: an empty start refills from here.
                state.buckets.insert(key.to_string(), b);
            }
            if limits.tokens.is_some() && b.tokens < tokens as f64 {
                let retry_after_ms = wait(tokens as f64 - b.tokens, s.tokens_per_ms);
                return Err(LocalRefusal { scope, reason: Refusal::TokenRate, retry_after_ms });
            }
            if limits.requests.is_some() && b.requests < 1.0 {
                let retry_after_ms = wait(1.0 - b.requests, s.requests_per_ms);
                return Err(LocalRefusal { scope, reason: Refusal::RequestRate, retry_after_ms });
            }
            let budget = limits.budget(TOKENS_PER_DAY).map(|whole| {
                let known = state.budgets.get(key).copied().filter(|d| d.day == today);
                let d = known.unwrap_or(DayBudget { day: today, ..DayBudget::default() });
                // A day the store has not spoken of: the whole budget, unless scopes were forgotten.
                let left = d.store_left.unwrap_or(if forgetful { 0 } else { whole.get() });
                (d, left as f64 * share - d.spent)
            });
            if let Some((_, allowance)) = budget
                && allowance < tokens as f64
            {
                let retry_after_ms = DAY_MS.saturating_sub(now_ms % DAY_MS);
                return Err(LocalRefusal { scope, reason: Refusal::Budget(TOKENS_PER_DAY), retry_after_ms });
            }
            passed.push((key, limits, b, budget.map(|(d, _)| d)));
        }
        for (key, limits, mut b, budget) in passed {
            if limits.tokens.is_some() {
                b.tokens -= tokens as f64;
            }
            if limits.requests.is_some() {
                b.requests -= 1.0;
            }
            if limits.tokens.is_some() || limits.requests.is_some() {
                state.buckets.insert(key.to_string(), b);
            }
            if let Some(mut d) = budget {
                d.spent += tokens as f64;
                state.budgets.insert(key.to_string(), d);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU64;
    use std::time::Duration;

    use super::*;

    /// 2026-11-29T12:00:00Z.
    const NOON: u64 = 1_795_953_600_000;

    /// A scope's limits; 0 leaves a bucket out.
    fn limits(tokens_per_minute: u64, burst: u64, requests_per_minute: u64) -> ScopeLimits {
        let bucket = |capacity: u64, per_minute: u64| {
            NonZeroU64::new(capacity).map(|capacity| Bucket { capacity, per_ms: per_minute as f64 / 60_000.0 })
        };
        ScopeLimits {
            tokens: bucket(burst, tokens_per_minute),
            requests: bucket(requests_per_minute, requests_per_minute),
            ..ScopeLimits::default()
        }
    }

    #[test]
    fn each_replica_admits_its_share_of_the_burst_and_of_the_refill() {
        let local = LocalLimits::new(0.8);
        local.counted(2);
        let l = limits(60_000, 1_000, 0);
        let t0 = Instant::now();
        // 1,000 × 0.8 ÷ 2 = 400 tokens: four holds of 100.
        for i in 0..4 {
            assert_eq!(local.admit([("tenant", &l)].into_iter(), 100, t0, NOON), Ok(()), "hold {i}");
        }
        let refused = local.admit([("tenant", &l)].into_iter(), 100, t0, NOON).unwrap_err();
        // Refill 60,000/min × 0.4 = 0.4 tokens a ms: 100 tokens in 250 ms.
        assert_eq!((refused.reason, refused.retry_after_ms), (Refusal::TokenRate, 250));
        assert_eq!(local.admit([("tenant", &l)].into_iter(), 100, t0 + Duration::from_millis(250), NOON), Ok(()));
    }

    #[test]
    fn every_scope_must_pass_and_a_refusal_takes_nothing() {
        let local = LocalLimits::new(1.0);
        let (tenant, user) = (limits(600, 1_000, 0), limits(600, 150, 0));
        let t0 = Instant::now();
        let both = || [("tenant", &tenant), ("user", &user)].into_iter();
        assert_eq!(local.admit(both(), 100, t0, NOON), Ok(()));
        assert_eq!(local.admit(both(), 100, t0, NOON).unwrap_err().scope, 1, "the user's 50 left");
        // The tenant was not charged for the refused request: nine more of 100 fit its 900.
        for _ in 0..9 {
            assert_eq!(local.admit([("tenant", &tenant)].into_iter(), 100, t0, NOON), Ok(()));
        }
        assert!(local.admit([("tenant", &tenant)].into_iter(), 100, t0, NOON).is_err());
    }

    #[test]
    fn requests_are_counted_too_and_unset_limits_are_no_limit() {
        let local = LocalLimits::new(1.0);
        let l = limits(0, 0, 3);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(local.admit([("tenant", &l)].into_iter(), 1_000_000, t0, NOON), Ok(()));
        }
        let refused = local.admit([("tenant", &l)].into_iter(), 1, t0, NOON).unwrap_err();
        assert_eq!((refused.reason, refused.retry_after_ms), (Refusal::RequestRate, 20_000));
    }

    #[test]
    fn a_store_that_flaps_hands_out_no_fresh_burst() {
        let local = LocalLimits::new(0.5);
        let l = limits(600, 200, 0);
        let t0 = Instant::now();
        assert_eq!(local.admit([("tenant", &l)].into_iter(), 100, t0, NOON), Ok(()));
        assert!(local.admit([("tenant", &l)].into_iter(), 100, t0, NOON).is_err());
        // The store answered a heartbeat, then failed again: the bucket is where it was.
        local.counted(1);
        assert!(local.admit([("tenant", &l)].into_iter(), 100, t0, NOON).is_err(), "no burst handed out anew");
        // It refills at the share's rate (600/min x 0.5 = 5 tokens a second): 100 in 20 s.
        assert_eq!(local.admit([("tenant", &l)].into_iter(), 100, t0 + Duration::from_secs(20), NOON), Ok(()));
    }

    fn budget(tokens_per_day: u64) -> ScopeLimits {
        let mut budgets = crate::hold::BudgetLimits::default();
        budgets[TOKENS_PER_DAY.index()] = tokens_per_day;
        ScopeLimits { budgets, ..ScopeLimits::default() }
    }

    #[test]
    fn a_budget_gets_a_share_of_what_the_store_said_remains() {
        let local = LocalLimits::new(1.0);
        local.counted(2);
        let l = budget(10_000);
        let t0 = Instant::now();
        local.saw_budgets(NOON / DAY_MS, [("tenant", 1_000)]);
        // Half of the 1,000 left: five holds of 100.
        for i in 0..5 {
            assert_eq!(local.admit([("tenant", &l)].into_iter(), 100, t0, NOON), Ok(()), "hold {i}");
        }
        let refused = local.admit([("tenant", &l)].into_iter(), 100, t0, NOON).unwrap_err();
        assert_eq!(
            (refused.reason, refused.retry_after_ms),
            (Refusal::Budget(TOKENS_PER_DAY), 12 * 3_600_000),
            "until midnight"
        );
        // The store, which never sees local admissions, says the same again: still spent.
        local.saw_budgets(NOON / DAY_MS, [("tenant", 1_000)]);
        assert!(local.admit([("tenant", &l)].into_iter(), 100, t0, NOON).is_err(), "spent stays spent that day");
        // A new day the store has not spoken of: half the whole budget.
        let tomorrow = NOON + DAY_MS;
        for _ in 0..50 {
            assert_eq!(local.admit([("tenant", &l)].into_iter(), 100, t0, tomorrow), Ok(()));
        }
        assert!(local.admit([("tenant", &l)].into_iter(), 100, t0, tomorrow).is_err());
    }

    /// Past its bound on scopes, a replica forgets only what it loses nothing by forgetting
    /// (buckets refilled to full), and otherwise starts unknown scopes empty: never a fresh burst.
    #[test]
    fn a_forgotten_scope_comes_back_empty_never_with_a_fresh_burst() {
        let l = limits(600, 100, 0);
        let t0 = Instant::now();
        let full = LocalLimits::new(1.0);
        for i in 0..MAX_BUCKETS {
            full.admit([(format!("s{i}").as_str(), &l)].into_iter(), 1, t0, NOON).unwrap();
        }
        // 10 s later every one has refilled: forgotten at no cost, and a new scope starts full.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(full.admit([("new", &l)].into_iter(), 100, later, NOON), Ok(()));
        assert!(!full.lock().forgetful);

        let busy = LocalLimits::new(1.0);
        for i in 0..MAX_BUCKETS {
            busy.admit([(format!("s{i}").as_str(), &l)].into_iter(), 100, t0, NOON).unwrap();
        }
        // Every scope spent: none can be forgotten for free. A scope it no longer knows (the
        // first one, "s0", included) starts empty, refilling at its rate (10 tokens a second).
        let refused = busy.admit([("s0", &l)].into_iter(), 100, t0, NOON).unwrap_err();
        assert_eq!((refused.reason, refused.retry_after_ms), (Refusal::TokenRate, 10_000), "empty, not full");
        assert_eq!(busy.admit([("s0", &l)].into_iter(), 100, t0 + Duration::from_secs(10), NOON), Ok(()));
    }
}
