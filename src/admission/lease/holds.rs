//! The holds a replica admitted from its slices: live, and settled (remembered to answer a
//! repeated or late commit the way the store's retained records do).

use super::slice::{Spend, Taken};
use super::{Leases, State};
use crate::hold::{CommitOutcome, Counted, Detail, Ending, ReleaseOutcome, RenewOutcome, Settled, Usage};

/// Settled holds remembered per tenant, to answer a repeated commit or release the way the store's
/// retained records do; past this many, the oldest are forgotten (a repeat then finds nothing and
/// charges nothing).
const MAX_CLOSED: usize = 100_000;

#[derive(Debug, Clone)]
pub(super) struct LocalHold {
    /// The scopes it charged, each with what it took from the scope's slice.
    pub(super) scopes: Vec<(String, Taken)>,
    pub(super) held: u64,
    pub(super) prompt: u64,
    pub(super) day: u64,
    /// The hold's own terms, fixed when it was taken (a policy reload does not change them).
    pub(super) lease_until: u64,
    pub(super) refund_on_expiry: bool,
    pub(super) model: String,
    /// Who it is for, when it was made (this replica's clock) and its model's price: what its
    /// ledger entry says.
    pub(super) user: Option<String>,
    pub(super) tier: &'static str,
    pub(super) reserved_at: u64,
    pub(super) price: crate::config::Price,
    /// What its model's cached prompt tokens count, when a commit reports them.
    pub(super) token_weights: crate::config::TokenWeights,
}

impl LocalHold {
    /// What `prompt` and `output` tokens of this hold cost (nanos).
    fn cost(&self, prompt: u64, output: u64) -> u64 {
        crate::admission::plan::cost_of(self.price, prompt, output)
    }

    fn held_cost(&self) -> u64 {
        self.spend().cost
    }

    /// What the hold took from each slice.
    fn spend(&self) -> Spend {
        Spend::of_hold(self.price, self.held, self.prompt)
    }

    /// What `counted` charges this hold: tokens, and their cost.
    fn used(&self, counted: Counted) -> Spend {
        match counted {
            Counted::Exact { prompt, output, detail } => {
                let c = crate::hold::charge(self.price, self.token_weights, prompt, output, detail);
                Spend { tokens: c.tokens, cost: c.cost }
            }
            Counted::Metered { output } => {
                Spend { tokens: self.prompt.saturating_add(output), cost: self.cost(self.prompt, output) }
            }
            Counted::AsHeld => self.spend(),
        }
    }
}

/// How a leased hold settled, for its ledger entry.
pub(super) enum Entered {
    Committed { spent: Spend, counted: Counted, late: bool, ending: Ending },
    Released(Ending),
    Expired { charged: u64 },
}

#[derive(Debug, Clone)]
pub(super) enum Closed {
    Committed(Usage),
    Released {
        refunded: u64,
    },
    /// Expired; a late commit reconciles against `charged`.
    Expired {
        hold: LocalHold,
        charged: u64,
    },
}

impl Closed {
    pub(super) fn settled(&self) -> Settled {
        match self {
            Closed::Committed(u) if u.late => Settled::LateCommitted,
            Closed::Committed(_) => Settled::Committed,
            Closed::Released { .. } => Settled::Released,
            Closed::Expired { .. } => Settled::Expired,
        }
    }
}

impl State {
    /// Keeps the ledger entry of a leased hold settled here, for the next lease call to append
    /// (when the policy keeps a ledger): the fields `lua/common.lua` lists, as `lua/lease.lua`
    /// reads them.
    pub(super) fn enter(&mut self, id: &str, hold: &LocalHold, how: Entered, now: u64) {
        if !self.ledger {
            return;
        }
        let n = |v: u64| v.to_string();
        let mut detail = Detail::default();
        let ending = match how {
            Entered::Committed { ending, .. } | Entered::Released(ending) => ending,
            Entered::Expired { .. } => Ending::Expired,
        };
        let (outcome, usage, counts, charged, cost) = match how {
            Entered::Committed { spent, counted, late, .. } => {
                let outcome = if late { "late_committed" } else { "committed" };
                let (used, cost) = (spent.tokens, spent.cost);
                match counted {
                    Counted::Exact { prompt, output, detail: said } => {
                        detail = said;
                        (outcome, "exact", Some((prompt, output)), used, cost)
                    }
                    Counted::Metered { output } => (outcome, "metered", Some((hold.prompt, output)), used, cost),
                    Counted::AsHeld => (outcome, "held", None, used, cost),
                }
            }
            Entered::Released(_) => ("released", "none", None, 0, 0),
            Entered::Expired { charged: 0 } => ("expired", "none", None, 0, 0),
            Entered::Expired { charged } => ("expired", "held", None, charged, hold.held_cost()),
        };
        let (prompt, output) = counts.map_or((String::new(), String::new()), |(p, o)| (n(p), n(o)));
        let count = |c: Option<u64>| c.map_or_else(String::new, n);
        let fields = [
            id.to_string(),
            self.name.clone(),
            hold.user.clone().unwrap_or_default(),
            hold.model.clone(),
            hold.tier.to_string(),
            outcome.to_string(),
            usage.to_string(),
            prompt,
            output,
            n(hold.held),
            n(charged),
            n(cost),
            n(hold.held_cost()),
            n(hold.reserved_at),
            n(now),
            count(detail.cache_read),
            count(detail.cache_write),
            count(detail.reasoning),
            ending.as_str().to_string(),
        ];
        let escape = |v: &str| v.replace('%', "%25").replace('\t', "%09").replace('\n', "%0A");
        self.unentered.push(fields.iter().map(|f| escape(f)).collect::<Vec<_>>().join("\t"));
    }

    /// Keeps a settled hold's outcome for repeats: `retention_ms`; an expired hold's, for its late
    /// commit, as long as it lived again (its lease, as renewed) if that is longer, as the store
    /// keeps an expired record.
    pub(super) fn close(&mut self, id: &str, closed: Closed, now: u64, retention_ms: u64) {
        let keep = match &closed {
            Closed::Expired { hold, .. } => retention_ms.max(hold.lease_until.saturating_sub(hold.reserved_at)),
            _ => retention_ms,
        };
        self.closed.insert(id.to_string(), closed);
        self.closed_order.push_back((now.saturating_add(keep), id.to_string()));
        while self.closed_order.len() > MAX_CLOSED {
            if let Some((_, old)) = self.closed_order.pop_front() {
                self.closed.remove(&old);
            }
        }
    }

    pub(super) fn forget_closed(&mut self, now: u64) {
        while let Some((until, _)) = self.closed_order.front() {
            if *until > now {
                break;
            }
            if let Some((_, id)) = self.closed_order.pop_front() {
                self.closed.remove(&id);
            }
        }
    }

    /// Settles a hold whose lease ran out: the slot comes back; the tokens stay charged, or come
    /// back, by the tenant's expired-usage policy. Returns what stays charged.
    pub(super) fn expire(&mut self, hold: &LocalHold, now: u64) -> u64 {
        let refund = hold.refund_on_expiry;
        let held = hold.spend();
        let today = self.today(now);
        for (key, took) in &hold.scopes {
            if let Some(slice) = self.slices.get_mut(key) {
                slice.free_slot();
                let used = if refund { Spend::default() } else { held };
                slice.settle(*took, held, Spend::default(), used, hold.day, today);
            }
        }
        if refund { 0 } else { hold.held }
    }

    /// Settles what the hold used (`used`) in every scope, against what it still had charged:
    /// all it held (`charged`), or nothing once an expiry refunded it; and what was counted of
    /// what a scope does not lease (by an expiry that charged the hold).
    pub(super) fn reconcile(&mut self, hold: &LocalHold, charged: Spend, counted: Spend, used: Spend, now: u64) {
        let today = self.today(now);
        for (key, took) in &hold.scopes {
            if let Some(slice) = self.slices.get_mut(key) {
                slice.settle(*took, charged, counted, used, hold.day, today);
            }
        }
    }

    /// Settles the hold `id` as expired if its lease has passed, so that what is left in `holds`
    /// is live.
    pub(super) fn expire_if_due(&mut self, id: &str, now: u64, retention_ms: u64) {
        if self.holds.get(id).is_some_and(|h| now >= h.lease_until)
            && let Some(hold) = self.holds.remove(id)
        {
            let charged = self.expire(&hold, now);
            self.enter(id, &hold, Entered::Expired { charged }, now);
            self.close(id, Closed::Expired { hold, charged }, now, retention_ms);
            self.expired_by_touch.push(id.to_string());
        }
    }
}

impl Leases {
    /// Commits a leased hold of this replica; `ending` says how its request ended.
    pub fn commit(&self, tenant: &str, id: &str, counted: Counted, ending: Ending) -> CommitOutcome {
        let Some(t) = self.existing(tenant) else { return CommitOutcome::NotFound };
        let now = self.clock.now_ms();
        let retention = self.retention_ms;
        let mut s = t.lock();
        s.active = true;
        let metered = !matches!(counted, Counted::Exact { .. });
        s.expire_if_due(id, now, retention);
        if let Some(hold) = s.holds.remove(id) {
            let spent = hold.used(counted);
            for (key, _) in &hold.scopes {
                if let Some(slice) = s.slices.get_mut(key) {
                    slice.free_slot();
                }
            }
            s.reconcile(&hold, hold.spend(), Spend::default(), spent, now);
            let usage = usage(&hold, spent, false, metered, ending);
            s.enter(id, &hold, Entered::Committed { spent, counted, late: false, ending }, now);
            s.close(id, Closed::Committed(usage.clone()), now, retention);
            return CommitOutcome::Committed(usage);
        }
        match s.closed.get(id).cloned() {
            Some(Closed::Committed(u)) => CommitOutcome::Committed(Usage { duplicate: true, ..u }),
            Some(Closed::Released { .. }) => CommitOutcome::Released,
            Some(Closed::Expired { hold, charged }) => {
                let spent = hold.used(counted);
                // An expired hold charges all it held, or nothing (refunded).
                let charged = if charged == 0 { Spend::default() } else { hold.spend() };
                s.reconcile(&hold, charged, charged, spent, now);
                let usage = usage(&hold, spent, true, metered, ending);
                s.enter(id, &hold, Entered::Committed { spent, counted, late: true, ending }, now);
                s.closed.insert(id.to_string(), Closed::Committed(usage.clone()));
                CommitOutcome::Committed(usage)
            }
            None => CommitOutcome::NotFound,
        }
    }

    /// Releases a leased hold of this replica: every token back, the slot free; `ending` says why.
    pub fn release(&self, tenant: &str, id: &str, ending: Ending) -> ReleaseOutcome {
        let Some(t) = self.existing(tenant) else { return ReleaseOutcome::NotFound };
        let now = self.clock.now_ms();
        let retention = self.retention_ms;
        let mut s = t.lock();
        s.active = true;
        s.expire_if_due(id, now, retention);
        if let Some(hold) = s.holds.remove(id) {
            let today = s.today(now);
            for (key, took) in &hold.scopes {
                if let Some(slice) = s.slices.get_mut(key) {
                    slice.free_slot();
                    slice.settle(*took, hold.spend(), Spend::default(), Spend::default(), hold.day, today);
                }
            }
            s.enter(id, &hold, Entered::Released(ending), now);
            s.close(id, Closed::Released { refunded: hold.held }, now, retention);
            return ReleaseOutcome::Released { refunded: hold.held, repeated: false };
        }
        match s.closed.get(id) {
            Some(Closed::Released { refunded }) => ReleaseOutcome::Released { refunded: *refunded, repeated: true },
            Some(closed) => ReleaseOutcome::Settled(closed.settled()),
            None => ReleaseOutcome::NotFound,
        }
    }

    /// Extends a leased hold's lease to `lease_ms` from now.
    pub fn renew(&self, tenant: &str, id: &str, lease_ms: u64) -> RenewOutcome {
        let Some(t) = self.existing(tenant) else { return RenewOutcome::NotFound };
        let now = self.clock.now_ms();
        let retention = self.retention_ms;
        let mut s = t.lock();
        s.active = true;
        let valid_until = s.valid_until;
        s.expire_if_due(id, now, retention);
        if let Some(hold) = s.holds.get_mut(id) {
            hold.lease_until = now.saturating_add(lease_ms).min(valid_until);
            return RenewOutcome::Renewed { lease_remaining_ms: hold.lease_until.saturating_sub(now) };
        }
        s.closed.get(id).map_or(RenewOutcome::NotFound, |closed| RenewOutcome::Settled(closed.settled()))
    }
}

fn usage(hold: &LocalHold, spent: Spend, late: bool, metered: bool, ending: Ending) -> Usage {
    let used = spent.tokens;
    Usage {
        late,
        duplicate: false,
        metered,
        used,
        held: hold.held,
        refunded: hold.held.saturating_sub(used),
        overrun: used.saturating_sub(hold.held),
        model: Some(hold.model.clone()),
        output_held: Some(hold.held.saturating_sub(hold.prompt)),
        cost_nanos: spent.cost,
        ending: Some(ending),
    }
}
