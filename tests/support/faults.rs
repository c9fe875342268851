//! Stores that misbehave on purpose, wrapped around a real one: what a network and a client do to
//! a script call. A script that ran may still look failed to its caller (the reply was lost), a
//! client may re-send a call it already made, and a caller may give up while a call is in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tollgate::store::{Reply, Script, Store, StoreError};

/// Runs every call of the named scripts twice and answers with the second reply, as fred does when
/// it re-sends a command after a dropped connection: the first run happened, its reply was lost.
#[derive(Clone)]
pub struct Resend<S> {
    pub inner: S,
    pub scripts: &'static [&'static str],
}

impl<S: Store> Store for Resend<S> {
    async fn load(&self, script: &Script) -> Result<(), StoreError> {
        self.inner.load(script).await
    }

    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        if self.scripts.contains(&script.name) {
            self.inner.eval(script, keys.clone(), args.clone()).await?;
        }
        self.inner.eval(script, keys, args).await
    }
}

/// A script call: the script, its keys, its arguments.
type Call = (Script, Vec<String>, Vec<String>);

/// What goes wrong with a call of the faulty script.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// It runs, then its reply takes this long to arrive.
    SlowReply(Duration),
    /// It takes this long to reach the store, then runs.
    SlowCall(Duration),
    /// It runs, then its reply is lost: the caller sees a timeout. (The call is kept for
    /// [`Faulty::send_lost_again`].)
    LostReply,
    /// The first N calls never reach the store: the caller sees a timeout.
    Unreachable(u32),
    /// Every call is refused by the store (a script error): the caller sees it at once.
    Refused,
    /// Every call goes through: [`Faulty`] only counts them.
    Passes,
}

/// Applies a [`Fault`] to every call of one script, and passes every other call through.
#[derive(Clone)]
pub struct Faulty<S> {
    pub inner: S,
    pub script: &'static str,
    pub fault: Fault,
    calls: Arc<AtomicU32>,
    /// The last call whose reply was lost.
    lost: Arc<std::sync::Mutex<Option<Call>>>,
}

impl<S> Faulty<S> {
    pub fn new(inner: S, script: &'static str, fault: Fault) -> Self {
        Faulty { inner, script, fault, calls: Arc::new(AtomicU32::new(0)), lost: Arc::default() }
    }

    /// Calls of the faulty script made so far (each counted as it is sent).
    pub fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }
}

impl<S: Store> Faulty<S> {
    /// Sends the last call whose reply was lost again, as the client re-sending it on a new
    /// connection, late: after its caller gave up on it.
    pub async fn send_lost_again(&self) -> Result<Reply, StoreError> {
        let lost = self.lost.lock().unwrap().clone();
        let (script, keys, args) = lost.expect("a call whose reply was lost");
        self.inner.eval(&script, keys, args).await
    }
}

fn timeout() -> StoreError {
    StoreError::Unavailable("injected: the reply never came".into())
}

impl<S: Store> Store for Faulty<S> {
    async fn load(&self, script: &Script) -> Result<(), StoreError> {
        self.inner.load(script).await
    }

    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        if script.name != self.script {
            return self.inner.eval(script, keys, args).await;
        }
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        match self.fault {
            Fault::SlowReply(delay) => {
                let reply = self.inner.eval(script, keys, args).await;
                tokio::time::sleep(delay).await;
                reply
            }
            Fault::SlowCall(delay) => {
                tokio::time::sleep(delay).await;
                self.inner.eval(script, keys, args).await
            }
            Fault::LostReply => {
                *self.lost.lock().unwrap() = Some((script.clone(), keys.clone(), args.clone()));
                self.inner.eval(script, keys, args).await?;
                Err(timeout())
            }
            Fault::Unreachable(n) if call < n => Err(timeout()),
            Fault::Unreachable(_) => self.inner.eval(script, keys, args).await,
            Fault::Refused => Err(StoreError::Script { script: script.name, message: "injected: refused".into() }),
            Fault::Passes => self.inner.eval(script, keys, args).await,
        }
    }
}

/// Fails the calls of the scripts the test says, when it says: each call takes the next fault the
/// test queued for its script (none queued: the call goes through), so a test can let a lease call
/// through and lose the next one's reply. It remembers the first argument (the reservation id, for
/// the phase scripts) of each script's last call: what a caller whose reply was lost never learns.
#[derive(Clone)]
pub struct Queued<S> {
    pub inner: S,
    pub script: &'static str,
    faults: Arc<std::sync::Mutex<Vec<(&'static str, Fault)>>>,
    last: Arc<std::sync::Mutex<std::collections::HashMap<&'static str, String>>>,
}

impl<S> Queued<S> {
    pub fn new(inner: S, script: &'static str) -> Self {
        Queued { inner, script, faults: Arc::default(), last: Arc::default() }
    }

    /// The next call of the script meets `fault` (`LostReply`: it runs, its reply is lost;
    /// `Unreachable(_)`: it never reaches the store).
    pub fn next(&self, fault: Fault) {
        self.next_for(self.script, fault);
    }

    /// The next call of `script` meets `fault`.
    pub fn next_for(&self, script: &'static str, fault: Fault) {
        self.faults.lock().unwrap().push((script, fault));
    }

    /// Forgets the faults no call has met, and says how many there were.
    pub fn clear(&self) -> usize {
        let mut faults = self.faults.lock().unwrap();
        let left = faults.len();
        faults.clear();
        left
    }

    /// The first argument of the last call of `script`.
    pub fn last_first_arg(&self, script: &str) -> Option<String> {
        self.last.lock().unwrap().get(script).cloned()
    }

    fn take(&self, script: &str) -> Option<Fault> {
        let mut faults = self.faults.lock().unwrap();
        let at = faults.iter().position(|(s, _)| *s == script)?;
        Some(faults.remove(at).1)
    }
}

impl<S: Store> Store for Queued<S> {
    async fn load(&self, script: &Script) -> Result<(), StoreError> {
        self.inner.load(script).await
    }

    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        if let Some(first) = args.first() {
            self.last.lock().unwrap().insert(script.name, first.clone());
        }
        match self.take(script.name) {
            None | Some(Fault::Unreachable(0)) => self.inner.eval(script, keys, args).await,
            Some(Fault::Unreachable(_)) => Err(timeout()),
            Some(Fault::LostReply) => {
                self.inner.eval(script, keys, args).await?;
                Err(timeout())
            }
            Some(Fault::SlowReply(delay)) => {
                let reply = self.inner.eval(script, keys, args).await;
                tokio::time::sleep(delay).await;
                reply
            }
            Some(Fault::SlowCall(delay)) => {
                tokio::time::sleep(delay).await;
                self.inner.eval(script, keys, args).await
            }
            Some(Fault::Refused) => {
                Err(StoreError::Script { script: script.name, message: "injected: refused".into() })
            }
            Some(Fault::Passes) => self.inner.eval(script, keys, args).await,
        }
    }
}

/// Fails calls at random, as a flaky network does: of every call (the test's own inspections
/// and heartbeats aside), `per_mille` run and lose their reply, and as many never reach the store. Seeded, so a
/// failing run repeats; switched off with [`Chaos::calm`].
#[derive(Clone)]
pub struct Chaos<S> {
    pub inner: S,
    per_mille: Arc<AtomicU32>,
    rng: Arc<super::rng::Seeded>,
    failed: Arc<AtomicU32>,
}

impl<S> Chaos<S> {
    pub fn new(inner: S, per_mille: u32, seed: u64) -> Self {
        Chaos {
            inner,
            per_mille: Arc::new(AtomicU32::new(per_mille)),
            rng: Arc::new(super::rng::Seeded::new(seed)),
            failed: Arc::default(),
        }
    }

    /// No faults from now on.
    pub fn calm(&self) {
        self.per_mille.store(0, Ordering::SeqCst);
    }

    /// Calls failed so far.
    pub fn failed(&self) -> u32 {
        self.failed.load(Ordering::SeqCst)
    }

    /// A number in 0..1000.
    fn roll(&self) -> u64 {
        self.rng.below(1000)
    }
}

impl<S: Store> Store for Chaos<S> {
    async fn load(&self, script: &Script) -> Result<(), StoreError> {
        self.inner.load(script).await
    }

    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        let per_mille = u64::from(self.per_mille.load(Ordering::SeqCst));
        // (Nor a heartbeat: a harness's, at its start, would move every seeded schedule.)
        if matches!(script.name, "inspect" | "ledger" | "heartbeat") || per_mille == 0 {
            return self.inner.eval(script, keys, args).await;
        }
        let roll = self.roll();
        if roll < per_mille {
            self.failed.fetch_add(1, Ordering::SeqCst);
            self.inner.eval(script, keys, args).await?;
            return Err(timeout());
        }
        if roll < 2 * per_mille {
            self.failed.fetch_add(1, Ordering::SeqCst);
            return Err(timeout());
        }
        self.inner.eval(script, keys, args).await
    }
}
