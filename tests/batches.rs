//! Commits from responses batched by tenant (`store.commit_window_ms`), on every store: a
//! tenant's commits made within a window go in one store call, each charged as alone; the drain
//! commits what waits at once; a batch the store does not take is retried commit by commit.
//! (What a batch charges against single commits: the conformance scenario
//! `a_batch_of_commits_charges_what_each_alone_would`.)
//!
//! The tests run on one thread: a window's timer cannot fire while a test makes its commits
//! (nothing in the batched path awaits), so what goes in which batch does not depend on timing.

mod support;

use std::time::Duration;

use support::faults::{Fault, Faulty};
use support::{Harness, admitted, denied};
use tokio_util::sync::CancellationToken;
use tollgate::admission::Reason;
use tollgate::hold::{CommitOutcome, Counted, Ending, RenewOutcome};
use tollgate::store::Store;
use tollgate::store::embedded::EmbeddedStore;

/// A window far longer than the few statements between a test's commits, far shorter than a lease;
/// slots to spare (more than one batch's commits could hold), so a commit waits its whole window.
const BODY: &str = "commit_window_ms: 100\n---store---\nlimits: { tokens_per_minute: 600000, max_concurrency: 1000 }\n";
/// The same window, and no cap on concurrency.
const UNCAPPED: &str = "commit_window_ms: 100\n---store---\nlimits: { tokens_per_minute: 600000 }\n";
/// The same window, and one request at a time: the tenant is short of slots, its commits go within
/// 5 ms (a refused reserve finds them waiting, or on their way).
const ONE_AT_A_TIME: &str =
    "commit_window_ms: 100\n---store---\nlimits: { tokens_per_minute: 600000, max_concurrency: 1 }\n";
/// One request at a time, in shadow.
const SHADOWED: &str =
    "commit_window_ms: 100\n---store---\nshadow: true\nlimits: { tokens_per_minute: 600000, max_concurrency: 1 }\n";
const WAIT: Duration = Duration::from_secs(10);

/// The state of a hold, read by a renew (never batched).
async fn state<S: Store>(h: &Harness<S>, id: &str) -> &'static str {
    match h.admission.renew(id, 0).await.unwrap() {
        RenewOutcome::Renewed { .. } => "reserved",
        other => other.state(),
    }
}

/// What a committed hold's commit charged, as a repeat of it answers.
async fn used<S: Store>(h: &Harness<S>, id: &str) -> u64 {
    match h.admission.commit(id, 1, 1).await.unwrap() {
        CommitOutcome::Committed(u) if u.duplicate => u.used,
        other => panic!("{id} is not committed: {other:?}"),
    }
}

async fn holds<S: Store>(h: &Harness<S>, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for _ in 0..n {
        ids.push(admitted(&h.reserve(100, 100).await).reservation_id.clone());
    }
    ids
}

async fn a_tenants_commits_in_one_window_go_in_one_call<S: Store + Clone>(h: Harness<S>) {
    let batched = h.wrapped(|s| Faulty::new(s, "commit_many", Fault::Passes)).await;
    let ids = holds(&batched, 5).await;
    for (i, id) in (0u64..).zip(&ids) {
        let counted = Counted::exact(100, 10 * i);
        batched.admission.commit_from_response(id, counted, Ending::Completed).await;
    }
    // (Nothing has yielded to the window's timer yet.)
    let store = batched.admission.protocol().store();
    assert_eq!(store.calls(), 0, "the commits wait for their window");
    let landed = batched.eventually(WAIT, || async { batched.in_flight().await == 0.0 }).await;
    assert!(landed, "the window's commits never landed");
    assert_eq!(store.calls(), 1, "five commits, one call");
    for (i, id) in (0u64..).zip(&ids) {
        assert_eq!(used(&batched, id).await, 100 + 10 * i, "{id}: charged its own counts");
    }
}

async fn the_drain_commits_what_waits_at_once<S: Store + Clone>(h: Harness<S>) {
    let batched = h.wrapped(|s| Faulty::new(s, "commit_many", Fault::Passes)).await;
    let ids = holds(&batched, 3).await;
    for id in &ids[..2] {
        batched.admission.commit_from_response(id, Counted::exact(50, 5), Ending::Completed).await;
    }
    batched.admission.finish_tasks().await;
    let store = batched.admission.protocol().store();
    assert_eq!(store.calls(), 1, "the waiting batch went when the drain began");
    for id in &ids[..2] {
        assert_eq!(state(&batched, id).await, "committed", "{id}: committed before the drain ended");
    }
    // Draining, a commit goes alone and has landed when the call returns.
    batched.admission.commit_from_response(&ids[2], Counted::exact(50, 6), Ending::Completed).await;
    assert_eq!(store.calls(), 1, "no batch once the drain began");
    assert_eq!(used(&batched, &ids[2]).await, 56);
}

async fn a_batch_the_store_does_not_take_is_retried_commit_by_commit<S: Store + Clone>(h: Harness<S>) {
    let batched = h.wrapped(|s| Faulty::new(s, "commit_many", Fault::Unreachable(u32::MAX))).await;
    let stop = CancellationToken::new();
    let worker = batched.admission.run_retries(stop.clone()).expect("the admission's own retry worker");
    let ids = holds(&batched, 2).await;
    batched.admission.commit_from_response(&ids[0], Counted::exact(100, 7), Ending::Completed).await;
    batched.admission.commit_from_response(&ids[1], Counted::Metered { output: 9 }, Ending::Metered).await;
    let landed = batched.eventually(WAIT, || async { batched.in_flight().await == 0.0 }).await;
    assert!(landed, "the retries never landed");
    assert_eq!(batched.admission.protocol().store().calls(), 1, "the batch was tried once");
    assert_eq!(used(&batched, &ids[0]).await, 107, "exactly its counts, once");
    assert_eq!(used(&batched, &ids[1]).await, 109, "metered: the prompt held and the output counted");
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), worker).await.expect("the worker stops").unwrap();
}

/// A batch the store refuses (a script error) goes again commit by commit: each lands, with its
/// own counts.
async fn a_batch_the_store_refuses_goes_commit_by_commit<S: Store + Clone>(h: Harness<S>) {
    let batched = h.wrapped(|s| Faulty::new(s, "commit_many", Fault::Refused)).await;
    let ids = holds(&batched, 3).await;
    for (i, id) in (0u64..).zip(&ids) {
        batched.admission.commit_from_response(id, Counted::exact(100, i), Ending::Completed).await;
    }
    let landed = batched.eventually(WAIT, || async { batched.in_flight().await == 0.0 }).await;
    assert!(landed, "the commits never landed");
    assert_eq!(batched.admission.protocol().store().calls(), 1, "the batch was tried once");
    for (i, id) in (0u64..).zip(&ids) {
        assert_eq!(used(&batched, id).await, 100 + i, "{id}: exactly its counts, once");
    }
}

/// A commit alone in its window goes alone, as commit.lua (a batch's gathering would cost the
/// store more than the call it saves).
async fn a_commit_alone_in_its_window_goes_alone<S: Store + Clone>(h: Harness<S>) {
    let batched = h.wrapped(|s| Faulty::new(s, "commit_many", Fault::Passes)).await;
    let ids = holds(&batched, 1).await;
    batched.admission.commit_from_response(&ids[0], Counted::exact(100, 3), Ending::Completed).await;
    let landed = batched.eventually(WAIT, || async { batched.in_flight().await == 0.0 }).await;
    assert!(landed, "the commit never landed");
    assert_eq!(batched.admission.protocol().store().calls(), 0, "no batch call for one commit");
    assert_eq!(used(&batched, &ids[0]).await, 103);
}

/// A slot held by a commit that waits in this replica's window comes back a few ms later: the
/// tenant's next reserve, refused for it, sends the waiting commits at once and is asked again,
/// so a client that sends one request at a time is not refused for its own last one. A refusal
/// with nothing waiting stands.
async fn a_refusal_for_a_slot_a_waiting_commit_holds_sends_it_and_asks_again<S: Store + Clone>(h: Harness<S>) {
    let first = admitted(&h.reserve(100, 100).await).reservation_id.clone();
    h.admission.commit_from_response(&first, Counted::exact(100, 10), Ending::Completed).await;
    // (The commit waits in its window, its hold keeping the slot, or, where the tenant's 5 ms timer
    // fired during the reserve's round trip, is on its way: either way the refused reserve has it
    // land first, and is asked again.)
    let second = admitted(&h.reserve(100, 100).await).reservation_id.clone();
    assert_eq!(state(&h, &first).await, "committed", "the waiting commit went first");
    assert_eq!(used(&h, &first).await, 110);
    assert_eq!(denied(&h.reserve(100, 100).await).reason, Reason::Concurrency, "{second} holds the slot");
    assert_eq!(state(&h, &second).await, "reserved");
}

/// A refusal is asked again only once the store has taken the waiting commits: one that could not
/// reach it goes to the retry queue, the refusal stands (the decision does not wait on a failing
/// store twice), and the slot is back when the retry lands.
async fn a_refusal_is_asked_again_only_once_the_store_took_the_waiting_commits<S: Store + Clone>(h: Harness<S>) {
    let batched =
        h.wrapped(|s| Faulty::new(Faulty::new(s, "commit", Fault::Unreachable(1)), "reserve", Fault::Passes)).await;
    let stop = CancellationToken::new();
    let worker = batched.admission.run_retries(stop.clone()).expect("the admission's own retry worker");
    let first = admitted(&batched.reserve(100, 100).await).reservation_id.clone();
    batched.admission.commit_from_response(&first, Counted::exact(100, 10), Ending::Completed).await;
    assert_eq!(denied(&batched.reserve(100, 100).await).reason, Reason::Concurrency, "the commit did not land");
    let store = batched.admission.protocol().store();
    let (reserves, commits) = (store.calls(), store.inner.calls());
    assert_eq!(reserves, 2, "the refused reserve was not asked again");
    assert_eq!(commits, 1, "the waiting commit was sent once, alone");
    let landed = batched.eventually(WAIT, || async { batched.in_flight().await == 0.0 }).await;
    assert!(landed, "the retry never landed");
    assert_eq!(used(&batched, &first).await, 110, "exactly its counts, once");
    admitted(&batched.reserve(100, 100).await);
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), worker).await.expect("the worker stops").unwrap();
}

/// A shadowed tenant's commits go at once: a slot a waiting commit still held would show in its
/// shadow as a refusal that enforcing, which sends the waiting commits and asks again, would not
/// make.
async fn a_shadowed_tenants_commits_go_at_once<S: Store + Clone>(h: Harness<S>) {
    let first = admitted(&h.reserve(100, 100).await).reservation_id.clone();
    h.admission.commit_from_response(&first, Counted::exact(100, 10), Ending::Completed).await;
    assert_eq!(state(&h, &first).await, "committed", "landed before commit_from_response returned");
    let second = h.reserve(100, 100).await;
    assert_eq!(admitted(&second).shadow, None, "the slot was free: nothing would have refused it");
}

/// Reloads `h` from a policy file whose one tenant, `h`'s, leases for `lease_ms`.
async fn reload_leasing_for<S: Store>(h: &Harness<S>, lease_ms: u64) -> tollgate::reload::Reloaded {
    let dir = std::env::temp_dir().join(format!("tollgate-batches-{}", h.tenant));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policy.yaml");
    let text = format!(
        "models:\n  m: {{ max_output_tokens: 100 }}\ntenants:\n  {}:\n    lease_ttl_ms: {lease_ms}\n",
        h.tenant
    );
    std::fs::write(&path, text).unwrap();
    let keep: tollgate::reload::Adjust = std::sync::Arc::new(|_| Ok(()));
    let reloaded = tollgate::reload::reload(&path, &h.admission, &keep).await;
    std::fs::remove_dir_all(&dir).unwrap();
    reloaded
}

/// The window in force stays until a restart (the store's settings do): a reload whose leases it
/// would not fit ten times into is refused, and the policy in force stays.
async fn a_reload_keeps_every_lease_ten_windows_long<S: Store + Clone>(h: Harness<S>) {
    let before = h.admission.policy().version.clone();
    let reloaded = reload_leasing_for(&h, 500).await;
    let tollgate::reload::Reloaded::Refused(why) = reloaded else { panic!("reloaded: {reloaded:?}") };
    assert!(
        why.contains(
            "store.commit_window_ms: 100 (in force until a restart) is more than a tenth of the shortest lease (500 ms)"
        ),
        "{why}"
    );
    assert_eq!(h.admission.policy().version, before, "the policy in force stays");
}

// How long a commit waits, on the test's own clock (`start_paused`: whenever every task waits,
// time moves on to the next timer), counted as its call is made (`Faulty` counts a call as it
// starts): between the commit and the counts the test awaits no store call, during which time
// would move on. On the embedded store (a Redis client's own timeouts would fire first on such a
// clock).

/// `h`'s commit calls from now: none until `window` has all but ended, one just after (`what` says
/// whose).
async fn one_commit_call_after<S: Store>(h: &Harness<Faulty<S>>, window: Duration, what: &str) {
    let store = h.admission.protocol().store();
    tokio::time::sleep(window - Duration::from_millis(1)).await;
    assert_eq!(store.calls(), 0, "waits for company: {what}");
    tokio::time::sleep(Duration::from_millis(2)).await;
    assert_eq!(store.calls(), 1, "went as its window ended: {what}");
}

/// A commit of `body`'s tenant goes when `window` ends, not before.
async fn a_commit_goes_after(body: &str, window: Duration) {
    let h = support::embedded(body).await.wrapped(|s| Faulty::new(s, "commit", Fault::Passes)).await;
    let id = admitted(&h.reserve(100, 100).await).reservation_id.clone();
    h.admission.commit_from_response(&id, Counted::exact(100, 10), Ending::Completed).await;
    one_commit_call_after(&h, window, body).await;
    assert_eq!(used(&h, &id).await, 110);
}

/// A commit whose tenant is short of slots (a reserve here left it fewer than a batch's commits
/// could hold) goes within 5 ms, where its window is 100: a request of its tenant at another
/// replica does not meet the slot still held.
#[tokio::test(start_paused = true)]
async fn a_commit_of_a_tenant_short_of_slots_goes_within_5_ms() {
    a_commit_goes_after(ONE_AT_A_TIME, Duration::from_millis(5)).await;
}

/// A commit whose hold has a pool leg frees a slot of the pool's, which capacity admission counts:
/// it goes within 5 ms, though its tenant has no cap on its own slots.
#[tokio::test(start_paused = true)]
async fn a_commit_that_frees_a_pools_slot_goes_within_5_ms() {
    let pooled = "commit_window_ms: 100\n---store---\nlimits: { tokens_per_minute: 600000 }\n---pool---\n\
                  max_sequences: 100\nprefill_tokens_per_second: 100000\ndecode_tokens_per_second: 100000\n\
                  max_queue_delay_ms: 60000\n";
    a_commit_goes_after(pooled, Duration::from_millis(5)).await;
}

/// A commit whose tenant has slots to spare (or no cap on them) waits its whole window for company.
#[tokio::test(start_paused = true)]
async fn a_commit_of_a_tenant_with_slots_to_spare_waits_its_window() {
    for body in [BODY, UNCAPPED] {
        a_commit_goes_after(body, Duration::from_millis(100)).await;
    }
}

/// Two replicas on one embedded store, of a tenant of [`SLOTS`] slots and 100 ms windows: another,
/// and one whose commit calls are counted.
async fn two_replicas() -> (Harness<EmbeddedStore>, Harness<Faulty<EmbeddedStore>>) {
    let body = format!(
        "commit_window_ms: 100\n---store---\nlimits: {{ tokens_per_minute: 6000000, max_concurrency: {SLOTS} }}\n"
    );
    let other = support::embedded(&body).await;
    let counted = other.wrapped(|s| Faulty::new(s, "commit", Fault::Passes)).await;
    (other, counted)
}

/// The slots of [`two_replicas`]' tenant: more than a batch of commits could hold.
const SLOTS: usize = 100;

/// A tenant becomes short of slots where a reserve is refused one, too: a replica whose own reserve
/// left slots to spare, refused once another replica has taken the rest, sends its commit within
/// 5 ms, where its window is 100.
#[tokio::test(start_paused = true)]
async fn a_commit_goes_within_5_ms_once_its_replica_was_refused_a_slot() {
    let (other, h) = two_replicas().await;
    let id = admitted(&h.reserve(100, 100).await).reservation_id.clone();
    holds(&other, SLOTS - 1).await;
    assert_eq!(denied(&h.reserve(100, 100).await).reason, Reason::Concurrency);
    h.admission.commit_from_response(&id, Counted::exact(100, 10), Ending::Completed).await;
    one_commit_call_after(&h, Duration::from_millis(5), "within 5 ms, not its window's 100").await;
    assert_eq!(used(&h, &id).await, 110);
}

/// A commit waiting in its window when a reserve here finds its tenant short of slots goes within
/// 5 ms of that reserve, though it joined with slots to spare and its window is 100; its window's
/// own timer then finds nothing to send.
#[tokio::test(start_paused = true)]
async fn a_waiting_commit_goes_within_5_ms_once_its_tenant_becomes_short_of_slots() {
    let (other, h) = two_replicas().await;
    let id = admitted(&h.reserve(100, 100).await).reservation_id.clone();
    holds(&other, SLOTS / 2).await;
    // (A task that never rests keeps the paused clock where the test puts it while the embedded
    // store's thread answers the reserve below: a resting runtime would move it on to the window's
    // end.)
    let busy = tokio::spawn(async {
        loop {
            tokio::task::yield_now().await;
        }
    });
    h.admission.commit_from_response(&id, Counted::exact(100, 10), Ending::Completed).await;
    tokio::time::advance(Duration::from_millis(50)).await;
    admitted(&h.reserve(100, 100).await);
    busy.abort();
    one_commit_call_after(&h, Duration::from_millis(5), "within 5 ms of the reserve, not its window's 100").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(h.admission.protocol().store().calls(), 1, "the window's own timer sent nothing more");
    assert_eq!(used(&h, &id).await, 110);
}

/// The drain waits for no window: what waits goes at once, and the windows' timers stop.
#[tokio::test(start_paused = true)]
async fn the_drain_waits_for_no_window() {
    let h = support::embedded(BODY).await;
    let id = admitted(&h.reserve(100, 100).await).reservation_id.clone();
    h.admission.commit_from_response(&id, Counted::exact(100, 10), Ending::Completed).await;
    let began = tokio::time::Instant::now();
    h.admission.finish_tasks().await;
    assert!(began.elapsed() < Duration::from_millis(100), "the drain waited {:?}", began.elapsed());
    assert_eq!(used(&h, &id).await, 110);
}

/// A reserve refused for a slot that a commit on its way from its window holds (it left, it has not
/// landed) waits for it to land, and is asked again.
#[tokio::test(start_paused = true)]
async fn a_refusal_for_a_slot_a_commit_on_its_way_holds_waits_for_it_and_asks_again() {
    let slow = Duration::from_millis(20);
    let h = support::embedded(ONE_AT_A_TIME).await.wrapped(|s| Faulty::new(s, "commit", Fault::SlowCall(slow))).await;
    let first = admitted(&h.reserve(100, 100).await).reservation_id.clone();
    h.admission.commit_from_response(&first, Counted::exact(100, 10), Ending::Completed).await;
    tokio::time::sleep(Duration::from_millis(6)).await;
    assert_eq!(h.admission.protocol().store().calls(), 1, "the window sent it");
    let second = admitted(&h.reserve(100, 100).await).reservation_id.clone();
    assert_eq!(used(&h, &first).await, 110, "landed before the reserve was asked again");
    assert_eq!(state(&h, &second).await, "reserved");
}

/// A window the policy does not set (on Redis, 50 ms) fits itself to the leases in force: a reload
/// whose shortest lease is 300 ms is applied, and the window is 30 ms.
#[tokio::test]
async fn a_default_window_fits_itself_to_a_reloads_leases() {
    let h = support::redis("limits: { tokens_per_minute: 600000 }\n").await;
    assert_eq!(h.admission.policy().commit_window(), Some(Duration::from_millis(50)));
    let reloaded = reload_leasing_for(&h, 300).await;
    assert!(matches!(reloaded, tollgate::reload::Reloaded::Applied { .. }), "{reloaded:?}");
    assert_eq!(h.admission.policy().commit_window(), Some(Duration::from_millis(30)));
}

macro_rules! everywhere {
    ($($scenario:ident: $body:ident),* $(,)?) => {
        mod embedded {
            $(#[tokio::test]
            async fn $scenario() {
                super::$scenario(crate::support::embedded(super::$body).await).await;
            })*
        }
        mod redis {
            $(#[tokio::test]
            async fn $scenario() {
                super::$scenario(crate::support::redis(super::$body).await).await;
            })*
        }
        mod cluster {
            $(#[tokio::test]
            async fn $scenario() {
                super::$scenario(crate::support::cluster(super::$body).await).await;
            })*
        }
    };
}

everywhere!(
    a_tenants_commits_in_one_window_go_in_one_call: BODY,
    the_drain_commits_what_waits_at_once: BODY,
    a_batch_the_store_does_not_take_is_retried_commit_by_commit: BODY,
    a_batch_the_store_refuses_goes_commit_by_commit: BODY,
    a_commit_alone_in_its_window_goes_alone: BODY,
    a_refusal_for_a_slot_a_waiting_commit_holds_sends_it_and_asks_again: ONE_AT_A_TIME,
    a_refusal_is_asked_again_only_once_the_store_took_the_waiting_commits: ONE_AT_A_TIME,
    a_shadowed_tenants_commits_go_at_once: SHADOWED,
    a_reload_keeps_every_lease_ten_windows_long: BODY,
);
