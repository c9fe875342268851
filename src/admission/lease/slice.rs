//! A replica's slice of one scope: what it holds free, what it took, what the store refused.

use std::num::NonZeroU64;

use super::super::plan::ScopeOf;
use crate::config::Limits;
use crate::hold::{Amounts, Refusal, ScopeLimits};

#[derive(Debug, Clone)]
pub(super) struct Slice {
    /// Which limits of the tenant's policy this scope keeps.
    pub(super) of: ScopeOf,
    /// Sent with every call for this scope: the policy's, as of the last reload.
    pub(super) limits: ScopeLimits,
    /// The policy no longer leases this scope (it does not limit it, or keeps a budget only the
    /// store decides): the slice covers nothing, and every call gives back all it holds.
    pub(super) retired: bool,
    /// Free tokens, drawn on `day`; negative: debt the replica's holds ran up, charged at the next call.
    pub(super) tokens: i64,
    pub(super) day: u64,
    /// Refunds of holds drawn on an earlier day than `day`: they go back to the bucket only.
    pub(super) stale_refund: u64,
    /// Refunds beyond what the slice may hold free (`cap`): given back with the next call, never
    /// spent here, so that what a replica can spend unseen stays within its share.
    pub(super) surplus: u64,
    /// The most this slice may hold free: `max_share` of each capacity.
    pub(super) cap: Amounts,
    pub(super) requests: u64,
    /// Permits beyond the cap a reload set: given back with the next call, never spent here.
    pub(super) surplus_requests: u64,
    pub(super) slots_free: u64,
    pub(super) slots_used: u64,
    /// Taken in this window and the one before: what the next draw is sized by.
    pub(super) taken: Amounts,
    pub(super) taken_before: Amounts,
    pub(super) blocked: Option<Blocked>,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Blocked {
    /// Until when the refusal is answered from memory: its wait, or one window, whichever is less.
    pub(super) until: u64,
    /// When the store said the request could fit: what a refusal from memory tells the client.
    pub(super) retry_at: u64,
    pub(super) reason: Refusal,
}

impl Slice {
    /// An empty slice of the scope `of`, under `limits` (`None`: the policy no longer limits it).
    pub(super) fn new(of: ScopeOf, limits: Option<&Limits>, day: u64, share: f64) -> Self {
        let mut slice = Slice {
            of,
            limits: ScopeLimits::default(),
            retired: false,
            tokens: 0,
            day,
            stale_refund: 0,
            surplus: 0,
            cap: Amounts::default(),
            requests: 0,
            surplus_requests: 0,
            slots_free: 0,
            slots_used: 0,
            taken: Amounts::default(),
            taken_before: Amounts::default(),
            blocked: None,
        };
        slice.retune(limits, share);
        slice
    }

    /// The policy's terms for this scope, from now on: its limits, its cap, and what the slice
    /// holds free beyond the cap set aside to give back with the next call (free slots beyond it
    /// are dropped: every call states the slots held, so the store frees them then).
    pub(super) fn retune(&mut self, limits: Option<&Limits>, share: f64) {
        self.retired = limits.is_none_or(Limits::has_long_budgets);
        if let Some(limits) = limits {
            self.limits = ScopeLimits::from(limits);
        }
        self.cap = if self.retired { Amounts::default() } else { self.share_cap(share) };
        let excess = self.tokens.saturating_sub(signed(self.cap.tokens)).max(0);
        self.tokens = self.tokens.saturating_sub(excess);
        self.surplus = self.surplus.saturating_add(u64::try_from(excess).unwrap_or(0));
        let excess = self.requests.saturating_sub(self.cap.requests);
        self.requests = self.requests.saturating_sub(excess);
        self.surplus_requests = self.surplus_requests.saturating_add(excess);
        self.slots_free = self.slots_free.min(self.cap.slots);
        self.blocked = None;
    }

    pub(super) fn limits_tokens(&self) -> bool {
        self.limits.tokens.is_some() || self.limits.daily_budget.is_some()
    }

    pub(super) fn limits_requests(&self) -> bool {
        self.limits.requests.is_some()
    }

    pub(super) fn limits_slots(&self) -> bool {
        self.limits.max_concurrency.is_some()
    }

    pub(super) fn covers(&self, hold: u64) -> bool {
        !self.retired
            && (!self.limits_tokens() || self.tokens >= signed(hold))
            && (!self.limits_requests() || self.requests >= 1)
            && (!self.limits_slots() || self.slots_free >= 1)
    }

    pub(super) fn take(&mut self, hold: u64) {
        if self.limits_tokens() {
            self.tokens = self.tokens.saturating_sub(signed(hold));
            self.taken.tokens = self.taken.tokens.saturating_add(hold);
        }
        if self.limits_requests() {
            self.requests = self.requests.saturating_sub(1);
            self.taken.requests = self.taken.requests.saturating_add(1);
        }
        if self.limits_slots() {
            self.slots_free = self.slots_free.saturating_sub(1);
            self.slots_used = self.slots_used.saturating_add(1);
            self.taken.slots = self.taken.slots.saturating_add(1);
        }
    }

    /// Tokens back from a hold drawn on `day`.
    pub(super) fn refund(&mut self, amount: u64, day: u64) {
        if !self.limits_tokens() || amount == 0 {
            return;
        }
        if day == self.day {
            let room = u64::try_from(signed(self.cap.tokens).saturating_sub(self.tokens)).unwrap_or(0);
            let kept = amount.min(room);
            self.tokens = self.tokens.saturating_add(signed(kept));
            self.surplus = self.surplus.saturating_add(amount.saturating_sub(kept));
        } else {
            self.stale_refund = self.stale_refund.saturating_add(amount);
        }
    }

    /// Usage beyond a hold: debt, given to the store with the next call.
    pub(super) fn overrun(&mut self, amount: u64) {
        if self.limits_tokens() {
            self.tokens = self.tokens.saturating_sub(signed(amount));
        }
    }

    pub(super) fn free_slot(&mut self) {
        if self.limits_slots() && self.slots_used > 0 {
            self.slots_used = self.slots_used.saturating_sub(1);
            self.slots_free = self.slots_free.saturating_add(1);
        }
    }

    /// The most this slice may hold free: `share` of each capacity (at least one); 0 for what the
    /// scope does not limit.
    pub(super) fn share_cap(&self, share: f64) -> Amounts {
        let l = &self.limits;
        // Tokens are bounded by the bucket and the day's budget, whichever is smaller.
        let tokens = [l.tokens.map(|b| b.capacity), l.daily_budget].into_iter().flatten().min();
        let share_of = |n: Option<NonZeroU64>| n.map_or(0, |n| share_of(n.get(), share));
        Amounts {
            tokens: share_of(tokens),
            requests: share_of(l.requests.map(|b| b.capacity)),
            slots: share_of(l.max_concurrency),
        }
    }

    /// What this slice should hold free after the next call: twice what it took in its busier
    /// recent window, within its share.
    pub(super) fn target(&self, share: f64) -> Amounts {
        let recent = |now: u64, before: u64| now.max(before).saturating_mul(2);
        let cap = if self.retired { Amounts::default() } else { self.share_cap(share) };
        Amounts {
            tokens: recent(self.taken.tokens, self.taken_before.tokens).min(cap.tokens),
            requests: recent(self.taken.requests, self.taken_before.requests).min(cap.requests),
            slots: recent(self.taken.slots, self.taken_before.slots).min(cap.slots),
        }
    }
}

/// `share` of `capacity`, at least 1.
// A share is in (0, 1] and a capacity at most 10^12 (validated): the product is finite and small.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
pub(super) fn share_of(capacity: u64, share: f64) -> u64 {
    ((capacity as f64 * share).floor() as u64).max(1)
}

/// Token counts are at most 10^9 per hold and slices far below 2^63: the conversion saturates.
pub(super) fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
