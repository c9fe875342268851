//! A replica's slice of one scope: what it holds free, what it took, what the store refused.

use std::num::NonZeroU64;

use crate::hold::{Amounts, Refusal, ScopeLimits};

#[derive(Debug, Clone)]
pub(super) struct Slice {
    pub(super) limits: ScopeLimits,
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
    pub(super) fn new(limits: ScopeLimits, day: u64, share: f64) -> Self {
        let mut slice = Slice {
            limits,
            tokens: 0,
            day,
            stale_refund: 0,
            surplus: 0,
            cap: Amounts::default(),
            requests: 0,
            slots_free: 0,
            slots_used: 0,
            taken: Amounts::default(),
            taken_before: Amounts::default(),
            blocked: None,
        };
        slice.cap = slice.share_cap(share);
        slice
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
        (!self.limits_tokens() || self.tokens >= signed(hold))
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
        let cap = self.share_cap(share);
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
