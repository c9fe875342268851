//! A replica's slice of one scope: what it holds free, what it took, what the store refused.

use std::collections::BTreeMap;
use std::num::NonZeroU64;

use super::super::plan::ScopeOf;
use crate::config::Limits;
use crate::hold::budget::{TOKENS_PER_DAY, TOKENS_PER_MONTH};
use crate::hold::{Amounts, Refusal, ScopeLimits};
use crate::store::{Earlier, LeaseScope};

#[derive(Debug, Clone)]
pub(super) struct Slice {
    /// Which limits of the tenant's policy this scope keeps.
    pub(super) of: ScopeOf,
    /// Sent with every call for this scope: the policy's, as of the last reload.
    pub(super) limits: ScopeLimits,
    /// The policy no longer limits this scope: the slice covers nothing, and every call gives
    /// back all it holds.
    pub(super) retired: bool,
    /// Free tokens and money (nanos), drawn on `day`; negative: debt the replica's holds ran up,
    /// charged at the next call.
    pub(super) tokens: i64,
    pub(super) cost: i64,
    pub(super) day: u64,
    /// Refunds of holds drawn on a day before `day`, by month (with the latest such day): they go
    /// back to the bucket and to that month's usage while it is the store's current one, a month a
    /// call. (Never to a day's usage: the store has passed those days when a slice turns.)
    pub(super) earlier: BTreeMap<u64, (u64, Spend)>,
    /// Refunds beyond what the slice may hold free (`cap`): given back with the next call, never
    /// spent here, so that what a replica can spend unseen stays within its share.
    pub(super) surplus: Spend,
    /// Charged to the scope today by the next call: what this replica's holds used of what the
    /// scope does not lease (tokens of a scope with only a budget in money, money of one without),
    /// counted in its usage as a store hold counts it, so a budget a reload adds starts from the
    /// usage there was; and debt run up once the slice's day has passed, which is today's.
    pub(super) charge_today: Spend,
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

/// Tokens and what they cost (nanos): what a hold takes from a slice, or gives back to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Spend {
    pub(super) tokens: u64,
    pub(super) cost: u64,
}

/// What a hold took from one slice, in each amount the slice leases (`None`: the slice does not
/// lease it, so the hold's use of it is counted, not drawn). Fixed when the hold is taken: a reload
/// that changes what the scope limits changes nothing a hold already took.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Taken {
    pub(super) tokens: Option<u64>,
    pub(super) cost: Option<u64>,
}

impl Taken {
    /// `s` split into what this hold took from the slice's own amounts and what it did not.
    fn split(self, s: Spend) -> (Spend, Spend) {
        let part = |took: Option<u64>, n: u64, leased: bool| if took.is_some() == leased { n } else { 0 };
        (
            Spend { tokens: part(self.tokens, s.tokens, true), cost: part(self.cost, s.cost, true) },
            Spend { tokens: part(self.tokens, s.tokens, false), cost: part(self.cost, s.cost, false) },
        )
    }
}

impl Spend {
    /// What a hold of `hold` tokens, `prompt` of them input, takes at `price`: its tokens, and
    /// what they may cost.
    pub(super) fn of_hold(price: crate::config::Price, hold: u64, prompt: u64) -> Spend {
        let output = hold.saturating_sub(prompt);
        Spend { tokens: hold, cost: crate::admission::plan::cost_of(price, prompt, output) }
    }

    pub(super) fn add(self, other: Spend) -> Spend {
        Spend { tokens: self.tokens.saturating_add(other.tokens), cost: self.cost.saturating_add(other.cost) }
    }

    pub(super) fn is_zero(self) -> bool {
        self == Spend::default()
    }

    /// What `self` has beyond `other`, in each amount (never below zero).
    pub(super) fn beyond(self, other: Spend) -> Spend {
        Spend { tokens: self.tokens.saturating_sub(other.tokens), cost: self.cost.saturating_sub(other.cost) }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Blocked {
    /// Until when the refusal is answered from memory: its wait, or one window, whichever is less.
    pub(super) until: u64,
    /// When the store said the request could fit: what a refusal from memory tells the client.
    pub(super) retry_at: u64,
    pub(super) reason: Refusal,
    /// The wait the store said (ms), which says what kind of wait it is (a concurrency wait at
    /// the back-off is one nobody could predict).
    pub(super) told_ms: u64,
}

impl Slice {
    /// An empty slice of the scope `of`, under `limits` (`None`: the policy no longer limits it).
    pub(super) fn new(of: ScopeOf, limits: Option<&Limits>, day: u64, share: f64) -> Self {
        let mut slice = Slice {
            of,
            limits: ScopeLimits::default(),
            retired: false,
            tokens: 0,
            cost: 0,
            day,
            earlier: BTreeMap::new(),
            surplus: Spend::default(),
            charge_today: Spend::default(),
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
        self.retired = limits.is_none();
        if let Some(limits) = limits {
            self.limits = ScopeLimits::from(limits);
        }
        self.cap = if self.retired { Amounts::default() } else { self.share_cap(share) };
        let (tokens, excess) = beyond(self.tokens, self.cap.tokens);
        self.tokens = tokens;
        self.surplus.tokens = self.surplus.tokens.saturating_add(excess);
        let (cost, excess) = beyond(self.cost, self.cap.cost);
        self.cost = cost;
        self.surplus.cost = self.surplus.cost.saturating_add(excess);
        let excess = self.requests.saturating_sub(self.cap.requests);
        self.requests = self.requests.saturating_sub(excess);
        self.surplus_requests = self.surplus_requests.saturating_add(excess);
        self.slots_free = self.slots_free.min(self.cap.slots);
        self.blocked = None;
    }

    pub(super) fn limits_tokens(&self) -> bool {
        let l = &self.limits;
        l.tokens.is_some() || l.budget(TOKENS_PER_DAY).is_some() || l.budget(TOKENS_PER_MONTH).is_some()
    }

    pub(super) fn limits_cost(&self) -> bool {
        self.limits.tightest_cost().is_some()
    }

    pub(super) fn limits_requests(&self) -> bool {
        self.limits.requests.is_some()
    }

    pub(super) fn limits_slots(&self) -> bool {
        self.limits.max_concurrency.is_some()
    }

    pub(super) fn covers(&self, hold: Spend) -> bool {
        !self.retired
            && (!self.limits_tokens() || self.tokens >= signed(hold.tokens))
            && (!self.limits_cost() || self.cost >= signed(hold.cost))
            && (!self.limits_requests() || self.requests >= 1)
            && (!self.limits_slots() || self.slots_free >= 1)
    }

    pub(super) fn take(&mut self, hold: Spend) -> Taken {
        let mut took = Taken::default();
        if self.limits_tokens() {
            self.tokens = self.tokens.saturating_sub(signed(hold.tokens));
            self.taken.tokens = self.taken.tokens.saturating_add(hold.tokens);
            took.tokens = Some(hold.tokens);
        }
        if self.limits_cost() {
            self.cost = self.cost.saturating_sub(signed(hold.cost));
            self.taken.cost = self.taken.cost.saturating_add(hold.cost);
            took.cost = Some(hold.cost);
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
        took
    }

    /// Settles what a hold took (`took`, drawn on `day`) against what it uses now (`used`), given
    /// what it had charged of the amounts the slice leases (`charged`: what it took, or nothing
    /// once refunded) and counted of the others (`counted`): each leased amount's difference comes
    /// back or is debt; use of the others beyond what was counted is counted. `today`: the store's
    /// day as this replica places it.
    pub(super) fn settle(&mut self, took: Taken, charged: Spend, counted: Spend, used: Spend, day: u64, today: u64) {
        let (charged_here, _) = took.split(charged);
        let (used_here, used_elsewhere) = took.split(used);
        let (_, counted_elsewhere) = took.split(counted);
        self.refund(charged_here.beyond(used_here), day);
        let debt = used_here.beyond(charged_here);
        if today == self.day {
            // Paid from what the slice holds free, which is this day's too.
            self.overrun(debt);
        } else {
            self.charge_today = self.charge_today.add(debt);
        }
        // What the scope does not lease: use beyond what was counted (by an expiry that charged
        // the hold) is counted today; what was counted and not used comes off its day's usage.
        self.charge_today = self.charge_today.add(used_elsewhere.beyond(counted_elsewhere));
        self.refund(counted_elsewhere.beyond(used_elsewhere), day);
    }

    /// Tokens and money back from a hold drawn on `day`.
    fn refund(&mut self, back: Spend, day: u64) {
        if back.is_zero() {
            return;
        }
        if day != self.day {
            self.set_aside(day, back);
            return;
        }
        let room = |free: i64, cap: u64| unsigned(signed(cap).saturating_sub(free));
        let kept = Spend {
            tokens: back.tokens.min(room(self.tokens, self.cap.tokens)),
            cost: back.cost.min(room(self.cost, self.cap.cost)),
        };
        self.tokens = self.tokens.saturating_add(signed(kept.tokens));
        self.cost = self.cost.saturating_add(signed(kept.cost));
        self.surplus = self.surplus.add(back.beyond(kept));
    }

    /// A refund of a hold drawn on an earlier `day`, set aside for its month.
    fn set_aside(&mut self, day: u64, back: Spend) {
        let e = self.earlier.entry(crate::hold::month_of(day)).or_insert((day, Spend::default()));
        *e = (e.0.max(day), e.1.add(back));
    }

    /// Usage beyond a hold: debt, given to the store with the next call.
    fn overrun(&mut self, beyond: Spend) {
        self.tokens = self.tokens.saturating_sub(signed(beyond.tokens));
        self.cost = self.cost.saturating_sub(signed(beyond.cost));
    }

    pub(super) fn free_slot(&mut self) {
        if self.limits_slots() && self.slots_used > 0 {
            self.slots_used = self.slots_used.saturating_sub(1);
            self.slots_free = self.slots_free.saturating_add(1);
        }
    }

    /// The store's answer placed the slice in a new day: what it holds free of the old one (and
    /// what came back to it while the call was on its way) goes back to that day with the next
    /// call, never spent in the new one.
    pub(super) fn turn_day(&mut self, day: u64) {
        if day == self.day {
            return;
        }
        let free = Spend { tokens: unsigned(self.tokens), cost: unsigned(self.cost) };
        let back = free.add(std::mem::take(&mut self.surplus));
        if !back.is_zero() {
            self.set_aside(self.day, back);
        }
        self.tokens = self.tokens.min(0);
        self.cost = self.cost.min(0);
        self.day = day;
    }

    /// What a lease call given up unanswered charged (its debt, the usage it counted), charged
    /// again with the next call: counted twice if it ran, never lost.
    pub(super) fn charge_again(&mut self, call: &LeaseScope) {
        let debt = |back: i64| unsigned(back.saturating_neg());
        let again = Spend {
            tokens: debt(call.back_tokens).saturating_add(call.charge_tokens),
            cost: debt(call.back_cost).saturating_add(call.charge_cost),
        };
        self.charge_today = self.charge_today.add(again);
    }

    /// Anything to give back to the store: free amounts, refunds set aside, debt.
    pub(super) fn owes(&self) -> bool {
        self.tokens != 0
            || self.cost != 0
            || self.requests > 0
            || self.slots_free > 0
            || !self.earlier.is_empty()
            || !self.surplus.is_zero()
            || !self.charge_today.is_zero()
            || self.surplus_requests > 0
    }

    /// This slice's part of a lease call: gives back what is free beyond `target` (all of it when
    /// the slice is of a day before `today`), with the refunds set aside and the debt, states the
    /// slots held, and asks for `target` again, at least what `asking` needs beyond what it keeps.
    /// What it gives back leaves the slice now: the call carrying it goes again, as it was, until
    /// its answer is in hand.
    pub(super) fn ready(&mut self, key: &str, target: Amounts, asking: Option<Spend>, today: u64) -> LeaseScope {
        // Free tokens and money of another day go back to it; the new day draws its own.
        let same_day = self.day == today;
        let keep = |free: i64, target: u64| if same_day { free.clamp(0, signed(target)) } else { 0 };
        let keep_tokens = keep(self.tokens, target.tokens);
        let keep_cost = keep(self.cost, target.cost);
        let surplus = std::mem::take(&mut self.surplus);
        let back_tokens = self.tokens.saturating_sub(keep_tokens).saturating_add(signed(surplus.tokens));
        let back_cost = self.cost.saturating_sub(keep_cost).saturating_add(signed(surplus.cost));
        let keep_requests = self.requests.min(target.requests);
        let back_requests =
            self.requests.saturating_sub(keep_requests).saturating_add(std::mem::take(&mut self.surplus_requests));
        let keep_slots = self.slots_free.min(target.slots);
        let mut need = Amounts::default();
        if let Some(hold) = asking {
            if self.limits_tokens() {
                need.tokens = hold.tokens.saturating_sub(unsigned(keep_tokens));
            }
            if self.limits_cost() {
                need.cost = hold.cost.saturating_sub(unsigned(keep_cost));
            }
            need.requests = u64::from(self.limits_requests() && keep_requests == 0);
            need.slots = u64::from(self.limits_slots() && keep_slots == 0);
        }
        let want = Amounts {
            tokens: if self.limits_tokens() {
                target.tokens.saturating_sub(unsigned(keep_tokens)).max(need.tokens)
            } else {
                0
            },
            cost: if self.limits_cost() { target.cost.saturating_sub(unsigned(keep_cost)).max(need.cost) } else { 0 },
            requests: target.requests.saturating_sub(keep_requests).max(need.requests),
            slots: target.slots.saturating_sub(keep_slots).max(need.slots),
        };
        let back_earlier =
            self.earlier.pop_first().map(|(_, (day, s))| Earlier { day, tokens: s.tokens, cost: s.cost });
        let charged = std::mem::take(&mut self.charge_today);
        let scope = LeaseScope {
            key: key.to_string(),
            limits: self.limits,
            back_tokens,
            back_cost,
            back_day: self.day,
            back_earlier,
            charge_tokens: charged.tokens,
            charge_cost: charged.cost,
            back_requests,
            held_slots: self.slots_used.saturating_add(keep_slots),
            need,
            want,
        };
        self.tokens = keep_tokens;
        self.cost = keep_cost;
        self.requests = keep_requests;
        self.slots_free = keep_slots;
        scope
    }

    /// The most this slice may hold free: `share` of each capacity (at least one); 0 for what the
    /// scope does not limit.
    pub(super) fn share_cap(&self, share: f64) -> Amounts {
        let l = &self.limits;
        // Tokens are bounded by the bucket and the budgets, whichever is smallest.
        let tokens = [l.tokens.map(|b| b.capacity), l.budget(TOKENS_PER_DAY), l.budget(TOKENS_PER_MONTH)]
            .into_iter()
            .flatten()
            .min();
        let of = |n: Option<u64>| n.map_or(0, |n| share_of(n, share));
        Amounts {
            tokens: of(tokens.map(NonZeroU64::get)),
            cost: of(l.tightest_cost()),
            requests: of(l.requests.map(|b| b.capacity.get())),
            slots: of(l.max_concurrency.map(NonZeroU64::get)),
        }
    }

    /// What this slice should hold free after the next call: twice what it took in its busier
    /// recent window, within its share.
    pub(super) fn target(&self, share: f64) -> Amounts {
        let recent = |now: u64, before: u64| now.max(before).saturating_mul(2);
        let cap = if self.retired { Amounts::default() } else { self.share_cap(share) };
        Amounts {
            tokens: recent(self.taken.tokens, self.taken_before.tokens).min(cap.tokens),
            cost: recent(self.taken.cost, self.taken_before.cost).min(cap.cost),
            requests: recent(self.taken.requests, self.taken_before.requests).min(cap.requests),
            slots: recent(self.taken.slots, self.taken_before.slots).min(cap.slots),
        }
    }
}

/// What of `free` a slice keeps within `cap`, and the excess set aside (debt is kept whole).
fn beyond(free: i64, cap: u64) -> (i64, u64) {
    let excess = unsigned(free.saturating_sub(signed(cap)));
    (free.saturating_sub(signed(excess)), excess)
}

/// What is free of an amount that may be debt: 0 for debt.
fn unsigned(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
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
