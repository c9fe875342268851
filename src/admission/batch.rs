//! Commits from responses, batched by tenant (`store.commit_window_ms`).
//!
//! A decision in the store is two calls, the reserve and the commit, and each call costs Redis a
//! round of its own (reading the request, running the function, writing the reply) before the
//! script does anything. Nobody waits for the commit that Envoy's ext_proc makes when a response
//! ends, so it can wait a little for company: the first commit of a tenant starts its window, and
//! every commit of that tenant made within it goes in the same call (`commit_many.lua`), each
//! exactly as it would alone, at one time. A batch goes early when it reaches [`MOST`].
//!
//! What a window changes is when a commit lands, never what it charges: until then its hold stays
//! charged as held (refunds come later, a debt beyond the hold lands later), and its slot stays
//! taken. The window is at most a tenth of any lease (see the policy's validation), so a hold's
//! lease covers its commit's wait. A batch that could not reach the store goes, commit by commit,
//! to the retry queue, as a single commit from a response would. Stopping flushes every window at
//! once (see [`Admission::finish_tasks`]); once the drain has begun, a commit goes alone.
//!
//! Only holds in the store are batched: a leased hold settles in this replica's memory, and
//! another replica's is forwarded, neither with a store call of its own to save. Callers of
//! `Admission/Commit` wait for their answer, and are never batched.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio_util::task::TaskTracker;

use super::retry::Settlement;
use super::settle::{Home, checked_commit};
use super::{Admission, AdmissionError};
use crate::hold::{CommitOutcome, Counted, Ending};
use crate::store::{CommitCall, Store};

/// The most commits one call carries: a batch this large goes at once.
pub const MOST: usize = 64;

/// The commits waiting for their tenant's window to end, and the windows' timers.
#[derive(Debug, Default)]
pub(super) struct Batches {
    waiting: Mutex<HashMap<String, Vec<CommitCall>>>,
    /// The windows open and the batches on their way to the store: the drain waits for them.
    tasks: TaskTracker,
}

impl Batches {
    /// Takes `tenant`'s batch, leaving none.
    fn take(&self, tenant: &str) -> Vec<CommitCall> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner).remove(tenant).unwrap_or_default()
    }

    /// Every batch, leaving none.
    fn take_all(&self) -> Vec<(String, Vec<CommitCall>)> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner).drain().collect()
    }
}

impl<S: Store> Admission<S> {
    /// The commit Envoy's ext_proc makes when a response ends: nobody waits for its answer. Where
    /// the policy batches commits and the hold is in the store, it joins its tenant's batch and
    /// this returns at once; otherwise it is made now. Either way, one that cannot reach the store
    /// is retried ([`Admission::retry`]), and what happened is logged.
    pub async fn commit_from_response(self: &Arc<Self>, id: &str, counted: Counted, ending: Ending) {
        let window = self.policy().store.commit_window;
        let batched = !window.is_zero()
            && !self.batches.tasks.is_closed()
            && checked_commit(id, counted).is_ok_and(|r| matches!(self.home(&r), Home::Store));
        if !batched {
            let outcome = self.commit_ended(id, counted, ending).await;
            self.committed_from_response(id, counted, ending, outcome.as_ref());
            return;
        }
        let Ok(r) = checked_commit(id, counted) else { return };
        let call = CommitCall { id: id.to_string(), counted, ending };
        let (opened, full) = {
            let mut waiting = self.batches.waiting.lock().unwrap_or_else(PoisonError::into_inner);
            let batch = waiting.entry(r.tenant.to_string()).or_default();
            batch.push(call);
            let full = (batch.len() >= MOST).then(|| std::mem::take(batch));
            (batch.len() == 1, full)
        };
        let tenant = r.tenant.to_string();
        if let Some(batch) = full {
            let admission = Arc::clone(self);
            self.batches.tasks.spawn(async move { admission.commit_batch(&tenant, batch).await });
        } else if opened {
            let admission = Arc::clone(self);
            self.batches.tasks.spawn(async move {
                tokio::time::sleep(window).await;
                let batch = admission.batches.take(&tenant);
                admission.commit_batch(&tenant, batch).await;
            });
        }
    }

    /// Commits every batch waiting now, without waiting for their windows, and waits for those on
    /// their way: the drain's, once no response can end any more.
    pub(super) async fn flush_batches(self: &Arc<Self>) {
        self.batches.tasks.close();
        // (Again while any is left: a commit that saw the windows open as they closed.)
        loop {
            let batches = self.batches.take_all();
            if batches.is_empty() && self.batches.tasks.is_empty() {
                return;
            }
            for (tenant, batch) in batches {
                let admission = Arc::clone(self);
                self.batches.tasks.spawn(async move { admission.commit_batch(&tenant, batch).await });
            }
            self.batches.tasks.wait().await;
        }
    }

    /// A batch sent: its commits' outcomes logged, and, where the store did not take it, each
    /// commit kept for the retry queue.
    async fn commit_batch(&self, tenant: &str, batch: Vec<CommitCall>) {
        if batch.is_empty() {
            return;
        }
        match self.commit_together(tenant, &batch).await {
            Ok(outcomes) => {
                for (c, outcome) in batch.iter().zip(&outcomes) {
                    self.committed_from_response(&c.id, c.counted, c.ending, Ok(outcome));
                }
            }
            // (None of the batch is known to have run: each is retried, and a commit that did run
            // answers its retry as a repeat, charging nothing more.)
            Err(e) => {
                for c in &batch {
                    self.committed_from_response(&c.id, c.counted, c.ending, Err(&e));
                }
            }
        }
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
        for ((c, r), outcome) in commits.iter().zip(&holds).zip(&outcomes) {
            self.after_store_commit(&policy, r, &c.id, outcome, c.counted, c.ending).await;
        }
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
            Err(AdmissionError::Store(e)) if e.is_transient() => {
                tracing::warn!(error = %e, reservation = id, "commit from the response could not reach the store; retrying");
                self.retry(Settlement::Commit { id: id.to_string(), measured: counted, ending });
            }
            Err(e) => tracing::warn!(error = %e, reservation = id, "commit from the response failed"),
        }
    }
}
