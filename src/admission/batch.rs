//! Commits from responses, batched by tenant (`store.commit_window_ms`).
//!
//! A decision in the store is two calls, the reserve and the commit, and each call costs Redis a
//! round of its own (reading the request, running the function, writing the reply) before the
//! script does anything. Nobody waits for the commit that Envoy's ext_proc makes when a response
//! ends, so it can wait a little for company: the first commit of a tenant starts its window, and
//! every commit of that tenant made within it goes in the same call (`commit_many.lua`), each
//! exactly as it would alone, at one time; a window that ends with one commit sends it alone
//! (`commit.lua`). A batch goes early when it reaches [`MOST`]. Redis and a Cluster batch unless
//! the policy says `commit_window_ms: 0` (over 50 ms unless it says otherwise); the embedded store
//! only when the policy sets a window.
//!
//! What a window changes is when a commit lands, never what it charges: until then its hold stays
//! charged as held (refunds come later, a debt beyond the hold lands later), and its slot stays
//! taken. So a commit that frees what another request may be waiting for goes within
//! [`SHORT_COMMIT_WINDOW`], and takes its tenant's batch with it: a pool's slot (capacity
//! admission), or a slot of a tenant short of them (a reserve here found fewer left than one batch
//! could hold, or refused one: see `short.rs`; a batch already waiting then is hurried too),
//! which a request of its tenant at another replica would otherwise meet still taken. Here, a
//! reserve of its tenant refused for a slot sends the waiting commits at once, or waits for those
//! on their way, and asks again ([`Admission::commit_waiting`]). The window is at most a tenth of
//! any lease (see the policy's validation; a reload is held to a window the policy
//! set, and a default one fits itself to the leases in force), so a hold's lease covers its
//! commit's wait. A batch that could not reach the store goes, commit by commit, to the
//! retry queue, as a single commit from a response would; one the store refused (a script error
//! before its end, which writes nothing of the commits it gathered: see common.lua's `gather`) goes
//! again commit by commit, so only the one at fault fails. Stopping flushes every window at once
//! (see [`Admission::finish_tasks`]); once the drain has begun, a commit goes alone. What waits in
//! a window when the process dies (not a drain) is lost, as a commit on its way would be: its hold
//! expires by its lease, settled per `expired_usage`.
//!
//! Only holds in the store are batched: a leased hold settles in this replica's memory, and
//! another replica's is forwarded, neither with a store call of its own to save. Callers of
//! `Admission/Commit` wait for their answer, and are never batched; nor is a shadowed tenant's
//! commit (see [`Admission::commit_from_response`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tokio_util::task::task_tracker::TaskTrackerToken;

use super::retry::Settlement;
use super::settle::{Home, checked_commit};
use super::short::ShortOfSlots;
use super::{Admission, AdmissionError};
use crate::config::SHORT_COMMIT_WINDOW;
use crate::hold::{CommitOutcome, Counted, Ending};
use crate::store::{CommitCall, Store};

/// The most commits one call carries: a batch this large goes at once.
pub const MOST: usize = 64;

/// The commits waiting for their tenant's window to end, and the windows' timers.
#[derive(Default)]
pub(super) struct Batches {
    waiting: Mutex<Waiting>,
    /// Tenants short of concurrency slots: their commits go within the short window.
    pub(super) short: ShortOfSlots,
    /// The windows open and the batches on their way to the store: the drain waits for them.
    tasks: TaskTracker,
    /// Cancelled as the drain begins: the windows' timers stop waiting (the drain sends what they
    /// waited for).
    closing: CancellationToken,
}

impl std::fmt::Debug for Batches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batches").field("tasks", &self.tasks).finish_non_exhaustive()
    }
}

/// A batch on its way to the store: true once the store has taken it. (Whoever awaits it first
/// makes the call; every other waits for the same answer.)
type Sending = Shared<BoxFuture<'static, bool>>;

#[derive(Default)]
struct Waiting {
    by_tenant: HashMap<String, Batch>,
    /// Each tenant's batch on its way to the store, the latest: a reserve refused for a slot while
    /// it is waits for it (see [`Admission::commit_waiting`]).
    sending: HashMap<String, Sending>,
    /// Set as the drain begins (under the same lock as a commit joins a batch, so none joins one
    /// the drain will not send): from then on a commit goes alone.
    closed: bool,
}

/// A tenant's commits waiting, and when its window ends.
#[derive(Debug)]
struct Batch {
    calls: Vec<CommitCall>,
    due: Instant,
}

/// `wait` after `now` (past the clock's range: `now`).
pub(super) fn later(now: Instant, wait: Duration) -> Instant {
    now.checked_add(wait).unwrap_or(now)
}

/// The window of a commit that frees what another request may be waiting for: the short one, or
/// the policy's `window` where that is shorter.
fn short(window: Duration) -> Duration {
    window.min(SHORT_COMMIT_WINDOW)
}

/// Where a commit from a response went. A batch to send comes with a token of the batches'
/// tracker, taken under the lock the drain closes them with, so the drain waits for it.
enum Joined {
    /// Its tenant's batch, opening it: the batch goes when its window ends, then.
    Opened(Instant, TaskTrackerToken),
    /// Its tenant's batch, already open.
    Waits,
    /// Its tenant's batch, already open, whose window it shortens: the batch goes then.
    Hurries(Instant, TaskTrackerToken),
    /// Its tenant's batch, which it filled: the batch goes now.
    Filled(Vec<CommitCall>, TaskTrackerToken),
    /// None: the drain has begun. The commit comes back, to go alone.
    Closed(CommitCall),
}

impl Batches {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Puts `call` in its tenant's batch, to go within `window`, or within the short window
    /// where it frees what another request may be waiting for (`soon`: a pool's slot, or a slot
    /// of a tenant short of them).
    fn join(&self, tenant: &str, call: CommitCall, window: Duration, soon: bool) -> Joined {
        let now = Instant::now();
        let due = later(now, if soon { short(window) } else { window });
        let mut waiting = self.lock();
        if waiting.closed {
            return Joined::Closed(call);
        }
        let Some(batch) = waiting.by_tenant.get_mut(tenant) else {
            waiting.by_tenant.insert(tenant.to_string(), Batch { calls: vec![call], due });
            return Joined::Opened(due, self.tasks.token());
        };
        batch.calls.push(call);
        if batch.calls.len() >= MOST {
            let calls = std::mem::take(&mut batch.calls);
            waiting.by_tenant.remove(tenant);
            Joined::Filled(calls, self.tasks.token())
        } else if due < batch.due {
            batch.due = due;
            Joined::Hurries(due, self.tasks.token())
        } else {
            Joined::Waits
        }
    }

    /// Takes `tenant`'s batch, leaving none.
    fn take(&self, tenant: &str) -> Vec<CommitCall> {
        self.lock().by_tenant.remove(tenant).map(|b| b.calls).unwrap_or_default()
    }

    /// Takes `tenant`'s batch if the window that ended at `due` was its, and notes it as on its
    /// way (`send` makes its call), in one step: a reserve refused for a slot finds it waiting or
    /// on its way, never between. (A timer set for a window a later commit or a reserve shortened,
    /// or for a batch that filled, may find another batch, due later, with a timer of its own.)
    fn take_due(&self, tenant: &str, due: Instant, send: impl FnOnce(Vec<CommitCall>) -> Sending) -> Option<Sending> {
        let mut waiting = self.lock();
        if waiting.by_tenant.get(tenant).is_none_or(|batch| batch.due > due) {
            return None;
        }
        let sending = send(waiting.by_tenant.remove(tenant)?.calls);
        waiting.sending.insert(tenant.to_string(), sending.clone());
        Some(sending)
    }

    /// Every batch, leaving none, and no more to come; the windows' timers stop.
    fn close(&self) -> Vec<(String, Vec<CommitCall>)> {
        let mut waiting = self.lock();
        waiting.closed = true;
        self.closing.cancel();
        waiting.by_tenant.drain().filter(|(_, batch)| !batch.calls.is_empty()).map(|(t, b)| (t, b.calls)).collect()
    }

    /// Shortens `tenant`'s open window to the short one from now, if it would end later than that:
    /// its tenant has just become short of slots. The batch then goes at the time returned, the
    /// token keeping the drain waiting until the timer that sends it is spawned.
    fn hurry(&self, tenant: &str, window: Duration) -> Option<(Instant, TaskTrackerToken)> {
        let due = later(Instant::now(), short(window));
        let mut waiting = self.lock();
        let batch = waiting.by_tenant.get_mut(tenant).filter(|batch| batch.due > due)?;
        batch.due = due;
        Some((due, self.tasks.token()))
    }

    /// Notes `sending` as `tenant`'s batch on its way.
    fn note_on_its_way(&self, tenant: &str, sending: &Sending) {
        self.lock().sending.insert(tenant.to_string(), sending.clone());
    }

    /// `tenant`'s batch `sending` has landed: no longer on its way (a later one may be).
    fn landed(&self, tenant: &str, sending: &Sending) {
        let mut waiting = self.lock();
        if waiting.sending.get(tenant).is_some_and(|s| s.ptr_eq(sending)) {
            waiting.sending.remove(tenant);
        }
    }

    /// `tenant`'s batch on its way, if one is.
    fn on_its_way(&self, tenant: &str) -> Option<Sending> {
        self.lock().sending.get(tenant).cloned()
    }
}

impl<S: Store> Admission<S> {
    /// The commit Envoy's ext_proc makes when a response ends: nobody waits for its answer. Where
    /// the policy batches commits and the hold is in the store, it joins its tenant's batch and
    /// this returns at once; otherwise it is made now. Either way, one that cannot reach the store
    /// is retried ([`Admission::retry`]), and what happened is logged.
    pub async fn commit_from_response(self: &Arc<Self>, id: &str, counted: Counted, ending: Ending) {
        let policy = self.policy();
        // (No window: nothing read here that commit_ended reads again.) A shadowed tenant's
        // commits go at once: a slot a waiting commit still held would show in its shadow as a
        // refusal enforcing would not make (a reserve refused for a slot sends the waiting commits
        // and asks again; a shadowed one is admitted, and cannot be asked again).
        // One that frees a pool's slot, or a slot of a tenant short of them, goes soon.
        let batched = policy.commit_window().and_then(|window| {
            let r = checked_commit(id, counted).ok()?;
            let shadowed = self.tenant_policy(&policy, r.tenant).is_some_and(|tp| tp.shadow);
            (matches!(self.home(&r), Home::Store) && !shadowed).then(|| {
                let soon = r.pool.is_some() || self.batches.short.is_short(r.tenant);
                (r.tenant.to_string(), window, soon)
            })
        });
        let call = CommitCall { id: id.to_string(), counted, ending };
        let Some((tenant, window, soon)) = batched else {
            self.commit_alone(&call).await;
            return;
        };
        match self.batches.join(&tenant, call, window, soon) {
            Joined::Closed(call) => {
                self.commit_alone(&call).await;
            }
            Joined::Waits => {}
            Joined::Filled(batch, token) => {
                self.send_batch(tenant, batch);
                drop(token);
            }
            Joined::Opened(due, token) | Joined::Hurries(due, token) => self.send_when_due(tenant, due, token),
        }
    }

    /// Hurries `tenant`'s waiting commits to the short window (see [`ShortOfSlots::saw`]): the
    /// tenant has just become short of slots.
    pub(super) fn hurry_commits(self: &Arc<Self>, tenant: &str) {
        let Some(window) = self.policy().commit_window() else { return };
        if let Some((due, token)) = self.batches.hurry(tenant, window) {
            self.send_when_due(tenant.to_string(), due, token);
        }
    }

    /// Sends `tenant`'s batch when its window ends at `due`, unless it went before (another
    /// timer's, filled, the drain's, or sent by a reserve refused for a slot); the task spawned
    /// keeps the drain waiting for it (`token` until it is spawned).
    fn send_when_due(self: &Arc<Self>, tenant: String, due: Instant, token: TaskTrackerToken) {
        let admission = Arc::clone(self);
        self.batches.tasks.spawn(async move {
            tokio::select! {
                () = tokio::time::sleep_until(due) => {}
                // (The drain sends what waits.)
                () = admission.batches.closing.cancelled() => return,
            }
            if let Some(sending) = admission.batches.take_due(&tenant, due, |batch| admission.to_send(&tenant, batch)) {
                admission.land(tenant, sending).await;
            }
        });
        drop(token);
    }

    /// `tenant`'s `batch` made ready to go ([`Admission::commit_batch`]), for a reserve refused for
    /// a slot to wait for too.
    fn to_send(self: &Arc<Self>, tenant: &str, batch: Vec<CommitCall>) -> Sending {
        let (admission, tenant) = (Arc::clone(self), tenant.to_string());
        async move { admission.commit_batch(&tenant, batch).await }.boxed().shared()
    }

    /// Sends `tenant`'s batch `sending` (noted as on its way), no longer on its way once it lands.
    async fn land(self: Arc<Self>, tenant: String, sending: Sending) {
        sending.clone().await;
        self.batches.landed(&tenant, &sending);
    }

    /// Sends `tenant`'s `batch` now, noted as on its way until it lands (a batch that filled, the
    /// drain's).
    fn send_batch(self: &Arc<Self>, tenant: String, batch: Vec<CommitCall>) {
        let sending = self.to_send(&tenant, batch);
        self.batches.note_on_its_way(&tenant, &sending);
        self.batches.tasks.spawn(Arc::clone(self).land(tenant, sending));
    }

    /// Commits every batch waiting now, without waiting for their windows, and waits for those on
    /// their way: the drain's. From then on a commit from a response goes alone.
    pub(super) async fn flush_batches(self: &Arc<Self>) {
        for (tenant, batch) in self.batches.close() {
            self.send_batch(tenant, batch);
        }
        self.batches.tasks.close();
        self.batches.tasks.wait().await;
    }

    /// Sends `tenant`'s waiting batch now, without waiting for its window to end, or, where none
    /// waits, waits for the one its window sent, if that is on its way: true when there was one
    /// and the store took it (see [`Admission::tenant_leg`], which then asks a reserve refused for
    /// a slot again).
    pub(super) async fn commit_waiting(&self, tenant: &str) -> bool {
        let batch = self.batches.take(tenant);
        if batch.is_empty() {
            return match self.batches.on_its_way(tenant) {
                Some(sending) => sending.await,
                None => false,
            };
        }
        // Sent here, and noted as on its way meanwhile, for another reserve refused for a slot to
        // wait for too (the answer reaches it through `landed`; a reserve dropped half way leaves
        // a note that answers false).
        let (landed, answer) = tokio::sync::oneshot::channel();
        let sending: Sending = async move { answer.await.unwrap_or(false) }.boxed().shared();
        self.batches.note_on_its_way(tenant, &sending);
        let taken = self.commit_batch(tenant, batch).await;
        let _ = landed.send(taken);
        self.batches.landed(tenant, &sending);
        taken
    }

    /// A batch sent: its commits' outcomes logged, and, where the store did not take it, each
    /// commit kept for the retry queue. True when the store took it (a commit it refused on its
    /// own aside). A batch of one goes alone, as `commit.lua` (a window of one all the same, in
    /// `tollgate_commit_batch`): gathering a batch's writes (`commit_many.lua`) costs the store
    /// more than one commit saves it.
    async fn commit_batch(&self, tenant: &str, batch: Vec<CommitCall>) -> bool {
        if batch.is_empty() {
            return true;
        }
        self.metrics.commit_batch(batch.len());
        if let [c] = batch.as_slice() {
            return self.commit_alone(c).await;
        }
        match self.commit_together(tenant, &batch).await {
            Ok(outcomes) => {
                for (c, outcome) in batch.iter().zip(&outcomes) {
                    self.committed_from_response(&c.id, c.counted, c.ending, Ok(outcome));
                }
                true
            }
            // (None of the batch is known to have run: each is retried, and a commit that did run
            // answers its retry as a repeat, charging nothing more.)
            Err(e) if e.is_transient() => {
                for c in &batch {
                    self.committed_from_response(&c.id, c.counted, c.ending, Err(&e));
                }
                false
            }
            // A batch the store refused (a script error before its end has written nothing of the
            // commits it gathered: see common.lua's gather): each commit alone, so that only the
            // one at fault fails.
            Err(e) => {
                tracing::warn!(error = %e, tenant, commits = batch.len(), "a batch of commits failed; committing each alone");
                for c in &batch {
                    self.commit_alone(c).await;
                }
                true
            }
        }
    }

    /// One commit from a response, made now in a call of its own, and what happened logged (one
    /// that cannot reach the store kept for the retry queue): true when the store took it.
    async fn commit_alone(&self, c: &CommitCall) -> bool {
        let outcome = self.commit_ended(&c.id, c.counted, c.ending).await;
        self.committed_from_response(&c.id, c.counted, c.ending, outcome.as_ref());
        !outcome.is_err_and(|e| e.is_transient())
    }

    /// Commits `tenant`'s holds in the store in one call, each as [`Admission::commit_ended`]
    /// would alone, in order: the outcomes in the order of `commits`, after each one's metrics
    /// and pool leg. An id of another tenant, of a hold not in the store (a leased one), or with a
    /// count out of bounds refuses the whole batch, before any is made.
    pub async fn commit_together(
        &self,
        tenant: &str,
        commits: &[CommitCall],
    ) -> Result<Vec<CommitOutcome>, AdmissionError> {
        let mut holds = Vec::with_capacity(commits.len());
        for c in commits {
            let r = checked_commit(&c.id, c.counted)?;
            if r.tenant != tenant || !matches!(self.home(&r), Home::Store) {
                return Err(AdmissionError::BadReservationId(c.id.clone()));
            }
            holds.push(r);
        }
        let policy = self.policy();
        let terms = self.commit_terms(&policy, tenant);
        let outcomes = self.protocol.commit_many(tenant, commits, terms).await?;
        let after = commits
            .iter()
            .zip(&holds)
            .zip(&outcomes)
            .map(|((c, r), outcome)| self.after_store_commit(&policy, r, &c.id, outcome, c.counted, c.ending));
        futures_util::future::join_all(after).await;
        Ok(outcomes)
    }

    /// Logs how a commit from a response went, and keeps one that could not reach the store for
    /// the retry queue.
    fn committed_from_response(
        &self,
        id: &str,
        counted: Counted,
        ending: Ending,
        outcome: Result<&CommitOutcome, &AdmissionError>,
    ) {
        match outcome {
            Ok(outcome) => tracing::debug!(
                reservation = id,
                state = outcome.state(),
                measured = ?counted,
                ending = ending.as_str(),
                "committed from the response"
            ),
            Err(e) if e.is_transient() => {
                tracing::warn!(error = %e, reservation = id, "commit from the response could not reach the store; retrying");
                self.retry(Settlement::Commit { id: id.to_string(), measured: counted, ending });
            }
            Err(e) => tracing::warn!(error = %e, reservation = id, "commit from the response failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::short::SHORT_OF_SLOTS;

    const WINDOW: Duration = Duration::from_millis(100);

    fn call(n: usize) -> CommitCall {
        CommitCall { id: format!("hold-{n}"), counted: Counted::AsHeld, ending: Ending::Completed }
    }

    /// The window a commit's batch goes after, from when it joined (now, to the ms above).
    fn window(joined: &Joined) -> Option<Duration> {
        match joined {
            Joined::Opened(due, _) | Joined::Hurries(due, _) => {
                let left = due.saturating_duration_since(Instant::now()).as_micros().div_ceil(1000);
                Some(Duration::from_millis(u64::try_from(left).unwrap()))
            }
            _ => None,
        }
    }

    #[test]
    fn a_tenant_with_slots_to_spare_waits_the_window_and_one_short_of_them_five_ms() {
        let b = Batches::default();
        b.short.saw("roomy", Some(SHORT_OF_SLOTS));
        b.short.saw("uncapped", None);
        b.short.saw("short", Some(SHORT_OF_SLOTS - 1));
        assert_eq!(window(&b.join("roomy", call(0), WINDOW, b.short.is_short("roomy"))), Some(WINDOW));
        assert_eq!(window(&b.join("uncapped", call(1), WINDOW, b.short.is_short("uncapped"))), Some(WINDOW));
        assert_eq!(window(&b.join("short", call(2), WINDOW, b.short.is_short("short"))), Some(SHORT_COMMIT_WINDOW));
        // A pool's slot: within the short window whatever its tenant's.
        assert_eq!(window(&b.join("pooled", call(3), WINDOW, true)), Some(SHORT_COMMIT_WINDOW));
        // A window shorter than the short one stays as it is.
        assert_eq!(window(&b.join("brief", call(4), Duration::from_millis(2), true)), Some(Duration::from_millis(2)));
    }

    #[test]
    fn a_commit_that_must_go_soon_hurries_an_open_window_and_one_that_may_wait_joins_it() {
        let b = Batches::default();
        assert!(matches!(b.join("t", call(0), WINDOW, false), Joined::Opened(..)));
        assert!(matches!(b.join("t", call(1), WINDOW, false), Joined::Waits), "the window is open");
        b.short.saw("t", Some(0));
        assert_eq!(
            window(&b.join("t", call(2), WINDOW, b.short.is_short("t"))),
            Some(SHORT_COMMIT_WINDOW),
            "hurries it"
        );
        assert!(matches!(b.join("t", call(3), WINDOW, false), Joined::Waits), "already due that soon");
        assert_eq!(b.take("t").len(), 4, "one batch, all four");
    }

    #[tokio::test(start_paused = true)]
    async fn a_hurried_window_ends_at_the_short_one_from_now_and_its_timer_takes_it() {
        let b = Batches::default();
        let nothing = || -> Sending { async { true }.boxed().shared() };
        let Joined::Opened(first_due, _) = b.join("t", call(0), WINDOW, false) else { panic!("not opened") };
        tokio::time::advance(WINDOW / 2).await;
        let (due, _) = b.hurry("t", WINDOW).expect("the open window hurried");
        assert_eq!(due, Instant::now() + SHORT_COMMIT_WINDOW, "the short window from now");
        assert!(b.hurry("t", WINDOW).is_none(), "due that soon already");
        assert!(b.hurry("none", WINDOW).is_none(), "no window open");
        tokio::time::advance(SHORT_COMMIT_WINDOW).await;
        assert!(b.take_due("t", due, |_| nothing()).is_some(), "its timer takes it");
        assert!(b.take_due("t", first_due, |_| nothing()).is_none(), "the window's first timer finds none");
    }

    #[tokio::test(start_paused = true)]
    async fn a_timer_takes_only_the_batch_whose_window_ended_and_notes_it_on_its_way() {
        let b = Batches::default();
        let nothing = || -> Sending { async { true }.boxed().shared() };
        let Joined::Opened(due, _) = b.join("t", call(0), WINDOW, false) else { panic!("not opened") };
        let early = Instant::now();
        assert!(b.take_due("t", early, |_| nothing()).is_none(), "a timer of a window that ended earlier");
        tokio::time::advance(WINDOW).await;
        let mut carried = 0;
        let sending = b.take_due("t", due, |batch| {
            carried = batch.len();
            nothing()
        });
        assert_eq!(carried, 1);
        let sending = sending.expect("its own window's timer");
        assert!(b.on_its_way("t").is_some_and(|s| s.ptr_eq(&sending)), "on its way");
        b.landed("t", &sending);
        assert!(b.on_its_way("t").is_none());
    }

    #[test]
    fn a_batch_goes_when_full_and_the_next_opens_anew() {
        let b = Batches::default();
        for n in 0..MOST - 1 {
            assert!(!matches!(b.join("t", call(n), WINDOW, false), Joined::Filled(..)));
        }
        let Joined::Filled(batch, _) = b.join("t", call(MOST), WINDOW, false) else { panic!("not filled") };
        assert_eq!(batch.len(), MOST);
        assert!(matches!(b.join("t", call(0), WINDOW, false), Joined::Opened(..)), "a new window");
    }
}
