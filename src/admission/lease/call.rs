//! One lease call: made ready from the slices (what to give back, what to ask for), sent, and its
//! reply applied to the slices.

use super::slice::{Blocked, Slice, signed};
use super::{Ask, Followups, Leases, TenantLease};
use std::sync::atomic::Ordering;

use crate::hold::{Amounts, DAY_MS, Refusal};
use crate::store::{LeaseCall, LeaseOutcome, LeaseReply, LeaseScope, Protocol, Store, StoreError};

/// What a lease call answered, for the caller to finish.
#[derive(Debug)]
pub(in crate::admission) struct Called {
    /// The store refused the asking request: (scope, reason, retry after ms).
    pub refused: Option<(usize, Refusal, u64)>,
    pub followups: Followups,
    /// This was an earlier call sent again; the caller's own call is still to make.
    pub resent: bool,
}

/// A lease call made ready: its number, its scopes, when it was first sent, the tenant's lease and
/// idle TTL. Kept until its answer is in hand, and sent again as it was until then.
#[derive(Debug, Clone)]
pub(super) struct Prepared {
    seq: u64,
    scopes: Vec<LeaseScope>,
    sent_at: u64,
    lease_ms: u64,
    idle_ttl_ms: u64,
    ending: bool,
    /// Ledger entries of the leased holds settled since the last call: appended by this call.
    entries: Vec<String>,
}

impl Prepared {
    pub(super) fn seq(&self) -> u64 {
        self.seq
    }
}

impl Leases {
    /// Builds a lease call for the tenant: every slice it has (or, for a miss, the asking
    /// request's scopes), giving back what is free beyond each slice's target, and asking for the
    /// target again (at least what `ask` needs).
    fn prepare(&self, t: &TenantLease, ask: Option<&Ask<'_>>, ending: bool) -> Prepared {
        let now = self.clock.now_ms();
        let share = self.settings.max_share;
        let mut s = t.lock();
        let today = s.today(now);
        s.last_call = now;
        let lapsed = now >= s.valid_until;
        let day = s.day;
        if let Some(ask) = ask {
            let tp = std::sync::Arc::clone(&s.tp);
            for a in &ask.scopes {
                // Under the tenant's terms of the moment (a reload retunes the slices it finds).
                s.slices
                    .entry(a.key.to_string())
                    .or_insert_with(|| Slice::new(a.of.clone(), a.of.limits(&tp), day, share));
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
            // A scope the policy no longer leases draws nothing (the store decides the request).
            let asking = ask.filter(|_| !slice.retired).map(Ask::spend);
            if let Some(hold) = asking {
                // A miss draws ahead (four of this request), within the share; the need may ask
                // for more, which the asking request then takes at once.
                let cap = slice.cap;
                target.tokens = target.tokens.max(hold.tokens.saturating_mul(4).min(cap.tokens));
                target.cost = target.cost.max(hold.cost.saturating_mul(4).min(cap.cost));
                target.requests = target.requests.max(4.min(cap.requests));
                target.slots = target.slots.max(1);
            } else if slice.day != today {
                // The window's call gives yesterday's slice back and draws nothing for today.
                target.tokens = 0;
                target.cost = 0;
            }
            scopes.push(slice.ready(&key, target, asking, today));
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        let entries = std::mem::take(&mut s.unentered);
        Prepared {
            seq,
            scopes,
            sent_at: now,
            lease_ms: s.tp.lease_ttl_ms,
            idle_ttl_ms: s.tp.idle_ttl_ms,
            ending,
            entries,
        }
    }

    /// Applies a lease call's reply. Returns the refusal, if the store refused the asking request.
    fn apply(
        &self,
        t: &TenantLease,
        scopes: &[LeaseScope],
        (sent_at, lease_ms): (u64, u64),
        sending: u64,
        resent: bool,
        reply: &LeaseReply,
    ) -> Option<(usize, Refusal, u64)> {
        let now = self.clock.now_ms();
        let mut s = t.lock();
        // The record's lease is the one the call was sent with, counted from its first sending.
        s.valid_until = sent_at.saturating_add(lease_ms);
        // A call sent again was made under the terms of its time: only a call made now draws the
        // slices under the policy in force.
        if !resent {
            s.stale = false;
        }
        s.day = reply.store_now / DAY_MS;
        let left_of_day = DAY_MS.saturating_sub(reply.store_now % DAY_MS);
        s.day_ends_at = sending.saturating_add(left_of_day);
        s.headroom = reply.headroom.clone();
        match &reply.outcome {
            LeaseOutcome::Granted(granted) => {
                for (scope, g) in scopes.iter().zip(granted) {
                    if let Some(slice) = s.slices.get_mut(&scope.key) {
                        slice.turn_day(reply.day);
                        slice.tokens = slice.tokens.saturating_add(signed(g.tokens));
                        slice.cost = slice.cost.saturating_add(signed(g.cost));
                        slice.requests = slice.requests.saturating_add(g.requests);
                        slice.slots_free = slice.slots_free.saturating_add(g.slots);
                        slice.blocked = None;
                    }
                }
                None
            }
            // An earlier call's refusal, answered again, is long past: it blocks nothing now.
            LeaseOutcome::Refused { .. } if resent => None,
            LeaseOutcome::Refused { reason, scope, retry_after_ms } => {
                let window = self.settings.window_ms;
                if let Some(slice) = scopes.get(*scope).and_then(|sc| s.slices.get_mut(&sc.key)) {
                    let until = now.saturating_add((*retry_after_ms).clamp(1, window));
                    let retry_at = now.saturating_add(*retry_after_ms);
                    slice.blocked = Some(Blocked { until, retry_at, reason: *reason, told_ms: *retry_after_ms });
                }
                Some((*scope, *reason, *retry_after_ms))
            }
        }
    }

    /// One lease call for the tenant, for `ask` (a miss) or for the window's upkeep (`None`); or,
    /// when a call's answer was lost, that call again, as it was (`Called::resent`: the caller
    /// applies what it hands over, then calls again for itself). A call that fails stays pending:
    /// what it gives back and what it charges are neither lost nor counted twice, since the store
    /// answers its re-send without running it a second time.
    pub async fn call<S: Store>(
        &self,
        protocol: &Protocol<S>,
        tenant: &str,
        t: &TenantLease,
        ask: Option<&Ask<'_>>,
        ending: bool,
        policy: (u32, u64),
    ) -> Result<Called, StoreError> {
        let now = self.clock.now_ms();
        let pending = t.lock().pending.clone();
        let pending = match pending {
            // Given up once half the store's memory of its answer has passed (a re-send still on
            // its way when the store forgets would run as a new call). Whether it ran is unknown:
            // what it gave back stays charged (missing is never refunded twice), and what it
            // charged (debt, usage counted) is charged again by the next call; its ledger entries
            // are lost (logged), rather than entered twice.
            Some(p) if now.saturating_sub(p.sent_at) >= p.idle_ttl_ms / 2 => {
                tracing::warn!(
                    tenant,
                    seq = p.seq,
                    entries = p.entries.len(),
                    "a lease call unanswered for half as long as the store remembers answers: given up"
                );
                let mut s = t.lock();
                s.pending = None;
                for scope in &p.scopes {
                    if let Some(slice) = s.slices.get_mut(&scope.key) {
                        slice.charge_again(scope);
                    }
                }
                None
            }
            other => other,
        };
        let (call, resent) = match pending {
            // Its asking request, if any, was answered long ago: only its scopes' state counts.
            Some(pending) => (pending, true),
            None => (self.prepare(t, ask, ending), false),
        };
        let (refused, followups) = self.send(protocol, tenant, t, call, resent, policy).await?;
        Ok(Called { refused: refused.filter(|_| !resent), followups, resent })
    }

    /// Sends `call`, pending until its answer is in hand, and applies the answer to the slices.
    async fn send<S: Store>(
        &self,
        protocol: &Protocol<S>,
        tenant: &str,
        t: &TenantLease,
        call: Prepared,
        resent: bool,
        (sweep_batch, concurrency_retry_cap_ms): (u32, u64),
    ) -> Result<(Option<(usize, Refusal, u64)>, Followups), StoreError> {
        t.lock().pending = Some(call.clone());
        let Prepared { seq, scopes, sent_at, lease_ms, idle_ttl_ms, ending, entries } = call;
        let lease_call = LeaseCall {
            ledger: self.ledger,
            entries,
            tenant,
            replica: &self.replica,
            lease_ms,
            idle_ttl_ms,
            sweep_batch,
            concurrency_retry_cap_ms,
            ending,
            seq,
            scopes,
        };
        let sending = self.clock.now_ms();
        let reply = match protocol.lease(&lease_call).await {
            Ok(reply) => reply,
            Err(e) => {
                // The store refused the call itself (a script error, a reply it could not
                // shape): it did not run, and sending it again would fail again.
                if !e.is_transient() {
                    t.lock().pending = None;
                }
                return Err(e);
            }
        };
        t.lock().pending = None;
        // The lease record's lease counts from the first sending: the store's may be later, never
        // earlier.
        let refused = self.apply(t, &lease_call.scopes, (sent_at, lease_ms), sending, resent, &reply);
        Ok((refused, Followups { forwarded: reply.forwarded, released: reply.swept }))
    }
}
