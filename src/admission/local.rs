//! `on_store_error: local`: while the store cannot be reached, each replica admits within its share
//! of each rate limit, from memory (the distributed rate-limiting design's default degraded mode).
//!
//! A replica's share of a scope is `limit × factor ÷ replicas`, for both its token bucket and its
//! request bucket (capacity and refill alike). The replicas count themselves through the store
//! while it is up ([`Admission::heartbeat`](super::Admission::heartbeat)); while it is down the
//! last count stands. So the replicas together admit at most `factor` of each rate limit, as long
//! as the count is right; a replica that started during the outage counts itself alone, and admits
//! as if it were. What local admission does not enforce: concurrency slots, daily budgets and
//! pools (they need the store's shared state), and output beyond the hold (an unmetered request is
//! never committed, so its hold, prompt plus ceiling, is what it is charged here). A scope's buckets
//! start full at its first local admission and refill at the share's rate between outages, so a
//! store that flaps never hands out a fresh burst each time it answers; nothing learned locally is
//! written back (as that design has it: counters are never repaired by hand).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::hold::{Bucket, Refusal, ScopeLimits};

/// Local buckets kept at most; past it, all are dropped and start full again (a bound on memory
/// under many tenants, at the cost of one refill's worth of admission).
const MAX_BUCKETS: usize = 100_000;

/// One scope's local buckets.
#[derive(Debug, Clone, Copy)]
struct Buckets {
    tokens: f64,
    requests: f64,
    at: Instant,
}

/// What the local share of one scope allows.
#[derive(Debug, Clone, Copy)]
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

/// This replica's local buckets, and its count of the replicas.
#[derive(Debug)]
pub struct LocalLimits {
    factor: f64,
    replicas: AtomicU64,
    buckets: Mutex<HashMap<String, Buckets>>,
}

impl LocalLimits {
    pub fn new(factor: f64) -> Self {
        LocalLimits { factor, replicas: AtomicU64::new(1), buckets: Mutex::new(HashMap::new()) }
    }

    /// The replicas last counted through the store (1 until the first count).
    pub fn replicas(&self) -> u64 {
        self.replicas.load(Ordering::Relaxed)
    }

    /// A count of the replicas, from a heartbeat.
    pub fn counted(&self, replicas: u64) {
        self.replicas.store(replicas.max(1), Ordering::Relaxed);
    }

    /// Admits `tokens` against every scope's local share, all or nothing.
    #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    pub fn admit<'a>(
        &self,
        scopes: impl Iterator<Item = (&'a str, &'a ScopeLimits)> + Clone,
        tokens: u64,
        now: Instant,
    ) -> Result<(), LocalRefusal> {
        let share = self.factor / self.replicas() as f64;
        let mut all = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if all.len() >= MAX_BUCKETS {
            all.clear();
        }
        let wait = |deficit: f64, per_ms: f64| if per_ms > 0.0 { (deficit / per_ms).ceil() as u64 } else { u64::MAX };
        let mut refilled = Vec::new();
        for (scope, (key, limits)) in scopes.clone().enumerate() {
            let s = Share::of(limits, share);
            let b = all.get(key).copied().unwrap_or(Buckets {
                tokens: s.token_capacity,
                requests: s.request_capacity,
                at: now,
            });
            let ms = now.saturating_duration_since(b.at).as_secs_f64() * 1000.0;
            let b = Buckets {
                tokens: (b.tokens + ms * s.tokens_per_ms).min(s.token_capacity),
                requests: (b.requests + ms * s.requests_per_ms).min(s.request_capacity),
                at: now,
            };
            if limits.tokens.is_some() && b.tokens < tokens as f64 {
                let retry_after_ms = wait(tokens as f64 - b.tokens, s.tokens_per_ms);
                return Err(LocalRefusal { scope, reason: Refusal::TokenRate, retry_after_ms });
            }
            if limits.requests.is_some() && b.requests < 1.0 {
                let retry_after_ms = wait(1.0 - b.requests, s.requests_per_ms);
                return Err(LocalRefusal { scope, reason: Refusal::RequestRate, retry_after_ms });
            }
            refilled.push((key, limits, b));
        }
        for (key, limits, mut b) in refilled {
            if limits.tokens.is_some() {
                b.tokens -= tokens as f64;
            }
            if limits.requests.is_some() {
                b.requests -= 1.0;
            }
            all.insert(key.to_string(), b);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU64;
    use std::time::Duration;

    use super::*;

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
            assert_eq!(local.admit([("tenant", &l)].into_iter(), 100, t0), Ok(()), "hold {i}");
        }
        let refused = local.admit([("tenant", &l)].into_iter(), 100, t0).unwrap_err();
        // Refill 60,000/min × 0.4 = 0.4 tokens a ms: 100 tokens in 250 ms.
        assert_eq!((refused.reason, refused.retry_after_ms), (Refusal::TokenRate, 250));
        assert_eq!(local.admit([("tenant", &l)].into_iter(), 100, t0 + Duration::from_millis(250)), Ok(()));
    }

    #[test]
    fn every_scope_must_pass_and_a_refusal_takes_nothing() {
        let local = LocalLimits::new(1.0);
        let (tenant, user) = (limits(600, 1_000, 0), limits(600, 150, 0));
        let t0 = Instant::now();
        let both = || [("tenant", &tenant), ("user", &user)].into_iter();
        assert_eq!(local.admit(both(), 100, t0), Ok(()));
        assert_eq!(local.admit(both(), 100, t0).unwrap_err().scope, 1, "the user's 50 left");
        // The tenant was not charged for the refused request: nine more of 100 fit its 900.
        for _ in 0..9 {
            assert_eq!(local.admit([("tenant", &tenant)].into_iter(), 100, t0), Ok(()));
        }
        assert!(local.admit([("tenant", &tenant)].into_iter(), 100, t0).is_err());
    }

    #[test]
    fn requests_are_counted_too_and_unset_limits_are_no_limit() {
        let local = LocalLimits::new(1.0);
        let l = limits(0, 0, 3);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(local.admit([("tenant", &l)].into_iter(), 1_000_000, t0), Ok(()));
        }
        let refused = local.admit([("tenant", &l)].into_iter(), 1, t0).unwrap_err();
        assert_eq!((refused.reason, refused.retry_after_ms), (Refusal::RequestRate, 20_000));
    }

    #[test]
    fn a_store_that_flaps_hands_out_no_fresh_burst() {
        let local = LocalLimits::new(0.5);
        let l = limits(600, 200, 0);
        let t0 = Instant::now();
        assert_eq!(local.admit([("tenant", &l)].into_iter(), 100, t0), Ok(()));
        assert!(local.admit([("tenant", &l)].into_iter(), 100, t0).is_err());
        // The store answered a heartbeat, then failed again: the bucket is where it was.
        local.counted(1);
        assert!(local.admit([("tenant", &l)].into_iter(), 100, t0).is_err(), "no burst handed out anew");
        // It refills at the share's rate (600/min x 0.5 = 5 tokens a second): 100 in 20 s.
        assert_eq!(local.admit([("tenant", &l)].into_iter(), 100, t0 + Duration::from_secs(20)), Ok(()));
    }
}
