//! Settlements tollgate makes itself that could not reach the store (the commit from the
//! response; the clean-up of a reserve nobody received): kept and retried with backoff until they
//! land, breaker or not, so a store outage at the end of a response does not turn its exact usage
//! into an expired hold, and a stalled store leaves no ghost hold charged for a lease.
//!
//! A caller of `Admission/Commit` is told `UNAVAILABLE` and retries itself (commit is idempotent);
//! Envoy's ext_proc has nobody to tell, so its commits and releases come here. The queue is
//! bounded ([`CAPACITY`]): past it, a settlement is dropped and its hold expires by its lease, as
//! it would have without the queue. A retry that reaches the store after the hold expired still
//! counts (a late commit, within the record's retention). What the queue holds when the process
//! stops is tried once more, then lost: those holds expire by their leases, and the log says how
//! many.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{Admission, AdmissionError};
use crate::hold::Ending;
use crate::llm::usage::Measured;
use crate::store::Store;

/// Settlements the queue keeps at most, waiting and being retried (each at most this many).
pub const CAPACITY: usize = 10_000;
/// How long a stopping worker waits for settlements still on their way, before its last try.
const LAST_CALL: Duration = Duration::from_millis(500);
/// The first wait before a retry, doubled while the store keeps failing, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// A settlement to retry.
#[derive(Debug, Clone, PartialEq)]
pub enum Settlement {
    Commit {
        id: String,
        measured: Measured,
        ending: Ending,
    },
    Release {
        id: String,
        ending: Ending,
    },
    /// What a reserve made and nobody received (its reply was lost, or its caller left): the
    /// tenant leg in the store, the pool leg, or both, given back.
    Abandon {
        id: String,
        tenant_leg: bool,
        /// How its pool leg ended, where it has one to give back.
        pool_leg: Option<crate::store::PoolEnd>,
    },
}

impl Settlement {
    fn id(&self) -> &str {
        match self {
            Settlement::Commit { id, .. } | Settlement::Release { id, .. } | Settlement::Abandon { id, .. } => id,
        }
    }

    async fn settle<S: Store>(&self, admission: &Admission<S>) -> Result<(), AdmissionError> {
        match self {
            Settlement::Commit { id, measured, ending } => {
                admission.commit_ended(id, *measured, *ending).await.map(|_| ())
            }
            Settlement::Release { id, ending } => admission.release_ended(id, *ending).await.map(|_| ()),
            Settlement::Abandon { id, tenant_leg, pool_leg } => admission.abandon(id, *tenant_leg, *pool_leg).await,
        }
    }
}

/// The queue's sending side; [`Retries::start`] (or [`Retries::run`]) runs its worker.
#[derive(Debug)]
pub struct Retries {
    queue: mpsc::Sender<Settlement>,
    dropped: AtomicU64,
    /// Settlements kept and not yet taken by the store (or refused by it).
    waiting: Arc<AtomicU64>,
}

/// The queue's receiving side, which its worker takes.
#[derive(Debug)]
pub struct Inbox(mpsc::Receiver<Settlement>, Arc<AtomicU64>);

impl Retries {
    /// A queue, and its inbox for [`Retries::run`].
    pub fn new() -> (Retries, Inbox) {
        let (queue, inbox) = mpsc::channel(CAPACITY);
        let waiting = Arc::new(AtomicU64::new(0));
        (Retries { queue, dropped: AtomicU64::new(0), waiting: Arc::clone(&waiting) }, Inbox(inbox, waiting))
    }

    /// Starts a queue of its own and its worker (see [`Retries::run`]).
    pub fn start<S: Store>(
        admission: Arc<Admission<S>>,
        shutdown: CancellationToken,
    ) -> (Arc<Retries>, JoinHandle<()>) {
        let (retries, inbox) = Retries::new();
        (Arc::new(retries), Retries::run(admission, inbox, shutdown))
    }

    /// Runs the worker of `inbox`. When `shutdown` is cancelled it takes what is still on its way
    /// (for at most half a second), tries it all once more, logs what it lost, and ends; await the
    /// handle for that.
    pub fn run<S: Store>(admission: Arc<Admission<S>>, inbox: Inbox, shutdown: CancellationToken) -> JoinHandle<()> {
        tokio::spawn(work(admission, inbox.0, inbox.1, shutdown))
    }

    /// Keeps a settlement whose store call failed for retrying; a full queue drops it (its hold
    /// expires by its lease).
    pub fn push(&self, settlement: Settlement) {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.queue.try_send(settlement) {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            let dropped = self.dropped.fetch_add(1, Ordering::Relaxed).saturating_add(1);
            let settlement = e.into_inner();
            tracing::warn!(
                reservation = settlement.id(),
                dropped,
                "retry queue full (or stopped): a settlement is dropped, its hold expires by its lease"
            );
        }
    }

    /// Settlements kept and not yet settled (taken, or refused, by the store).
    pub fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Settlements dropped for a full queue since the start.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// Tries the oldest settlement first; one that fails for the store waits, and so do those behind
/// it, so a store that is down is asked once per backoff, not once per settlement.
async fn work<S: Store>(
    admission: Arc<Admission<S>>,
    mut inbox: mpsc::Receiver<Settlement>,
    waiting: Arc<AtomicU64>,
    stop: CancellationToken,
) {
    let mut pending: VecDeque<Settlement> = VecDeque::new();
    let mut backoff = FIRST_BACKOFF;
    loop {
        if pending.is_empty() {
            tokio::select! {
                next = inbox.recv() => match next {
                    Some(s) => pending.push_back(s),
                    None => break,
                },
                () = stop.cancelled() => break,
            }
        }
        while pending.len() < CAPACITY
            && let Ok(s) = inbox.try_recv()
        {
            pending.push_back(s);
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = stop.cancelled() => break,
        }
        backoff = match drain(&admission, &mut pending, &waiting).await {
            Drained::All => FIRST_BACKOFF,
            Drained::StoreDown => backoff.saturating_mul(2).min(MAX_BACKOFF),
        };
    }
    // Stopping: what is still on its way (until the senders are gone, or for LAST_CALL), then one
    // last try.
    let _ = tokio::time::timeout(LAST_CALL, async {
        while let Some(s) = inbox.recv().await {
            pending.push_back(s);
        }
    })
    .await;
    while let Ok(s) = inbox.try_recv() {
        pending.push_back(s);
    }
    let _ = drain(&admission, &mut pending, &waiting).await;
    if !pending.is_empty() {
        tracing::warn!(
            lost = pending.len(),
            "stopping with settlements the store never took: their holds expire by their leases"
        );
    }
}

enum Drained {
    All,
    StoreDown,
}

async fn drain<S: Store>(admission: &Admission<S>, pending: &mut VecDeque<Settlement>, waiting: &AtomicU64) -> Drained {
    while let Some(s) = pending.front() {
        match s.settle(admission).await {
            Ok(()) => tracing::info!(reservation = s.id(), "settled on retry"),
            Err(e) if e.is_transient() => return Drained::StoreDown,
            Err(e) => tracing::warn!(error = %e, reservation = s.id(), "a retried settlement was refused; dropped"),
        }
        pending.pop_front();
        waiting.fetch_sub(1, Ordering::Relaxed);
    }
    Drained::All
}
