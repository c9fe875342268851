//! Settlements tollgate makes itself (the commit from the response; the clean-up of a reserve
//! nobody received) that could not reach the store are retried until they land, on every store;
//! what is still queued when tollgate stops is tried once more and then left to the holds' leases.

mod support;

use std::time::Duration;

use support::faults::{Fault, Faulty};
use support::{Harness, admitted};
use tokio_util::sync::CancellationToken;
use tollgate::admission::retry::{Retries, Settlement};
use tollgate::hold::Ending;
use tollgate::llm::usage::Measured;
use tollgate::store::Store;

const BODY: &str = "limits: { tokens_per_minute: 6000, max_concurrency: 4 }\n";

/// The state of a hold, read by a renew (which the faults below never touch).
async fn state<S: Store>(h: &Harness<S>, id: &str) -> &'static str {
    match h.admission.renew(id, 0).await.unwrap() {
        tollgate::hold::RenewOutcome::Renewed { .. } => "reserved",
        other => other.state(),
    }
}

async fn commit_lands_after_the_store_comes_back<S: Store + Clone>(h: Harness<S>) {
    // The store does not answer the next three commit calls.
    let faulty = h.wrapped(|s| Faulty::new(s, "commit", Fault::Unreachable(3))).await;
    let a = admitted(&faulty.reserve(100, 50).await).clone();
    let stop = CancellationToken::new();
    let (retries, worker) = Retries::start(faulty.admission.clone(), stop.clone());
    let measured = Measured::exact(90, 30);
    retries.push(Settlement::Commit { id: a.reservation_id.clone(), measured, ending: Ending::ClientLeft });
    let landed = faulty
        .eventually(Duration::from_secs(10), || async { state(&faulty, &a.reservation_id).await != "reserved" })
        .await;
    assert!(landed, "the commit never landed");
    assert_eq!(state(&faulty, &a.reservation_id).await, "committed");
    // Exactly once, with the counts it was queued with: a repeat answers the first commit.
    let again = faulty.admission.commit(&a.reservation_id, 1, 1).await.unwrap();
    let usage = again.usage().expect("a committed hold's usage");
    assert_eq!((usage.duplicate, usage.used, usage.metered), (true, 120, false), "{again:?}");
    assert_eq!(usage.ending, Some(Ending::ClientLeft), "and how it ended: {again:?}");
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), worker).await.expect("the worker stops").unwrap();
    assert_eq!(retries.dropped(), 0);
}

async fn a_release_lands_too<S: Store + Clone>(h: Harness<S>) {
    let faulty = h.wrapped(|s| Faulty::new(s, "release", Fault::Unreachable(2))).await;
    let a = admitted(&faulty.reserve(100, 50).await).clone();
    let stop = CancellationToken::new();
    let (retries, worker) = Retries::start(faulty.admission.clone(), stop.clone());
    retries.push(Settlement::Release { id: a.reservation_id.clone(), ending: Ending::UpstreamError });
    let landed = faulty
        .eventually(Duration::from_secs(10), || async { state(&faulty, &a.reservation_id).await != "reserved" })
        .await;
    assert!(landed, "the release never landed");
    assert_eq!(state(&faulty, &a.reservation_id).await, "released");
    stop.cancel();
    worker.await.unwrap();
}

/// A store that never comes back: at the stop the worker tries once more, gives up within a second,
/// and the hold is left to its lease (still reserved, never half-settled).
async fn what_the_store_never_takes_is_left_to_the_lease<S: Store + Clone>(h: Harness<S>) {
    let faulty = h.wrapped(|s| Faulty::new(s, "commit", Fault::Unreachable(u32::MAX))).await;
    let a = admitted(&faulty.reserve(100, 50).await).clone();
    let stop = CancellationToken::new();
    let (retries, worker) = Retries::start(faulty.admission.clone(), stop.clone());
    let measured = Measured::Metered { output: 3 };
    retries.push(Settlement::Commit { id: a.reservation_id.clone(), measured, ending: Ending::Metered });
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(3), worker).await.expect("the worker stops").unwrap();
    assert_eq!(state(&faulty, &a.reservation_id).await, "reserved");
}

/// A reserve whose reply was lost ran all the same: its hold is given back, and when the store
/// does not take that release either (a stall, an open breaker), the retry queue gives it back once
/// the store answers, instead of leaving it charged and its slot held for the lease.
async fn a_reserve_nobody_received_leaves_no_ghost_hold<S: Store + Clone>(h: Harness<S>) {
    use support::faults::Queued;
    let releases = Queued::new(h.admission.protocol().store().clone(), "release");
    let reserves = Queued::new(releases.clone(), "reserve");
    let r = h.wrapped(|_| reserves.clone()).await;
    let stop = CancellationToken::new();
    let worker = r.admission.run_retries(stop.clone()).expect("the admission's own retry worker");
    reserves.next(Fault::LostReply);
    releases.next(Fault::Unreachable(1));
    releases.next(Fault::Unreachable(1));
    let d = r.reserve(100, 50).await;
    // (Answered by the tenant's store-down mode: no hold of the store's reached the caller.)
    assert!(!matches!(d, tollgate::admission::Decision::Admitted(_)), "{d:?}");
    let gone = r.eventually(Duration::from_secs(10), || async { r.in_flight().await == 0.0 }).await;
    assert!(gone, "the hold the lost reply made is still held");
    let charged = 6_000.0 - r.tenant_scope().await.num("t");
    assert!(charged < 1.0, "{charged} tokens still charged");
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), worker).await.expect("the worker stops").unwrap();
}

#[tokio::test]
async fn embedded_a_reserve_nobody_received_leaves_no_ghost_hold() {
    a_reserve_nobody_received_leaves_no_ghost_hold(support::embedded(BODY).await).await;
}

#[tokio::test]
async fn redis_a_reserve_nobody_received_leaves_no_ghost_hold() {
    a_reserve_nobody_received_leaves_no_ghost_hold(support::redis(BODY).await).await;
}

#[tokio::test]
async fn cluster_a_reserve_nobody_received_leaves_no_ghost_hold() {
    a_reserve_nobody_received_leaves_no_ghost_hold(support::cluster(BODY).await).await;
}

#[tokio::test]
async fn embedded_commit_lands_after_the_store_comes_back() {
    commit_lands_after_the_store_comes_back(support::embedded(BODY).await).await;
}

#[tokio::test]
async fn redis_commit_lands_after_the_store_comes_back() {
    commit_lands_after_the_store_comes_back(support::redis(BODY).await).await;
}

#[tokio::test]
async fn cluster_commit_lands_after_the_store_comes_back() {
    commit_lands_after_the_store_comes_back(support::cluster(BODY).await).await;
}

#[tokio::test]
async fn embedded_a_release_lands_too() {
    a_release_lands_too(support::embedded(BODY).await).await;
}

#[tokio::test]
async fn redis_a_release_lands_too() {
    a_release_lands_too(support::redis(BODY).await).await;
}

#[tokio::test]
async fn embedded_what_the_store_never_takes_is_left_to_the_lease() {
    what_the_store_never_takes_is_left_to_the_lease(support::embedded(BODY).await).await;
}

#[tokio::test]
async fn redis_what_the_store_never_takes_is_left_to_the_lease() {
    what_the_store_never_takes_is_left_to_the_lease(support::redis(BODY).await).await;
}
