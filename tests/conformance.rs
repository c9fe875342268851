//! One protocol, three stores: every scenario here runs against the embedded store (manual clock),
//! a single Redis and a 3-node Redis Cluster. A scenario written once runs everywhere, so the
//! embedded keyspace cannot drift from Redis unnoticed.

mod support;

use std::time::Duration;

use futures_util::future::join_all;
use support::faults::{Fault, Faulty, Queued, Resend};
use support::{Harness, admitted, denied};
use tollgate::admission::{AdmissionError, Attributes, Decision, KeyRepeat, OLDER_REPLICA_MEMORY_MS, Priority, Reason};
use tollgate::hold::{CommitOutcome, Counted, Detail, Ending, ReleaseOutcome, RenewOutcome, Usage};
use tollgate::store::clock::Clock;
use tollgate::store::{COMPACT_RECORD, CommitCall, CommitTerms, Heard, Reply, Script, Store, StoreError, keys};

#[path = "conformance/periods.rs"]
mod periods;
#[path = "conformance/provider.rs"]
mod provider;
#[path = "conformance/soft.rs"]
mod soft;

/// Scenarios, each generic over the store.
mod scenarios {
    use super::*;

    pub use super::periods::*;
    pub use super::provider::*;
    pub use super::soft::*;

    /// 1 token per second of refill: slow enough that the few milliseconds a real Redis test
    /// takes cannot refill a meaningful amount.
    const SLOW_BUCKET: &str = "limits:\n  tokens_per_minute: 60\n  burst_tokens: 1000\n";

    pub async fn admits_until_the_bucket_is_spent<S: Store>(h: Harness<S>) {
        for i in 0..10 {
            let d = h.reserve(50, 50).await;
            assert_eq!(admitted(&d).reserved_tokens, 100, "request {i}");
        }
        let d = h.reserve(50, 50).await;
        let no = denied(&d);
        assert_eq!(no.reason, Reason::TokenRate);
        // Deficit 100 tokens at 1 token/s: 100 s, less whatever refilled while the test ran.
        let wait = no.retry_after_ms.unwrap();
        assert!((95_000..=100_000).contains(&wait), "retry after {wait} ms");
        if h.exact_time() {
            assert_eq!(wait, 100_000);
        }
        let tokens = no.headroom.tokens.unwrap();
        assert_eq!((tokens.limit, tokens.remaining), (1000, 0));
    }

    pub async fn the_bucket_refills_with_time<S: Store>(h: Harness<S>) {
        // 600 tokens/min = 10 tokens/s.
        let h = h;
        admitted(&h.reserve(0, 100).await);
        let no = h.reserve(0, 100).await;
        let wait = denied(&no).retry_after_ms.unwrap();
        assert!((9_000..=10_000).contains(&wait), "retry after {wait} ms");
        if h.exact_time() {
            h.advance(wait).await;
            admitted(&h.reserve(0, 100).await);
        }
    }

    pub async fn a_request_larger_than_the_bucket_is_unsatisfiable<S: Store>(h: Harness<S>) {
        let d = h.reserve(500, 501).await;
        let no = denied(&d);
        assert_eq!(no.reason, Reason::Unsatisfiable);
        assert_eq!(no.retry_after_ms, None);
        assert!(no.message.contains("1001"), "{}", no.message);
        let scope = h.tenant_scope().await;
        assert_eq!(scope.kind, "none", "an unsatisfiable request charges nothing");
    }

    pub async fn a_denial_changes_no_counter<S: Store>(h: Harness<S>) {
        let first = h.reserve(400, 400).await;
        let id = admitted(&first).reservation_id.clone();
        let before = h.snapshot(&[&id]).await;
        for _ in 0..3 {
            assert_eq!(denied(&h.reserve(400, 400).await).reason, Reason::TokenRate);
        }
        let after = h.snapshot(&[&id]).await;
        assert_eq!(before, after);
    }

    /// A tenant in shadow: what its limits would refuse is held and charged anyway (into debt no
    /// deeper than the capacity), and the decision says what the refusal would have been.
    pub async fn a_shadow_tenant_is_held_past_its_limits_and_told_why<S: Store>(h: Harness<S>) {
        let first = h.reserve(400, 400).await;
        assert_eq!(admitted(&first).shadow, None, "within the limits");
        let second = h.reserve(400, 400).await;
        assert_eq!(admitted(&second).shadow, Some(Reason::TokenRate));
        let t = h.tenant_scope().await.num("t");
        assert!((-600.0..-599.0).contains(&t), "charged as any hold: 1000 - 800 - 800, got {t}");
        let third = h.reserve(400, 400).await;
        assert_eq!(admitted(&third).shadow, Some(Reason::TokenRate));
        let t = h.tenant_scope().await.num("t");
        assert!((-1000.0..-999.0).contains(&t), "debt floors at minus the capacity, got {t}");
        // Larger than the bucket could ever hold: held, and said so.
        let huge = h.reserve(600, 600).await;
        assert_eq!(admitted(&huge).shadow, Some(Reason::Unsatisfiable));
        // Settled as any hold: the commit refunds what was not used.
        let id = admitted(&second).reservation_id.clone();
        let c = h.admission.commit(&id, 100, 0).await.unwrap();
        assert_eq!((c.usage().unwrap().used, c.usage().unwrap().refunded), (100, 700));
    }

    pub async fn commit_refunds_the_unused_hold<S: Store>(h: Harness<S>) {
        let a = h.reserve(100, 500).await;
        let id = admitted(&a).reservation_id.clone();
        assert_eq!(denied(&h.reserve(100, 500).await).reason, Reason::TokenRate);
        let c = h.admission.commit(&id, 100, 50).await.unwrap();
        assert_eq!(
            (
                c.state(),
                c.usage().unwrap().used,
                c.usage().unwrap().held,
                c.usage().unwrap().refunded,
                c.usage().unwrap().overrun
            ),
            ("committed", 150, 600, 450, 0)
        );
        let t = h.tenant_scope().await.num("t");
        assert!((850.0..851.0).contains(&t), "1000 - 600 + 450 = 850, got {t}");
        admitted(&h.reserve(100, 500).await);
    }

    /// `commit_many.lua` against `commit.lua`: holds made alike, one of each pair committed alone
    /// and the other in one batch with the same counts, answer and charge alike; a batch answers a
    /// repeat inside it, a released hold and an unknown id as single commits would.
    pub async fn a_batch_of_commits_charges_what_each_alone_would<S: Store>(h: Harness<S>) {
        let reasoned = Detail { cache_read: Some(40), cache_write: Some(10), reasoning: Some(20) };
        let counts = [
            Counted::exact(100, 50),
            Counted::exact(300, 900),
            Counted::Metered { output: 40 },
            Counted::AsHeld,
            Counted::Exact { prompt: 100, output: 80, detail: reasoned },
        ];
        let mut holds = Vec::new();
        for _ in 0..2 * counts.len() + 1 {
            holds.push(admitted(&h.reserve(100, 200).await).reservation_id.clone());
        }
        let (alone, rest) = holds.split_at(counts.len());
        let (batched, released) = rest.split_at(counts.len());
        let released = &released[0];
        h.admission.release(released).await.unwrap();

        let (day, tokens) = (h.day_usage().await, h.tenant_scope().await.num("t"));
        let mut one_by_one = Vec::new();
        for (id, counted) in alone.iter().zip(counts) {
            one_by_one.push(h.admission.commit_counted(id, counted).await.unwrap());
        }
        let (day_alone, tokens_alone) = (h.day_usage().await - day, h.tenant_scope().await.num("t") - tokens);

        let unknown = format!("{}:{}", h.tenant, "ab".repeat(16));
        let mut calls: Vec<CommitCall> = batched
            .iter()
            .zip(counts)
            .map(|(id, counted)| CommitCall { id: id.clone(), counted, ending: Ending::of(counted) })
            .collect();
        calls.push(CommitCall { id: batched[0].clone(), counted: Counted::exact(1, 1), ending: Ending::Completed });
        calls.push(CommitCall { id: released.clone(), counted: Counted::exact(1, 1), ending: Ending::Completed });
        calls.push(CommitCall { id: unknown, counted: Counted::exact(1, 1), ending: Ending::Completed });
        let (day, tokens) = (h.day_usage().await, h.tenant_scope().await.num("t"));
        let in_one = commit_many(&h, &calls).await.unwrap();
        let (day_batched, tokens_batched) = (h.day_usage().await - day, h.tenant_scope().await.num("t") - tokens);

        assert_eq!(in_one.len(), calls.len(), "one outcome a commit: {in_one:?}");
        assert_eq!(in_one[..counts.len()], one_by_one[..], "each as it would alone");
        assert_eq!(day_batched, day_alone, "the day's counter moves alike");
        // (What each used less the 300 its hold charged: exact, overrun, metered, as held, detailed.)
        assert_eq!(day_alone, 150 + 1200 + 140 + 300 + 180 - 5 * 300);
        // (1 token a second of refill while a real store's calls run.)
        assert!(
            (tokens_batched - tokens_alone).abs() < 2.0,
            "the bucket moves alike: {tokens_batched} vs {tokens_alone}"
        );
        let first = in_one[0].usage().expect("committed");
        let repeat = in_one[counts.len()].usage().expect("a repeat answers the first commit");
        assert_eq!((repeat.duplicate, repeat.used), (true, first.used), "{repeat:?}");
        assert_eq!(in_one[counts.len() + 1], CommitOutcome::Released);
        assert_eq!(in_one[counts.len() + 2], CommitOutcome::NotFound);
        assert_eq!(h.in_flight().await, 0.0, "every slot freed");
    }

    /// `commit_many.lua` called as the gateway calls it for a tenant in UTC that does not learn.
    async fn commit_many<S: Store>(h: &Harness<S>, calls: &[CommitCall]) -> Result<Vec<CommitOutcome>, StoreError> {
        let retention_ms = h.admission.policy().record_retention_ms;
        let terms = CommitTerms { learning: None, retention_ms, zone_offset_min: Some(0) };
        h.admission.protocol().commit_many(&h.tenant, calls, terms).await
    }

    /// Three small holds (10 tokens of prompt, 10 of output), and a commit of each at 5 and 5.
    async fn small_holds<S: Store>(h: &Harness<S>) -> (Vec<String>, Vec<CommitCall>) {
        let mut ids = Vec::new();
        for _ in 0..3 {
            ids.push(admitted(&h.reserve(10, 10).await).reservation_id.clone());
        }
        let calls = ids
            .iter()
            .map(|id| CommitCall { id: id.clone(), counted: Counted::exact(5, 5), ending: Ending::Completed })
            .collect();
        (ids, calls)
    }

    /// A batch's writes, made once at its end (common.lua's gather), leave its keys as single
    /// commits would: the first filing of a period's settled bucket gives it its TTL, the scope
    /// keeps its TTL, the records are gone, and so are the lease index and the holds hash once
    /// the batch settled every live hold.
    pub async fn a_batch_leaves_its_keys_as_single_commits_would<S: Store>(h: Harness<S>) {
        let (ids, calls) = small_holds(&h).await;
        let outcomes = commit_many(&h, &calls).await.unwrap();
        assert!(outcomes.iter().all(|o| o.state() == "committed"), "{outcomes:?}");
        let settled = h.settled().await;
        assert_eq!(settled.len(), 3, "{settled:?}");
        let retention = i64::try_from(h.admission.policy().record_retention_ms).unwrap();
        for (field, (_, pttl)) in settled {
            assert!(pttl > 0 && pttl <= 2 * retention, "{field}'s settled bucket expires in {pttl} ms");
        }
        let scope = h.tenant_scope().await;
        assert!(scope.pttl > 0, "the scope keeps its TTL: {scope:?}");
        assert_eq!((scope.num("c"), scope.num("du")), (0.0, 30.0), "every slot freed, the day charged 3 x 10");
        let mut gone: Vec<String> = ids.iter().map(|id| keys::record(&h.tenant, id)).collect();
        gone.extend([keys::leases(&h.tenant), keys::holds(&h.tenant)]);
        for (key, view) in h.inspect(gone).await {
            assert_eq!(view.kind, "none", "{key} is left: {view:?}");
        }
    }

    /// A batch that fails half way (a script error, which Redis does not undo) has written
    /// nothing, not even for the commits before the one at fault: each can be made again alone,
    /// as if the batch had never run.
    pub async fn a_batch_that_fails_half_way_writes_nothing<S: Store>(h: Harness<S>) {
        let (ids, calls) = small_holds(&h).await;
        // The second hold's record made into something no script reads as a record.
        let broken =
            Script::new("broken", "redis.call('DEL', KEYS[1]) return redis.call('SET', KEYS[1], 'x')".to_string());
        let store = h.admission.protocol().store();
        store.eval(&broken, vec![keys::record(&h.tenant, &ids[1])], vec![]).await.expect("a broken record");
        let before = h.snapshot(&[&ids[0], &ids[2]]).await;
        let failed = commit_many(&h, &calls).await;
        assert!(failed.is_err(), "{failed:?}");
        assert_eq!(h.snapshot(&[&ids[0], &ids[2]]).await, before, "the batch wrote nothing");
        for id in [&ids[0], &ids[2]] {
            let alone = h.admission.commit(id, 5, 5).await.unwrap();
            let usage = alone.usage().expect("committed");
            assert_eq!((usage.duplicate, usage.used), (false, 10), "{id}: {alone:?}");
        }
    }

    pub async fn a_second_commit_returns_the_first_result_and_charges_nothing<S: Store>(h: Harness<S>) {
        let id = admitted(&h.reserve(100, 500).await).reservation_id.clone();
        let first = h.admission.commit(&id, 100, 50).await.unwrap();
        let before = h.snapshot(&[&id]).await;
        let second = h.admission.commit(&id, 900, 900).await.unwrap();
        assert!(!first.usage().unwrap().duplicate);
        assert!(second.usage().unwrap().duplicate);
        assert_eq!(
            (second.usage().unwrap().used, second.usage().unwrap().refunded, second.state()),
            (150, 450, "committed")
        );
        assert_eq!(before, h.snapshot(&[&id]).await);
    }

    pub async fn an_overrun_is_debt_bounded_by_the_capacity<S: Store>(h: Harness<S>) {
        let id = admitted(&h.reserve(50, 50).await).reservation_id.clone();
        let c = h.admission.commit(&id, 3000, 2000).await.unwrap();
        assert_eq!((c.usage().unwrap().used, c.usage().unwrap().overrun, c.usage().unwrap().refunded), (5000, 4900, 0));
        let t = h.tenant_scope().await.num("t");
        assert!((-1000.0..-999.0).contains(&t), "debt floors at minus the capacity, got {t}");
        let no = h.reserve(50, 50).await;
        let wait = denied(&no).retry_after_ms.unwrap();
        // 1,100 tokens short at 1 token/s.
        assert!((1_095_000..=1_100_000).contains(&wait), "retry after {wait}");
    }

    pub async fn concurrency_slots_are_held_until_release<S: Store>(h: Harness<S>) {
        let a = admitted(&h.reserve(1, 1).await).reservation_id.clone();
        admitted(&h.reserve(1, 1).await);
        let d = h.reserve(1, 1).await;
        let no = denied(&d);
        assert_eq!(no.reason, Reason::Concurrency);
        let wait = no.retry_after_ms.unwrap();
        assert!((1..=1000).contains(&wait), "capped by concurrency_retry_ms, got {wait}");
        // Both holds' leases (two minutes) end past the back-off: when a slot frees cannot be
        // predicted, and the message says the back-off it hints.
        assert_eq!(wait, 1000);
        assert!(
            no.message.contains("when one frees cannot be predicted") && no.message.contains("back off 1000 ms"),
            "{no:?}"
        );
        let r = h.admission.release(&a).await.unwrap();
        assert_eq!(r, ReleaseOutcome::Released { refunded: 2, repeated: false });
        admitted(&h.reserve(1, 1).await);
        let again = h.admission.release(&a).await.unwrap();
        assert_eq!(again, ReleaseOutcome::Released { refunded: 2, repeated: true }, "the first result, given once");
        let c = h.admission.commit(&a, 1, 1).await.unwrap();
        assert_eq!(c.state(), "released", "a released hold cannot be committed");
    }

    pub async fn an_expired_hold_keeps_its_tokens_under_charge_reserved<S: Store>(h: Harness<S>) {
        let first = admitted(&h.reserve(100, 500).await).reservation_id.clone();
        assert_eq!(denied(&h.reserve(0, 100).await).reason, Reason::Concurrency);
        h.advance(400).await;
        // The next reserve sweeps the expired hold: its slot is free, its 600 tokens stay charged.
        admitted(&h.reserve(0, 300).await);
        let t = h.tenant_scope().await.num("t");
        assert!((100.0..102.0).contains(&t), "1000 - 600 - 300 = 100, got {t}");
        let late = h.admission.commit(&first, 100, 20).await.unwrap();
        assert_eq!(
            (late.state(), late.usage().unwrap().used, late.usage().unwrap().refunded),
            ("late_committed", 120, 480)
        );
        let t = h.tenant_scope().await.num("t");
        assert!((580.0..582.0).contains(&t), "the late commit gives back 480, got {t}");
    }

    pub async fn an_expired_hold_is_refunded_under_refund<S: Store>(h: Harness<S>) {
        let first = admitted(&h.reserve(100, 500).await).reservation_id.clone();
        h.advance(400).await;
        admitted(&h.reserve(0, 900).await);
        let t = h.tenant_scope().await.num("t");
        assert!((100.0..102.0).contains(&t), "600 came back, 900 went: {t}");
        let late = h.admission.commit(&first, 100, 20).await.unwrap();
        assert_eq!(late.state(), "late_committed");
        let t = h.tenant_scope().await.num("t");
        assert!((-20.0..-18.0).contains(&t), "the late commit charges the 120 used, got {t}");
    }

    /// An expired hold's record waits for its late commit for the retention (here longer than the
    /// lease), and then is gone: a later commit is answered `not_found` and changes nothing (under
    /// `refund`, the hold stays given back). On the manual clock.
    pub async fn an_expired_hold_waits_its_time_for_a_late_commit<S: Store>(h: Harness<S>) {
        if !h.exact_time() {
            return;
        }
        let wait = h.admission.policy().record_retention_ms;
        let (early, late) = (admitted(&h.reserve(100, 500).await).reservation_id.clone(), {
            h.advance(400).await;
            admitted(&h.reserve(10, 10).await).reservation_id.clone()
        });
        // `early` expired at the reserve that swept it, a moment ago; `late` is let expire too.
        h.admission.release(&late).await.unwrap();
        h.advance(wait - 1).await;
        let c = h.admission.commit(&early, 100, 20).await.unwrap();
        assert_eq!(c.state(), "late_committed", "{c:?}");
        let again = admitted(&h.reserve(100, 500).await).reservation_id.clone();
        h.advance(400).await;
        admitted(&h.reserve(10, 10).await);
        let before = h.tenant_scope().await.num("t");
        h.advance(wait + 1).await;
        assert_eq!(h.admission.commit(&again, 100, 20).await.unwrap(), CommitOutcome::NotFound);
        let after = h.tenant_scope().await.num("t");
        assert!(after >= before, "nothing charged: {before} then {after}");
    }

    pub async fn a_commit_after_the_lease_settles_the_expiry_first<S: Store>(h: Harness<S>) {
        let id = admitted(&h.reserve(100, 500).await).reservation_id.clone();
        h.advance(400).await;
        let c = h.admission.commit(&id, 10, 10).await.unwrap();
        assert_eq!(c.state(), "late_committed");
        let scope = h.tenant_scope().await;
        assert_eq!(scope.num("c"), 0.0, "the slot is free");
        assert_eq!(h.admission.renew(&id, 0).await.unwrap().state(), "late_committed");
    }

    /// A reserve writes a compact record (its terms in `tm`, what a new hold starts with left
    /// out: see common.lua) only while every replica heard reads one: with a replica of an
    /// earlier version heard (its heartbeat names no record form), and for a while after it was
    /// last heard, it writes every field, as it does from its start until a heartbeat is answered
    /// and after one that failed. Either form commits, renews, releases, expires and late-commits
    /// alike; expiring, it frees its slot (one at a time here: the next hold is admitted only if
    /// it did).
    pub async fn a_record_is_compact_only_while_every_replica_reads_it<S: Store + Clone>(h: Harness<S>) {
        let replicas = vec![keys::replicas(), keys::oldest_record_form()];
        let earlier = vec![format!("earlier-{}", h.tenant)];
        let heard = another_replicas_heartbeat();
        let gone = Script::new("an earlier replica gone", "return redis.call('ZREM', KEYS[1], ARGV[1])".to_string());
        let forgotten = Script::new("an earlier replica forgotten", "return redis.call('DEL', KEYS[2])".to_string());
        let encoding = Script::new("encoding", "return redis.call('OBJECT', 'ENCODING', KEYS[1])".to_string());
        let memory = Script::new("memory", "return redis.call('MEMORY', 'USAGE', KEYS[1])".to_string());
        let bytes = std::sync::Mutex::new(Vec::new());
        let store = h.admission.protocol().store();
        for compact in [false, true] {
            if compact {
                store.eval(&gone, replicas.clone(), earlier.clone()).await.expect("gone");
                h.admission.heartbeat().await.unwrap();
                assert!(!h.admission.writes_compact_records(), "an earlier replica gone is remembered");
                store.eval(&forgotten, replicas.clone(), vec![]).await.expect("forgotten");
            } else {
                store.eval(&heard, replicas.clone(), earlier.clone()).await.expect("heard");
            }
            let fleet = h.admission.heartbeat().await.unwrap();
            assert_eq!(h.admission.writes_compact_records(), compact, "{fleet:?}");
            let hold = || async {
                let id = admitted(&h.reserve(10, 50).await).reservation_id.clone();
                let record = keys::record(&h.tenant, &id);
                let fields = h.inspect(vec![record.clone()]).await.remove(&record).unwrap().fields;
                let written = ["tm", "sl", "xp", "ch"].map(|f| fields.contains_key(f));
                let expected = if compact { [true, false, false, false] } else { [false, true, true, true] };
                assert_eq!(written, expected, "compact: {compact}, {fields:?}");
                // Every value under Redis's 64 bytes a listpack value: over it, the record's hash
                // would be a table, twice the memory.
                assert!(fields.values().all(|v| v.len() <= 64), "{fields:?}");
                if !h.exact_time() {
                    let encoding = store.eval(&encoding, vec![record.clone()], vec![]).await.unwrap();
                    assert_eq!(encoding, Reply::Text("listpack".into()), "{fields:?}");
                    let used = store.eval(&memory, vec![record.clone()], vec![]).await.unwrap().as_int();
                    bytes.lock().unwrap().push((compact, used.unwrap()));
                }
                id
            };
            let a = hold().await;
            let c = h.admission.commit(&a, 10, 2).await.unwrap();
            assert_eq!((c.state(), c.usage().unwrap().used, c.usage().unwrap().refunded), ("committed", 12, 48));
            let b = hold().await;
            assert_eq!(h.admission.renew(&b, 0).await.unwrap(), RenewOutcome::Renewed { lease_remaining_ms: 300 });
            let r = h.admission.release(&b).await.unwrap();
            assert_eq!(r, ReleaseOutcome::Released { refunded: 60, repeated: false });
            let c = hold().await;
            h.advance(400).await;
            // The next reserve sweeps the expired hold: its slot is free, its 60 tokens stay charged.
            let next = admitted(&h.reserve(0, 10).await).reservation_id.clone();
            let late = h.admission.commit(&c, 10, 2).await.unwrap();
            assert_eq!((late.state(), late.usage().unwrap().used), ("late_committed", 12));
            h.admission.release(&next).await.unwrap();
        }
        // On Redis, a compact record takes less memory than a full one.
        let bytes = bytes.into_inner().unwrap();
        let most = |form: bool| bytes.iter().filter(|(compact, _)| *compact == form).map(|(_, b)| *b).max();
        if let (Some(compact), Some(full)) = (most(true), most(false)) {
            eprintln!("a record: compact {compact} bytes, full {full} bytes (MEMORY USAGE)");
            assert!(compact < full, "a compact record {compact} bytes, a full one {full}");
        }
        // A replica writes full records until a heartbeat is answered, and again after one that
        // was not.
        let r = h.wrapped(|s| Queued::new(s, "heartbeat")).await;
        assert!(!r.admission.writes_compact_records(), "nothing heard yet");
        r.admission.heartbeat().await.unwrap();
        assert!(r.admission.writes_compact_records());
        r.admission.protocol().store().next(Fault::Unreachable(1));
        assert!(r.admission.heartbeat().await.is_err());
        assert!(!r.admission.writes_compact_records(), "after a heartbeat that failed");
        let id = admitted(&r.reserve(10, 50).await).reservation_id.clone();
        let record = keys::record(&r.tenant, &id);
        let fields = r.inspect(vec![record.clone()]).await.remove(&record).unwrap().fields;
        assert!(fields.contains_key("sl") && !fields.contains_key("tm"), "{fields:?}");
        r.admission.release(&id).await.unwrap();
    }

    /// A heartbeat hears the replicas within its TTL, and the newest record form every one of
    /// them reads: an earlier version's (no form named) reads only the full one, and is
    /// remembered for a quarter of an hour after the last heartbeat that heard it. On the manual clock (on Redis
    /// the replicas are shared with the tests running beside this one).
    pub async fn a_heartbeat_hears_the_replicas_and_the_record_form_all_read<S: Store>(h: Harness<S>) {
        if !h.exact_time() {
            return;
        }
        let heard = another_replicas_heartbeat();
        let another = |member: &'static str| {
            h.admission.protocol().store().eval(&heard, vec![keys::replicas()], vec![member.to_string()])
        };
        let form = |replicas, record_form| Heard { replicas, record_form };
        assert_eq!(h.admission.heartbeat().await.unwrap(), form(1, COMPACT_RECORD), "alone");
        another("newer#3").await.unwrap();
        assert_eq!(h.admission.heartbeat().await.unwrap(), form(2, COMPACT_RECORD));
        assert!(h.admission.writes_compact_records());
        h.advance(1_000).await;
        another("earlier").await.unwrap();
        assert_eq!(h.admission.heartbeat().await.unwrap(), form(3, 1));
        assert!(!h.admission.writes_compact_records());
        // Three seconds after its last heartbeat a replica is gone: the newer one, then the
        // earlier, which is remembered for its record form.
        h.advance(2_500).await;
        assert_eq!(h.admission.heartbeat().await.unwrap(), form(2, 1));
        h.advance(1_000).await;
        assert_eq!(h.admission.heartbeat().await.unwrap(), form(1, 1));
        h.advance(OLDER_REPLICA_MEMORY_MS - 1_001).await;
        assert_eq!(h.admission.heartbeat().await.unwrap(), form(1, 1));
        assert!(!h.admission.writes_compact_records());
        h.advance(2).await;
        assert_eq!(h.admission.heartbeat().await.unwrap(), form(1, COMPACT_RECORD));
        assert!(h.admission.writes_compact_records());
    }

    /// Another replica's heartbeat, as the replicas' sorted set keeps it (`ARGV[1]`: its member).
    fn another_replicas_heartbeat() -> Script {
        Script::new(
            "another replica's heartbeat",
            "local t = redis.call('TIME') \
             return redis.call('ZADD', KEYS[1], t[1] * 1000 + math.floor(t[2] / 1000), ARGV[1])"
                .to_string(),
        )
    }

    pub async fn renew_extends_the_lease<S: Store>(h: Harness<S>) {
        let id = admitted(&h.reserve(1, 1).await).reservation_id.clone();
        h.advance(200).await;
        let r = h.admission.renew(&id, 3_600_000).await.unwrap();
        assert_eq!(r, RenewOutcome::Renewed { lease_remaining_ms: 300 }, "never past the lease TTL");
        h.advance(200).await;
        // 400 ms after reserve, past the first lease but inside the renewed one: still held.
        assert_eq!(denied(&h.reserve(1, 1).await).reason, Reason::Concurrency);
        h.advance(200).await;
        admitted(&h.reserve(1, 1).await);
        assert_eq!(h.admission.renew(&id, 0).await.unwrap().state(), "expired");
    }

    /// `Admission/Reserve` repeated with a key: the caller lost the answer and gets its hold back.
    pub async fn a_repeated_reserve_returns_the_same_hold<S: Store>(h: Harness<S>) {
        let a = h.keyed(100, 100, "req-1", KeyRepeat::ReturnHold);
        let first = admitted(&h.admission.reserve(&a).await).clone();
        let second = admitted(&h.admission.reserve(&a).await).clone();
        assert_eq!(first.reservation_id, second.reservation_id);
        assert_eq!((first.attempts, second.attempts), (1, 2));
        assert_eq!((first.replayed, second.replayed), (false, true));
        let t = h.tenant_scope().await.num("t");
        assert!((800.0..801.0).contains(&t), "charged once, got {t}");
        admitted(&h.admission.reserve(&a).await);
        let fourth = h.admission.reserve(&a).await;
        assert_eq!(denied(&fourth).reason, Reason::InvalidRequest, "past max_attempts");
        h.admission.commit(&first.reservation_id, 1, 1).await.unwrap();
        let after = h.admission.reserve(&a).await;
        assert_eq!(denied(&after).reason, Reason::InvalidRequest, "the key counts attempts for its whole life");
        if h.exact_time() {
            h.advance(120_000).await;
            let fresh = admitted(&h.admission.reserve(&a).await).clone();
            assert_ne!(fresh.reservation_id, first.reservation_id, "past its TTL the key starts again");
            assert_eq!(fresh.attempts, 1);
        }
    }

    /// A request retried through Envoy with a key: it will reach the backend again, so each attempt
    /// holds for itself; the key counts and bounds them.
    pub async fn a_retried_request_is_a_new_attempt<S: Store>(h: Harness<S>) {
        let a = h.keyed(100, 100, "req-2", KeyRepeat::NewAttempt);
        let first = admitted(&h.admission.reserve(&a).await).clone();
        let second = admitted(&h.admission.reserve(&a).await).clone();
        assert_ne!(first.reservation_id, second.reservation_id);
        assert_eq!((first.attempts, second.attempts), (1, 2));
        assert!(!second.replayed);
        let t = h.tenant_scope().await.num("t");
        assert!((600.0..601.0).contains(&t), "each attempt charged: {t}");
        admitted(&h.admission.reserve(&a).await);
        let before = h.snapshot(&[]).await;
        assert_eq!(denied(&h.admission.reserve(&a).await).reason, Reason::InvalidRequest, "past max_attempts");
        let mut other = h.keyed(100, 100, "req-2", KeyRepeat::NewAttempt);
        other.max_tokens = Some(99);
        let no = h.admission.reserve(&other).await;
        assert!(denied(&no).message.contains("different request"), "{:?}", denied(&no));
        assert_eq!(h.snapshot(&[]).await, before, "refusals change nothing");
    }

    pub async fn user_and_model_scopes_limit_within_the_tenant<S: Store>(h: Harness<S>) {
        let mut alice = h.attributes(0, 300);
        alice.user = Some("alice".into());
        let mut bob = alice.clone();
        bob.user = Some("bob".into());
        admitted(&h.admission.reserve(&alice).await);
        let no = h.admission.reserve(&alice).await;
        assert!(denied(&no).message.contains("user alice"), "{:?}", denied(&no));
        admitted(&h.admission.reserve(&bob).await);
        let mut big = h.attributes(0, 300);
        big.model = Some("other".into());
        admitted(&h.admission.reserve(&big).await);
        let no = h.admission.reserve(&big).await;
        assert!(denied(&no).message.contains("model other"), "{:?}", denied(&no));
    }

    pub async fn the_daily_budget_resets_at_midnight_utc<S: Store>(h: Harness<S>) {
        admitted(&h.reserve(0, 600).await);
        let d = h.reserve(0, 600).await;
        let no = denied(&d);
        assert_eq!(no.reason, Reason::Budget);
        let wait = no.retry_after_ms.unwrap();
        assert!(wait <= 86_400_000);
        if h.exact_time() {
            assert_eq!(wait, 43_200_000, "the manual clock starts at noon UTC");
        } else {
            let now = tollgate::store::clock::Clock::now_ms(&tollgate::store::clock::SystemClock);
            let expected = 86_400_000 - now % 86_400_000;
            assert!(wait.abs_diff(expected) < 5_000, "{wait} vs {expected}");
        }
    }

    /// Milliseconds from `now` to the start of the next UTC calendar month.
    fn to_next_month(now: u64) -> u64 {
        let month = support::model::month_of(now / 86_400_000);
        support::model::month_start(month + 1) * 86_400_000 - now
    }

    pub async fn the_monthly_budget_resets_at_the_start_of_the_month<S: Store>(h: Harness<S>) {
        let november = admitted(&h.reserve(0, 600).await).reservation_id.clone();
        let no = denied(&h.reserve(0, 600).await).clone();
        assert_eq!(no.reason, Reason::Budget);
        assert!(no.message.contains("monthly token budget of scope tenant"), "{no:?}");
        let wait = no.retry_after_ms.unwrap();
        if !h.exact_time() {
            let now = tollgate::store::clock::Clock::now_ms(&tollgate::store::clock::SystemClock);
            assert!(wait.abs_diff(to_next_month(now)) < 5_000, "{wait} vs {}", to_next_month(now));
            return;
        }
        // The manual clock starts at noon on 29 November: December is a day and a half away.
        assert_eq!(wait, 36 * 3_600_000);
        h.advance(24 * 3_600_000).await;
        assert_eq!(denied(&h.reserve(0, 600).await).reason, Reason::Budget, "a new day is not a new month");
        h.advance(12 * 3_600_000).await;
        let december = admitted(&h.reserve(0, 600).await).reservation_id.clone();
        // November's hold gives its tokens back to November only: December's 600 stay counted.
        h.admission.release(&november).await.unwrap();
        assert_eq!(h.tenant_scope().await.num("mu"), 600.0);
        assert_eq!(denied(&h.reserve(0, 600).await).reason, Reason::Budget);
        h.admission.commit(&december, 0, 100).await.unwrap();
        assert_eq!(h.tenant_scope().await.num("mu"), 100.0, "a December commit refunds December");
    }

    /// Model `m` costs 1,000 nanos an input token and 3,000 an output token; the budget is 0.001.
    pub async fn a_budget_in_money_holds_the_worst_case_and_charges_the_actual<S: Store>(h: Harness<S>) {
        let first = admitted(&h.reserve(100, 200).await).reservation_id.clone();
        let no = denied(&h.reserve(100, 200).await).clone();
        assert_eq!(no.reason, Reason::Budget, "700,000 held, 700,000 more asked, 1,000,000 in all");
        assert!(no.message.contains("daily cost budget of scope tenant"), "{no:?}");
        assert!(no.retry_after_ms.unwrap() <= 86_400_000);
        let c = h.admission.commit(&first, 100, 50).await.unwrap();
        assert_eq!(c.usage().unwrap().cost_nanos, 250_000, "100 x 1,000 + 50 x 3,000");
        let second = admitted(&h.reserve(100, 200).await).reservation_id.clone();
        let c = h.admission.commit(&second, 100, 400).await.unwrap();
        assert_eq!(c.usage().unwrap().cost_nanos, 1_300_000, "an overrun costs what it used");
        assert_eq!(h.tenant_scope().await.num("dc"), 1_550_000.0);
        assert_eq!(denied(&h.reserve(1, 1).await).reason, Reason::Budget, "spent past the budget");
        let never = denied(&h.reserve(100, 400).await).clone();
        assert_eq!(never.reason, Reason::Unsatisfiable, "1,300,000 can never fit 1,000,000: {never:?}");
        assert!(never.message.contains("may cost 0.0013"), "{never:?}");
    }

    pub async fn the_request_rate_is_limited<S: Store>(h: Harness<S>) {
        let first = h.reserve(1, 1).await;
        let requests = admitted(&first).headroom.requests.unwrap();
        assert_eq!((requests.limit, requests.remaining), (2, 1));
        assert!(admitted(&first).headroom.tokens.is_none(), "no scope limits tokens");
        admitted(&h.reserve(1, 1).await);
        let d = h.reserve(1, 1).await;
        let no = denied(&d);
        assert_eq!(no.reason, Reason::RequestRate);
        // 2 per minute: one permit every 30 s.
        let wait = no.retry_after_ms.unwrap();
        assert!((29_000..=30_000).contains(&wait), "{wait}");
    }

    /// A concurrency refusal whose slot frees within the back-off, when the hold's lease ends
    /// (300 ms), hints that time, and its message says so; sent again then, admitted.
    pub async fn a_concurrency_refusal_says_when_a_lease_frees_the_slot<S: Store>(h: Harness<S>) {
        admitted(&h.reserve(1, 1).await);
        let d = h.reserve(1, 1).await;
        let no = denied(&d);
        assert_eq!(no.reason, Reason::Concurrency);
        let wait = no.retry_after_ms.unwrap();
        assert!((200..=300).contains(&wait), "{no:?}");
        assert!(
            no.message.contains(&format!("one frees at the latest when a hold's lease ends, in {wait} ms")),
            "{no:?}"
        );
        if h.exact_time() {
            assert_eq!(wait, 300);
            h.advance(wait - 1).await;
            assert_eq!(denied(&h.reserve(1, 1).await).retry_after_ms, Some(1), "not a ms sooner");
            h.advance(1).await;
            admitted(&h.reserve(1, 1).await);
        }
    }

    pub async fn the_limit_that_frees_last_is_the_reason<S: Store>(h: Harness<S>) {
        admitted(&h.reserve(0, 600).await);
        // Both the bucket (200 tokens short, 200 s) and the day (until midnight) refuse.
        let d = h.reserve(0, 600).await;
        let no = denied(&d);
        let wait = no.retry_after_ms.unwrap();
        let to_midnight = to_turn(&h, 0, tollgate::hold::Period::Day);
        if h.exact_time() {
            // The manual clock starts at noon: the day frees last, exactly at midnight.
            assert_eq!((no.reason, wait), (Reason::Budget, to_midnight), "{no:?}");
        }
        // On the real clock, within 200 s of midnight the bucket frees last and is the reason; at
        // about 200 s either may be.
        if to_midnight > 201_000 {
            assert_eq!(no.reason, Reason::Budget, "{no:?}");
            assert!(wait > 200_000 && wait.abs_diff(to_midnight) < 5_000, "{wait} vs {to_midnight}");
        } else if to_midnight < 199_000 {
            assert_eq!(no.reason, Reason::TokenRate, "{no:?}");
            assert!((199_000..=200_000).contains(&wait), "{wait}");
        } else {
            assert!(matches!(no.reason, Reason::Budget | Reason::TokenRate), "{no:?}");
            assert!(wait.abs_diff(200_000) < 5_000, "{wait}");
        }
    }

    pub async fn every_key_carries_a_ttl<S: Store>(h: Harness<S>) {
        let id = admitted(&h.reserve(10, 10).await).reservation_id.clone();
        for (key, view) in h.snapshot(&[&id]).await {
            assert_eq!(view.pttl, 1, "{key} has no TTL");
        }
        h.admission.commit(&id, 1, 1).await.unwrap();
        // The second hold settled in a bucket finds it with its TTL, and leaves it so.
        let other = admitted(&h.reserve(10, 10).await).reservation_id.clone();
        h.admission.commit(&other, 1, 1).await.unwrap();
        let retention = i64::try_from(h.admission.policy().record_retention_ms).unwrap();
        let settled = h.settled().await;
        assert_eq!(settled.len(), 2, "{settled:?}");
        for (field, (_, pttl)) in settled {
            assert!(pttl > 0 && pttl <= 2 * retention, "{field}'s settled bucket expires in {pttl} ms");
        }
    }

    /// A settled bucket an earlier version filed in (entries, no `ttl` mark) is given its TTL by
    /// the first filing of this one, whether the earlier one had given it one or not: the mark, not
    /// the entries, says the bucket has it. (Here the earlier bucket has none, the worst case.)
    pub async fn a_settled_bucket_an_earlier_version_made_gets_its_ttl<S: Store>(h: Harness<S>) {
        let retention = h.admission.policy().record_retention_ms;
        let period = h.now_ms() / retention;
        let bucket = format!("{}{period}", keys::settled_prefix(&h.tenant));
        let earlier = Script::new(
            "earlier",
            "return redis.call('HSET', KEYS[1], '0123456789abcdef0123', 'c0 20 1 10 7 13000')".to_string(),
        );
        let store = h.admission.protocol().store();
        store.eval(&earlier, vec![bucket.clone()], vec![]).await.expect("an earlier version's entry");
        assert_eq!(h.scope(&bucket).await.unwrap().pttl, -1, "no TTL yet");
        let id = admitted(&h.reserve(10, 10).await).reservation_id.clone();
        h.admission.commit(&id, 1, 1).await.unwrap();
        if h.now_ms() / retention != period {
            return; // (the period turned: this hold was filed in a bucket of its own)
        }
        let view = h.scope(&bucket).await.unwrap();
        assert!(view.pttl > 0 && view.pttl <= 2 * i64::try_from(retention).unwrap(), "{view:?}");
        assert_eq!(view.fields.get("ttl").map(String::as_str), Some("1"), "{view:?}");
    }

    /// A busy scope's TTL is set about once in every sixteenth of its idle TTL, not at every call
    /// (see `lasting` in lua/common.lua), and a call that writes it never leaves it less than the
    /// idle TTL to live.
    pub async fn a_busy_scope_sets_its_ttl_once_in_a_while<S: Store>(h: Harness<S>) {
        if !h.exact_time() {
            return; // Reads TTLs to the millisecond.
        }
        let idle = i64::try_from(h.admission.policy().tenants[&h.tenant].idle_ttl_ms).unwrap();
        let (scope, slack) = (keys::tenant_scope(&h.tenant), idle / 16);
        let id = admitted(&h.reserve(1, 1).await).reservation_id.clone();
        assert_eq!(h.scope(&scope).await.unwrap().pttl, idle + slack);
        h.advance(slack.unsigned_abs() / 2).await;
        h.admission.commit(&id, 1, 1).await.unwrap();
        assert_eq!(h.scope(&scope).await.unwrap().pttl, idle + slack - slack / 2, "not set again within a sixteenth");
        h.advance((slack - slack / 2 + 1).unsigned_abs()).await;
        admitted(&h.reserve(1, 1).await);
        assert_eq!(
            h.scope(&scope).await.unwrap().pttl,
            idle + slack,
            "set again once it would fall short of the idle TTL"
        );
    }

    /// A tenant with holds in flight keeps its lease index's and holds hash's TTL as a busy scope
    /// does: set when its first hold makes them, then again only once it would fall short of the
    /// idle TTL; every hold outlives its lease in both all the same.
    pub async fn a_busy_tenant_sets_its_index_ttl_once_in_a_while<S: Store>(h: Harness<S>) {
        if !h.exact_time() {
            return; // Reads TTLs to the millisecond.
        }
        let idle = i64::try_from(h.admission.policy().tenants[&h.tenant].idle_ttl_ms).unwrap();
        let slack = idle / 16;
        let shared = [keys::leases(&h.tenant), keys::holds(&h.tenant)];
        let ttls = || async { h.inspect(shared.to_vec()).await.into_values().map(|v| v.pttl).collect::<Vec<_>>() };
        let first = admitted(&h.reserve(1, 1).await).reservation_id.clone();
        assert_eq!(ttls().await, [idle + slack; 2], "the first hold makes both keys, with their TTL");
        h.advance(slack.unsigned_abs() / 2).await;
        admitted(&h.reserve(1, 1).await);
        assert_eq!(ttls().await, [idle + slack; 2], "the first hold beside another notes how long they live");
        h.advance(slack.unsigned_abs() / 2).await;
        admitted(&h.reserve(1, 1).await);
        assert_eq!(ttls().await, [idle + slack - slack / 2; 2], "not set again within a sixteenth");
        h.advance((slack - slack / 2 + 1).unsigned_abs()).await;
        admitted(&h.reserve(1, 1).await);
        assert_eq!(ttls().await, [idle + slack; 2], "set again once it would fall short of the idle TTL");
        // Every hold settled: the keys go, and the next hold makes them anew, with their TTL.
        h.advance(1).await;
        h.admission.commit(&first, 1, 1).await.unwrap();
        let ids: Vec<String> = h.inspect(vec![shared[1].clone()]).await[&shared[1]]
            .fields
            .keys()
            .filter(|f| !f.ends_with('+'))
            .cloned()
            .collect();
        for id in ids {
            h.admission.commit(&id, 1, 1).await.unwrap();
        }
        assert_eq!(ttls().await, [-2; 2], "no hold left: no index, no holds hash");
        admitted(&h.reserve(1, 1).await);
        assert_eq!(ttls().await, [idle + slack; 2]);
    }

    /// A hold once committed or released leaves no record: one entry of its tenant's settled
    /// bucket, the last 20 hex digits of its id and a short value, answers a repeated commit,
    /// release or renew with the first result for at least the retention, and is gone after twice
    /// it.
    pub async fn a_settled_hold_is_one_short_entry_that_answers_repeats<S: Store>(h: Harness<S>) {
        let committed = admitted(&h.reserve(10, 10).await).reservation_id.clone();
        let first = h.admission.commit(&committed, 4, 3).await.unwrap();
        let released = admitted(&h.reserve(10, 10).await).reservation_id.clone();
        h.admission.release(&released).await.unwrap();
        let (c, r) = (keys::record(&h.tenant, &committed), keys::record(&h.tenant, &released));
        assert!(h.scope(&c).await.is_none() && h.scope(&r).await.is_none(), "no record left");
        let entries = h.settled().await;
        let field = |id: &str| id[id.len() - 20..].to_string();
        let values: Vec<&str> = [&committed, &released].map(|id| entries[&field(id)].0.as_str()).to_vec();
        // (state and metered, held, attempts, output held, used or refunded, cost; how they ended
        // is what the entries imply, so nothing more is kept)
        assert_eq!(values, ["c0 20 1 10 7 13000", "r0 20 1 10 20 0"], "{entries:?}");
        let CommitOutcome::Committed(u) = &first else { panic!("{first:?}") };
        assert_eq!(u.ending, Some(Ending::Completed));
        let repeat = Usage { duplicate: true, model: None, ..u.clone() };
        assert_eq!(h.admission.commit(&committed, 9, 9).await.unwrap(), CommitOutcome::Committed(repeat.clone()));
        // An ending the entry does not imply is kept beside it, and answers a repeat too.
        let left = admitted(&h.reserve(10, 10).await).reservation_id.clone();
        let metered = Counted::Metered { output: 3 };
        h.admission.commit_ended(&left, metered, Ending::ClientLeft).await.unwrap();
        let answer = h.admission.commit(&left, 9, 9).await.unwrap();
        assert_eq!(answer.usage().and_then(|u| u.ending), Some(Ending::ClientLeft), "{answer:?}");
        let again = h.admission.release(&released).await.unwrap();
        assert_eq!(again, ReleaseOutcome::Released { refunded: 20, repeated: true });
        assert_eq!(h.admission.renew(&committed, 0).await.unwrap().state(), "committed");
        assert_eq!(h.admission.commit(&released, 1, 1).await.unwrap(), CommitOutcome::Released);
        let retention = h.admission.policy().record_retention_ms;
        let pttl = entries[&field(&committed)].1;
        assert!(pttl > i64::try_from(retention).unwrap() && pttl <= 2 * i64::try_from(retention).unwrap(), "{pttl}");
        if let Some(clock) = &h.clock {
            let bucket = format!("{}{}", keys::settled_prefix(&h.tenant), clock.now_ms() / retention);
            h.advance(retention - 1).await;
            assert_eq!(h.admission.commit(&committed, 4, 3).await.unwrap(), CommitOutcome::Committed(repeat));
            h.advance(retention + 1).await;
            assert!(h.scope(&bucket).await.is_none(), "gone after twice the retention");
            assert_eq!(h.admission.commit(&committed, 4, 3).await.unwrap(), CommitOutcome::NotFound);
            assert_eq!(h.admission.release(&released).await.unwrap(), ReleaseOutcome::NotFound);
        }
    }

    /// A reload that shortens the lease (and with it the idle TTL) leaves a hold made before it its
    /// own terms: no later call shortens the TTL of a key it lives in (lease index, holds hash,
    /// scope), so it is never orphaned, and its late settlement frees its own slot, no other.
    pub async fn a_reload_that_shortens_the_lease_leaves_old_holds_their_terms<S: Store>(h: Harness<S>) {
        let old = admitted(&h.reserve(10, 90).await).reservation_id.clone();
        let mut policy = tollgate::config::Policy::clone(&h.admission.policy());
        let mut tp = tollgate::config::TenantPolicy::clone(&policy.tenants[&h.tenant]);
        assert_eq!(tp.lease_ttl_ms, 120_000, "the default lease");
        (tp.lease_ttl_ms, tp.idle_ttl_ms) = (1_000, 63_000);
        policy.tenants.insert(h.tenant.clone(), std::sync::Arc::new(tp));
        h.admission.reload(policy);
        admitted(&h.reserve(10, 90).await);
        let shared = [keys::leases(&h.tenant), keys::holds(&h.tenant), keys::tenant_scope(&h.tenant)];
        for (key, view) in h.inspect(shared.to_vec()).await {
            assert!(view.pttl > 120_000, "{key} expires in {} ms, before the old hold's lease ends", view.pttl);
        }
        if !h.exact_time() {
            return;
        }
        // Past the new idle TTL, within the old hold's lease: the new hold has expired, the old
        // one is alive, and every key it needs is there.
        h.advance(70_000).await;
        admitted(&h.reserve(10, 90).await);
        assert_eq!(h.in_flight().await, 2.0, "the old hold and the newest: the expired one settled");
        let c = h.admission.commit(&old, 10, 20).await.unwrap();
        assert_eq!(c.usage().map(|u| (u.used, u.duplicate)), Some((30, false)), "{c:?}");
        assert_eq!(h.in_flight().await, 1.0, "the old hold freed its own slot, and only it");
    }

    pub async fn bad_ids_change_nothing<S: Store>(h: Harness<S>) {
        assert!(h.admission.commit("nope", 1, 1).await.is_err());
        let unknown = format!("{}:{}", h.tenant, "0".repeat(32));
        assert_eq!(h.admission.commit(&unknown, 1, 1).await.unwrap().state(), "not_found");
        assert_eq!(h.admission.release(&unknown).await.unwrap().state(), "not_found");
        assert_eq!(h.admission.renew(&unknown, 0).await.unwrap().state(), "not_found");
        assert_eq!(h.tenant_scope().await.kind, "none");
    }

    /// Hundreds of concurrent reserves against a budget that admits exactly K.
    pub async fn concurrent_reserves_never_over_admit<S: Store>(h: Harness<S>) {
        let h = &h;
        let results = join_all((0..300).map(|_| async move { h.reserve(0, 100).await })).await;
        let admitted = results.iter().filter(|d| matches!(d, Decision::Admitted(_))).count();
        assert_eq!(admitted, 7, "a 700-token bucket admits exactly seven 100-token holds");
    }

    // Pools. Model m: 1,000 prefill tokens/s, 100 decode tokens/s per sequence, so a request of
    // 100 prompt + 100 output tokens is predicted to hold a slot for 100 + 1,000 = 1,100 ms.

    fn pooled<S: Store>(h: &Harness<S>, tier: Priority, deadline_ms: Option<u64>) -> Attributes {
        let mut a = h.attributes(100, 100);
        a.priority = Some(tier);
        a.deadline_ms = deadline_ms;
        a
    }

    pub async fn a_committed_or_released_hold_leaves_the_pool_exactly<S: Store>(h: Harness<S>) {
        let a = admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await).reservation_id.clone();
        let b = admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await).reservation_id.clone();
        assert_eq!(h.pool_load().await, (2, 2200));
        assert_eq!(h.admission.commit(&a, 90, 40).await.unwrap().state(), "committed");
        assert_eq!(h.pool_load().await, (1, 1100));
        assert_eq!(h.admission.commit(&a, 90, 40).await.unwrap().state(), "committed", "a repeat");
        assert_eq!(h.pool_load().await, (1, 1100), "a repeated commit takes nothing more off the pool");
        assert_eq!(h.admission.release(&b).await.unwrap().state(), "released");
        assert_eq!(h.pool_load().await, (0, 0));
    }

    pub async fn an_expired_hold_leaves_the_pool<S: Store>(h: Harness<S>) {
        let a = admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await).reservation_id.clone();
        h.advance(400).await;
        let b = admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await).reservation_id.clone();
        assert_eq!(h.pool_load().await, (1, 1100), "the expired hold was swept from the pool");
        assert_eq!(h.admission.commit(&a, 1, 1).await.unwrap().state(), "late_committed");
        assert_eq!(h.pool_load().await, (1, 1100), "a late commit takes nothing more off");
        h.admission.commit(&b, 1, 1).await.unwrap();
        assert_eq!(h.pool_load().await, (0, 0));
    }

    /// The tenant's sweep settles an expired pooled hold on a reserve for another model: its pool
    /// work leaves with it, not when the pool's own sweep comes round.
    pub async fn a_hold_the_tenant_sweep_settles_leaves_its_pool<S: Store>(h: Harness<S>) {
        admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await);
        assert_eq!(h.pool_load().await, (1, 1100));
        h.advance(400).await;
        let mut other = h.attributes(1, 1);
        other.model = Some("other".into());
        admitted(&h.admission.reserve(&other).await);
        assert_eq!(h.pool_load().await, (0, 0));
    }

    /// A provider's 429 throttles the pool: nothing new until its Retry-After, then half the slots
    /// (one decrease per cooldown), recovering with time.
    pub async fn a_providers_429s_throttle_its_pool<S: Store>(h: Harness<S>) {
        // Four slots, 1,000 ms max queue delay; each request is 1,100 ms of work.
        let a = admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await).reservation_id.clone();
        admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await);
        assert_eq!(h.admission.upstream_refused(&a, Some(300)).await.unwrap(), Some(0.5));
        let v = h.admission.pool_status(&h.pool).await.unwrap().load;
        assert_eq!((v.holds, v.share), (2, 0.5));
        assert!((1..=300).contains(&v.resumes_in_ms), "{v:?}");
        let no = h.admission.reserve(&pooled(&h, Priority::Critical, None)).await;
        let no = denied(&no);
        assert_eq!(no.reason, Reason::QueueFull);
        assert!(no.message.contains("throttled"), "{}", no.message);
        // Not at the provider's Retry-After (half the pool is still full then: two holds wait
        // ceil(2200 / 2) > 1,000 ms) but when both holds end as predicted, 1,210 ms after they came
        // (their work, a tenth more).
        let ms = no.retry_after_ms.unwrap();
        assert!((1_100..=1_210).contains(&ms), "{no:?}");
        assert!(no.message.contains(&format!("sent again in {ms} ms")), "{}", no.message);
        h.advance(400).await;
        // Retry-After passed; half the pool: two holds on two slots wait ceil(2200 / 2) > 1,000 ms.
        let no = h.admission.reserve(&pooled(&h, Priority::Critical, None)).await;
        assert!(denied(&no).message.contains("is full"), "{:?}", denied(&no));
        // Another 429 within the cooldown is the same burst: no second decrease.
        let share = h.admission.upstream_refused(&a, None).await.unwrap().unwrap();
        assert!((0.5..0.6).contains(&share), "{share}");
        assert_eq!(h.pool_load().await, (2, 2200), "a throttled refusal holds nothing");
        if h.exact_time() {
            // 0.05 of the pool back per second: whole again within ten seconds.
            h.advance(10_000).await;
            assert_eq!(h.admission.pool_status(&h.pool).await.unwrap().load.share, 1.0);
            admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await);
        }
    }

    pub async fn renew_extends_the_pool_lease_too<S: Store>(h: Harness<S>) {
        let a = admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await).reservation_id.clone();
        h.advance(200).await;
        assert_eq!(h.admission.renew(&a, 0).await.unwrap().state(), "reserved");
        h.advance(200).await;
        // Past the first lease, inside the renewed one: the next reserve's sweep keeps it.
        admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await);
        assert_eq!(h.pool_load().await, (2, 2200));
        h.advance(400).await;
        admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await);
        assert_eq!(h.pool_load().await, (1, 1100), "both earlier holds expired and left the pool");
    }

    pub async fn a_tenant_refusal_gives_the_pool_leg_back<S: Store>(h: Harness<S>) {
        let a = admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await).reservation_id.clone();
        let no = h.admission.reserve(&pooled(&h, Priority::Critical, None)).await;
        assert_eq!(denied(&no).reason, Reason::Concurrency, "the tenant's one slot is taken");
        assert_eq!(h.pool_load().await, (1, 1100), "the refused request's pool work was given back");
        h.admission.release(&a).await.unwrap();
        assert_eq!(h.pool_load().await, (0, 0));
    }

    pub async fn deadline_and_queue_decisions_follow_the_model<S: Store>(h: Harness<S>) {
        // Two slots, 1,500 ms max queue delay.
        let crit = |deadline| pooled(&h, Priority::Critical, deadline);
        let a = admitted(&h.admission.reserve(&crit(None)).await).reservation_id.clone();
        let b = admitted(&h.admission.reserve(&crit(Some(1_100))).await).reservation_id.clone();
        assert_eq!(h.pool_load().await, (2, 2200));
        let before = h.snapshot(&[]).await;
        // Both slots busy: start in ceil(2200 / 2) = 1,100 ms, finish at 2,200 ms.
        let d = h.admission.reserve(&crit(Some(2_000))).await;
        let no = denied(&d);
        assert_eq!(no.reason, Reason::Deadline);
        assert!(no.message.contains("2200 ms"), "{}", no.message);
        // Sent again once both holds end as predicted (1,210 ms after they came: their 1,100 ms of
        // work and a tenth more, the error their speeds may have), it starts at once
        // and finishes in time; the message says the same time, and no SDK retries by itself.
        let fits = no.retry_after_ms.unwrap();
        assert!(no.message.contains(&format!("sent again in {fits} ms")), "{}", no.message);
        assert!(!no.should_retry());
        assert_eq!(h.pool_load().await, (2, 2200), "a refused request occupies nothing");
        assert_eq!(h.snapshot(&[]).await, before, "nor charges its tenant");
        admitted(&h.admission.reserve(&crit(Some(2_200))).await);
        // Three outstanding on two slots: start in ceil(3300 / 2) = 1,650 ms, past the 1,500 max.
        // Admission counts each hold in full until it ends, so the retry is when the first two end
        // as predicted (1,210 ms after they came): one hold left, a slot free. Not sooner: the
        // pool does not drain by time alone.
        let d = h.admission.reserve(&crit(None)).await;
        let no = denied(&d);
        assert_eq!(no.reason, Reason::QueueFull);
        let ms = no.retry_after_ms.unwrap();
        assert!(no.message.contains(&format!("sent again in {ms} ms")), "{}", no.message);
        assert_eq!(h.pool_load().await, (3, 3300));
        if h.exact_time() {
            assert_eq!((fits, ms), (1_210, 1_210));
            h.advance(ms - 1).await;
            assert_eq!(denied(&h.admission.reserve(&crit(None)).await).retry_after_ms, Some(1), "not a ms sooner");
            h.advance(1).await;
            // Their predicted end, and they have not ended: when they will, nobody can say, so the
            // retry does not count on them: it is when the third ends (its start in 1,100 ms and its
            // work, a tenth more: 2,420 ms after it came), leaving two holds of work.
            assert_eq!(denied(&h.admission.reserve(&crit(None)).await).retry_after_ms, Some(1_210));
            // Past the third's predicted end too: no hold can be counted on, so no time can be
            // predicted, and the hint is the back-off (`concurrency_retry_ms`), said so.
            h.advance(1_211).await;
            let d = h.admission.reserve(&crit(None)).await;
            let no = denied(&d);
            assert_eq!((no.reason, no.retry_after_ms), (Reason::QueueFull, Some(1_000)), "{no:?}");
            assert!(no.message.contains("cannot be predicted") && no.message.contains("back off 1000 ms"), "{no:?}");
            // They end.
            h.admission.commit(&a, 1, 1).await.unwrap();
            h.admission.commit(&b, 1, 1).await.unwrap();
            admitted(&h.admission.reserve(&crit(None)).await);
        } else {
            assert!((1_100..=1_210).contains(&fits) && (1_100..=1_210).contains(&ms), "{fits} {ms}");
        }
    }

    pub async fn tiers_are_refused_in_order<S: Store>(h: Harness<S>) {
        // Four slots, max delay 1,000 ms; standard may fill 3 slots, sheddable 2.
        let ask = |tier| pooled(&h, tier, None);
        admitted(&h.admission.reserve(&ask(Priority::Sheddable)).await);
        admitted(&h.admission.reserve(&ask(Priority::Sheddable)).await);
        assert_eq!(denied(&h.admission.reserve(&ask(Priority::Sheddable)).await).reason, Reason::QueueFull);
        admitted(&h.admission.reserve(&ask(Priority::Standard)).await);
        assert_eq!(denied(&h.admission.reserve(&ask(Priority::Standard)).await).reason, Reason::QueueFull);
        assert_eq!(denied(&h.admission.reserve(&ask(Priority::Sheddable)).await).reason, Reason::QueueFull);
        admitted(&h.admission.reserve(&ask(Priority::Critical)).await);
        // All four slots busy: even critical would start 1,100 ms late, past the max.
        assert_eq!(denied(&h.admission.reserve(&ask(Priority::Critical)).await).reason, Reason::QueueFull);
        assert_eq!(h.pool_load().await, (4, 4400));
    }

    /// A lower tier queues only its share of the pool's max queue delay (2,000 ms): sheddable
    /// (0.5) 1,000 ms, standard (0.8) 1,600 ms, so the queue they leave is one critical requests
    /// still get through in time.
    pub async fn a_lower_tier_queues_only_its_share_of_the_delay<S: Store>(h: Harness<S>) {
        let ask = |tier| pooled(&h, tier, None);
        admitted(&h.admission.reserve(&ask(Priority::Sheddable)).await);
        admitted(&h.admission.reserve(&ask(Priority::Sheddable)).await);
        // Its two slots busy: it would start in 1,100 ms, past its 1,000.
        let no = h.admission.reserve(&ask(Priority::Sheddable)).await;
        assert_eq!(denied(&no).reason, Reason::QueueFull, "{no:?}");
        // Standard's three slots: 1,100 then 1,467 ms are within its 1,600; 1,834 is not.
        admitted(&h.admission.reserve(&ask(Priority::Standard)).await);
        admitted(&h.admission.reserve(&ask(Priority::Standard)).await);
        admitted(&h.admission.reserve(&ask(Priority::Standard)).await);
        assert_eq!(denied(&h.admission.reserve(&ask(Priority::Standard)).await).reason, Reason::QueueFull);
        // Critical, over all four slots: 5,500 / 4 = 1,375 ms, within the pool's 2,000.
        admitted(&h.admission.reserve(&ask(Priority::Critical)).await);
        assert_eq!(h.pool_load().await, (6, 6600));
    }

    pub async fn a_tenant_cannot_claim_a_tier_above_its_cap<S: Store>(h: Harness<S>) {
        // The tenant may claim at most sheddable, which gets one of the pool's two slots.
        admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await);
        let no = h.admission.reserve(&pooled(&h, Priority::Critical, None)).await;
        assert_eq!(denied(&no).reason, Reason::QueueFull);
        assert!(denied(&no).message.contains("sheddable"), "{}", denied(&no).message);
    }

    pub async fn the_kv_cache_bounds_what_a_pool_holds<S: Store>(h: Harness<S>) {
        // 500 KV tokens; each request holds 200.
        admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await);
        admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await);
        assert_eq!(denied(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await).reason, Reason::QueueFull);
        let mut huge = pooled(&h, Priority::Critical, None);
        huge.max_tokens = Some(500);
        assert_eq!(denied(&h.admission.reserve(&huge).await).reason, Reason::Unsatisfiable);
        assert_eq!(h.pool_load().await, (2, 2200));
    }

    /// Ten rounds of twenty concurrent reserves, each round running alongside the commits and
    /// releases of the round before, so reserves, commits, releases and both legs' refusals
    /// interleave (for real on Redis; in poll order on the embedded store). When all is settled,
    /// the pool holds nothing and the tenant has been charged exactly what was committed.
    pub async fn no_interleaving_leaks_pool_work_or_tenant_budget<S: Store>(h: Harness<S>) {
        let h = &h;
        let settle = |ids: Vec<(u32, String)>| async move {
            join_all(ids.into_iter().map(|(i, id)| async move {
                if i % 2 == 0 {
                    assert_eq!(h.admission.commit(&id, 30, 20).await.unwrap().state(), "committed");
                    50
                } else {
                    assert_eq!(h.admission.release(&id).await.unwrap().state(), "released");
                    0
                }
            }))
            .await
            .into_iter()
            .sum::<u64>()
        };
        let (mut pending, mut charged, mut refused) = (Vec::new(), 0, Vec::new());
        for round in 0..10u32 {
            let reserves = join_all((0..20u32).map(|j| async move {
                let i = round * 20 + j;
                let tier = [Priority::Critical, Priority::Standard, Priority::Sheddable][i as usize % 3];
                (i, h.admission.reserve(&pooled(h, tier, None)).await)
            }));
            let (decisions, settled) = futures_util::join!(reserves, settle(std::mem::take(&mut pending)));
            charged += settled;
            for (i, d) in decisions {
                match d {
                    Decision::Admitted(a) => pending.push((i, a.reservation_id)),
                    Decision::Denied(d) => refused.push(d.reason),
                    Decision::Unmetered(_) => panic!("the store is up: nothing is unmetered"),
                }
            }
        }
        charged += settle(pending).await;
        let count = |r: Reason| refused.iter().filter(|x| **x == r).count();
        assert!(count(Reason::QueueFull) > 0, "the pool leg should refuse some: {refused:?}");
        assert!(count(Reason::TokenRate) > 0, "the tenant leg should refuse some: {refused:?}");
        assert_eq!(count(Reason::QueueFull) + count(Reason::TokenRate), refused.len(), "{refused:?}");
        assert_eq!(h.pool_load().await, (0, 0), "every pool hold was given back");
        let scope = h.tenant_scope().await;
        assert_eq!(scope.num("c"), 0.0, "no slot is left held");
        let t = scope.num("t");
        let expected = 1500.0 - charged as f64;
        assert!(t >= expected && t < expected + 5.0, "tokens {t}, expected {expected} (+ refill)");
    }

    // Adaptive output. Outputs of 100 tokens fall in the bucket (1.05^94, 1.05^95] = (98.1, 103.0],
    // whose upper edge, rounded up to 104, is what the estimate reserves.

    async fn cycle<S: Store>(h: &Harness<S>, max_tokens: u64, output: u64) -> u64 {
        let d = h.reserve(0, max_tokens).await;
        let a = admitted(&d);
        h.admission.commit(&a.reservation_id, 0, output).await.unwrap();
        a.reserved_tokens
    }

    pub async fn the_ceiling_is_held_until_the_estimate_has_its_samples<S: Store>(h: Harness<S>) {
        for i in 0..10 {
            assert_eq!(cycle(&h, 1000, 100).await, 1000, "sample {i}: too few samples, the ceiling is held");
        }
        assert_eq!(cycle(&h, 1000, 100).await, 104, "ten samples: the 90th percentile's bucket edge");
        assert_eq!(cycle(&h, 50, 40).await, 50, "never above the request's max_tokens");
        let e = h.admission.output_estimate(&h.tenant, "m").await.unwrap();
        assert_eq!((e.samples, e.quantile_tokens, e.overrun_tokens), (12, 104, 0));
        assert_eq!(e.used_tokens, 11 * 100 + 40);
    }

    pub async fn an_output_past_the_estimate_is_debt_and_counts_as_estimator_error<S: Store>(h: Harness<S>) {
        for _ in 0..10 {
            cycle(&h, 1000, 100).await;
        }
        let d = h.reserve(0, 1000).await;
        let a = admitted(&d);
        assert_eq!(a.reserved_tokens, 104);
        let c = h.admission.commit(&a.reservation_id, 0, 300).await.unwrap();
        assert_eq!((c.usage().unwrap().overrun, c.usage().unwrap().refunded), (196, 0));
        let e = h.admission.output_estimate(&h.tenant, "m").await.unwrap();
        assert_eq!((e.used_tokens, e.overrun_tokens), (1300, 196));
    }

    pub async fn the_estimate_is_shared_by_every_replica<S: Store + Clone>(h: Harness<S>) {
        for _ in 0..10 {
            cycle(&h, 1000, 100).await;
        }
        // A second admission service on the same store, as a second replica would be.
        let protocol = tollgate::store::Protocol::new(h.admission.protocol().store().clone()).await.unwrap();
        let other = std::sync::Arc::new(tollgate::admission::Admission::new(h.admission.policy(), protocol));
        let d = other.reserve(&h.attributes(0, 1000)).await;
        assert_eq!(admitted(&d).reserved_tokens, 104);
    }

    pub async fn the_estimate_follows_drift<S: Store>(h: Harness<S>) {
        for _ in 0..20 {
            cycle(&h, 1000, 100).await;
        }
        // A window of 20: older samples are halved away as the outputs grow to 400.
        for _ in 0..40 {
            cycle(&h, 1000, 400).await;
        }
        let e = h.admission.output_estimate(&h.tenant, "m").await.unwrap();
        assert!(e.samples <= 20, "decayed to the window: {}", e.samples);
        assert_eq!(e.quantile_tokens, 404, "400 falls in (1.05^122, 1.05^123] = (384.7, 403.9], edge 404");
    }

    // The books balance on paths the scenarios above never walk: re-sent scripts, a caller that
    // gives up mid-call, debt after refill, long renewed streams, a sweep that falls behind.

    /// fred re-sends a script after a dropped connection; the first run happened, its reply was
    /// lost. Every write script must charge, free and release exactly once all the same.
    pub async fn every_write_script_is_safe_to_run_twice<S: Store + Clone>(h: Harness<S>) {
        let all = &["reserve", "commit", "renew", "release", "pool_reserve", "pool_release", "pool_renew"];
        let twice = h.wrapped(|s| Resend { inner: s, scripts: all }).await;
        let a = admitted(&twice.admission.reserve(&pooled(&twice, Priority::Critical, None)).await).clone();
        assert_eq!(a.reserved_tokens, 200);
        assert_eq!(twice.pool_load().await, (1, 1100), "the pool holds the work once");
        assert_eq!(twice.in_flight().await, 1.0, "one slot, not two");
        let t = twice.tenant_scope().await.num("t");
        assert!((800.0..802.0).contains(&t), "charged once: {t}");
        assert_eq!(twice.admission.renew(&a.reservation_id, 0).await.unwrap().state(), "reserved");
        let c = twice.admission.commit(&a.reservation_id, 50, 20).await.unwrap();
        assert_eq!((c.usage().unwrap().used, c.usage().unwrap().refunded), (70, 130));
        assert_eq!(twice.pool_load().await, (0, 0));
        assert_eq!(twice.in_flight().await, 0.0);
        let t = twice.tenant_scope().await.num("t");
        assert!((930.0..932.0).contains(&t), "1000 - 70: {t}");
        let b = admitted(&twice.admission.reserve(&pooled(&twice, Priority::Critical, None)).await).clone();
        let r = twice.admission.release(&b.reservation_id).await.unwrap();
        assert_eq!(r.state(), "released");
        assert_eq!(twice.pool_load().await, (0, 0));
        assert_eq!(twice.in_flight().await, 0.0);
        let t = twice.tenant_scope().await.num("t");
        assert!((930.0..933.0).contains(&t), "the release gave back all 200: {t}");
    }

    /// The caller gives up (Envoy's ext_authz timeout, a gRPC deadline) after the pool leg and
    /// while the tenant leg's reply is on its way: neither leg may stay held for nobody.
    pub async fn a_reserve_nobody_waits_for_leaves_nothing_held<S: Store + Clone>(h: Harness<S>) {
        let slow = h.wrapped(|s| Faulty::new(s, "reserve", Fault::SlowReply(Duration::from_millis(300)))).await;
        let gave_up = tokio::time::timeout(
            Duration::from_millis(100),
            slow.admission.reserve(&pooled(&slow, Priority::Critical, None)),
        )
        .await;
        assert!(gave_up.is_err(), "the caller gave up before the answer");
        let settled = h
            .eventually(Duration::from_secs(3), || async {
                h.pool_load().await == (0, 0) && h.in_flight().await == 0.0
            })
            .await;
        assert!(settled, "pool {:?}, in flight {}", h.pool_load().await, h.in_flight().await);
        let t = h.tenant_scope().await.num("t");
        assert!(t >= 999.0, "the undelivered hold was given back: {t}");
    }

    /// A reserve whose reply was lost is given back; the client's re-send of that very call,
    /// arriving after the give-back, answers as its first run did and holds nothing: no slot, no
    /// token, no second entry in the books.
    pub async fn a_reserve_re_sent_after_its_give_back_holds_nothing<S: Store + Clone>(h: Harness<S>) {
        let lossy = h.wrapped(|s| Faulty::new(s, "reserve", Fault::LostReply)).await;
        let d = lossy.admission.reserve(&lossy.attributes(100, 100)).await;
        assert_eq!(denied(&d).reason, Reason::StoreUnavailable);
        let given_back = h.eventually(Duration::from_secs(3), || async { h.in_flight().await == 0.0 }).await;
        assert!(given_back, "the hold nobody received was given back: {} in flight", h.in_flight().await);
        let before = h.tenant_scope().await.num("t");
        assert!(before >= 999.0, "every token came back: {before}");
        let ledger = h.ledger().await;
        let record = keys::record(&h.tenant, &ledger[0]["id"]);
        let note = h.scope(&record).await.expect("the give-back's note");
        assert_eq!(note.fields.into_iter().collect::<Vec<_>>(), [("st".to_string(), "settled".to_string())]);
        assert!(note.pttl > 0, "the note has a TTL: {}", note.pttl);
        lossy.admission.protocol().store().send_lost_again().await.expect("the re-send is answered");
        assert_eq!(h.in_flight().await, 0.0, "the re-send took no slot");
        let after = h.tenant_scope().await.num("t");
        assert!(after >= before, "the re-send took no token: {before} -> {after}");
        let ledger = h.ledger().await;
        assert_eq!(ledger.len(), 1, "one hold, entered once: {ledger:?}");
        assert_eq!(ledger[0]["outcome"], "released");
    }

    /// A pool leg whose reply was lost may have run: it is released all the same.
    pub async fn a_pool_leg_that_failed_is_released<S: Store + Clone>(h: Harness<S>) {
        let lossy = h.wrapped(|s| Faulty::new(s, "pool_reserve", Fault::LostReply)).await;
        let d = lossy.admission.reserve(&pooled(&lossy, Priority::Critical, None)).await;
        assert_eq!(denied(&d).reason, Reason::StoreUnavailable);
        // Given back once the decision is answered (a decision waits on a failing store once).
        let given_back = h.eventually(Duration::from_secs(5), || async { h.pool_load().await == (0, 0) }).await;
        assert!(given_back, "the pool leg that ran was given back: {:?}", h.pool_load().await);
        assert_eq!(h.in_flight().await, 0.0);
    }

    /// The first commit settled the tenant leg but could not reach the pool; the caller commits
    /// again (commit is idempotent), and this time the pool leg is released.
    pub async fn a_repeated_commit_releases_the_pool_leg_the_first_could_not<S: Store + Clone>(h: Harness<S>) {
        let flaky = h.wrapped(|s| Faulty::new(s, "pool_release", Fault::Unreachable(1))).await;
        let id =
            admitted(&flaky.admission.reserve(&pooled(&flaky, Priority::Critical, None)).await).reservation_id.clone();
        assert_eq!(flaky.admission.commit(&id, 10, 10).await.unwrap().state(), "committed");
        assert_eq!(h.pool_load().await, (1, 1100), "the first pool release did not arrive");
        let again = flaky.admission.commit(&id, 10, 10).await.unwrap();
        assert!(again.usage().unwrap().duplicate);
        assert_eq!(h.pool_load().await, (0, 0), "the repeated commit released it");
    }

    /// An overrun is debt against the bucket as it stands now: a full bucket's refill, which it
    /// could not hold, never pays it.
    pub async fn debt_is_charged_after_the_refill<S: Store>(h: Harness<S>) {
        // 1 token per ms, 1,000 of burst.
        let id = admitted(&h.reserve(99, 1).await).reservation_id.clone();
        h.advance(300).await;
        // Full again (900 + 300, capped at 1,000); 1,000 tokens past the hold of 100.
        let c = h.admission.commit(&id, 1_099, 1).await.unwrap();
        assert_eq!(c.usage().unwrap().overrun, 1_000);
        let no = h.reserve(99, 1).await;
        let wait = denied(&no).retry_after_ms.unwrap();
        assert!((90..=100).contains(&wait), "the bucket sits at 0: 100 tokens short, got {wait} ms");
        if h.exact_time() {
            assert_eq!(wait, 100);
        }
    }

    /// A commit from a response that reported no usage: the prompt held, the output metered (or,
    /// unreadable, the whole hold), marked metered in the reply of every later duplicate too.
    pub async fn metered_commits_charge_the_held_prompt_and_say_so<S: Store>(h: Harness<S>) {
        let id = admitted(&h.reserve(100, 500).await).reservation_id.clone();
        let c = h.admission.commit_counted(&id, Counted::Metered { output: 50 }).await.unwrap();
        let u = c.usage().unwrap().clone();
        assert_eq!((u.used, u.refunded, u.metered, u.duplicate), (150, 450, true, false));
        let again = h.admission.commit(&id, 1, 1).await.unwrap();
        assert_eq!(again.usage().map(|u| (u.used, u.metered, u.duplicate)), Some((150, true, true)));
        let id = admitted(&h.reserve(100, 500).await).reservation_id.clone();
        let c = h.admission.commit_counted(&id, Counted::AsHeld).await.unwrap();
        assert_eq!(c.usage().map(|u| (u.used, u.refunded, u.metered)), Some((600, 0, true)));
        let id = admitted(&h.reserve(10, 10).await).reservation_id.clone();
        let c = h.admission.commit(&id, 10, 10).await.unwrap();
        assert_eq!(c.usage().map(|u| u.metered), Some(false), "reported counts are exact");
        let t = h.tenant_scope().await.num("t");
        assert!((230.0..233.0).contains(&t), "1000 - 150 - 600 - 20: {t}");
    }

    /// A metered count is the meter's error, not an output length: it teaches no estimate.
    pub async fn a_metered_commit_teaches_no_estimate<S: Store>(h: Harness<S>) {
        for _ in 0..10 {
            let id = admitted(&h.reserve(0, 1000).await).reservation_id.clone();
            h.admission.commit_counted(&id, Counted::Metered { output: 100 }).await.unwrap();
        }
        let e = h.admission.output_estimate(&h.tenant, "m").await.unwrap();
        assert_eq!(e.samples, 0);
        assert_eq!(admitted(&h.reserve(0, 1000).await).reserved_tokens, 1000, "the ceiling is still held");
    }

    /// A batch teaches the output estimate as its commits would one by one: each exact count
    /// once, a metered one not at all.
    pub async fn a_batch_teaches_the_estimate_as_single_commits_would<S: Store>(h: Harness<S>) {
        let mut calls = Vec::new();
        for i in 0..10u64 {
            let id = admitted(&h.reserve(0, 1000).await).reservation_id.clone();
            let counted = if i == 9 { Counted::Metered { output: 999 } } else { Counted::exact(0, 100 + i) };
            calls.push(CommitCall { id, counted, ending: Ending::of(counted) });
        }
        let outcomes = h.admission.commit_together(&h.tenant, &calls).await.unwrap();
        assert!(outcomes.iter().all(|o| o.state() == "committed"), "{outcomes:?}");
        let e = h.admission.output_estimate(&h.tenant, "m").await.unwrap();
        assert_eq!(
            (e.samples, e.used_tokens),
            (9, (100..109).sum::<u64>()),
            "the nine exact counts, not the metered one: {e:?}"
        );
    }

    /// Renew keeps every scope hash the hold counts in alive, not just its record: four long
    /// streams of one user keep the user's four slots taken for as long as they run.
    pub async fn renewed_holds_keep_their_scopes_alive<S: Store>(h: Harness<S>) {
        let mut alice = h.attributes(1, 1);
        alice.user = Some("alice".into());
        let mut ids = Vec::new();
        for _ in 0..4 {
            ids.push(admitted(&h.admission.reserve(&alice).await).reservation_id.clone());
        }
        let user = keys::user_scope(&h.tenant, "alice");
        let before = h.scope(&user).await.unwrap().pttl;
        h.advance(250).await;
        for id in &ids {
            assert_eq!(h.admission.renew(id, 0).await.unwrap().state(), "reserved");
        }
        let after = h.scope(&user).await.unwrap().pttl;
        let idle = i64::try_from(h.admission.policy().tenants[&h.tenant].idle_ttl_ms).unwrap();
        assert!(after >= idle - 50, "the user scope lives its idle TTL past a renew: {before} -> {after} of {idle}");
        if h.exact_time() {
            // Past the scope's idle TTL (about 61 s), renewing every 250 ms.
            for _ in 0..300 {
                h.advance(250).await;
                for id in &ids {
                    assert_eq!(h.admission.renew(id, 0).await.unwrap().state(), "reserved");
                }
            }
            let no = h.admission.reserve(&alice).await;
            assert_eq!(denied(&no).reason, Reason::Concurrency, "the four streams still hold alice's slots");
            h.admission.commit(&ids[0], 1, 1).await.unwrap();
            admitted(&h.admission.reserve(&alice).await);
        }
    }

    /// A backlog of expired holds larger than the sweep's batch, swept slower than their records'
    /// TTL: every slot still comes back.
    pub async fn a_sweep_that_falls_behind_loses_no_slot<S: Store>(h: Harness<S>) {
        if !h.exact_time() {
            return; // Needs minutes of store time; the manual clock covers it.
        }
        for _ in 0..10 {
            admitted(&h.reserve(1, 1).await);
        }
        h.advance(400).await;
        // One reserve every 20 s sweeps one expired hold (batch 1); records outlive their lease by
        // about a minute, so most are gone before the sweep reaches them.
        for _ in 0..20 {
            h.advance(20_000).await;
            let id = admitted(&h.reserve(1, 1).await).reservation_id.clone();
            h.admission.commit(&id, 1, 1).await.unwrap();
        }
        assert_eq!(h.in_flight().await, 0.0, "every expired hold gave its slot back");
        let holds = keys::holds(&h.tenant);
        assert_eq!(h.inspect(vec![holds.clone()]).await[&holds].fields.len(), 0, "and left the holds hash");
    }

    /// Every way a hold can settle is entered in the ledger, once, by the script that settles it;
    /// repeats and refusals enter nothing; what the entries charge is what the counters charged.
    pub async fn every_settled_hold_is_entered_in_the_ledger<S: Store>(h: Harness<S>) {
        let alice = Attributes { user: Some("alice".into()), ..h.attributes(10, 90) };
        let a = admitted(&h.admission.reserve(&alice).await).reservation_id.clone();
        h.admission.commit(&a, 10, 20).await.unwrap();
        let b = admitted(&h.reserve(5, 45).await).reservation_id.clone();
        h.admission.release(&b).await.unwrap();
        let c = admitted(&h.reserve(10, 90).await).reservation_id.clone();
        h.admission.commit_counted(&c, Counted::Metered { output: 40 }).await.unwrap();
        let d = admitted(&h.reserve(10, 90).await).reservation_id.clone();
        h.admission.commit_counted(&d, Counted::AsHeld).await.unwrap();
        // e expires and is swept by f's reserve, then commits late; g commits after its lease
        // with no sweep in between (entered once, as late).
        let e = admitted(&h.reserve(10, 90).await).reservation_id.clone();
        h.advance(400).await;
        let f = admitted(&h.reserve(1, 1).await).reservation_id.clone();
        h.admission.commit(&e, 10, 5).await.unwrap();
        h.admission.release(&f).await.unwrap();
        let g = admitted(&h.reserve(10, 90).await).reservation_id.clone();
        h.advance(400).await;
        h.admission.commit(&g, 1, 1).await.unwrap();
        // Repeats and refusals change nothing, the ledger included.
        assert!(h.admission.commit(&a, 10, 20).await.unwrap().usage().unwrap().duplicate);
        h.admission.release(&b).await.unwrap();
        assert_eq!(denied(&h.reserve(1000, 1900).await).reason, Reason::Budget);

        // How each request ended, as its settler says: a client that left, a backend that refused.
        let i = admitted(&h.reserve(10, 90).await).reservation_id.clone();
        h.admission.commit_ended(&i, Counted::Metered { output: 7 }, Ending::ClientLeft).await.unwrap();
        let j = admitted(&h.reserve(10, 90).await).reservation_id.clone();
        h.admission.release_ended(&j, Ending::UpstreamRefused).await.unwrap();

        let ledger = h.ledger().await;
        let seen: Vec<[&str; 5]> = ledger
            .iter()
            .map(|x| ["id", "outcome", "usage", "charged_tokens", "ending"].map(|f| x[f].as_str()))
            .collect();
        assert_eq!(
            seen,
            vec![
                [a.as_str(), "committed", "exact", "30", "completed"],
                [b.as_str(), "released", "none", "0", "released"],
                [c.as_str(), "committed", "metered", "50", "metered"],
                [d.as_str(), "committed", "held", "100", "as_held"],
                [e.as_str(), "expired", "held", "100", "expired"],
                [e.as_str(), "late_committed", "exact", "15", "completed"],
                [f.as_str(), "released", "none", "0", "released"],
                [g.as_str(), "late_committed", "exact", "2", "completed"],
                [i.as_str(), "committed", "metered", "17", "client_left"],
                [j.as_str(), "released", "none", "0", "upstream_refused"],
            ]
        );
        let first = &ledger[0];
        for (field, value) in [
            ("tenant", h.tenant.as_str()),
            ("user", "alice"),
            ("model", "m"),
            ("tier", Priority::Standard.as_str()),
            ("prompt_tokens", "10"),
            ("output_tokens", "20"),
            ("reserved_tokens", "100"),
            ("cost_nanos", "70000"),
            ("reserved_cost_nanos", "280000"),
        ] {
            assert_eq!(first[field], value, "{field} of {first:?}");
        }
        assert_eq!(ledger[1]["user"], "", "no user");
        let at = |x: &std::collections::BTreeMap<String, String>, f: &str| x[f].parse::<u64>().unwrap();
        assert!(ledger.iter().all(|x| at(x, "reserved_at_ms") <= at(x, "settled_at_ms")), "{ledger:?}");
        // The last entry of each hold is what it charges: together, the day's usage to the token.
        let mut last = std::collections::BTreeMap::new();
        for x in &ledger {
            last.insert(x["id"].clone(), at(x, "charged_tokens"));
        }
        assert_eq!(last.values().sum::<u64>(), h.day_usage().await);
        if let Some(file) = &h.ledger_file {
            let lines = std::fs::read_to_string(file).unwrap();
            let written: Vec<serde_json::Value> = lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
            assert_eq!(written.len(), ledger.len(), "every entry is in the file: {lines}");
            for (w, x) in written.iter().zip(&ledger) {
                assert_eq!(
                    (w["id"].as_str(), w["outcome"].as_str()),
                    (Some(x["id"].as_str()), Some(x["outcome"].as_str()))
                );
                assert_eq!(w["charged_tokens"].as_u64(), Some(at(x, "charged_tokens")), "numbers are numbers: {w}");
                assert_eq!(w["cost_nanos"].as_u64(), Some(at(x, "cost_nanos")), "{w}");
            }
            assert_eq!(written[1]["user"], serde_json::Value::Null, "an empty field is null: {}", written[1]);
        }
    }

    /// Cached prompt tokens and reasoning tokens a response reports count at the weights and
    /// prices of their model (`cached`: reads 0.1 of an input token, writes 1.25, reasoning 0.5 of
    /// an output token; prices 3, 15, 0.3 and 3.75 per million, reasoning at the output's), in the
    /// tokens charged, the money charged and the ledger; a model without them counts every token
    /// whole.
    pub async fn cached_prompt_tokens_count_at_their_weight_and_price<S: Store>(h: Harness<S>) {
        let cached = Attributes { model: Some("cached".into()), ..h.attributes(1000, 100) };
        let id = admitted(&h.admission.reserve(&cached).await).reservation_id.clone();
        let detail = Detail { cache_read: Some(600), cache_write: Some(200), reasoning: Some(10) };
        let counted = Counted::Exact { prompt: 1000, output: 50, detail };
        let u = h.admission.commit_counted(&id, counted).await.unwrap().usage().cloned().unwrap();
        // 200 plain + 600 x 0.1 + 200 x 1.25 + 40 output + 10 x 0.5 reasoning; in nanos, each at
        // its price.
        assert_eq!((u.used, u.held, u.refunded), (200 + 60 + 250 + 40 + 5, 1100, 1100 - 555));
        assert_eq!(u.cost_nanos, 200 * 3000 + 600 * 300 + 200 * 3750 + 50 * 15000);
        let again = h.admission.commit_counted(&id, counted).await.unwrap().usage().cloned().unwrap();
        assert!(again.duplicate && again.used == 555, "{again:?}");
        // Model m has no terms for cached tokens: they are input tokens.
        let plain = admitted(&h.reserve(100, 10).await).reservation_id.clone();
        let counted = Counted::Exact { prompt: 100, output: 10, detail };
        assert_eq!(h.admission.commit_counted(&plain, counted).await.unwrap().usage().unwrap().used, 110);
        // More cache than prompt charges no more than the prompt: reads first, then writes.
        let over = admitted(&h.admission.reserve(&cached).await).reservation_id.clone();
        let detail = Detail { cache_read: Some(80), cache_write: Some(80), reasoning: None };
        let u = h.admission.commit_counted(&over, Counted::Exact { prompt: 100, output: 0, detail }).await.unwrap();
        assert_eq!(u.usage().unwrap().used, 8 + 25);
        // Counts past what any response could say are refused, and charge nothing.
        let live = admitted(&h.admission.reserve(&cached).await).reservation_id.clone();
        let detail = Detail { cache_read: Some(u64::MAX), ..Detail::default() };
        let e = h.admission.commit_counted(&live, Counted::Exact { prompt: 1, output: 1, detail }).await;
        assert!(matches!(e, Err(AdmissionError::TooLarge { what: "cache_read_tokens", .. })), "{e:?}");
        assert_eq!(h.tenant_scope().await.num("du"), (555 + 110 + 33 + 1100) as f64, "the live hold still held");

        let ledger = h.ledger().await;
        let entry = ledger.iter().find(|e| e["id"] == id).expect("entered");
        for (field, value) in [
            ("prompt_tokens", "1000"),
            ("output_tokens", "50"),
            ("cache_read_tokens", "600"),
            ("cache_write_tokens", "200"),
            ("reasoning_tokens", "10"),
            ("charged_tokens", "555"),
            ("cost_nanos", "2280000"),
        ] {
            assert_eq!(entry[field], value, "{field} of {entry:?}");
        }
        let unsaid = ledger.iter().find(|e| e["id"] == over).expect("entered");
        assert_eq!(unsaid["reasoning_tokens"], "", "unsaid is empty: {unsaid:?}");
        if let Some(file) = &h.ledger_file {
            let lines = std::fs::read_to_string(file).unwrap();
            let written: Vec<serde_json::Value> = lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
            let line = |of: &str| written.iter().find(|w| w["id"] == of).unwrap_or_else(|| panic!("{of} in {lines}"));
            assert_eq!(line(&id)["cache_read_tokens"], 600, "a number: {}", line(&id));
            assert_eq!(line(&over)["reasoning_tokens"], serde_json::Value::Null, "{}", line(&over));
        }
    }

    /// The Budgets API reads what a reserve then does: every limit with what is used, held and
    /// left, and a reserve of exactly what Get says is left is admitted, one token more refused.
    pub async fn budgets_get_says_what_the_next_reserve_finds<S: Store>(h: Harness<S>) {
        let a = admitted(&h.reserve(100, 200).await).reservation_id.clone();
        h.admission.commit(&a, 100, 50).await.unwrap();
        admitted(&h.reserve(50, 50).await);
        let scopes = h.admission.budgets(&h.tenant, None, None).await.unwrap();
        assert_eq!(scopes.len(), 1, "no user or model named: {scopes:?}");
        let got = tollgate::grpc::budgets::limit_states(&scopes[0]);
        let find = |name: &str| got.iter().find(|l| l.name == name).unwrap_or_else(|| panic!("{name} in {got:?}"));
        let bucket = find("tokens_per_minute");
        assert_eq!((bucket.limit, bucket.unit.as_str()), (1000, "tokens"));
        // 250 taken at 1 token a second: a real Redis may have refilled a token or two since.
        assert!((248..=250).contains(&bucket.used) && bucket.remaining == 1000 - bucket.used as i64, "{bucket:?}");
        assert!(bucket.resets_in_ms > 0 && bucket.resets_in_ms <= 250_000, "{bucket:?}");
        let requests = find("requests_per_minute");
        assert_eq!((requests.limit, requests.used, requests.remaining), (10, 2, 8), "{requests:?}");
        let slots = find("max_concurrency");
        assert_eq!((slots.limit, slots.used, slots.remaining, slots.unit.as_str()), (3, 1, 2, "holds"));
        let day = find("tokens_per_day");
        assert_eq!((day.limit, day.used, day.held, day.remaining), (5000, 250, 100, 4750), "{day:?}");
        assert!(day.resets_in_ms <= 86_400_000, "{day:?}");
        let month = find("tokens_per_month");
        assert_eq!((month.used, month.held, month.remaining), (250, 100, 49_750), "{month:?}");
        assert!(month.resets_in_ms >= day.resets_in_ms, "{month:?}");
        // In money: 100 x 1,000 + 50 x 3,000 nanos used, and the live hold's 50 x 1,000 + 50 x 3,000.
        let cost = find("cost_per_day");
        assert_eq!((cost.unit.as_str(), cost.used, cost.held), ("nanos", 250_000 + 200_000, 200_000), "{cost:?}");
        if h.exact_time() {
            let left = u64::try_from(bucket.remaining).unwrap();
            admitted(&h.reserve(0, left).await);
            assert_eq!(denied(&h.reserve(0, 1).await).reason, Reason::TokenRate, "Get said {left} were left");
        }
        // A name that is not the policy's is refused, as a reserve's would be.
        assert!(h.admission.budgets(&h.tenant, None, Some("no-such-model")).await.is_err());
        assert!(h.admission.budgets("a{b", None, None).await.is_err());
    }

    /// Adjust credits, debits or resets one period budget, once per request id, and enters it
    /// in the ledger with who asked and why; Get and the next reserve see it.
    pub async fn a_budget_adjustment_is_made_once_and_entered<S: Store>(h: Harness<S>) {
        use tollgate::admission::{Adjusted, Adjustment};
        use tollgate::hold::{BudgetKey, Measure, Period};
        let id = admitted(&h.reserve(0, 2000).await).reservation_id.clone();
        h.admission.commit(&id, 0, 2000).await.unwrap();
        // The day's 3,000 has 1,000 left: 1,500 is refused.
        assert_eq!(denied(&h.reserve(0, 1500).await).reason, Reason::Budget);
        let credit = |amount: i64, request_id: &'static str| Adjustment {
            tenant: &h.tenant,
            user: None,
            model: None,
            budget: BudgetKey::new(Measure::Tokens, Period::Day),
            credit: amount,
            reset: false,
            request_id,
            by: "ops@example",
            why: "a refund for a failed batch",
        };
        let a = credit(1500, "r1");
        assert_eq!(h.admission.adjust_budget(&a).await.unwrap(), Adjusted::Applied { before: 2000, after: 500 });
        // Sent again: answered as the first time, nothing taken off again.
        assert_eq!(h.admission.adjust_budget(&a).await.unwrap(), Adjusted::Repeated { before: 2000, after: 500 });
        // The same request id for another adjustment: refused, nothing changed.
        assert_eq!(h.admission.adjust_budget(&credit(5, "r1")).await.unwrap(), Adjusted::Conflict);
        let day = |scopes: &[tollgate::admission::ScopeBudget]| {
            scopes[0].used.period(BudgetKey::new(Measure::Tokens, Period::Day)).counted
        };
        assert_eq!(day(&h.admission.budgets(&h.tenant, None, None).await.unwrap()), 500);
        admitted(&h.reserve(0, 1500).await);
        // A debit adds; a credit past zero leaves zero; a reset takes all off.
        assert_eq!(
            h.admission.adjust_budget(&credit(-100, "r2")).await.unwrap(),
            Adjusted::Applied { before: 2000, after: 2100 }
        );
        assert_eq!(
            h.admission.adjust_budget(&credit(9_999, "r3")).await.unwrap(),
            Adjusted::Applied { before: 2100, after: 0 }
        );
        let reset = Adjustment { reset: true, credit: 0, request_id: "r4", ..credit(0, "r4") };
        assert_eq!(h.admission.adjust_budget(&reset).await.unwrap(), Adjusted::Applied { before: 0, after: 0 });
        // A budget the scope does not have, or a scope the tenant does not limit: refused.
        let monthly = Adjustment { budget: BudgetKey::new(Measure::Tokens, Period::Month), ..credit(1, "r5") };
        assert!(h.admission.adjust_budget(&monthly).await.is_err());
        let user = Adjustment { user: Some("nobody"), ..credit(1, "r6") };
        assert!(h.admission.adjust_budget(&user).await.is_err());

        let ledger = h.ledger().await;
        let entry = ledger.iter().find(|e| e["id"] == "adjust:r1").expect("entered");
        for (field, value) in [
            ("outcome", "adjusted"),
            ("budget", "tokens_per_day"),
            ("counted_before", "2000"),
            ("counted_after", "500"),
            ("adjusted_by", "ops@example"),
            ("reason", "a refund for a failed batch"),
        ] {
            assert_eq!(entry[field], value, "{field} of {entry:?}");
        }
        assert_eq!(ledger.iter().filter(|e| e["id"] == "adjust:r1").count(), 1, "entered once");
    }

    /// A policy without a ledger writes none.
    pub async fn no_ledger_no_entries<S: Store>(h: Harness<S>) {
        let id = admitted(&h.reserve(1, 1).await).reservation_id.clone();
        h.admission.commit(&id, 1, 1).await.unwrap();
        assert!(h.ledger().await.is_empty());
        let key = keys::ledger(&h.tenant);
        assert_eq!(h.inspect(vec![key.clone()]).await[&key].kind, "none");
    }

    /// A live stream reports the work it has left: its hold in the pool shrinks to that, never
    /// grows, and leaves the pool with what it holds by then.
    pub async fn a_live_streams_progress_shrinks_its_pool_work<S: Store>(h: Harness<S>) {
        let a = admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await).reservation_id.clone();
        let b = admitted(&h.admission.reserve(&pooled(&h, Priority::Critical, None)).await).reservation_id.clone();
        assert_eq!(h.pool_load().await, (2, 2200));
        assert_eq!(h.admission.progress(&a, 600).await.unwrap(), Some(600));
        assert_eq!(h.pool_load().await, (2, 1700));
        assert_eq!(h.admission.progress(&a, 600).await.unwrap(), Some(600), "a repeat");
        assert_eq!(h.admission.progress(&a, 900).await.unwrap(), Some(600), "a late, larger report");
        assert_eq!(h.pool_load().await, (2, 1700), "work never grows back");
        h.admission.commit(&a, 100, 60).await.unwrap();
        assert_eq!(h.pool_load().await, (1, 1100), "the hold left with the 600 ms it held");
        assert_eq!(h.admission.progress(&a, 10).await.unwrap(), None, "settled: the pool holds it no more");
        assert_eq!(h.pool_load().await, (1, 1100));
        h.admission.release(&b).await.unwrap();
        assert_eq!(h.pool_load().await, (0, 0));
    }

    /// Ten requests of this tenant to model m, each generating 20 of its 100 tokens.
    async fn twenty_tokens_ten_times<S: Store>(h: &Harness<S>) {
        for _ in 0..10 {
            let a = admitted(&h.admission.reserve(&pooled(h, Priority::Critical, None)).await).reservation_id.clone();
            h.admission.commit(&a, 100, 20).await.unwrap();
        }
        assert_eq!(h.pool_load().await, (0, 0));
    }

    /// Once the tenant's requests have shown their output, the pool holds what they generate on
    /// average (20 tokens: 100 + 200 ms), not the 100 each may: the forecast says so upstream. A
    /// request's own deadline is judged by a long one (the 90th percentile: 23 tokens, 330 ms).
    pub async fn the_pool_holds_the_output_its_tenant_has_had<S: Store>(h: Harness<S>) {
        twenty_tokens_ten_times(&h).await;
        let d = h.admission.reserve(&pooled(&h, Priority::Critical, None)).await;
        let a = admitted(&d);
        assert_eq!(a.forecast, Some(tollgate::admission::Forecast { start_delay_ms: 0, output_tokens: 20 }));
        assert_eq!(h.pool_load().await, (1, 300));
        h.admission.release(&a.reservation_id).await.unwrap();
        let d = h.admission.reserve(&pooled(&h, Priority::Critical, Some(320))).await;
        assert_eq!(denied(&d).reason, Reason::Deadline, "{d:?}");
        assert!(denied(&d).message.contains("finish in 330 ms"), "{d:?}");
        let d = h.admission.reserve(&pooled(&h, Priority::Critical, Some(340))).await;
        assert_eq!(h.pool_load().await, (1, 300), "{d:?}");
    }

    /// A pool that does not calibrate holds every request at its ceiling, whatever it has seen.
    pub async fn a_pool_that_does_not_calibrate_holds_the_ceiling<S: Store>(h: Harness<S>) {
        twenty_tokens_ten_times(&h).await;
        let d = h.admission.reserve(&pooled(&h, Priority::Critical, None)).await;
        assert_eq!(admitted(&d).forecast.map(|f| f.output_tokens), Some(100));
        assert_eq!(h.pool_load().await, (1, 1100));
    }

    /// A request of this harness's tenant (`a`) or of another (`b`, under `default_tenant`).
    async fn pool_try<S: Store>(h: &Harness<S>, b: bool) -> Decision {
        let mut a = pooled(h, Priority::Critical, None);
        if b {
            a.tenant = Some(format!("{}-b", h.tenant));
        }
        h.admission.reserve(&a).await
    }

    /// Whether a request is refused for its tenant's share of a contended tier.
    fn over_share(d: &Decision) -> bool {
        matches!(d, Decision::Denied(x) if x.reason == Reason::QueueFull && x.message.contains("holds its share"))
    }

    /// Two slots, each request 1,100 ms of work. Once the tier is contended (both slots taken), a
    /// tenant holding work there may hold only its share of the tier's work: `a`, alone, takes a
    /// third; `b` is let in, and then `a` waits while `b` comes up to an equal share.
    pub async fn a_contended_tier_is_shared_equally<S: Store>(h: Harness<S>) {
        for _ in 0..3 {
            admitted(&pool_try(&h, false).await);
        }
        admitted(&pool_try(&h, true).await);
        let d = pool_try(&h, false).await;
        assert!(over_share(&d), "a holds 3 of 4: {d:?}");
        assert!(denied(&d).message.contains(&h.tenant), "{d:?}");
        assert!(denied(&d).retry_after_ms.is_some_and(|ms| ms > 0), "{d:?}");
        admitted(&pool_try(&h, true).await);
        admitted(&pool_try(&h, true).await);
        let d = pool_try(&h, true).await;
        assert!(over_share(&d), "b holds 3 of 6, its share: {d:?}");
        assert_eq!(h.pool_load().await, (6, 6600), "refusals hold nothing");
    }

    /// The same with `a` weighing three: it keeps three holds to `b`'s one.
    pub async fn a_contended_tier_is_shared_by_weight<S: Store>(h: Harness<S>) {
        for _ in 0..3 {
            admitted(&pool_try(&h, false).await);
        }
        admitted(&pool_try(&h, true).await);
        assert!(over_share(&pool_try(&h, true).await), "b holds its quarter");
        assert!(over_share(&pool_try(&h, false).await), "a holds its three quarters");
        // An uncontended tier admits anyone: one slot frees, and b's next request starts at once.
        let ids = h.pool_holds().await;
        h.admission.release(&ids[0]).await.unwrap();
        h.admission.release(&ids[1]).await.unwrap();
        h.admission.release(&ids[2]).await.unwrap();
        admitted(&pool_try(&h, true).await);
        // Empty again, the pool keeps no share of anyone's.
        for id in h.pool_holds().await {
            h.admission.release(&id).await.unwrap();
        }
        let (state, _, _) = h.pool_view().await;
        assert!(state.fields.keys().all(|f| !f.starts_with('f')), "{:?}", state.fields);
    }

    /// Work is stored as integers: a hold's work leaves the pool exactly as it came, at any size.
    pub async fn pool_work_is_exact_at_any_size<S: Store>(h: Harness<S>) {
        // 999,999,937 prompt tokens at 0.003 tokens/s: 333,333,312,333,334 ms of work, 15 digits.
        let d = h.reserve(999_999_937, 1).await;
        let id = admitted(&d).reservation_id.clone();
        assert_eq!(h.pool_load().await, (1, 333_333_312_333_334 + 1_000));
        h.admission.commit(&id, 1, 1).await.unwrap();
        assert_eq!(h.pool_load().await, (0, 0));
    }

    // A pool that queues in tollgate: a request that cannot start waits for its slot.

    /// A reserve run on a task of its own (it may wait), for the tenant `a` or `b`.
    fn waiting_reserve<S: Store>(h: &Harness<S>, tier: Priority, b: bool) -> tokio::task::JoinHandle<Decision> {
        let mut a = pooled(h, tier, None);
        if b {
            a.tenant = Some(format!("{}-b", h.tenant));
        }
        let admission = std::sync::Arc::clone(&h.admission);
        tokio::spawn(async move { admission.reserve(&a).await })
    }

    /// Until `n` requests wait for the pool (a bounded look).
    async fn until_waiting<S: Store>(h: &Harness<S>, n: usize) {
        let waiting = h.eventually(Duration::from_secs(5), || async { h.pool_waiting().await == n }).await;
        assert!(waiting, "{n} requests should be waiting, {} are", h.pool_waiting().await);
    }

    /// Two slots, both taken: a third request waits (the backend is not given it), and takes the
    /// slot the first hold gives back; the pool then holds exactly two again.
    pub async fn a_request_waits_in_tollgate_for_a_free_slot<S: Store>(h: Harness<S>) {
        let first = admitted(&pool_try(&h, false).await).reservation_id.clone();
        admitted(&pool_try(&h, false).await);
        let third = waiting_reserve(&h, Priority::Critical, false);
        until_waiting(&h, 1).await;
        assert_eq!(h.pool_load().await, (2, 2200), "a waiting request holds nothing");
        assert!(!third.is_finished());
        h.admission.commit(&first, 100, 100).await.unwrap();
        let d = third.await.unwrap();
        assert_eq!(admitted(&d).forecast.map(|f| f.start_delay_ms), Some(0), "it starts at once: {d:?}");
        assert_eq!(h.pool_load().await, (2, 2200));
        assert_eq!(h.pool_waiting().await, 0);
    }

    /// Higher tiers first: a sheddable request waiting before a critical one still takes the
    /// second slot to come free, not the first.
    pub async fn a_higher_tier_takes_the_next_slot_first<S: Store>(h: Harness<S>) {
        let first = admitted(&pool_try(&h, false).await).reservation_id.clone();
        let second = admitted(&pool_try(&h, false).await).reservation_id.clone();
        let low = waiting_reserve(&h, Priority::Sheddable, false);
        until_waiting(&h, 1).await;
        let high = waiting_reserve(&h, Priority::Critical, false);
        until_waiting(&h, 2).await;
        h.admission.release(&first).await.unwrap();
        admitted(&high.await.unwrap());
        assert!(!low.is_finished(), "the sheddable request still waits");
        assert_eq!(h.pool_waiting().await, 1);
        h.admission.release(&second).await.unwrap();
        admitted(&low.await.unwrap());
        assert_eq!(h.pool_load().await, (2, 2200));
    }

    /// One slot, held by `a`, with three more of `a`'s requests waiting: `b`'s request, arriving
    /// last, takes the next slot (its tenant has been served nothing), then `a`'s, one a slot.
    pub async fn a_tenant_served_less_goes_first<S: Store>(h: Harness<S>) {
        let held = admitted(&pool_try(&h, false).await).reservation_id.clone();
        let mut mine = Vec::new();
        for n in 1..=3 {
            mine.push(waiting_reserve(&h, Priority::Critical, false));
            until_waiting(&h, n).await;
        }
        let theirs = waiting_reserve(&h, Priority::Critical, true);
        until_waiting(&h, 4).await;
        h.admission.release(&held).await.unwrap();
        let d = theirs.await.unwrap();
        assert!(admitted(&d).reservation_id.contains("-b:"), "{d:?}");
        assert!(mine.iter().all(|m| !m.is_finished()), "a's requests wait");
        // Each slot given back goes to one of a's requests (in arrival order; two that arrived in
        // the same millisecond go by id).
        let mut last = admitted(&d).reservation_id.clone();
        while !mine.is_empty() {
            h.admission.release(&last).await.unwrap();
            assert!(h.eventually(Duration::from_secs(5), || async { mine.iter().any(|m| m.is_finished()) }).await);
            let at = mine.iter().position(|m| m.is_finished()).unwrap();
            last = admitted(&mine.remove(at).await.unwrap()).reservation_id.clone();
            assert!(mine.iter().all(|m| !m.is_finished()), "one slot, one request");
        }
        h.admission.release(&last).await.unwrap();
        assert_eq!(h.pool_load().await, (0, 0));
        assert_eq!(h.pool_waiting().await, 0);
        let (state, _, _) = h.pool_view().await;
        assert!(state.fields.keys().all(|f| !f.starts_with('v') && !f.starts_with('f')), "{:?}", state.fields);
    }

    /// A request that cannot get a slot within the time its caller gives it, or whose deadline
    /// the wait would pass, is refused and leaves nothing behind: no hold, no place, no tag.
    pub async fn a_wait_that_cannot_be_met_changes_nothing<S: Store>(h: Harness<S>) {
        admitted(&pool_try(&h, false).await);
        admitted(&pool_try(&h, false).await);
        let before = pool_contents(&h).await;
        // The caller gives it 50 ms; a slot is predicted in 550 (1,100 ms of work over 2 slots).
        let mut short = pooled(&h, Priority::Critical, None);
        short.wait_ms = Some(50);
        let d = h.admission.reserve(&short).await;
        let no = denied(&d);
        assert_eq!(no.reason, Reason::QueueFull, "{d:?}");
        let ms = no.retry_after_ms.unwrap();
        assert!(ms > 0, "{d:?}");
        assert!(no.message.contains("is later than it may wait"), "{no:?}");
        assert!(
            no.message.contains(&format!("sent again in {ms} ms, it would wait for its slot no longer than it may")),
            "the message states the hint: {no:?}"
        );
        // Predicted to finish in 550 + 1,100 ms: past a 1,500 ms deadline, refused at once.
        let d = h.admission.reserve(&pooled(&h, Priority::Critical, Some(1_500))).await;
        assert_eq!(denied(&d).reason, Reason::Deadline, "{d:?}");
        assert_eq!(pool_contents(&h).await, before, "refusals change nothing");
        // A caller that leaves while it waits gives its place up.
        let gone = waiting_reserve(&h, Priority::Critical, false);
        until_waiting(&h, 1).await;
        gone.abort();
        until_waiting(&h, 0).await;
        assert_eq!(pool_contents(&h).await, before, "a caller gone leaves nothing");
    }

    /// The tenant's finish tag at the critical tier, as the queue reads it: its own, or the tier's
    /// virtual time when that is later (or it has none).
    async fn finish_tag<S: Store>(h: &Harness<S>) -> f64 {
        let (tags, state) = (keys::pool_tags(&h.pool, Priority::Critical), keys::pool_state(&h.pool));
        let views = h.inspect(vec![tags.clone(), state.clone()]).await;
        let read = |v: Option<&String>| v.map_or(0.0, |v| v.parse::<f64>().unwrap());
        read(views[&tags].fields.get(&h.tenant)).max(read(views[&state].fields.get("vcritical")))
    }

    /// A request the pool admits but its tenant refuses (here its concurrency) never reaches the
    /// backend: the pool gives its slot back and its tenant's finish tag is what it was, so the
    /// tenant is not queued behind others as if it had been served.
    pub async fn a_request_its_tenant_refuses_is_not_counted_as_served<S: Store>(h: Harness<S>) {
        admitted(&pool_try(&h, false).await);
        let served = finish_tag(&h).await;
        assert_eq!(served, 1_100.0, "one request of 1,100 ms at weight 1");
        let d = pool_try(&h, false).await;
        assert_eq!(denied(&d).reason, Reason::Concurrency, "{d:?}");
        assert_eq!(h.pool_load().await, (1, 1100));
        assert_eq!(finish_tag(&h).await, served);
    }

    /// What every key of the harness's pool holds (not how long it lives).
    async fn pool_contents<S: Store>(h: &Harness<S>) -> Vec<(String, std::collections::BTreeMap<String, String>)> {
        h.inspect(keys::pool_keys(&h.pool)).await.into_iter().map(|(k, v)| (k, v.fields)).collect()
    }

    const POOL_SPEEDS: &str = "prefill_tokens_per_second: 1000\ndecode_tokens_per_second: 100\n";
    /// Two slots every tier may fill, queueing in tollgate; and one slot.
    pub const TOLLGATE_QUEUE: &str =
        "max_sequences: 2\nmax_queue_delay_ms: 60000\nqueue: tollgate\ntier_shares: { standard: 1, sheddable: 1 }\n";
    pub const TOLLGATE_QUEUE_ONE: &str = "max_sequences: 1\nmax_queue_delay_ms: 60000\nqueue: tollgate\n";

    pub fn pool_policy(tenant: &str, pool: &str) -> String {
        format!("{tenant}---pool---\n{POOL_SPEEDS}{pool}")
    }

    pub const BUCKET: &str = SLOW_BUCKET;
    pub const BATCHED: &str =
        "limits:\n  tokens_per_minute: 60\n  burst_tokens: 100000\n  tokens_per_day: 1000000\n  max_concurrency: 20\n";
    pub const SHADOW: &str = "shadow: true\nlimits:\n  tokens_per_minute: 60\n  burst_tokens: 1000\n";
    pub const REFILL: &str = "limits:\n  tokens_per_minute: 600\n  burst_tokens: 100\n";
    pub const CONCURRENCY: &str = "limits:\n  tokens_per_minute: 60\n  burst_tokens: 1000\n  max_concurrency: 2\n";
    pub const LEASE_CHARGE: &str = "lease_ttl_ms: 300\nexpired_usage: charge_reserved\nlimits:\n  tokens_per_minute: 60\n  burst_tokens: 1000\n  max_concurrency: 1\n";
    pub const LEASE_REFUND: &str = "lease_ttl_ms: 300\nexpired_usage: refund\nlimits:\n  tokens_per_minute: 60\n  burst_tokens: 1000\n  max_concurrency: 1\n";
    pub const SCOPED: &str = "limits:\n  tokens_per_minute: 60\n  burst_tokens: 2000\ndefault_user:\n  tokens_per_minute: 60\n  burst_tokens: 500\nmodels:\n  other:\n    tokens_per_minute: 60\n    burst_tokens: 400\n";
    pub const DAILY: &str = "limits:\n  tokens_per_day: 1000\n";
    pub const MONTHLY: &str = "limits:\n  tokens_per_month: 1000\n";
    pub const MONEY: &str = "limits:\n  cost_per_day: 0.001\n";
    pub const DAILY_AND_BUCKET: &str =
        "limits:\n  tokens_per_minute: 60\n  burst_tokens: 1000\n  tokens_per_day: 1000\n";
    pub const REQUESTS: &str = "limits:\n  requests_per_minute: 2\n";
    pub const BUDGETS: &str = "limits: { tokens_per_minute: 60, burst_tokens: 1000, requests_per_minute: 10, \
        max_concurrency: 3, tokens_per_day: 5000, tokens_per_month: 50000, cost_per_day: 0.01 }\n";
    pub const K7: &str = "limits:\n  tokens_per_minute: 1\n  burst_tokens: 700\n";
    pub const LEDGER: &str = "ledger:\n  max_len: 1000\n---top---\nlease_ttl_ms: 300\nexpired_usage: charge_reserved\n\
        limits:\n  tokens_per_minute: 60\n  burst_tokens: 5000\n  tokens_per_day: 3000\n";
}

/// Generates one test per scenario for a store: `conformance!(module, harness_constructor)`.
macro_rules! conformance {
    ($backend:ident, $make:path) => {
        mod $backend {
            use super::scenarios::*;

            macro_rules! scenario {
                ($name:ident, $policy:expr) => {
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        super::scenarios::$name($make($policy).await).await;
                    }
                };
            }

            scenario!(admits_until_the_bucket_is_spent, BUCKET);
            scenario!(the_bucket_refills_with_time, REFILL);
            scenario!(a_request_larger_than_the_bucket_is_unsatisfiable, BUCKET);
            scenario!(a_denial_changes_no_counter, BUCKET);
            scenario!(a_shadow_tenant_is_held_past_its_limits_and_told_why, SHADOW);
            scenario!(commit_refunds_the_unused_hold, BUCKET);
            scenario!(a_second_commit_returns_the_first_result_and_charges_nothing, BUCKET);
            scenario!(a_batch_of_commits_charges_what_each_alone_would, BATCHED);
            scenario!(a_batch_leaves_its_keys_as_single_commits_would, BATCHED);
            scenario!(a_batch_that_fails_half_way_writes_nothing, BATCHED);
            scenario!(an_overrun_is_debt_bounded_by_the_capacity, BUCKET);
            scenario!(concurrency_slots_are_held_until_release, CONCURRENCY);
            scenario!(an_expired_hold_keeps_its_tokens_under_charge_reserved, LEASE_CHARGE);
            scenario!(an_expired_hold_is_refunded_under_refund, LEASE_REFUND);
            scenario!(a_commit_after_the_lease_settles_the_expiry_first, LEASE_CHARGE);
            scenario!(renew_extends_the_lease, LEASE_CHARGE);
            scenario!(a_record_is_compact_only_while_every_replica_reads_it, LEASE_CHARGE);
            scenario!(a_heartbeat_hears_the_replicas_and_the_record_form_all_read, BUCKET);
            scenario!(a_repeated_reserve_returns_the_same_hold, BUCKET);
            scenario!(a_retried_request_is_a_new_attempt, BUCKET);
            scenario!(user_and_model_scopes_limit_within_the_tenant, SCOPED);
            scenario!(the_daily_budget_resets_at_midnight_utc, DAILY);
            scenario!(the_monthly_budget_resets_at_the_start_of_the_month, MONTHLY);
            scenario!(input_and_output_limits_hold_and_correct_each_side, SIDES);
            scenario!(hourly_and_weekly_budgets_turn_on_their_boundaries, HOURLY_WEEKLY);
            scenario!(a_zone_ahead_of_utc_turns_the_day_at_its_midnight, TOKYO);
            scenario!(a_zone_behind_utc_turns_the_week_at_its_midnight, NEW_YORK);
            scenario!(a_zone_behind_utc_turns_the_day_at_its_midnight, LOS_ANGELES);
            scenario!(a_zone_ahead_of_utc_turns_the_week_at_its_midnight, KOLKATA);
            scenario!(the_other_windows_of_each_side_hold_and_correct, OTHER_SIDES);
            scenario!(budgets_in_money_turn_by_the_hour_and_the_week, MONEY_HOURLY_WEEKLY);
            scenario!(past_a_soft_budget_a_request_is_admitted_marked_and_demoted, &soft_policy());
            scenario!(
                a_demotion_ends_at_local_midnight_across_a_clock_change,
                &format!("time_zone: America/New_York\n{}", soft_policy())
            );
            scenario!(
                a_tenant_in_shadow_counts_its_soft_budget_and_does_nothing_more,
                &format!("shadow: true\n{}", soft_policy())
            );
            scenario!(a_budget_a_reload_adds_is_not_credited_by_older_holds, DAY_ONLY);
            scenario!(debt_in_an_earlier_period_than_the_counted_one_is_kept, DAY_ONLY);
            scenario!(debt_after_the_period_turned_starts_the_new_one, DAY_ONLY);
            scenario!(a_budget_in_money_holds_the_worst_case_and_charges_the_actual, MONEY);
            scenario!(the_request_rate_is_limited, REQUESTS);
            scenario!(the_limit_that_frees_last_is_the_reason, DAILY_AND_BUCKET);
            scenario!(a_concurrency_refusal_says_when_a_lease_frees_the_slot, LEASE_CHARGE);
            scenario!(every_key_carries_a_ttl, BUCKET);
            scenario!(a_settled_bucket_an_earlier_version_made_gets_its_ttl, BUCKET);
            scenario!(a_busy_scope_sets_its_ttl_once_in_a_while, BUCKET);
            scenario!(a_busy_tenant_sets_its_index_ttl_once_in_a_while, BUCKET);
            scenario!(a_settled_hold_is_one_short_entry_that_answers_repeats, BUCKET);
            scenario!(an_expired_hold_waits_its_time_for_a_late_commit, LEASE_REFUND);
            scenario!(a_reload_that_shortens_the_lease_leaves_old_holds_their_terms, CONCURRENCY);
            scenario!(every_settled_hold_is_entered_in_the_ledger, LEDGER);
            scenario!(no_ledger_no_entries, BUCKET);
            scenario!(budgets_get_says_what_the_next_reserve_finds, BUDGETS);
            scenario!(a_budget_adjustment_is_made_once_and_entered, LEDGER);
            scenario!(cached_prompt_tokens_count_at_their_weight_and_price, LEDGER);
            scenario!(bad_ids_change_nothing, BUCKET);
            scenario!(concurrent_reserves_never_over_admit, K7);
            scenario!(tenants_together_are_refused_at_the_providers_rate, &provider_policy("{}", PROVIDER_RATES));
            scenario!(the_provider_is_charged_what_ran, &provider_policy("{}", PROVIDER_RATES));
            scenario!(
                a_request_its_tenant_refuses_gives_the_provider_everything_back,
                &provider_policy("{ requests_per_minute: 1 }", PROVIDER_RATES)
            );
            scenario!(a_release_keeps_the_request_and_an_expiry_keeps_the_tokens, &provider_policy("{}", PROVIDER_RATES));
            scenario!(lower_tiers_keep_the_providers_headroom, &provider_policy("{}", PROVIDER_RATES));
            scenario!(a_providers_day_budget_turns_at_utc_midnight, &provider_policy("{}", "{ tokens_per_day: 400 }"));
            scenario!(a_providers_hour_budget_turns_on_the_utc_hour, &provider_policy("{}", "{ tokens_per_hour: 400 }"));
            scenario!(a_providers_week_budget_turns_on_monday_utc, &provider_policy("{}", "{ tokens_per_week: 400 }"));
            scenario!(
                a_providers_month_budget_turns_on_the_first_utc,
                &provider_policy("{}", "{ tokens_per_month: 400 }")
            );
            scenario!(pool_status_shows_the_providers_limits, &provider_policy("{}", PROVIDER_RATES));
            scenario!(a_release_of_a_settled_hold_keeps_the_provider_charged, &provider_policy("{}", PROVIDER_RATES));
            scenario!(a_commit_without_counts_charges_the_provider_what_it_knows, &provider_policy("{}", PROVIDER_RATES));
            scenario!(
                an_unmetered_request_stays_charged_to_the_provider,
                &provider_policy("{}\non_store_error: fail_open", PROVIDER_RATES)
            );
            scenario!(
                a_renewed_stream_keeps_the_provider_scope_it_took_from,
                &super::provider::long_lease_policy()
            );
            scenario!(
                the_throttle_slows_the_providers_refill,
                &provider_policy("{}", "{ tokens_per_minute: 60, burst_tokens: 1000 }")
            );
            scenario!(
                a_live_streams_progress_shrinks_its_pool_work,
                &pool_policy("limits: {}\n", "max_sequences: 4\nmax_queue_delay_ms: 60000\n")
            );
            scenario!(
                the_pool_holds_the_output_its_tenant_has_had,
                &pool_policy("limits: {}\n", "max_sequences: 4\nmax_queue_delay_ms: 60000\n")
            );
            scenario!(
                a_pool_that_does_not_calibrate_holds_the_ceiling,
                &pool_policy("limits: {}\n", "max_sequences: 4\nmax_queue_delay_ms: 60000\ncalibrate: false\n")
            );
            scenario!(
                a_lower_tier_queues_only_its_share_of_the_delay,
                &pool_policy("limits: {}\n", "max_sequences: 4\nmax_queue_delay_ms: 2000\n")
            );
            scenario!(
                a_contended_tier_is_shared_equally,
                &pool_policy("default_tenant:\n  limits: {}\n---top---\nlimits: {}\n", "max_sequences: 2\nmax_queue_delay_ms: 60000\n")
            );
            scenario!(
                a_request_waits_in_tollgate_for_a_free_slot,
                &pool_policy("limits: {}\n", TOLLGATE_QUEUE)
            );
            scenario!(
                a_higher_tier_takes_the_next_slot_first,
                &pool_policy("limits: {}\nmax_priority: critical\n", TOLLGATE_QUEUE)
            );
            scenario!(
                a_tenant_served_less_goes_first,
                &pool_policy("default_tenant:\n  limits: {}\n---top---\nlimits: {}\n", TOLLGATE_QUEUE_ONE)
            );
            scenario!(
                a_request_its_tenant_refuses_is_not_counted_as_served,
                &pool_policy("limits: { max_concurrency: 1 }\n", TOLLGATE_QUEUE)
            );
            scenario!(
                a_wait_that_cannot_be_met_changes_nothing,
                &pool_policy("limits: {}\n", TOLLGATE_QUEUE)
            );
            scenario!(
                a_contended_tier_is_shared_by_weight,
                &pool_policy("default_tenant:\n  limits: {}\n---top---\nlimits: {}\nweight: 3\n", "max_sequences: 2\nmax_queue_delay_ms: 60000\n")
            );
            scenario!(
                a_committed_or_released_hold_leaves_the_pool_exactly,
                &pool_policy("limits: {}\n", "max_sequences: 4\nmax_queue_delay_ms: 60000\n")
            );
            scenario!(
                an_expired_hold_leaves_the_pool,
                &pool_policy("lease_ttl_ms: 300\n", "max_sequences: 4\nmax_queue_delay_ms: 60000\n")
            );
            scenario!(
                a_hold_the_tenant_sweep_settles_leaves_its_pool,
                &pool_policy("lease_ttl_ms: 300\n", "max_sequences: 4\nmax_queue_delay_ms: 60000\n")
            );
            scenario!(
                a_providers_429s_throttle_its_pool,
                &pool_policy("limits: {}\n", "max_sequences: 4\nmax_queue_delay_ms: 1000\n")
            );
            scenario!(
                renew_extends_the_pool_lease_too,
                &pool_policy("lease_ttl_ms: 300\n", "max_sequences: 4\nmax_queue_delay_ms: 60000\n")
            );
            scenario!(
                a_tenant_refusal_gives_the_pool_leg_back,
                &pool_policy("limits: { max_concurrency: 1 }\n", "max_sequences: 4\nmax_queue_delay_ms: 60000\n")
            );
            scenario!(
                deadline_and_queue_decisions_follow_the_model,
                &pool_policy("limits: {}\n", "max_sequences: 2\nmax_queue_delay_ms: 1500\n")
            );
            scenario!(
                tiers_are_refused_in_order,
                &pool_policy(
                    "limits: {}\n",
                    "max_sequences: 4\nmax_queue_delay_ms: 1000\ntier_shares: { standard: 0.75, sheddable: 0.5 }\n"
                )
            );
            scenario!(
                a_tenant_cannot_claim_a_tier_above_its_cap,
                &pool_policy(
                    "max_priority: sheddable\ndefault_priority: sheddable\n",
                    "max_sequences: 2\nmax_queue_delay_ms: 1000\ntier_shares: { standard: 0.5, sheddable: 0.5 }\n"
                )
            );
            scenario!(
                the_ceiling_is_held_until_the_estimate_has_its_samples,
                "adaptive_output: { quantile: 0.9, min_samples: 10 }\nlimits: { tokens_per_minute: 600000 }\n"
            );
            scenario!(
                an_output_past_the_estimate_is_debt_and_counts_as_estimator_error,
                "adaptive_output: { quantile: 0.9, min_samples: 10 }\nlimits: { tokens_per_minute: 600000 }\n"
            );
            scenario!(
                the_estimate_is_shared_by_every_replica,
                "adaptive_output: { quantile: 0.9, min_samples: 10 }\nlimits: { tokens_per_minute: 600000 }\n"
            );
            scenario!(
                the_estimate_follows_drift,
                "adaptive_output: { quantile: 0.9, min_samples: 10, window: 20 }\nlimits: { tokens_per_minute: 600000 }\n"
            );
            scenario!(
                no_interleaving_leaks_pool_work_or_tenant_budget,
                &pool_policy(
                    "limits: { tokens_per_minute: 60, burst_tokens: 1500 }\n",
                    "max_sequences: 4\nmax_queue_delay_ms: 2000\n"
                )
            );
            scenario!(
                every_write_script_is_safe_to_run_twice,
                &pool_policy(
                    "limits: { tokens_per_minute: 60, burst_tokens: 1000, max_concurrency: 4 }\n",
                    "max_sequences: 4\nmax_queue_delay_ms: 60000\n"
                )
            );
            scenario!(
                a_reserve_nobody_waits_for_leaves_nothing_held,
                &pool_policy("limits: { tokens_per_minute: 60, burst_tokens: 1000 }\n", "max_sequences: 4\nmax_queue_delay_ms: 60000\n")
            );
            scenario!(
                a_reserve_re_sent_after_its_give_back_holds_nothing,
                "ledger:\n  max_len: 1000\n---top---\non_store_error: fail_closed\nlimits: { tokens_per_minute: 60, burst_tokens: 1000, max_concurrency: 4 }\n"
            );
            scenario!(
                a_pool_leg_that_failed_is_released,
                &pool_policy("on_store_error: fail_closed\nlimits: {}\n", "max_sequences: 4\nmax_queue_delay_ms: 60000\n")
            );
            scenario!(
                a_repeated_commit_releases_the_pool_leg_the_first_could_not,
                &pool_policy("limits: {}\n", "max_sequences: 4\nmax_queue_delay_ms: 60000\n")
            );
            scenario!(metered_commits_charge_the_held_prompt_and_say_so, BUCKET);
            scenario!(
                a_batch_teaches_the_estimate_as_single_commits_would,
                "adaptive_output: { quantile: 0.9, min_samples: 10 }\nlimits: { tokens_per_minute: 600000 }\n"
            );
            scenario!(
                a_metered_commit_teaches_no_estimate,
                "adaptive_output: { quantile: 0.9, min_samples: 10 }\nlimits: { tokens_per_minute: 600000 }\n"
            );
            scenario!(debt_is_charged_after_the_refill, "limits: { tokens_per_minute: 60000, burst_tokens: 1000 }\n");
            scenario!(
                renewed_holds_keep_their_scopes_alive,
                "lease_ttl_ms: 300\ndefault_user: { max_concurrency: 4 }\nlimits: { max_concurrency: 100 }\n"
            );
            scenario!(
                a_sweep_that_falls_behind_loses_no_slot,
                "sweep_batch: 1\n---defaults---\nlease_ttl_ms: 300\nlimits: { max_concurrency: 10 }\n"
            );
            scenario!(
                pool_work_is_exact_at_any_size,
                "limits: {}\n---pool---\nprefill_tokens_per_second: 0.003\ndecode_tokens_per_second: 1\nmax_sequences: 4\nmax_queue_delay_ms: 60000\n"
            );
            scenario!(
                the_kv_cache_bounds_what_a_pool_holds,
                &pool_policy("limits: {}\n", "max_sequences: 8\nmax_queue_delay_ms: 60000\nkv_cache_tokens: 500\n")
            );
        }
    };
}

conformance!(embedded, crate::support::embedded);
conformance!(redis, crate::support::redis);
conformance!(cluster, crate::support::cluster);
