//! The embedded store under its memory cap (`store.max_memory_mb`): past it the settled records
//! go, the oldest period's first; live holds and budgets never; at the cap with nothing left to
//! evict, no new hold is made (a store error: here `fail_closed`) while settling goes on, and
//! admission resumes once the keyspace is back under the cap.

mod support;

use support::admitted;
use tollgate::admission::{Decision, Reason};
use tollgate::hold::CommitOutcome;

const TENANT: &str = "on_store_error: fail_closed\nlimits:\n  tokens_per_minute: 6000000\n  burst_tokens: 1000000\n";

#[tokio::test]
async fn the_cap_evicts_settled_records_oldest_first_and_never_a_live_hold() {
    let h = support::embedded(TENANT).await;
    let store = h.admission.protocol().store();
    let retention = h.admission.policy().record_retention_ms;
    let settle_some = || async {
        let mut ids = Vec::new();
        for _ in 0..20 {
            let id = admitted(&h.reserve(10, 10).await).reservation_id.clone();
            h.admission.commit(&id, 5, 5).await.unwrap();
            ids.push(id);
        }
        ids
    };
    let older = settle_some().await;
    let live: Vec<String> = {
        let mut live = Vec::new();
        for _ in 0..5 {
            live.push(admitted(&h.reserve(10, 10).await).reservation_id.clone());
        }
        live
    };
    h.advance(retention).await;
    let newer = settle_some().await;
    let repeat = |id: String| {
        let admission = std::sync::Arc::clone(&h.admission);
        async move { admission.commit(&id, 5, 5).await.unwrap() }
    };
    assert!(matches!(repeat(older[0].clone()).await, CommitOutcome::Committed(u) if u.duplicate), "both periods kept");

    // One byte under what it holds: the older period's bucket goes, and nothing else.
    let full = store.size().await.unwrap().bytes;
    store.cap_memory(full - 1).unwrap();
    admitted(&h.reserve(10, 10).await);
    assert!(store.size().await.unwrap().bytes < full);
    for id in &older {
        assert_eq!(repeat(id.clone()).await, CommitOutcome::NotFound, "the oldest settled records went first");
    }
    for id in &newer {
        assert!(matches!(repeat(id.clone()).await, CommitOutcome::Committed(u) if u.duplicate), "the newer stay");
    }

    // A cap nothing can meet: every settled record goes, then no new hold is made; what is live
    // still settles, as it was held.
    store.cap_memory(1).unwrap();
    let refused = h.reserve(10, 10).await;
    let Decision::Denied(d) = &refused else { panic!("admitted over the cap: {refused:?}") };
    assert_eq!(d.reason, Reason::StoreUnavailable, "{d:?}");
    assert!(d.message.contains("unavailable"), "{d:?}");
    assert_eq!(repeat(newer[0].clone()).await, CommitOutcome::NotFound);
    for id in &live {
        let c = h.admission.commit(id, 5, 5).await.unwrap();
        assert!(matches!(&c, CommitOutcome::Committed(u) if !u.duplicate && u.used == 10), "{c:?}");
    }
    assert_eq!(h.in_flight().await, 1.0, "the hold made under the first cap is the one left");

    // Room again: admission resumes.
    store.cap_memory(full).unwrap();
    admitted(&h.reserve(10, 10).await);
}
