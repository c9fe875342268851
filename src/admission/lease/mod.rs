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

mod call;
mod holds;
mod slice;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use super::plan::ScopeOf;
use crate::config::{ExpiredUsage, Leasing, TenantPolicy};
use crate::hold::{DAY_MS, Forwarded, Headroom, Refusal};
use crate::store::clock::Clock;
pub(super) use call::Called;
use holds::{Closed, LocalHold};
use slice::{Slice, Spend};

/// Windows a tenant may stay idle (nothing held, nothing settled to remember, nothing asked)
/// before the replica leaves it.
const IDLE_WINDOWS: u32 = 4;

/// One scope of a request, as leasing needs it: its key, and which limits it keeps (looked up in
/// the tenant's terms of the moment, never in the decision's snapshot, which a reload may have
/// passed).
#[derive(Debug, Clone)]
pub(super) struct AskScope<'a> {
    pub key: &'a str,
    pub of: &'a ScopeOf,
}

/// A request to decide from the slices.
#[derive(Debug)]
pub(super) struct Ask<'a> {
    pub id: &'a str,
    pub model: &'a str,
    pub scopes: Vec<AskScope<'a>>,
    pub hold: u64,
    pub prompt: u64,
    /// Who the hold is for and what its tokens cost, as the ledger enters it.
    pub user: Option<&'a str>,
    pub tier: &'static str,
    pub price: crate::config::Price,
    pub token_weights: crate::config::TokenWeights,
}

impl Ask<'_> {
    /// What the hold takes from each slice: its tokens, and what they may cost.
    fn spend(&self) -> Spend {
        Spend::of_hold(self.price, self.hold, self.prompt)
    }
}

/// A decision from memory.
#[derive(Debug)]
pub(super) enum Local {
    Admitted {
        headroom: Headroom,
    },
    /// The store refused this scope (index into the ask's scopes) a moment ago: the wait left of
    /// the one it told (`told_ms`).
    Refused {
        scope: usize,
        reason: Refusal,
        retry_after_ms: u64,
        told_ms: u64,
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

/// This replica's slices and leased holds, per tenant.
pub(super) struct Leases {
    pub replica: String,
    pub settings: Leasing,
    clock: Arc<dyn Clock>,
    retention_ms: u64,
    tenants: RwLock<HashMap<String, Arc<TenantLease>>>,
    /// The last sequence number given a lease call. One count for every tenant, so a number never
    /// repeats while the process lives, even for a tenant this replica left and came back to.
    seq: std::sync::atomic::AtomicU64,
    /// The usage ledger's terms (a restart-only setting), if the policy keeps one: every leased
    /// hold settled here is entered in it by the replica's next lease call.
    ledger: Option<crate::config::LedgerTerms>,
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
    /// One lease call at a time per tenant: concurrent misses wait for it, then look again
    /// ([`Leases::one_call`]).
    calls: Arc<tokio::sync::Mutex<()>>,
}

struct State {
    /// The tenant's name, as its ledger entries give it.
    name: String,
    /// Whether settled holds are entered in the ledger, and the entries not yet sent.
    ledger: bool,
    unentered: Vec<String>,
    tp: Arc<TenantPolicy>,
    slices: HashMap<String, Slice>,
    holds: HashMap<String, LocalHold>,
    closed: HashMap<String, Closed>,
    closed_order: VecDeque<(u64, String)>,
    /// The store's day when it answered the last call.
    day: u64,
    /// When that day ends, on this replica's clock (0 before the first answer): counted from when
    /// the call was sent, so never later than the store's midnight. No slice is spent past it.
    day_ends_at: u64,
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
    /// Holds a commit, release or renewal found expired since the last upkeep.
    expired_by_touch: Vec<String>,
    /// A call sent whose answer never came: it may have run. It is sent again as it was (the
    /// store answers a re-send as it answered the first), before any other call, so what it gave
    /// back and what it drew count once.
    pending: Option<call::Prepared>,
}

impl Leases {
    pub fn new(
        replica: String,
        settings: Leasing,
        clock: Arc<dyn Clock>,
        retention_ms: u64,
        ledger: Option<crate::config::LedgerTerms>,
    ) -> Self {
        Leases {
            replica,
            settings,
            clock,
            retention_ms,
            tenants: RwLock::new(HashMap::new()),
            seq: std::sync::atomic::AtomicU64::new(0),
            ledger,
        }
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
                    name: tenant.to_string(),
                    ledger: self.ledger.is_some(),
                    unentered: Vec::new(),
                    tp: Arc::clone(tp),
                    slices: HashMap::new(),
                    holds: HashMap::new(),
                    closed: HashMap::new(),
                    closed_order: VecDeque::new(),
                    day: self.clock.now_ms() / DAY_MS,
                    day_ends_at: 0,
                    valid_until: 0,
                    headroom: Headroom::default(),
                    active: true,
                    idle_windows: 0,
                    left: false,
                    last_call: 0,
                    stale: false,
                    expired_by_touch: Vec::new(),
                    pending: None,
                }),
                calls: Arc::new(tokio::sync::Mutex::new(())),
            })
        }))
    }

    /// A reloaded policy reaches every slice at once: its new limits (sent with every call from
    /// now on, so no call refills a bucket to an old capacity) and its new share, with what a
    /// slice holds free beyond that set aside to give back at the next call, never spent; a scope
    /// the policy no longer leases gives everything back. The tenant's next decision calls
    /// first, and its new lease terms apply to holds taken from now on (a hold keeps its own). A
    /// tenant the policy no longer names keeps its terms until its holds are settled.
    /// `terms_of` gives a tenant's policy under the new policy.
    pub fn policy_changed<'p>(&self, terms_of: impl Fn(&str) -> Option<&'p Arc<TenantPolicy>>) {
        let share = self.settings.max_share;
        for (name, t) in self.tenants.read().unwrap_or_else(|p| p.into_inner()).iter() {
            let mut s = t.lock();
            if let Some(tp) = terms_of(name) {
                s.tp = Arc::clone(tp);
                let tp = Arc::clone(tp);
                for slice in s.slices.values_mut() {
                    slice.retune(slice.of.limits(&tp), share);
                }
            }
            s.stale = true;
        }
    }

    /// The terms a tenant's slices were leased under, if this replica leases for it.
    pub fn terms(&self, tenant: &str) -> Option<Arc<TenantPolicy>> {
        self.existing(tenant).map(|t| Arc::clone(&t.lock().tp))
    }

    /// The tenant's state, with its one-call-at-a-time lock held: the state as it is once the lock
    /// is held (the replica may have left the tenant, and made it anew, while this waited).
    pub async fn one_call(
        &self,
        tenant: &str,
        tp: &Arc<TenantPolicy>,
    ) -> (Arc<TenantLease>, tokio::sync::OwnedMutexGuard<()>) {
        let mut t = self.tenant(tenant, tp);
        loop {
            let held = Arc::clone(&t.calls).lock_owned().await;
            let now = self.tenant(tenant, tp);
            if Arc::ptr_eq(&now, &t) {
                return (t, held);
            }
            t = now;
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
        let spend = ask.spend();
        let mut s = t.lock();
        s.active = true;
        // A slice belongs to its day: past the store's midnight, the next call draws the new day's.
        if now >= s.valid_until || s.left || s.stale || now >= s.day_ends_at {
            return Local::Miss;
        }
        for (i, scope) in ask.scopes.iter().enumerate() {
            let Some(slice) = s.slices.get(scope.key) else { return Local::Miss };
            if slice.day != s.day {
                return Local::Miss;
            }
            if slice.covers(spend) {
                continue;
            }
            return match slice.blocked {
                Some(b) if b.until > now => Local::Refused {
                    scope: i,
                    reason: b.reason,
                    retry_after_ms: b.retry_at.saturating_sub(now).max(1),
                    told_ms: b.told_ms,
                },
                _ => Local::Miss,
            };
        }
        let mut tightest: Option<i64> = None;
        let mut scopes = Vec::with_capacity(ask.scopes.len());
        for scope in &ask.scopes {
            if let Some(slice) = s.slices.get_mut(scope.key) {
                scopes.push((scope.key.to_string(), slice.take(spend)));
                if slice.limits_tokens() {
                    tightest = Some(tightest.map_or(slice.tokens, |t| t.min(slice.tokens)));
                }
            }
        }
        let hold = LocalHold {
            scopes,
            held: ask.hold,
            prompt: ask.prompt,
            day: s.day,
            // Never past the replica's own lease record: the store frees its slots then.
            lease_until: now.saturating_add(s.tp.lease_ttl_ms).min(s.valid_until),
            refund_on_expiry: s.tp.expired_usage == ExpiredUsage::Refund,
            model: ask.model.to_string(),
            user: ask.user.map(str::to_string),
            tier: ask.tier,
            reserved_at: now,
            price: ask.price,
            token_weights: ask.token_weights,
        };
        s.holds.insert(ask.id.to_string(), hold);
        // The store's view at the last call, and what this replica holds free besides.
        let mut headroom = s.headroom.clone();
        if let (Some(w), Some(free)) = (headroom.tokens.as_mut(), tightest) {
            // (Never above the limit: the store's view may have refilled to it since.)
            let limit = i64::try_from(w.limit).unwrap_or(i64::MAX);
            w.remaining = w.remaining.saturating_add(free.max(0)).min(limit);
        }
        Local::Admitted { headroom }
    }

    /// The window's upkeep for one tenant: settles holds whose lease passed, forgets old settled
    /// holds, and says whether a call is due (anything held, asked, or to give back) and whether
    /// the replica is leaving the tenant. Returns the ids of the holds that expired since the last
    /// upkeep (here, or found so by a commit, release or renewal), for the expired-holds count.
    pub fn upkeep(&self, t: &TenantLease) -> (Vec<String>, Option<bool>) {
        let now = self.clock.now_ms();
        let retention = self.retention_ms;
        let mut s = t.lock();
        let mut due: Vec<String> =
            s.holds.iter().filter(|(_, h)| now >= h.lease_until).map(|(id, _)| id.clone()).collect();
        for id in &due {
            if let Some(hold) = s.holds.remove(id) {
                let charged = s.expire(&hold, now);
                s.enter(id, &hold, holds::Entered::Expired { charged }, now);
                s.close(id, Closed::Expired { hold, charged }, now, retention);
            }
        }
        due.append(&mut s.expired_by_touch);
        s.forget_closed(now);
        for slice in s.slices.values_mut() {
            slice.taken_before = std::mem::take(&mut slice.taken);
        }
        let active = std::mem::replace(&mut s.active, false) || !due.is_empty();
        // A call whose answer was lost is due at once.
        if active || !s.holds.is_empty() || s.pending.is_some() {
            s.idle_windows = 0;
            return (due, Some(false));
        }
        let holding = s.slices.values().any(Slice::owes);
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
            // Not while a call may still have to go again, nor while a slice owes the store.
            if s.holds.is_empty() && !s.active && s.pending.is_none() && !s.slices.values().any(Slice::owes) {
                s.left = true;
                drop(s);
                tenants.remove(tenant);
            }
        }
    }

    /// The sequence number of the tenant's lease call whose answer never came, if one is pending.
    pub fn unanswered(&self, tenant: &str) -> Option<u64> {
        self.existing(tenant).and_then(|t| t.lock().pending.as_ref().map(call::Prepared::seq))
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

impl State {
    /// The store's day at `now` (this replica's clock), as the last answer told it.
    fn today(&self, now: u64) -> u64 {
        if self.day_ends_at > 0 && now >= self.day_ends_at { self.day.saturating_add(1) } else { self.day }
    }
}

#[cfg(test)]
mod tests;
