//! Tenants short of concurrency slots, as this replica's reserves found them: their commits from
//! responses go within the short window (see `batch.rs`), so that a request of theirs at another
//! replica does not meet a slot a commit waiting here still holds.
//!
//! A tenant is short of slots for [`SHORT_FOR`] after a reserve here found it with fewer than
//! [`SHORT_OF_SLOTS`] left in its tightest scope (as many as one batch of commits carries), or
//! was refused one, until a reserve finds it with more. Every reserve looks, so the tenants kept
//! have a lock of their own, and a flag spares it while none is kept.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::batch::{MOST, later};

/// A tenant a reserve here found with fewer concurrency slots left than this (in its tightest
/// scope) is short of them: as many commits as one batch carries could hold the rest.
pub(super) const SHORT_OF_SLOTS: u64 = MOST as u64;

/// How long a tenant stays short of slots after a reserve here found it so, unless a later one
/// finds it with slots to spare.
const SHORT_FOR: Duration = Duration::from_secs(10);

/// Tenants kept short of slots before those whose time has passed are forgotten.
const SHORT_KEPT: usize = 1_024;

/// Tenants short of concurrency slots, until when, and when those whose time has passed go next.
#[derive(Default)]
struct Kept {
    until: HashMap<String, Instant>,
    next_prune: Option<Instant>,
}

/// The tenants short of concurrency slots (see the module's doc).
#[derive(Default)]
pub(super) struct ShortOfSlots {
    kept: Mutex<Kept>,
    any: AtomicBool,
}

impl ShortOfSlots {
    /// What a reserve of `tenant` here found: the fewest concurrency slots its scopes have left
    /// (`None`: no scope caps them). True when the tenant has just become short: the commits
    /// already waiting are then hurried too ([`super::Admission::hurry_commits`]). Those whose
    /// time has passed are forgotten every [`SHORT_FOR`], and at most [`SHORT_KEPT`] are kept
    /// (past that, every one: all forgotten, their commits wait their window until a reserve here
    /// finds them short again).
    pub(super) fn saw(&self, tenant: &str, slots_left: Option<u64>) -> bool {
        let short = slots_left.is_some_and(|n| n < SHORT_OF_SLOTS);
        if !short && !self.any.load(Ordering::Acquire) {
            return false;
        }
        let mut became_short = false;
        let now = Instant::now();
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.next_prune.is_none_or(|at| at <= now) {
            kept.until.retain(|_, until| *until > now);
            kept.next_prune = Some(later(now, SHORT_FOR));
        }
        if short {
            // (A tenant kept already: its time moved on, no key made again for each reserve.)
            if let Some(until) = kept.until.get_mut(tenant) {
                became_short = *until <= now;
                *until = later(now, SHORT_FOR);
            } else {
                if kept.until.len() >= SHORT_KEPT {
                    kept.until.retain(|_, until| *until > now);
                    if kept.until.len() >= SHORT_KEPT {
                        kept.until.clear();
                    }
                }
                kept.until.insert(tenant.to_string(), later(now, SHORT_FOR));
                became_short = true;
            }
        } else {
            kept.until.remove(tenant);
        }
        self.any.store(!kept.until.is_empty(), Ordering::Release);
        became_short
    }

    /// Whether `tenant` is short of slots.
    pub(super) fn is_short(&self, tenant: &str) -> bool {
        self.any.load(Ordering::Acquire)
            && self
                .kept
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .until
                .get(tenant)
                .is_some_and(|&until| Instant::now() < until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_found_with_slots_to_spare_again_is_no_longer_short_of_them() {
        let s = ShortOfSlots::default();
        s.saw("t", Some(0));
        assert!(s.is_short("t"));
        s.saw("t", Some(SHORT_OF_SLOTS));
        assert!(!s.is_short("t"));
        assert!(!s.any.load(Ordering::Acquire), "none kept: reserves take no lock");
    }

    #[tokio::test(start_paused = true)]
    async fn a_tenant_stays_short_of_slots_ten_seconds_then_is_forgotten() {
        let s = ShortOfSlots::default();
        s.saw("t", Some(0));
        tokio::time::advance(SHORT_FOR - Duration::from_millis(1)).await;
        assert!(s.is_short("t"));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!s.is_short("t"), "ten seconds on");
        s.saw("another", None);
        assert!(!s.any.load(Ordering::Acquire), "forgotten: reserves take no lock again");
    }

    #[tokio::test(start_paused = true)]
    async fn a_tenant_becomes_short_when_it_was_not_or_its_time_had_passed() {
        let s = ShortOfSlots::default();
        assert!(!s.saw("t", Some(SHORT_OF_SLOTS)), "slots to spare");
        assert!(s.saw("t", Some(0)), "became short");
        let half = SHORT_FOR / 2;
        tokio::time::advance(half).await;
        assert!(!s.saw("t", Some(0)), "short already: its time moves on");
        tokio::time::advance(half).await;
        // (Ten seconds from the first: the prune keeps it, its time not passed.)
        s.saw("other", Some(0));
        tokio::time::advance(half).await;
        assert!(!s.is_short("t"), "its time has passed, though it is kept until the next prune");
        assert!(s.saw("t", Some(0)), "became short again");
        tokio::time::advance(SHORT_FOR * 2).await;
        assert!(s.saw("t", Some(0)), "forgotten, then short again");
    }

    #[test]
    fn tenants_kept_short_of_slots_are_bounded() {
        let s = ShortOfSlots::default();
        for n in 0..SHORT_KEPT {
            s.saw(&format!("t{n}"), Some(0));
        }
        s.saw("t0", Some(1));
        assert_eq!(s.kept.lock().unwrap().until.len(), SHORT_KEPT, "one already kept: kept again");
        s.saw("one more", Some(0));
        assert_eq!(s.kept.lock().unwrap().until.len(), 1, "every one still short: forgotten but the newest");
        assert!(s.is_short("one more"));
    }
}
