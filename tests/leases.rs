//! Leasing (`leasing:` in the policy): replicas decide from slices drawn from the store. Every
//! scenario runs on the embedded store (manual clock), a single Redis and the Cluster, with two
//! replicas (two `Admission`s, each its own replica id) on one keyspace.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use support::{Harness, TOP_SEPARATOR, admitted, denied};
use tollgate::admission::{Attributes, KeyRepeat, Reason};
use tollgate::hold::{CommitOutcome, Counted, Detail, ReleaseOutcome};
use tollgate::store::{Reply, Script, Store, StoreError, keys};

/// Counts the calls of each script that reach the store.
#[derive(Clone)]
struct Counting<S> {
    inner: S,
    leases: Arc<AtomicU32>,
    others: Arc<AtomicU32>,
}

impl<S: Store> Store for Counting<S> {
    async fn load(&self, script: &Script) -> Result<(), StoreError> {
        self.inner.load(script).await
    }

    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        let counter = if script.name == "lease" { &self.leases } else { &self.others };
        counter.fetch_add(1, Ordering::SeqCst);
        self.inner.eval(script, keys, args).await
    }
}

fn counted<S: Store>(inner: S) -> (Counting<S>, Arc<AtomicU32>, Arc<AtomicU32>) {
    let (leases, others) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    (Counting { inner, leases: Arc::clone(&leases), others: Arc::clone(&others) }, leases, others)
}

fn policy(limits: &str) -> String {
    format!("leasing:\n  window_ms: 250\n  max_share: 0.5\n{TOP_SEPARATOR}limits:\n{limits}")
}

/// 1 token per second: refill cannot move a number while a test runs.
const SLOW: &str = "  tokens_per_minute: 60\n  burst_tokens: 10000\n";

mod scenarios {
    use super::*;

    /// A lease call the store refuses (here for slots it needs beyond the scope's concurrency)
    /// that gives requests back to a scope whose hash is gone (run out of its idle TTL while its
    /// replica was away) writes the scope again, and leaves it a TTL: no key lives forever.
    pub async fn a_refused_lease_call_leaves_what_it_writes_a_ttl<S: Store + Clone>(h: Harness<S>) {
        use tollgate::hold::{Amounts, ScopeLimits};
        use tollgate::store::phase::lease::{LeaseCall, LeaseOutcome, LeaseScope};
        let tp = Arc::clone(&h.admission.policy().tenants[&h.tenant]);
        let scope = keys::tenant_scope(&h.tenant);
        assert!(h.scope(&scope).await.is_none(), "a tenant no call has touched");
        let slots = Amounts { slots: 2, ..Amounts::default() };
        let call = LeaseCall {
            tenant: &h.tenant,
            replica: "0123456789ab",
            lease_ms: tp.lease_ttl_ms,
            idle_ttl_ms: tp.idle_ttl_ms,
            sweep_batch: 10,
            concurrency_retry_cap_ms: 1_000,
            ending: false,
            seq: 1,
            scopes: vec![LeaseScope {
                key: scope.clone(),
                limits: ScopeLimits::from(&tp.limits),
                back_tokens: 0,
                back_cost: 0,
                back_day: h.now_ms() / tollgate::hold::DAY_MS,
                back_earlier: None,
                charge_tokens: 0,
                charge_cost: 0,
                back_requests: 1,
                held_slots: 1,
                need: slots,
                want: slots,
            }],
            ledger: None,
            entries: Vec::new(),
        };
        let reply = h.admission.protocol().lease(&call).await.unwrap();
        assert!(matches!(reply.outcome, LeaseOutcome::Refused { .. }), "{reply:?}");
        let view = h.scope(&scope).await.expect("the scope, written by the returns");
        assert_eq!(view.num("c"), 1.0, "the slot its replica holds: {view:?}");
        assert!(view.pttl > 0, "the scope has no TTL: {view:?}");
        for (key, view) in h.snapshot(&[]).await {
            assert_eq!(view.pttl, 1, "{key} has no TTL: {view:?}");
        }
    }

    /// After the first call, decisions and commits are made in memory: no store call at all.
    pub async fn a_lease_hit_never_leaves_the_process<S: Store + Clone>(h: Harness<S>) {
        let (store, leases, others) = counted(h.admission.protocol().store().clone());
        let r = h.wrapped(|_| store).await;
        let first = r.reserve(10, 90).await;
        let id = admitted(&first).reservation_id.clone();
        assert!(id.ends_with(&format!("@{}", r.admission.replica().unwrap())), "{id}");
        assert_eq!(leases.load(Ordering::SeqCst), 1, "the first reserve draws a slice");
        for _ in 0..3 {
            let d = r.reserve(10, 90).await;
            let id = admitted(&d).reservation_id.clone();
            r.admission.commit(&id, 10, 20).await.unwrap();
        }
        assert_eq!(leases.load(Ordering::SeqCst), 1, "hits and commits make no lease call");
        assert_eq!(others.load(Ordering::SeqCst), 0, "and no other store call");
        // What the slice holds is charged in the store: 4 holds' worth drawn ahead (400 tokens).
        let drawn = 10_000.0 - r.tenant_scope().await.num("t");
        assert!((399.0..=400.0).contains(&drawn), "{drawn} tokens drawn");
    }

    /// Giving everything back leaves the store as one replica deciding alone would have: usage
    /// charged, holds refunded, slots free.
    pub async fn the_books_balance_when_the_slices_come_back<S: Store + Clone>(h: Harness<S>) {
        let mut ids = Vec::new();
        for _ in 0..3 {
            ids.push(admitted(&h.reserve(10, 90).await).reservation_id.clone());
        }
        for id in &ids[..2] {
            let c = h.admission.commit(id, 10, 20).await.unwrap();
            assert_eq!(c.usage().map(|u| (u.used, u.refunded)), Some((30, 70)));
        }
        assert_eq!(
            h.admission.release(&ids[2]).await.unwrap(),
            ReleaseOutcome::Released { refunded: 100, repeated: false }
        );
        h.admission.lease_tick(true).await.unwrap();
        let scope = h.tenant_scope().await;
        let charged = 10_000.0 - scope.num("t");
        assert!((59.0..=60.0).contains(&charged), "two commits of 30 charged, not {charged}");
        assert_eq!(scope.fields.get("c").map(String::as_str), Some("0"), "every slot back: {scope:?}");
        assert_eq!(scope.num("du"), 60.0, "the day's usage is what was used");
    }

    /// Slots are leased exclusively: two replicas together never hold more than the scope allows.
    pub async fn concurrency_is_exact_across_replicas<S: Store + Clone>(h: Harness<S>) {
        let other = h.wrapped(|s| s).await;
        let mut admitted_ids = Vec::new();
        for i in 0..6 {
            let r = if i % 2 == 0 { &h } else { &other };
            match r.reserve(1, 1).await {
                tollgate::admission::Decision::Admitted(a) => admitted_ids.push(a.reservation_id),
                d => assert_eq!(denied(&d).reason, Reason::Concurrency),
            }
        }
        assert!(admitted_ids.len() <= 4, "{} admitted with 4 slots", admitted_ids.len());
        assert_eq!(h.in_flight().await, 4.0, "the store counts every slot leased");
        // Slots a replica does not use come back with its window, and the other can take them.
        for id in &admitted_ids {
            h.admission.commit(id, 1, 1).await.unwrap();
        }
        h.admission.lease_tick(true).await.unwrap();
        other.admission.lease_tick(true).await.unwrap();
        assert_eq!(h.in_flight().await, 0.0);
        for _ in 0..4 {
            admitted(&other.reserve(1, 1).await);
        }
        assert_eq!(denied(&other.reserve(1, 1).await).reason, Reason::Concurrency);
    }

    /// A commit or release that reaches another replica is forwarded through the store, and the
    /// owner applies it with its next window: charged once.
    pub async fn a_commit_at_another_replica_reaches_the_owner<S: Store + Clone>(h: Harness<S>) {
        let other = h.wrapped(|s| s).await;
        let id = admitted(&h.reserve(10, 90).await).reservation_id.clone();
        let released = admitted(&h.reserve(10, 90).await).reservation_id.clone();
        assert_eq!(other.admission.commit(&id, 10, 20).await.unwrap(), CommitOutcome::Forwarded);
        assert_eq!(other.admission.release(&released).await.unwrap(), ReleaseOutcome::Forwarded);
        h.admission.lease_tick(false).await.unwrap();
        let again = h.admission.commit(&id, 10, 20).await.unwrap();
        assert!(again.usage().is_some_and(|u| u.duplicate && u.used == 30), "{again:?}");
        assert!(matches!(
            h.admission.release(&released).await.unwrap(),
            ReleaseOutcome::Released { repeated: true, .. }
        ));
        h.admission.lease_tick(true).await.unwrap();
        let charged = 10_000.0 - h.tenant_scope().await.num("t");
        assert!((29.0..=30.0).contains(&charged), "one commit of 30 charged, not {charged}");
        assert_eq!(h.in_flight().await, 0.0);
    }

    /// A replica that stops without giving back: its slots return when its lease record runs out
    /// (the tenant's lease), found by the next sweep; its tokens stay charged.
    pub async fn a_dead_replicas_slots_come_back_after_its_lease<S: Store + Clone>(h: Harness<S>) {
        let dead = h.wrapped(|s| s).await;
        for _ in 0..4 {
            admitted(&dead.reserve(1, 1).await);
        }
        drop(dead);
        assert_eq!(denied(&h.reserve(1, 1).await).reason, Reason::Concurrency);
        h.advance(1_001).await;
        admitted(&h.reserve(1, 1).await);
    }

    /// The store's refusal is answered from memory until its wait (at most a window) has passed.
    pub async fn a_refusal_is_remembered_for_its_wait<S: Store + Clone>(h: Harness<S>) {
        let (store, leases, _) = counted(h.admission.protocol().store().clone());
        let r = h.wrapped(|_| store).await;
        admitted(&r.reserve(0, 8_000).await);
        let calls = leases.load(Ordering::SeqCst);
        for _ in 0..5 {
            let no = r.reserve(0, 8_000).await;
            assert_eq!(denied(&no).reason, Reason::TokenRate);
            // 6,000 tokens short at 1 token/s: the store's wait, not the window's.
            assert!(denied(&no).retry_after_ms.is_some_and(|ms| ms > 5_000_000), "{no:?}");
        }
        assert_eq!(leases.load(Ordering::SeqCst), calls.saturating_add(1), "one call refused; the rest from memory");
    }

    /// A concurrency refusal the slices answer says what kind of wait it is, as a store decision's
    /// does: the only slot is this replica's own lease, which nobody can say when a commit frees,
    /// so the store told the back-off; remembered, the refusal says what is left of it.
    pub async fn a_leased_concurrency_refusal_says_its_wait<S: Store + Clone>(h: Harness<S>) {
        admitted(&h.reserve(1, 1).await);
        let no = h.reserve(1, 1).await;
        let no = denied(&no);
        assert_eq!((no.reason, no.retry_after_ms), (Reason::Concurrency, Some(1_000)), "{no:?}");
        assert!(no.message.contains("cannot be predicted") && no.message.contains("back off 1000 ms"), "{no:?}");
        if h.exact_time() {
            h.advance(100).await; // (Within the window, 250 ms, that a refusal is remembered.)
            let again = h.reserve(1, 1).await;
            let again = denied(&again);
            assert_eq!(again.retry_after_ms, Some(900), "from memory: {again:?}");
            assert!(
                again.message.contains("cannot be predicted") && again.message.contains("back off 900 ms"),
                "{again:?}"
            );
        }
    }

    /// A strict tenant's decisions, and any request with an idempotency key, go to the store: their
    /// holds are store holds (no replica in the id), charged there at once.
    pub async fn strict_tenants_and_keyed_requests_bypass_leasing<S: Store + Clone>(h: Harness<S>) {
        let d = h.reserve(10, 90).await;
        let id = admitted(&d).reservation_id.clone();
        assert!(!id.contains('@'), "{id}");
        let charged = 10_000.0 - h.tenant_scope().await.num("t");
        assert!((99.0..=100.0).contains(&charged), "the hold itself, no slice: {charged}");
        assert_eq!(h.admission.leased_holds(&h.tenant), (0, 0));
    }

    pub async fn a_request_with_an_idempotency_key_is_decided_by_the_store<S: Store + Clone>(h: Harness<S>) {
        let d = h.admission.reserve(&h.keyed(10, 90, "k1", KeyRepeat::ReturnHold)).await;
        assert!(!admitted(&d).reservation_id.contains('@'), "{d:?}");
        let leased = h.reserve(10, 90).await;
        assert!(admitted(&leased).reservation_id.contains('@'), "{leased:?}");
    }

    /// A lease call that makes the tenant's lease index anew (every hold before it settled, so
    /// Redis deleted the index) gives it the idle TTL, and the tenant's scope forgets how long the
    /// index it knew lived (`lk`): the next store hold, beside the replica's slots, gives the index
    /// the TTL a hold needs rather than trusting what the deleted one had.
    pub async fn an_index_a_lease_call_makes_anew_gets_its_ttl_from_the_next_store_hold<S: Store + Clone>(
        h: Harness<S>,
    ) {
        let keyed = |key| h.keyed(10, 90, key, KeyRepeat::ReturnHold);
        let index = keys::leases(&h.tenant);
        // Two store holds: the second, beside the first, notes how long the index lives.
        let first = admitted(&h.admission.reserve(&keyed("k1")).await).reservation_id.clone();
        let second = admitted(&h.admission.reserve(&keyed("k2")).await).reservation_id.clone();
        h.admission.commit(&first, 10, 20).await.unwrap();
        h.admission.commit(&second, 10, 20).await.unwrap();
        assert!(h.scope(&index).await.is_none(), "every hold settled: no index");
        assert!(h.tenant_scope().await.fields.contains_key("lk"), "{:?}", h.tenant_scope().await);
        assert!(admitted(&h.reserve(10, 90).await).reservation_id.contains('@'), "a leased hold");
        assert!(!h.tenant_scope().await.fields.contains_key("lk"), "{:?}", h.tenant_scope().await);
        admitted(&h.admission.reserve(&keyed("k3")).await);
        let idle = i64::try_from(h.admission.policy().tenants[&h.tenant].idle_ttl_ms).unwrap();
        let ttl = h.scope(&index).await.unwrap().pttl;
        assert!(ttl > idle, "the store hold lengthened the index's TTL: {ttl} ms, idle {idle}");
    }

    /// Beside a replica's lease the lease index lives on when the tenant's store holds all settle,
    /// and the holds hash goes: the next store hold makes it anew without a TTL (it trusts `lk`).
    /// A renew that gives it one, the idle TTL from now, shorter than `lk`, takes `lk` away, so
    /// the store hold after it gives the holds hash the TTL a hold needs.
    pub async fn a_renew_that_gives_the_holds_hash_its_ttl_takes_lk_away<S: Store + Clone>(h: Harness<S>) {
        let keyed = |key| h.keyed(10, 90, key, KeyRepeat::ReturnHold);
        let holds = keys::holds(&h.tenant);
        assert!(admitted(&h.reserve(10, 90).await).reservation_id.contains('@'), "a leased hold");
        let a = admitted(&h.admission.reserve(&keyed("k1")).await).reservation_id.clone();
        let b = admitted(&h.admission.reserve(&keyed("k2")).await).reservation_id.clone();
        h.admission.commit(&a, 10, 20).await.unwrap();
        h.admission.commit(&b, 10, 20).await.unwrap();
        assert!(h.scope(&holds).await.is_none(), "every store hold settled: no holds hash");
        assert!(h.in_flight().await > 0.0, "the replica's slots");
        let c = admitted(&h.admission.reserve(&keyed("k3")).await).reservation_id.clone();
        assert_eq!(h.scope(&holds).await.unwrap().pttl, -1, "made anew beside the replica's slots");
        h.admission.renew(&c, 0).await.unwrap();
        assert!(!h.tenant_scope().await.fields.contains_key("lk"), "{:?}", h.tenant_scope().await);
        admitted(&h.admission.reserve(&keyed("k4")).await);
        let idle = i64::try_from(h.admission.policy().tenants[&h.tenant].idle_ttl_ms).unwrap();
        let ttl = h.scope(&holds).await.unwrap().pttl;
        assert!(ttl > idle, "the store hold lengthened the holds hash's TTL: {ttl} ms, idle {idle}");
    }

    /// A budget leasing does not decide from slices (an hour's or a week's, one side's, periods in
    /// a zone) sends the tenant's decisions to the store: its holds are store holds, and two
    /// replicas racing on it admit exactly the budget.
    pub async fn a_budget_leasing_does_not_decide_goes_to_the_store<S: Store + Clone>(h: Harness<S>) {
        let other = h.wrapped(|s| s).await;
        let (a, b) = tokio::join!(
            futures_util::future::join_all((0..4).map(|_| h.reserve(0, 100))),
            futures_util::future::join_all((0..4).map(|_| other.reserve(0, 100)))
        );
        let admitted: Vec<&tollgate::admission::Admitted> = a
            .iter()
            .chain(&b)
            .filter_map(|d| match d {
                tollgate::admission::Decision::Admitted(a) => Some(a),
                _ => None,
            })
            .collect();
        assert_eq!(admitted.len(), 5, "500 tokens, 100 a request: {a:?} {b:?}");
        assert!(admitted.iter().all(|a| !a.reservation_id.contains('@')), "store holds: {admitted:?}");
        assert_eq!(h.admission.leased_holds(&h.tenant), (0, 0));
        assert_eq!(other.admission.leased_holds(&h.tenant), (0, 0));
    }

    /// A pooled request's pool leg is decided at the store, whatever leasing its tenant has (its
    /// tenant leg may be decided from slices): it must see every replica's holds, and the
    /// provider's limits with them. Two leasing replicas racing on a provider's 500 tokens, of
    /// which standard requests may use 80%, admit exactly four requests of 100. A commit that
    /// reaches the other replica is forwarded to the owner, which settles the provider with what
    /// its tenant leg charged.
    pub async fn a_pool_leg_is_decided_at_the_store<S: Store + Clone>(h: Harness<S>) {
        let other = h.wrapped(|s| s).await;
        let (a, b) = tokio::join!(
            futures_util::future::join_all((0..4).map(|_| h.reserve(0, 100))),
            futures_util::future::join_all((0..4).map(|_| other.reserve(0, 100)))
        );
        let admitted = a.iter().chain(&b).filter(|d| matches!(d, tollgate::admission::Decision::Admitted(_))).count();
        assert_eq!(admitted, 4, "400 tokens, 100 a request: {a:?} {b:?}");
        let refused = a.iter().chain(&b).filter_map(|d| match d {
            tollgate::admission::Decision::Denied(d) => Some(d.reason),
            _ => None,
        });
        assert!(refused.into_iter().all(|r| r == Reason::ProviderRate));
        assert_eq!(h.pool_load().await.0, 4);
        // Their tenant legs were leased: the replicas' slices hold them.
        let leased = h.admission.leased_holds(&h.tenant).0 + other.admission.leased_holds(&h.tenant).0;
        assert_eq!(leased, 4);
        let owned = a.iter().chain(&b).find_map(|d| match d {
            tollgate::admission::Decision::Admitted(x)
                if x.reservation_id.ends_with(&format!("@{}", h.admission.replica().unwrap())) =>
            {
                Some(x.reservation_id.clone())
            }
            _ => None,
        });
        let owned = owned.expect("a hold of the first replica");
        assert_eq!(other.admission.commit(&owned, 0, 30).await.unwrap(), CommitOutcome::Forwarded);
        assert_eq!(h.pool_load().await.0, 4, "the forwarding replica leaves the pool leg to the owner");
        h.admission.lease_tick(false).await.unwrap();
        assert_eq!(h.pool_load().await.0, 3);
        let day = tollgate::hold::BudgetKey::new(tollgate::hold::Measure::Tokens, tollgate::hold::Period::Day);
        let provider = h.admission.pool_status(&h.pool).await.unwrap().provider.unwrap().used;
        assert_eq!(provider.period(day).counted, 330, "three held, one that used 30");
        let cost = tollgate::hold::BudgetKey::new(tollgate::hold::Measure::Cost, tollgate::hold::Period::Day);
        assert_eq!(provider.period(cost).counted, 3 * 300_000 + 90_000, "at its price, not as held");
    }

    /// A client re-sends a command whose connection dropped after it was written: every lease call
    /// here runs twice. The second run is a re-send of the first and changes nothing, so the
    /// returns, the debt and the draws count once: the day's usage is what was used.
    pub async fn a_re_sent_lease_call_counts_once<S: Store + Clone>(h: Harness<S>) {
        use support::faults::Resend;
        let r = h.wrapped(|s| Resend { inner: s, scripts: &["lease"] }).await;
        let mut used = 0.0;
        for round in 0..3 {
            for _ in 0..3 {
                let id = admitted(&r.reserve(10, 90).await).reservation_id.clone();
                r.admission.commit(&id, 10, 20).await.unwrap();
                used += 30.0;
            }
            // And one overrun: 300 used of a 100 hold, debt the next call charges.
            let id = admitted(&r.reserve(10, 90).await).reservation_id.clone();
            r.admission.commit_counted(&id, Counted::exact(10, 290)).await.unwrap();
            used += 300.0;
            r.admission.lease_tick(round == 2).await.unwrap();
        }
        let scope = r.tenant_scope().await;
        assert_eq!(scope.num("du"), used, "the day's usage is what was used, once: {scope:?}");
        let charged = 10_000.0 - scope.num("t");
        assert!((used - 1.0..=used).contains(&charged), "{used} used, {charged} charged");
        assert_eq!(scope.fields.get("c").map(String::as_str), Some("0"), "every slot back: {scope:?}");
    }

    /// A lease call that never reaches the store (an open breaker, a timeout) loses nothing it
    /// carried: the debt of an overrun and the tokens it gave back go with the next call.
    pub async fn a_failed_lease_call_loses_no_debt<S: Store + Clone>(h: Harness<S>) {
        use support::faults::{Fault, Queued};
        let faults = Queued::new(h.admission.protocol().store().clone(), "lease");
        let r = h.wrapped(|_| faults.clone()).await;
        let id = admitted(&r.reserve(10, 90).await).reservation_id.clone();
        let c = r.admission.commit_counted(&id, Counted::exact(10, 4_990)).await.unwrap();
        assert_eq!(c.usage().map(|u| u.overrun), Some(4_900));
        faults.next(Fault::Unreachable(1));
        assert!(r.admission.lease_tick(false).await.is_err(), "the window's call never reached the store");
        r.admission.lease_tick(true).await.unwrap();
        let scope = r.tenant_scope().await;
        assert_eq!(scope.num("du"), 5_000.0, "5,000 used, 5,000 charged: {scope:?}");
    }

    /// A lease call that ran but whose answer was lost loses neither what it gave back nor the
    /// operations other replicas forwarded: the re-send answers as the call did, and the
    /// operations stay in the store until the owner says it applied them.
    pub async fn a_lost_lease_answer_loses_no_forwarded_commit<S: Store + Clone>(h: Harness<S>) {
        use support::faults::{Fault, Queued};
        let faults = Queued::new(h.admission.protocol().store().clone(), "lease");
        let owner = h.wrapped(|_| faults.clone()).await;
        let other = h.wrapped(|s| s).await;
        let id = admitted(&owner.reserve(10, 90).await).reservation_id.clone();
        assert_eq!(other.admission.commit(&id, 10, 20).await.unwrap(), CommitOutcome::Forwarded);
        faults.next(Fault::LostReply);
        assert!(owner.admission.lease_tick(false).await.is_err(), "the answer was lost");
        owner.admission.lease_tick(false).await.unwrap();
        let again = owner.admission.commit(&id, 10, 20).await.unwrap();
        assert!(again.usage().is_some_and(|u| u.duplicate && u.used == 30 && !u.late), "committed once: {again:?}");
        owner.admission.lease_tick(true).await.unwrap();
        other.admission.lease_tick(true).await.unwrap();
        let scope = owner.tenant_scope().await;
        assert_eq!(scope.num("du"), 30.0, "the forwarded commit charged once: {scope:?}");
    }

    /// A reload that removes a tenant: the replica gives that tenant's slices back at its next
    /// window, under the terms they were leased with; only what was used stays charged.
    pub async fn a_tenant_a_reload_removes_gives_its_slices_back<S: Store + Clone>(h: Harness<S>) {
        let id = admitted(&h.reserve(10, 90).await).reservation_id.clone();
        h.admission.commit(&id, 10, 20).await.unwrap();
        let drawn = 10_000.0 - h.tenant_scope().await.num("t");
        assert!(drawn >= 399.0, "a slice was drawn: {drawn}");
        let mut policy = tollgate::config::Policy::clone(&h.admission.policy());
        policy.tenants.remove(&h.tenant);
        h.admission.reload(policy);
        h.admission.lease_tick(false).await.unwrap();
        let charged = 10_000.0 - h.tenant_scope().await.num("t");
        assert!((29.0..=30.0).contains(&charged), "30 used, {charged} still charged");
        assert_eq!(h.admission.leased_holds(&h.tenant), (0, 0), "the replica left the tenant");
    }

    /// A reload that tightens a limit reaches every slice at once: refunds of holds made before it
    /// refill a slice only to the new share, every call sends the new limits (none refills the
    /// bucket to the old capacity), and what the replicas can spend unseen is one new slice each.
    pub async fn a_reload_that_tightens_reaches_every_slice<S: Store + Clone>(h: Harness<S>) {
        let other = h.wrapped(|s| s).await;
        let mut ids = Vec::new();
        for _ in 0..8 {
            ids.push(admitted(&h.reserve(10, 490).await).reservation_id.clone());
        }
        admitted(&other.reserve(10, 90).await);
        // Burst 10,000 to 1,000: a share of 500 (max_share 0.5), where it was 5,000.
        let mut policy = tollgate::config::Policy::clone(&h.admission.policy());
        let mut tp = tollgate::config::TenantPolicy::clone(&policy.tenants[&h.tenant]);
        tp.limits.burst_tokens = Some(1_000);
        policy.tenants.insert(h.tenant.clone(), Arc::new(tp));
        h.admission.reload(policy.clone());
        other.admission.reload(policy);
        // A decision after the reload: its call draws under the new terms.
        admitted(&h.reserve(10, 490).await);
        // The holds made before come back nearly unused: 8 × 490 tokens refunded.
        for id in &ids {
            h.admission.commit(id, 10, 0).await.unwrap();
        }
        other.admission.lease_tick(false).await.unwrap();
        assert_eq!(h.tenant_scope().await.num("tc"), 1_000.0, "the other replica's call sent the new capacity");
        // A single store would admit two holds of 500 now (its bucket full at 1,000); the replicas
        // may add what each holds unseen, one slice of 500: at most four in all, where refunds up
        // to the old share would have let the first replica admit seven from memory alone.
        let mut admitted_now = 0;
        for i in 0..12 {
            let r = if i % 2 == 0 { &h } else { &other };
            if matches!(r.reserve(10, 490).await, tollgate::admission::Decision::Admitted(_)) {
                admitted_now += 1;
            }
        }
        assert!(admitted_now <= 4, "{admitted_now} holds of 500 admitted after the burst fell to 1,000");
        assert!(admitted_now >= 2, "what the bucket holds is still admitted: {admitted_now}");
    }

    /// A reload that stops limiting a scope (the model's): its slice gives everything back at the
    /// next call, and the request is still decided from the slices of the scopes that remain.
    pub async fn a_reload_that_stops_limiting_a_scope_gives_its_slice_back<S: Store + Clone>(h: Harness<S>) {
        let model = keys::model_scope(&h.tenant, "m");
        let id = admitted(&h.reserve(10, 90).await).reservation_id.clone();
        h.admission.commit(&id, 10, 20).await.unwrap();
        let drawn = 10_000.0 - h.scope(&model).await.unwrap().num("t");
        assert!(drawn > 30.5, "the model scope is leased: {drawn} drawn");
        let mut policy = tollgate::config::Policy::clone(&h.admission.policy());
        let mut tp = tollgate::config::TenantPolicy::clone(&policy.tenants[&h.tenant]);
        tp.models.remove("m");
        policy.tenants.insert(h.tenant.clone(), Arc::new(tp));
        h.admission.reload(policy);
        h.admission.lease_tick(false).await.unwrap();
        let charged = 10_000.0 - h.scope(&model).await.unwrap().num("t");
        assert!((29.0..=30.0).contains(&charged), "30 used, {charged} still charged: the slice came back");
        let d = h.reserve(10, 90).await;
        let id = admitted(&d).reservation_id.clone();
        let c = h.admission.commit(&id, 10, 20).await.unwrap();
        assert_eq!(h.admission.leased_holds(&h.tenant), (0, 2), "still leased: both settled in memory");
        assert_eq!(c.usage().map(|u| (u.used, u.duplicate)), Some((30, false)), "{c:?}");
        h.admission.lease_tick(true).await.unwrap();
        let charged = 10_000.0 - h.tenant_scope().await.num("t");
        assert!((59.0..=60.0).contains(&charged), "60 used, {charged} charged");
        let charged = 10_000.0 - h.scope(&model).await.unwrap().num("t");
        assert!((29.0..=30.0).contains(&charged), "the model scope charged nothing more: {charged}");
    }

    /// A budget over the month or in money is leased as a daily token budget is: drawn with the
    /// slices, never exceeded however the holds fall on two replicas, and charged to the unit
    /// once the slices come back, as is what the scope does not lease. `field` is the scope's
    /// counter (`mu` tokens this month, `dc` money today), `budget` its limit, and each hold (10
    /// prompt + 20 output) commits 10 + 10, which counts 20 tokens or 40,000 nanos (model `m`:
    /// 1,000 and 3,000 nanos a token).
    pub async fn a_long_or_money_budget_is_leased_and_exact<S: Store + Clone>(h: Harness<S>, field: &str, budget: f64) {
        let (per_commit, per_hold) = if field == "mu" { (20.0, 30.0) } else { (40_000.0, 70_000.0) };
        let other = h.wrapped(|s| s).await;
        let (mut committed, mut refused) = (0.0, None);
        for i in 0..200 {
            let r = if i % 2 == 0 { &h } else { &other };
            match r.reserve(10, 20).await {
                tollgate::admission::Decision::Admitted(a) => {
                    r.admission.commit(&a.reservation_id, 10, 10).await.unwrap();
                    committed += per_commit;
                }
                d => {
                    refused = Some(denied(&d).reason);
                    break;
                }
            }
            let counted = h.tenant_scope().await.num(field);
            assert!(counted <= budget, "{field} {counted} past the budget {budget}");
        }
        assert_eq!(refused, Some(Reason::Budget), "the budget ran out after {committed}");
        // Every hold was decided and settled from the slices, in the replicas' memory.
        let in_memory = h.admission.leased_holds(&h.tenant).1 + other.admission.leased_holds(&h.tenant).1;
        assert_eq!(in_memory as f64, committed / per_commit, "holds settled from the slices");
        // Near the budget: a single store refuses a hold with less left than it takes; leasing
        // may also refuse while the other replica sits on its slice (at most half the budget).
        assert!(committed >= budget / 2.0 - per_hold, "{committed} of {budget} used before a refusal");
        h.admission.lease_tick(true).await.unwrap();
        other.admission.lease_tick(true).await.unwrap();
        assert_eq!(h.tenant_scope().await.num(field), committed, "{field}: what was committed, to the unit");
        // The usage the scope does not lease (money beside a monthly token budget) is counted too,
        // as a store hold counts it: both kinds, for the day and the month, to the unit.
        let holds = committed / per_commit;
        let scope = h.tenant_scope().await;
        for (f, per) in [("du", 20.0), ("mu", 20.0), ("dc", 40_000.0), ("mc", 40_000.0)] {
            assert_eq!(scope.num(f), holds * per, "{f} after {holds} holds");
        }
    }

    /// With a ledger, every leased hold is entered, by the replica's next lease call, as the store's
    /// scripts enter theirs: once (a re-sent call appends nothing), with what it charged and cost.
    pub async fn leased_holds_are_entered_in_the_ledger<S: Store + Clone>(h: Harness<S>) {
        use support::faults::Resend;
        let r = h.wrapped(|s| Resend { inner: s, scripts: &["lease"] }).await;
        let ids: Vec<String> = futures_util::future::join_all((0..3).map(|_| r.reserve(10, 90)))
            .await
            .iter()
            .map(|d| admitted(d).reservation_id.clone())
            .collect();
        // Model m has no terms for cached tokens: 4 read from the cache count whole, but are entered.
        let detail = Detail { cache_read: Some(4), cache_write: None, reasoning: Some(2) };
        let c = r.admission.commit_counted(&ids[0], Counted::Exact { prompt: 10, output: 20, detail }).await.unwrap();
        assert_eq!(c.usage().map(|u| u.cost_nanos), Some(70_000), "the commit reports the cost: {c:?}");
        r.admission.commit_counted(&ids[1], Counted::Metered { output: 50 }).await.unwrap();
        r.admission.release(&ids[2]).await.unwrap();
        r.admission.lease_tick(true).await.unwrap();
        let ledger = h.ledger_of(&h.tenant).await;
        assert_eq!(ledger.len(), 3, "one entry a hold, each once: {ledger:?}");
        let entry = |id: &str| ledger.iter().find(|e| e["id"] == id).unwrap_or_else(|| panic!("{id} entered"));
        let fields = |id: &str, names: &[&str]| names.iter().map(|f| entry(id)[*f].clone()).collect::<Vec<_>>();
        let what = ["outcome", "usage", "prompt_tokens", "output_tokens", "reserved_tokens", "charged_tokens"];
        assert_eq!(fields(&ids[0], &what), ["committed", "exact", "10", "20", "100", "30"]);
        assert_eq!(fields(&ids[1], &what), ["committed", "metered", "10", "50", "100", "60"]);
        assert_eq!(fields(&ids[2], &what), ["released", "none", "", "", "100", "0"]);
        assert_eq!(entry(&ids[0])["tenant"], h.tenant);
        let said = ["cache_read_tokens", "cache_write_tokens", "reasoning_tokens"];
        assert_eq!(fields(&ids[0], &said), ["4", "", "2"]);
        assert_eq!(fields(&ids[1], &said), ["", "", ""]);
        let ending = ["ending"];
        assert_eq!(
            [&ids[0], &ids[1], &ids[2]].map(|id| fields(id, &ending)[0].clone()),
            ["completed", "metered", "released"]
        );
        // Model m costs 1 and 3 per million tokens: 10 × 1,000 + 20 × 3,000 nanos.
        assert_eq!(entry(&ids[0])["cost_nanos"], "70000");
        let charged: f64 = ledger.iter().map(|e| e["charged_tokens"].parse::<f64>().unwrap()).sum();
        assert_eq!(h.tenant_scope().await.num("du"), charged, "the entries charge the day's usage exactly");
        if let Some(file) = &h.ledger_file {
            let lines = std::fs::read_to_string(file).unwrap();
            assert_eq!(lines.lines().count(), 3, "and the embedded store's ledger file has them: {lines}");
        }
        if !h.exact_time() {
            return;
        }
        // A hold nobody settles: entered as expired, charged as held; a late commit then enters
        // what it used, superseding that entry.
        // It comes later than the retention of settled holds (a minute) and within a lease past
        // the expiry, with the replica's windows going on meanwhile: an expired hold waits that
        // long for its late commit.
        let id = admitted(&r.reserve(10, 90).await).reservation_id.clone();
        r.advance(121_000).await;
        r.admission.lease_tick(false).await.unwrap();
        for _ in 0..70 {
            r.advance(1_000).await;
            r.admission.lease_tick(false).await.unwrap();
        }
        let late = r.admission.commit(&id, 10, 5).await.unwrap();
        assert!(late.usage().is_some_and(|u| u.late && u.used == 15), "{late:?}");
        r.admission.lease_tick(true).await.unwrap();
        let ledger = h.ledger_of(&h.tenant).await;
        let mine: Vec<Vec<String>> = ledger
            .iter()
            .filter(|e| e["id"] == id)
            .map(|e| ["outcome", "usage", "charged_tokens", "ending"].iter().map(|f| e[*f].clone()).collect())
            .collect();
        assert_eq!(mine, [["expired", "held", "100", "expired"], ["late_committed", "exact", "15", "completed"]]);
    }

    /// A leased hold charges cached prompt tokens as a store hold does (the conformance scenario
    /// of the same name gives the arithmetic), and so does one committed at another replica.
    pub async fn cached_prompt_tokens_of_a_leased_hold_count_as_in_the_store<S: Store + Clone>(h: Harness<S>) {
        let cached = Attributes { model: Some("cached".into()), ..h.attributes(1000, 100) };
        let id = admitted(&h.admission.reserve(&cached).await).reservation_id.clone();
        assert!(id.contains('@'), "leased: {id}");
        let detail = Detail { cache_read: Some(600), cache_write: Some(200), reasoning: Some(10) };
        let counted = Counted::Exact { prompt: 1000, output: 50, detail };
        let u = h.admission.commit_counted(&id, counted).await.unwrap().usage().cloned().unwrap();
        assert_eq!((u.used, u.cost_nanos), (555, 2_280_000), "{u:?}");
        // Forwarded from another replica, the counts and what they say arrive whole.
        let other = h.wrapped(|s| s).await;
        let forwarded = admitted(&h.admission.reserve(&cached).await).reservation_id.clone();
        assert_eq!(other.admission.commit_counted(&forwarded, counted).await.unwrap(), CommitOutcome::Forwarded);
        h.admission.lease_tick(false).await.unwrap();
        let repeat = h.admission.commit_counted(&forwarded, counted).await.unwrap();
        assert!(repeat.usage().is_some_and(|u| u.duplicate && u.used == 555), "{repeat:?}");
        h.admission.lease_tick(true).await.unwrap();
        let charged = 10_000.0 - h.tenant_scope().await.num("t");
        assert!((1109.0..=1110.0).contains(&charged), "555 twice, {charged} charged");
    }

    /// Usage beyond a leased hold is debt the store carries, as for a store hold.
    pub async fn an_overrun_of_a_leased_hold_is_debt_in_the_store<S: Store + Clone>(h: Harness<S>) {
        let id = admitted(&h.reserve(10, 90).await).reservation_id.clone();
        let c = h.admission.commit_counted(&id, Counted::exact(10, 290)).await.unwrap();
        assert_eq!(c.usage().map(|u| u.overrun), Some(200));
        h.admission.lease_tick(true).await.unwrap();
        let charged = 10_000.0 - h.tenant_scope().await.num("t");
        assert!((299.0..=300.0).contains(&charged), "300 used, {charged} charged");
    }
}

const CONCURRENCY: &str = "  max_concurrency: 4\n";

macro_rules! leasing {
    ($backend:ident, $make:path) => {
        mod $backend {
            use super::*;

            macro_rules! scenario {
                ($name:ident, $limits:expr) => {
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        scenarios::$name($make(&policy($limits)).await).await;
                    }
                };
            }

            scenario!(a_lease_hit_never_leaves_the_process, SLOW);
            scenario!(
                a_refused_lease_call_leaves_what_it_writes_a_ttl,
                &format!("{SLOW}  requests_per_minute: 60\n  max_concurrency: 1\n")
            );
            scenario!(the_books_balance_when_the_slices_come_back, SLOW);
            scenario!(concurrency_is_exact_across_replicas, CONCURRENCY);
            scenario!(a_commit_at_another_replica_reaches_the_owner, SLOW);
            scenario!(a_refusal_is_remembered_for_its_wait, SLOW);
            scenario!(a_leased_concurrency_refusal_says_its_wait, &format!("{SLOW}  max_concurrency: 1\n"));
            scenario!(an_overrun_of_a_leased_hold_is_debt_in_the_store, SLOW);
            scenario!(cached_prompt_tokens_of_a_leased_hold_count_as_in_the_store, SLOW);
            scenario!(a_re_sent_lease_call_counts_once, SLOW);
            scenario!(a_failed_lease_call_loses_no_debt, SLOW);
            scenario!(a_lost_lease_answer_loses_no_forwarded_commit, SLOW);
            scenario!(a_tenant_a_reload_removes_gives_its_slices_back, SLOW);
            scenario!(a_reload_that_tightens_reaches_every_slice, SLOW);
            scenario!(a_reload_that_stops_limiting_a_scope_gives_its_slice_back, &format!("{SLOW}models:\n  m: {{ tokens_per_minute: 60, burst_tokens: 10000 }}\n"));

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn leased_holds_are_entered_in_the_ledger() {
                let body = format!(
                    "ledger:\n  max_len: 1000\nleasing:\n  window_ms: 250\n  max_share: 0.5\n{TOP_SEPARATOR}limits:\n{SLOW}"
                );
                scenarios::leased_holds_are_entered_in_the_ledger($make(&body).await).await;
            }
            scenario!(a_request_with_an_idempotency_key_is_decided_by_the_store, SLOW);
            scenario!(an_index_a_lease_call_makes_anew_gets_its_ttl_from_the_next_store_hold, SLOW);
            scenario!(a_renew_that_gives_the_holds_hash_its_ttl_takes_lk_away, &format!("{SLOW}  max_concurrency: 8\n"));

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn strict_tenants_and_keyed_requests_bypass_leasing() {
                let body = format!("leasing:\n  window_ms: 250\n{TOP_SEPARATOR}strict: true\nlimits:\n{SLOW}");
                scenarios::strict_tenants_and_keyed_requests_bypass_leasing($make(&body).await).await;
            }

            scenario!(a_budget_leasing_does_not_decide_goes_to_the_store, &format!("{SLOW}  tokens_per_hour: 500\n"));
            scenario!(
                a_pool_leg_is_decided_at_the_store,
                &format!(
                    "{SLOW}---pool---\nmax_sequences: 64\nprefill_tokens_per_second: 1000\ndecode_tokens_per_second: 100\n\
                     max_queue_delay_ms: 600000\nprovider_limits: {{ tokens_per_minute: 60, burst_tokens: 500 }}\n"
                )
            );

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_output_budget_goes_to_the_store() {
                let h = $make(&policy(&format!("{SLOW}  output_tokens_per_day: 500\n"))).await;
                scenarios::a_budget_leasing_does_not_decide_goes_to_the_store(h).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_budget_in_a_time_zone_goes_to_the_store() {
                let body = format!(
                    "leasing:\n  window_ms: 250\n  max_share: 0.5\n{TOP_SEPARATOR}time_zone: Europe/Berlin\nlimits:\n{SLOW}  tokens_per_day: 500\n"
                );
                scenarios::a_budget_leasing_does_not_decide_goes_to_the_store($make(&body).await).await;
            }

            /// Budgets over a month or in money are leased, and stay exact.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn monthly_budgets_are_leased_and_exact() {
                let h = $make(&policy(&format!("{SLOW}  tokens_per_month: 1000\n"))).await;
                scenarios::a_long_or_money_budget_is_leased_and_exact(h, "mu", 1_000.0).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn money_budgets_are_leased_and_exact() {
                let h = $make(&policy(&format!("{SLOW}  cost_per_day: 0.001\n"))).await;
                scenarios::a_long_or_money_budget_is_leased_and_exact(h, "dc", 1_000_000.0).await;
            }

            /// A scope with a budget in money and no token limit: its tokens are counted all the same.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_money_only_scope_is_leased_and_counts_its_tokens() {
                let h = $make(&policy("  cost_per_day: 0.001\n")).await;
                scenarios::a_long_or_money_budget_is_leased_and_exact(h, "dc", 1_000_000.0).await;
            }
        }
    };
}

leasing!(embedded, support::embedded);
leasing!(redis, support::redis);
leasing!(cluster, support::cluster);

/// Needs the manual clock: the lease runs out in a moment, not two minutes.
#[tokio::test]
async fn a_dead_replicas_slots_come_back_after_its_lease_embedded() {
    let h = support::embedded(&policy(&format!("{CONCURRENCY}lease_ttl_ms: 1000\n"))).await;
    scenarios::a_dead_replicas_slots_come_back_after_its_lease(h).await;
}

/// A replica whose lease calls answer `reply_ms` late, and a miss on it whose caller stops waiting
/// (Envoy's ext_authz timeout) while its lease call is under way.
async fn a_caller_leaves_a_slow_lease_call(
    reply_ms: u64,
) -> Harness<support::faults::Faulty<tollgate::store::embedded::EmbeddedStore>> {
    use support::faults::{Fault, Faulty};
    let h = support::embedded(&policy(SLOW)).await;
    let slow =
        h.wrapped(|s| Faulty::new(s, "lease", Fault::SlowReply(std::time::Duration::from_millis(reply_ms)))).await;
    let gave_up = tokio::time::timeout(std::time::Duration::from_millis(20), slow.reserve(10, 90)).await;
    assert!(gave_up.is_err(), "the caller stopped waiting");
    slow
}

/// A miss whose caller stops waiting still finishes its lease call, and the hold nobody received
/// is released at once, in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_hold_nobody_waits_for_is_released() {
    let slow = a_caller_leaves_a_slow_lease_call(200).await;
    let released = slow
        .eventually(std::time::Duration::from_secs(5), || async { slow.admission.leased_holds(&slow.tenant) == (0, 1) })
        .await;
    assert!(released, "held in memory: {:?}", slow.admission.leased_holds(&slow.tenant));
    slow.admission.lease_tick(true).await.unwrap();
    let charged = 10_000.0 - slow.tenant_scope().await.num("t");
    assert!(charged.abs() < 0.5, "{charged} tokens still charged");
}

/// A miss whose lease call answers after the slices' window ran out is decided in the store (the
/// slices cannot cover it): if its caller stopped waiting, that store hold is released at once,
/// not left charged until its lease expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_plan_decided_in_the_store_that_nobody_waits_for_is_released() {
    let slow = a_caller_leaves_a_slow_lease_call(300).await;
    // The lease record's term runs out while the lease call's reply is on its way (sent first).
    let sent =
        slow.eventually(std::time::Duration::from_secs(5), || async { slow.admission.protocol().store().calls() == 1 });
    assert!(sent.await, "the lease call was never sent");
    let term = slow.admission.policy().tenants[&slow.tenant].lease_ttl_ms;
    slow.advance(term + 1).await;
    let settled =
        slow.eventually(std::time::Duration::from_secs(5), || async { slow.admission.reserves_running() == 0 }).await;
    assert!(settled, "the reserve's task never ended");
    assert_eq!(slow.admission.leased_holds(&slow.tenant), (0, 0), "decided in the store, not by the slices");
    // Released in the store: settled there (its entry answers a repeat), nothing left in flight.
    // (Its tokens would come back by refill over the lease's term anyway: the entry is the proof.)
    let settled = slow.settled().await;
    assert_eq!(settled.len(), 1, "the store hold nobody received is still live: {settled:?}");
    assert!(settled.values().all(|(entry, _)| entry.starts_with('r')), "settled as released: {settled:?}");
    assert_eq!(slow.in_flight().await, 0.0);
}

#[test]
fn lease_keys_share_the_tenant_slot() {
    for key in [keys::lease_record("acme", "0a1b2c3d4e5f"), keys::forwarded("acme", "0a1b2c3d4e5f")] {
        assert!(key.starts_with("tg:{acme}:"), "{key}");
    }
}

/// A replica that is told to stop gives its slices back before it exits: what it drew and did not
/// use returns to Redis; the hold still live stays charged, as a hold in the store would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_replica_gives_its_slices_back() {
    use envoy_types::pb::envoy::service::auth::v3::authorization_client::AuthorizationClient;
    use tollgate::proto::CommitRequest;
    use tollgate::proto::admission_client::AdmissionClient;

    let url = support::redis_url();
    let tenant = support::unique_tenant("stop");
    let policy = format!(
        "store: {{ redis_url: {url} }}\nleasing: {{ window_ms: 250, max_share: 0.5 }}\n\
         models:\n  m: {{ max_output_tokens: 4096, bytes_per_token: 4 }}\n\
         tenants:\n  {tenant}:\n    limits: {{ tokens_per_minute: 60, burst_tokens: 10000 }}\n"
    );
    let mut t = support::procs::Tollgate::start(&policy);
    let mut authz = AuthorizationClient::connect(t.endpoint()).await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..3 {
        let body = br#"{"model":"m","max_tokens":90,"messages":[{"role":"user","content":"0123456789012345678901234567890123456789"}]}"#;
        let r = authz.check(support::checks::check(&[("x-tenant-id", &tenant)], body)).await.unwrap().into_inner();
        ids.push(support::checks::reservation(&r).expect("admitted"));
    }
    let mut admission = AdmissionClient::connect(t.endpoint()).await.unwrap();
    for (id, _) in &ids[..2] {
        let c = CommitRequest {
            reservation_id: id.clone(),
            prompt_tokens: 10,
            completion_tokens: 20,
            ..Default::default()
        };
        admission.commit(c).await.unwrap();
    }
    let scope = keys::tenant_scope(&tenant);
    let h = support::redis("limits: {}\n").await;
    let drawn = 10_000.0 - h.scope(&scope).await.unwrap().num("t");
    assert!(drawn >= 400.0, "slices are drawn ahead: {drawn}");
    assert!(t.terminate(std::time::Duration::from_secs(10)).is_some_and(|s| s.success()), "{}", t.log());
    let charged = 10_000.0 - h.scope(&scope).await.unwrap().num("t");
    // Two commits of 30, and the hold still live.
    let expected = 60.0 + ids[2].1 as f64;
    assert!((expected - 1.0..=expected + 0.5).contains(&charged), "after the stop {charged} charged, not {expected}");
}

/// Slices belong to their day: one drawn a moment before the store's midnight is not spent on the
/// new day's requests; the first decision after midnight calls, and the new day draws its own.
#[tokio::test]
async fn no_slice_is_spent_across_midnight() {
    let h = support::embedded(&policy("  tokens_per_day: 100000\n")).await;
    // Fifty milliseconds before midnight UTC (the manual clock starts at noon).
    h.advance(12 * 3_600_000 - 50).await;
    admitted(&h.reserve(10, 90).await);
    let before = h.tenant_scope().await;
    let yesterday = before.num("d");
    assert!(before.num("du") >= 400.0, "a slice of four holds drawn ahead: {before:?}");
    h.advance(100).await;
    admitted(&h.reserve(10, 90).await);
    let after = h.tenant_scope().await;
    assert_eq!(after.num("d"), yesterday + 1.0, "the decision after midnight called: {after:?}");
    assert!(after.num("du") >= 100.0, "and charged the new day: {after:?}");
}
