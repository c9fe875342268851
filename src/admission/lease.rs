//! Leasing: most decisions never leave the process.
//!
//! With `leasing` in the policy, a replica draws a *slice* of each scope it serves from the store
//! (tokens, request permits, concurrency slots: `lua/lease.lua`) and decides from it in memory.
//! A hold admitted from a slice lives in this replica's memory, under an id that names the
//! replica; its commit, release and renewal settle against the slice, with no store call.
//!
//! Once per window, for each tenant it serves, the replica gives back what it did not use beyond
//! what it expects to need, draws again sized by its own recent rate (never more than
//! `max_share` of a scope), renews its lease record, and picks up operations other replicas
//! forwarded for its holds. A request its slice cannot cover makes a call of its own (a miss),
//! asking for at least what that request needs; a scope the store refused answers from memory
//! until the refusal's wait, or one window, has passed.
//!
//! # What it promises
//!
//! What a replica draws is charged to the scope when it is drawn, as a hold is. So the store's
//! counters always include every slice, and leasing never admits what a single store would have
//! refused: no overshoot, per scope, at any moment. What it can do is refuse what a single store
//! would have admitted, while other replicas sit on unused slices: at most one slice per other
//! replica, each at most `max_share` of the scope and returned within a window.
//!
//! Tokens a replica drew are charged until it gives them back: if it dies, they stay charged (its
//! in-flight requests ran, and missing usage is not zero usage), and its concurrency slots come
//! back when its lease record runs out (the tenant's lease TTL), as a dead client's holds do.
//!
//! # Bounds on what this replica believes
//!
//! The record's lease is counted from when a call was *sent*, so this replica stops deciding
//! from its slices no later than the store would settle its record. Slots are stated absolutely
//! in every call, so a lost reply corrects itself; tokens and permits of a lost reply stay
//! charged, never spent twice.

// Token arithmetic: no unchecked +, -, * (see Cargo.toml's [lints] for the casts).
#![warn(clippy::arithmetic_side_effects)]

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use crate::config::{ExpiredUsage, Leasing, TenantPolicy};
use crate::store::clock::Clock;
use crate::store::{
    Amounts, CommitOutcome, Counted, Forwarded, Headroom, LeaseCall, LeaseOutcome, LeaseReply, LeaseScope, Refusal,
    ReleaseOutcome, RenewOutcome, ScopeLimits, Settled, Usage,
};

const DAY_MS: u64 = 86_400_000;
/// Settled holds remembered per tenant, to answer a repeated commit or release the way the store's
/// retained records do; past this many, the oldest are forgotten (a repeat then finds nothing and
/// charges nothing).
const MAX_CLOSED: usize = 100_000;
/// Windows a tenant may stay idle (nothing held, nothing settled to remember, nothing asked)
/// before the replica leaves it.
const IDLE_WINDOWS: u32 = 4;

/// One scope of a request, as leasing needs it.
#[derive(Debug, Clone)]
pub(super) struct AskScope<'a> {
    pub key: &'a str,
    pub limits: ScopeLimits,
}

/// A request to decide from the slices.
#[derive(Debug)]
pub(super) struct Ask<'a> {
    pub id: &'a str,
    pub model: &'a str,
    pub scopes: Vec<AskScope<'a>>,
    pub hold: u64,
    pub prompt: u64,
}

/// A decision from memory.
#[derive(Debug)]
pub(super) enum Local {
    Admitted {
        headroom: Headroom,
    },
    /// The store refused this scope (index into the ask's scopes) a moment ago.
    Refused {
        scope: usize,
        reason: Refusal,
        retry_after_ms: u64,
    },
    /// The slices cannot cover it: a lease call must.
    Miss,
}

/// What a lease call left for the caller to finish: ops to apply here, pool legs to release.
#[derive(Debug, Default)]
pub(super) struct Followups {
    pub forwarded: Vec<(String, Forwarded)>,
    /// Ids whose pool legs are to be released: store holds the sweep settled, local holds expired.
    pub released: Vec<String>,
}

/// A lease call made ready: its scopes, when it is sent, and the tenant's lease and idle TTL.
struct Prepared {
    scopes: Vec<LeaseScope>,
    sent_at: u64,
    lease_ms: u64,
    idle_ttl_ms: u64,
}

/// This replica's slices and leased holds, per tenant.
pub(super) struct Leases {
    pub replica: String,
    pub settings: Leasing,
    clock: Arc<dyn Clock>,
    retention_ms: u64,
    tenants: RwLock<HashMap<String, Arc<TenantLease>>>,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("replica", &self.replica)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// One tenant's slices on this replica.
pub(super) struct TenantLease {
    state: Mutex<State>,
    /// One lease call at a time per tenant: concurrent misses wait for it, then look again.
    pub calls: tokio::sync::Mutex<()>,
}

struct State {
    tp: Arc<TenantPolicy>,
    slices: HashMap<String, Slice>,
    holds: HashMap<String, LocalHold>,
    closed: HashMap<String, Closed>,
    closed_order: VecDeque<(u64, String)>,
    /// The store's day at the last call.
    day: u64,
    /// Until when (this replica's clock) its lease record is surely live in the store.
    valid_until: u64,
    /// The store's view of the tightest scope at the last call, for the rate-limit headers.
    headroom: Headroom,
    active: bool,
    idle_windows: u32,
    /// The replica left the tenant: this state is no longer the tenant's, and decides nothing.
    left: bool,
    /// When this replica last sent a lease call for the tenant (its clock).
    last_call: u64,
    /// The policy changed since the last call: decide nothing from the slices until a call has
    /// drawn them again under the new limits.
    stale: bool,
}

#[derive(Debug, Clone)]
struct Slice {
    limits: ScopeLimits,
    /// Free tokens, drawn on `day`; negative: debt the replica's holds ran up, charged at the next call.
    tokens: i64,
    day: u64,
    /// Refunds of holds drawn on an earlier day than `day`: they go back to the bucket only.
    stale_refund: u64,
    /// Refunds beyond what the slice may hold free (`cap`): given back with the next call, never
    /// spent here, so that what a replica can spend unseen stays within its share.
    surplus: u64,
    /// The most this slice may hold free: `max_share` of each capacity.
    cap: Amounts,
    requests: u64,
    slots_free: u64,
    slots_used: u64,
    /// Taken in this window and the one before: what the next draw is sized by.
    taken: Amounts,
    taken_before: Amounts,
    blocked: Option<Blocked>,
}

#[derive(Debug, Clone, Copy)]
struct Blocked {
    /// Until when the refusal is answered from memory: its wait, or one window, whichever is less.
    until: u64,
    /// When the store said the request could fit: what a refusal from memory tells the client.
    retry_at: u64,
    reason: Refusal,
}

#[derive(Debug, Clone)]
struct LocalHold {
    scopes: Vec<String>,
    held: u64,
    prompt: u64,
    day: u64,
    /// The hold's own terms, fixed when it was taken (a policy reload does not change them).
    lease_until: u64,
    refund_on_expiry: bool,
    model: String,
}

#[derive(Debug, Clone)]
enum Closed {
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
    fn settled(&self) -> Settled {
        match self {
            Closed::Committed(u) if u.late => Settled::LateCommitted,
            Closed::Committed(_) => Settled::Committed,
            Closed::Released { .. } => Settled::Released,
            Closed::Expired { .. } => Settled::Expired,
        }
    }
}

impl Slice {
    fn new(limits: ScopeLimits, day: u64, share: f64) -> Self {
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

    fn limits_tokens(&self) -> bool {
        self.limits.token_capacity > 0 || self.limits.daily_budget > 0
    }

    fn limits_requests(&self) -> bool {
        self.limits.request_capacity > 0
    }

    fn limits_slots(&self) -> bool {
        self.limits.max_concurrency > 0
    }

    fn covers(&self, hold: u64) -> bool {
        (!self.limits_tokens() || self.tokens >= signed(hold))
            && (!self.limits_requests() || self.requests >= 1)
            && (!self.limits_slots() || self.slots_free >= 1)
    }

    fn take(&mut self, hold: u64) {
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
    fn refund(&mut self, amount: u64, day: u64) {
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
    fn overrun(&mut self, amount: u64) {
        if self.limits_tokens() {
            self.tokens = self.tokens.saturating_sub(signed(amount));
        }
    }

    fn free_slot(&mut self) {
        if self.limits_slots() && self.slots_used > 0 {
            self.slots_used = self.slots_used.saturating_sub(1);
            self.slots_free = self.slots_free.saturating_add(1);
        }
    }

    /// The most this slice may hold free: `share` of each capacity (at least one); 0 for what the
    /// scope does not limit.
    fn share_cap(&self, share: f64) -> Amounts {
        let l = &self.limits;
        let tokens = match (l.token_capacity, l.daily_budget) {
            (0, 0) => 0,
            (0, b) => share_of(b, share),
            (t, 0) => share_of(t, share),
            (t, b) => share_of(t.min(b), share),
        };
        Amounts {
            tokens,
            requests: if self.limits_requests() { share_of(l.request_capacity, share) } else { 0 },
            slots: if self.limits_slots() { share_of(l.max_concurrency, share) } else { 0 },
        }
    }

    /// What this slice should hold free after the next call: twice what it took in its busier
    /// recent window, within its share.
    fn target(&self, share: f64) -> Amounts {
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
fn share_of(capacity: u64, share: f64) -> u64 {
    ((capacity as f64 * share).floor() as u64).max(1)
}

/// Token counts are at most 10^9 per hold and slices far below 2^63: the conversion saturates.
fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl State {
    fn close(&mut self, id: &str, closed: Closed, now: u64, retention_ms: u64) {
        self.closed.insert(id.to_string(), closed);
        self.closed_order.push_back((now.saturating_add(retention_ms), id.to_string()));
        while self.closed_order.len() > MAX_CLOSED {
            if let Some((_, old)) = self.closed_order.pop_front() {
                self.closed.remove(&old);
            }
        }
    }

    fn forget_closed(&mut self, now: u64) {
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
    fn expire(&mut self, hold: &LocalHold) -> u64 {
        let refund = hold.refund_on_expiry;
        for key in &hold.scopes {
            if let Some(slice) = self.slices.get_mut(key) {
                slice.free_slot();
                if refund {
                    slice.refund(hold.held, hold.day);
                }
            }
        }
        if refund { 0 } else { hold.held }
    }

    /// Charges `used` against `charged` in every scope of the hold: the difference comes back or
    /// is debt.
    fn reconcile(&mut self, hold: &LocalHold, charged: u64, used: u64) {
        for key in &hold.scopes {
            if let Some(slice) = self.slices.get_mut(key) {
                if used < charged {
                    slice.refund(charged.saturating_sub(used), hold.day);
                } else {
                    slice.overrun(used.saturating_sub(charged));
                }
            }
        }
    }

    /// Settles the hold `id` as expired if its lease has passed, so that what is left in `holds`
    /// is live.
    fn expire_if_due(&mut self, id: &str, now: u64, retention_ms: u64) {
        if self.holds.get(id).is_some_and(|h| now >= h.lease_until)
            && let Some(hold) = self.holds.remove(id)
        {
            let charged = self.expire(&hold);
            self.close(id, Closed::Expired { hold, charged }, now, retention_ms);
        }
    }
}

impl Leases {
    pub fn new(replica: String, settings: Leasing, clock: Arc<dyn Clock>, retention_ms: u64) -> Self {
        Leases { replica, settings, clock, retention_ms, tenants: RwLock::new(HashMap::new()) }
    }

    /// The tenant's lease state, made on first use.
    pub fn tenant(&self, tenant: &str, tp: &Arc<TenantPolicy>) -> Arc<TenantLease> {
        if let Some(t) = self.tenants.read().unwrap_or_else(|p| p.into_inner()).get(tenant) {
            return Arc::clone(t);
        }
        let mut tenants = self.tenants.write().unwrap_or_else(|p| p.into_inner());
        Arc::clone(tenants.entry(tenant.to_string()).or_insert_with(|| {
            Arc::new(TenantLease {
                state: Mutex::new(State {
                    tp: Arc::clone(tp),
                    slices: HashMap::new(),
                    holds: HashMap::new(),
                    closed: HashMap::new(),
                    closed_order: VecDeque::new(),
                    day: self.clock.now_ms() / DAY_MS,
                    valid_until: 0,
                    headroom: Headroom::default(),
                    active: true,
                    idle_windows: 0,
                    left: false,
                    last_call: 0,
                    stale: false,
                }),
                calls: tokio::sync::Mutex::new(()),
            })
        }))
    }

    /// A reloaded policy: each tenant's slices are drawn again under its new terms at the next
    /// decision (which misses, and calls), and its new lease terms apply to holds taken from now
    /// on. A tenant the policy no longer names keeps its terms until its holds are settled.
    pub fn policy_changed(&self, policy: &crate::config::Policy) {
        for (name, t) in self.tenants.read().unwrap_or_else(|p| p.into_inner()).iter() {
            let mut s = t.lock();
            if let Some(tp) = policy.tenant(name) {
                s.tp = Arc::clone(tp);
            }
            s.stale = true;
        }
    }

    fn existing(&self, tenant: &str) -> Option<Arc<TenantLease>> {
        self.tenants.read().unwrap_or_else(|p| p.into_inner()).get(tenant).cloned()
    }

    /// Every tenant this replica holds slices of.
    pub fn tenant_names(&self) -> Vec<String> {
        self.tenants.read().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect()
    }

    /// Decides `ask` from the slices, or says a lease call must.
    pub fn try_admit(&self, t: &TenantLease, ask: &Ask<'_>) -> Local {
        let now = self.clock.now_ms();
        let mut s = t.lock();
        s.active = true;
        if now >= s.valid_until || s.left || s.stale {
            return Local::Miss;
        }
        for (i, scope) in ask.scopes.iter().enumerate() {
            let Some(slice) = s.slices.get(scope.key) else { return Local::Miss };
            if slice.covers(ask.hold) {
                continue;
            }
            return match slice.blocked {
                Some(b) if b.until > now => {
                    Local::Refused { scope: i, reason: b.reason, retry_after_ms: b.retry_at.saturating_sub(now).max(1) }
                }
                _ => Local::Miss,
            };
        }
        let mut tightest: Option<i64> = None;
        for scope in &ask.scopes {
            if let Some(slice) = s.slices.get_mut(scope.key) {
                slice.take(ask.hold);
                if slice.limits_tokens() {
                    tightest = Some(tightest.map_or(slice.tokens, |t| t.min(slice.tokens)));
                }
            }
        }
        let hold = LocalHold {
            scopes: ask.scopes.iter().map(|a| a.key.to_string()).collect(),
            held: ask.hold,
            prompt: ask.prompt,
            day: s.day,
            // Never past the replica's own lease record: the store frees its slots then.
            lease_until: now.saturating_add(s.tp.lease_ttl_ms).min(s.valid_until),
            refund_on_expiry: s.tp.expired_usage == ExpiredUsage::Refund,
            model: ask.model.to_string(),
        };
        s.holds.insert(ask.id.to_string(), hold);
        // The store's view at the last call, and what this replica holds free besides.
        let mut headroom = s.headroom;
        if let (Some(w), Some(free)) = (headroom.tokens.as_mut(), tightest) {
            w.remaining = w.remaining.saturating_add(free.max(0));
        }
        Local::Admitted { headroom }
    }

    /// Builds a lease call for the tenant: every slice it has (or, for a miss, the asking
    /// request's scopes), giving back what is free beyond each slice's target, and asking for the
    /// target again (at least what `ask` needs).
    fn prepare(&self, t: &TenantLease, ask: Option<&Ask<'_>>, ending: bool) -> Prepared {
        let now = self.clock.now_ms();
        let today = now / DAY_MS;
        let share = self.settings.max_share;
        let mut s = t.lock();
        s.last_call = now;
        let lapsed = now >= s.valid_until;
        let day = s.day;
        if let Some(ask) = ask {
            for a in &ask.scopes {
                // The limits of this decision's policy (a reload may have changed them).
                s.slices.entry(a.key.to_string()).or_insert_with(|| Slice::new(a.limits, day, share)).limits = a.limits;
            }
        }
        let keys: Vec<String> = match ask {
            Some(ask) => ask.scopes.iter().map(|a| a.key.to_string()).collect(),
            None => s.slices.keys().cloned().collect(),
        };
        let mut scopes = Vec::with_capacity(keys.len());
        for key in keys {
            let Some(slice) = s.slices.get_mut(&key) else { continue };
            if lapsed {
                // The store may have settled the record, and these slots with it.
                slice.slots_free = 0;
            }
            let mut target = if ending { Amounts::default() } else { slice.target(share) };
            if let Some(ask) = ask {
                // A miss draws ahead (four of this request), within the share; the need, below,
                // may ask for more, which the asking request then takes at once.
                let cap = slice.share_cap(share);
                target.tokens = target.tokens.max(ask.hold.saturating_mul(4).min(cap.tokens));
                target.requests = target.requests.max(4.min(cap.requests));
                target.slots = target.slots.max(1);
            }
            if slice.day != today {
                // Free tokens of another day go back to it; the new day draws its own.
                target.tokens = if ask.is_some() { target.tokens } else { 0 };
                slice.stale_refund = slice.stale_refund.saturating_add(u64::try_from(slice.tokens.max(0)).unwrap_or(0));
                slice.tokens = slice.tokens.min(0);
            }
            let keep_tokens = slice.tokens.clamp(0, signed(target.tokens));
            let back_tokens =
                slice.tokens.saturating_sub(keep_tokens).saturating_add(signed(std::mem::take(&mut slice.surplus)));
            let keep_requests = slice.requests.min(target.requests);
            let back_requests = slice.requests.saturating_sub(keep_requests);
            let keep_slots = slice.slots_free.min(target.slots);
            let mut need = Amounts::default();
            if let Some(ask) = ask {
                if slice.limits_tokens() {
                    need.tokens = ask.hold.saturating_sub(u64::try_from(keep_tokens).unwrap_or(0));
                }
                need.requests = u64::from(slice.limits_requests() && keep_requests == 0);
                need.slots = u64::from(slice.limits_slots() && keep_slots == 0);
            }
            let want = Amounts {
                tokens: target.tokens.saturating_sub(u64::try_from(keep_tokens).unwrap_or(0)).max(need.tokens),
                requests: target.requests.saturating_sub(keep_requests).max(need.requests),
                slots: target.slots.saturating_sub(keep_slots).max(need.slots),
            };
            let want = if slice.limits_tokens() { want } else { Amounts { tokens: 0, ..want } };
            scopes.push(LeaseScope {
                key: key.clone(),
                limits: slice.limits,
                back_tokens,
                back_day: slice.day,
                back_bucket_tokens: std::mem::take(&mut slice.stale_refund),
                back_requests,
                held_slots: slice.slots_used.saturating_add(keep_slots),
                need,
                want,
            });
            slice.tokens = keep_tokens;
            slice.requests = keep_requests;
            slice.slots_free = keep_slots;
        }
        Prepared { scopes, sent_at: now, lease_ms: s.tp.lease_ttl_ms, idle_ttl_ms: s.tp.idle_ttl_ms }
    }

    /// Applies a lease call's reply. Returns the refusal, if the store refused the asking request.
    fn apply(
        &self,
        t: &TenantLease,
        scopes: &[LeaseScope],
        sent_at: u64,
        reply: &LeaseReply,
    ) -> Option<(usize, Refusal, u64)> {
        let now = self.clock.now_ms();
        let mut s = t.lock();
        s.valid_until = sent_at.saturating_add(s.tp.lease_ttl_ms);
        s.stale = false;
        s.day = reply.day;
        s.headroom = reply.headroom;
        match &reply.outcome {
            LeaseOutcome::Granted(granted) => {
                for (scope, g) in scopes.iter().zip(granted) {
                    if let Some(slice) = s.slices.get_mut(&scope.key) {
                        slice.tokens = slice.tokens.saturating_add(signed(g.tokens));
                        slice.requests = slice.requests.saturating_add(g.requests);
                        slice.slots_free = slice.slots_free.saturating_add(g.slots);
                        slice.day = reply.day;
                        slice.blocked = None;
                    }
                }
                None
            }
            LeaseOutcome::Refused { reason, scope, retry_after_ms } => {
                let window = self.settings.window_ms;
                if let Some(slice) = scopes.get(*scope).and_then(|sc| s.slices.get_mut(&sc.key)) {
                    let until = now.saturating_add((*retry_after_ms).clamp(1, window));
                    let retry_at = now.saturating_add(*retry_after_ms);
                    slice.blocked = Some(Blocked { until, retry_at, reason: *reason });
                }
                Some((*scope, *reason, *retry_after_ms))
            }
        }
    }

    /// One lease call for the tenant, for `ask` (a miss) or for the window's upkeep (`None`).
    pub async fn call<S: crate::store::Store>(
        &self,
        protocol: &crate::store::Protocol<S>,
        tenant: &str,
        t: &TenantLease,
        ask: Option<&Ask<'_>>,
        ending: bool,
        policy: (u32, u64),
    ) -> Result<(Option<(usize, Refusal, u64)>, Followups), crate::store::StoreError> {
        let Prepared { scopes, sent_at, lease_ms, idle_ttl_ms } = self.prepare(t, ask, ending);
        let call = LeaseCall {
            tenant,
            replica: &self.replica,
            lease_ms,
            idle_ttl_ms,
            sweep_batch: policy.0,
            concurrency_retry_cap_ms: policy.1,
            ending,
            scopes,
        };
        let reply = protocol.lease(&call).await?;
        let refused = self.apply(t, &call.scopes, sent_at, &reply);
        Ok((refused, Followups { forwarded: reply.forwarded, released: reply.swept }))
    }

    /// The window's upkeep for one tenant: settles holds whose lease passed, forgets old settled
    /// holds, and says whether a call is due (anything held, asked, or to give back) and whether
    /// the replica is leaving the tenant. Returns the ids of the holds it expired.
    pub fn upkeep(&self, t: &TenantLease) -> (Vec<String>, Option<bool>) {
        let now = self.clock.now_ms();
        let retention = self.retention_ms;
        let mut s = t.lock();
        let due: Vec<String> = s.holds.iter().filter(|(_, h)| now >= h.lease_until).map(|(id, _)| id.clone()).collect();
        for id in &due {
            if let Some(hold) = s.holds.remove(id) {
                let charged = s.expire(&hold);
                s.close(id, Closed::Expired { hold, charged }, now, retention);
            }
        }
        s.forget_closed(now);
        for slice in s.slices.values_mut() {
            slice.taken_before = std::mem::take(&mut slice.taken);
        }
        let active = std::mem::replace(&mut s.active, false) || !due.is_empty();
        if active || !s.holds.is_empty() {
            s.idle_windows = 0;
            return (due, Some(false));
        }
        let holding = s
            .slices
            .values()
            .any(|sl| sl.tokens != 0 || sl.requests > 0 || sl.slots_free > 0 || sl.stale_refund > 0 || sl.surplus > 0);
        if !s.closed.is_empty() {
            // Settled holds can still be committed late, from another replica too: keep the lease
            // record, and look for forwarded operations, a few times a lease.
            let poll = now.saturating_sub(s.last_call) >= s.tp.lease_ttl_ms / 4;
            return (due, (holding || poll).then_some(false));
        }
        s.idle_windows = s.idle_windows.saturating_add(1);
        if s.idle_windows >= IDLE_WINDOWS {
            return (due, Some(true));
        }
        (due, holding.then_some(false))
    }

    /// Forgets a tenant the replica left (its last call gave everything back).
    pub fn leave(&self, tenant: &str) {
        let mut tenants = self.tenants.write().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = tenants.get(tenant) {
            let mut s = t.lock();
            if s.holds.is_empty() && !s.active {
                s.left = true;
                drop(s);
                tenants.remove(tenant);
            }
        }
    }

    /// Commits a leased hold of this replica.
    pub fn commit(&self, tenant: &str, id: &str, counted: Counted) -> CommitOutcome {
        let Some(t) = self.existing(tenant) else { return CommitOutcome::NotFound };
        let now = self.clock.now_ms();
        let retention = self.retention_ms;
        let mut s = t.lock();
        s.active = true;
        let metered = !matches!(counted, Counted::Exact { .. });
        let used = |hold: &LocalHold| match counted {
            Counted::Exact { prompt, output } => prompt.saturating_add(output),
            Counted::Metered { output } => hold.prompt.saturating_add(output),
            Counted::AsHeld => hold.held,
        };
        s.expire_if_due(id, now, retention);
        if let Some(hold) = s.holds.remove(id) {
            let used = used(&hold);
            for key in &hold.scopes {
                if let Some(slice) = s.slices.get_mut(key) {
                    slice.free_slot();
                }
            }
            s.reconcile(&hold, hold.held, used);
            let usage = usage(&hold, used, false, metered);
            s.close(id, Closed::Committed(usage.clone()), now, retention);
            return CommitOutcome::Committed(usage);
        }
        match s.closed.get(id).cloned() {
            Some(Closed::Committed(u)) => CommitOutcome::Committed(Usage { duplicate: true, ..u }),
            Some(Closed::Released { .. }) => CommitOutcome::Released,
            Some(Closed::Expired { hold, charged }) => {
                let used = used(&hold);
                s.reconcile(&hold, charged, used);
                let usage = usage(&hold, used, true, metered);
                s.closed.insert(id.to_string(), Closed::Committed(usage.clone()));
                CommitOutcome::Committed(usage)
            }
            None => CommitOutcome::NotFound,
        }
    }

    /// Releases a leased hold of this replica: every token back, the slot free.
    pub fn release(&self, tenant: &str, id: &str) -> ReleaseOutcome {
        let Some(t) = self.existing(tenant) else { return ReleaseOutcome::NotFound };
        let now = self.clock.now_ms();
        let retention = self.retention_ms;
        let mut s = t.lock();
        s.active = true;
        s.expire_if_due(id, now, retention);
        if let Some(hold) = s.holds.remove(id) {
            for key in &hold.scopes {
                if let Some(slice) = s.slices.get_mut(key) {
                    slice.free_slot();
                    slice.refund(hold.held, hold.day);
                }
            }
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

    /// How many holds this replica keeps in memory for the tenant, live and settled.
    pub fn held(&self, tenant: &str) -> (usize, usize) {
        self.existing(tenant).map_or((0, 0), |t| {
            let s = t.lock();
            (s.holds.len(), s.closed.len())
        })
    }
}

impl TenantLease {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn usage(hold: &LocalHold, used: u64, late: bool, metered: bool) -> Usage {
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
        // Leased holds are not priced: a tenant with a budget in money decides at the store.
        cost_nanos: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Policy;
    use crate::store::clock::ManualClock;

    const START: u64 = 1_795_953_600_000;

    fn leases(clock: &ManualClock) -> (Leases, Arc<TenantPolicy>) {
        let policy = Policy::parse(
            "t.yaml",
            "leasing: { window_ms: 250, max_share: 0.1 }\nmodels:\n  m: { max_output_tokens: 100 }\n\
             tenants:\n  acme: { lease_ttl_ms: 4000, limits: { tokens_per_minute: 60000, burst_tokens: 10000, max_concurrency: 10 } }\n",
        )
        .unwrap();
        let tp = Arc::clone(&policy.tenants["acme"]);
        (Leases::new("0a1b2c3d4e5f".into(), policy.leasing.unwrap(), Arc::new(clock.clone()), 60_000), tp)
    }

    fn limits(tp: &TenantPolicy) -> ScopeLimits {
        ScopeLimits::from(&tp.limits)
    }

    /// A slice that holds `tokens` and `slots` free, as a lease call would have left it.
    fn stock(t: &TenantLease, tp: &TenantPolicy, tokens: i64, slots: u64, valid_until: u64) {
        let mut s = t.lock();
        let mut slice = Slice::new(limits(tp), START / DAY_MS, 0.1);
        slice.tokens = tokens;
        slice.slots_free = slots;
        s.slices.insert("scope".into(), slice);
        s.valid_until = valid_until;
    }

    fn ask<'a>(id: &'a str, tp: &TenantPolicy, hold: u64) -> Ask<'a> {
        Ask { id, model: "m", scopes: vec![AskScope { key: "scope", limits: limits(tp) }], hold, prompt: 0 }
    }

    #[test]
    fn a_refund_beyond_the_share_is_given_back_not_spent() {
        let clock = ManualClock::new(START);
        let (_, tp) = leases(&clock);
        let mut slice = Slice::new(limits(&tp), 7, 0.1);
        assert_eq!(slice.cap.tokens, 1_000, "a tenth of 10,000");
        slice.tokens = 900;
        slice.refund(300, 7);
        assert_eq!((slice.tokens, slice.surplus), (1_000, 200));
        slice.refund(50, 6);
        assert_eq!(slice.stale_refund, 50, "a hold of another day refunds the bucket only");
    }

    #[test]
    fn a_leased_hold_never_outlives_its_replicas_lease_record() {
        let clock = ManualClock::new(START);
        let (leases, tp) = leases(&clock);
        let t = leases.tenant("acme", &tp);
        stock(&t, &tp, 1_000, 5, START + 1_500);
        assert!(matches!(leases.try_admit(&t, &ask("h1", &tp, 100)), Local::Admitted { .. }));
        assert_eq!(t.lock().holds["h1"].lease_until, START + 1_500, "not START + 4,000");
        assert_eq!(leases.renew("acme", "h1", 4_000), RenewOutcome::Renewed { lease_remaining_ms: 1_500 });
        clock.advance_ms(1_500);
        assert!(matches!(leases.try_admit(&t, &ask("h2", &tp, 100)), Local::Miss), "the lease lapsed");
        assert_eq!(leases.renew("acme", "h1", 4_000), RenewOutcome::Settled(Settled::Expired));
    }

    #[test]
    fn a_replica_with_only_settled_holds_polls_four_times_a_lease() {
        let clock = ManualClock::new(START);
        let (leases, tp) = leases(&clock);
        let t = leases.tenant("acme", &tp);
        stock(&t, &tp, 0, 0, START + 4_000);
        t.lock().closed.insert("done".into(), Closed::Released { refunded: 1 });
        t.lock().last_call = START;
        leases.upkeep(&t); // the window the tenant was created in: active
        clock.advance_ms(999);
        assert_eq!(leases.upkeep(&t).1, None, "nothing to give back, polled a moment ago");
        clock.advance_ms(1);
        assert_eq!(leases.upkeep(&t).1, Some(false), "a quarter of the 4,000 ms lease since the last call");
    }
}
