//! A circuit breaker in front of a store: a store that keeps failing is not called again until
//! it has had time to come back, so a decision never waits out a command timeout against a store
//! that is known to be down.
//!
//! - **Closed** (normal): every call goes through. `failures` transient errors in a row (the store
//!   unreachable, or slower than its command timeout) open the breaker. A script error is an answer
//!   from a live store and counts as a success here.
//! - **Open**: every call fails at once with [`StoreError::Unavailable`], for `open_for`.
//! - **Half-open**: after `open_for`, the breaker sends a probe of its own (a script returning
//!   one) while every call still fails at once: a user's decision is never the probe, so a store
//!   that still hangs costs no decision its command timeout. The probe's success closes the
//!   breaker; its failure opens it again, for twice as long each time (at most `max_open`), so a
//!   store that stays down is probed less and less often.
//!
//! The probe is sent by the first call after `open_for` (answered at once, as while open); the
//! replica's own background calls (the sweeper's, each second; lease windows) make one, so a store
//! that comes back is found with no user traffic at all.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::clock::{Clock, SystemClock};
use super::{Reply, Script, Store, StoreError};

/// When the breaker opens, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerSettings {
    /// Transient failures in a row that open the breaker.
    pub failures: u32,
    /// How long it stays open before the first probe.
    pub open_for: Duration,
    /// The longest it stays open between probes, however often they fail.
    pub max_open: Duration,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        BreakerSettings { failures: 3, open_for: Duration::from_millis(250), max_open: Duration::from_millis(500) }
    }
}

impl From<&crate::config::BreakerPolicy> for BreakerSettings {
    fn from(b: &crate::config::BreakerPolicy) -> Self {
        BreakerSettings { failures: b.failures, open_for: b.open, max_open: b.max_open }
    }
}

/// Times are the clock's milliseconds.
#[derive(Debug)]
enum State {
    Closed { failures: u32 },
    Open { until_ms: u64, open_for: Duration },
    Probing { open_for: Duration },
}

/// `S` behind a circuit breaker.
pub struct Breaker<S> {
    inner: Arc<S>,
    shared: Arc<Shared>,
}

/// What the breaker's probe shares with it.
struct Shared {
    settings: BreakerSettings,
    state: Mutex<State>,
    clock: Arc<dyn Clock>,
    probe: Script,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Breaker<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Breaker")
            .field("inner", &self.inner)
            .field("state", &*self.shared.lock())
            .finish_non_exhaustive()
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// What the breaker lets a call do.
enum Pass {
    Call,
    /// Refused; the probe is due and this call sends it.
    Probe,
    Refuse(Duration),
}

impl<S> Breaker<S> {
    pub fn new(inner: S, settings: BreakerSettings) -> Self {
        Breaker::with_clock(inner, settings, Arc::new(SystemClock))
    }

    pub fn with_clock(inner: S, settings: BreakerSettings, clock: Arc<dyn Clock>) -> Self {
        let state = Mutex::new(State::Closed { failures: 0 });
        let probe = Script::new("probe", "return 1".to_string());
        Breaker { inner: Arc::new(inner), shared: Arc::new(Shared { settings, state, clock, probe }) }
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// True while calls are refused without reaching the store.
    pub fn is_open(&self) -> bool {
        !matches!(*self.shared.lock(), State::Closed { .. })
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pass(&self) -> Pass {
        let mut state = self.lock();
        match *state {
            State::Closed { .. } => Pass::Call,
            State::Open { until_ms, open_for } => {
                let now = self.clock.now_ms();
                if now < until_ms {
                    return Pass::Refuse(Duration::from_millis(until_ms.saturating_sub(now)));
                }
                *state = State::Probing { open_for };
                Pass::Probe
            }
            State::Probing { .. } => Pass::Refuse(Duration::ZERO),
        }
    }

    fn record(&self, probe: bool, reached: bool) {
        let mut state = self.lock();
        let now = self.clock.now_ms();
        match (&mut *state, reached) {
            (_, true) => {
                if probe || !matches!(*state, State::Closed { .. }) {
                    tracing::warn!("store answers again: circuit closed");
                }
                *state = State::Closed { failures: 0 };
            }
            (State::Closed { failures }, false) => {
                *failures = failures.saturating_add(1);
                if *failures >= self.settings.failures {
                    tracing::warn!(
                        failures = *failures,
                        open_ms = self.settings.open_for.as_millis(),
                        "store failing: circuit open, calls refused at once until a probe succeeds"
                    );
                    let open_for = self.settings.open_for;
                    *state = State::Open { until_ms: now.saturating_add(ms(open_for)), open_for };
                }
            }
            (State::Probing { open_for }, false) if probe => {
                let open_for = open_for.saturating_mul(2).min(self.settings.max_open);
                *state = State::Open { until_ms: now.saturating_add(ms(open_for)), open_for };
            }
            // A call let through before the breaker opened failed late: it is open already.
            (State::Open { .. } | State::Probing { .. }, false) => {}
        }
    }
}

impl<S: Store> Breaker<S> {
    /// Sends the breaker's own probe, in the background: its answer closes or reopens the breaker.
    fn send_probe(&self) {
        let (inner, shared) = (Arc::clone(&self.inner), Arc::clone(&self.shared));
        tokio::spawn(async move {
            let result = inner.eval(&shared.probe, Vec::new(), Vec::new()).await;
            shared.record(true, !matches!(&result, Err(e) if e.is_transient()));
        });
    }
}

impl<S: Store> Store for Breaker<S> {
    async fn load(&self, script: &Script) -> Result<(), StoreError> {
        self.inner.load(script).await
    }

    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        let wait = match self.shared.pass() {
            Pass::Call => {
                let result = self.inner.eval(script, keys, args).await;
                self.shared.record(false, !matches!(&result, Err(e) if e.is_transient()));
                return result;
            }
            Pass::Probe => {
                self.send_probe();
                Duration::ZERO
            }
            Pass::Refuse(wait) => wait,
        };
        Err(StoreError::Unavailable(format!(
            "circuit open: the store failed its last calls; next probe in {} ms",
            wait.as_millis()
        )))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    use super::*;
    use crate::store::clock::ManualClock;

    /// A store that is up or down at the test's word, and counts the calls that reached it.
    #[derive(Debug, Default)]
    struct Switch {
        down: AtomicBool,
        /// Calls hang for an hour (a stalled store).
        hang: AtomicBool,
        calls: AtomicU32,
    }

    impl Store for Switch {
        async fn load(&self, _: &Script) -> Result<(), StoreError> {
            Ok(())
        }

        async fn eval(&self, script: &Script, _: Vec<String>, _: Vec<String>) -> Result<Reply, StoreError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.hang.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
            if self.down.load(Ordering::SeqCst) {
                return Err(StoreError::Unavailable("down".into()));
            }
            if script.name == "broken" {
                return Err(StoreError::Script { script: "broken", message: "ERR".into() });
            }
            Ok(Reply::Int(1))
        }
    }

    fn settings() -> BreakerSettings {
        BreakerSettings { failures: 3, open_for: Duration::from_millis(40), max_open: Duration::from_millis(100) }
    }

    fn breaker() -> (Breaker<Switch>, ManualClock) {
        let clock = ManualClock::new(1_000_000);
        (Breaker::with_clock(Switch::default(), settings(), Arc::new(clock.clone())), clock)
    }

    async fn call(b: &Breaker<Switch>) -> Result<Reply, StoreError> {
        b.eval(&Script::new("call", "return 1".into()), vec![], vec![]).await
    }

    /// Lets the breaker's probe, if one is out, run to its answer.
    async fn probe_answered(b: &Breaker<Switch>) {
        for _ in 0..100 {
            if !matches!(*b.shared.lock(), State::Probing { .. }) {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the probe never answered");
    }

    /// Takes the store down and fails `n` calls against it.
    async fn fail(b: &Breaker<Switch>, n: usize) {
        b.inner.down.store(true, Ordering::SeqCst);
        for _ in 0..n {
            assert!(call(b).await.is_err());
        }
    }

    fn reached(b: &Breaker<Switch>) -> u32 {
        b.inner.calls.load(Ordering::SeqCst)
    }

    #[tokio::test]
    async fn it_opens_after_failures_in_a_row_and_then_spares_the_store() {
        let (b, _clock) = breaker();
        fail(&b, 3).await;
        assert!(b.is_open());
        for _ in 0..10 {
            let e = call(&b).await.unwrap_err();
            assert!(e.is_transient() && e.to_string().contains("circuit open"), "{e}");
        }
        assert_eq!(reached(&b), 3, "an open breaker calls nothing");
    }

    #[tokio::test]
    async fn a_probe_of_its_own_after_the_open_time_closes_it_when_the_store_is_back() {
        let (b, clock) = breaker();
        fail(&b, 3).await;
        b.inner.down.store(false, Ordering::SeqCst);
        clock.advance_ms(39);
        assert!(call(&b).await.is_err(), "still open: no probe before open_for");
        probe_answered(&b).await;
        assert_eq!(reached(&b), 3, "no probe before open_for");
        clock.advance_ms(1);
        let e = call(&b).await.unwrap_err();
        assert!(e.to_string().contains("circuit open"), "the call that sends the probe is not it: {e}");
        probe_answered(&b).await;
        assert_eq!(reached(&b), 4, "the probe, and only it, reached the store");
        assert!(!b.is_open(), "the probe's answer closed the breaker");
        assert_eq!(call(&b).await.unwrap(), Reply::Int(1));
    }

    #[tokio::test]
    async fn a_failed_probe_opens_it_for_longer_up_to_the_maximum() {
        let (b, clock) = breaker();
        fail(&b, 3).await;
        clock.advance_ms(40);
        assert!(call(&b).await.is_err(), "refused; the probe is sent");
        probe_answered(&b).await;
        assert_eq!(reached(&b), 4, "the probe reached the store and failed");
        // Open for 80 ms now: a call 79 ms later is refused without reaching the store.
        clock.advance_ms(79);
        assert!(call(&b).await.is_err());
        probe_answered(&b).await;
        assert_eq!(reached(&b), 4);
        clock.advance_ms(1);
        assert!(call(&b).await.is_err());
        probe_answered(&b).await;
        assert_eq!(reached(&b), 5, "the second probe fails");
        let State::Open { open_for, .. } = *b.shared.lock() else { panic!("open") };
        assert_eq!(open_for, Duration::from_millis(100), "doubled to 160, held at the maximum");
    }

    /// A store that hangs while the breaker probes costs no call a wait: only the probe waits.
    #[tokio::test]
    async fn calls_while_the_probe_hangs_fail_at_once() {
        let (b, clock) = breaker();
        fail(&b, 3).await;
        b.inner.hang.store(true, Ordering::SeqCst);
        clock.advance_ms(40);
        let calls = async {
            for _ in 0..10 {
                assert!(call(&b).await.is_err());
                tokio::task::yield_now().await;
            }
        };
        // A call that waited on the probe's store would wait an hour.
        tokio::time::timeout(Duration::from_secs(30), calls).await.expect("no call waited on the hanging probe");
        assert_eq!(reached(&b), 4, "the probe alone reached the store");
        assert!(b.is_open());
    }

    #[tokio::test]
    async fn a_script_error_is_an_answer_not_a_failure() {
        let (b, _clock) = breaker();
        for _ in 0..5 {
            let e = b.eval(&Script::new("broken", "return (".into()), vec![], vec![]).await.unwrap_err();
            assert!(!e.is_transient());
        }
        assert!(!b.is_open());
    }

    #[tokio::test]
    async fn a_success_resets_the_count() {
        let (b, _clock) = breaker();
        for _ in 0..5 {
            b.inner.down.store(true, Ordering::SeqCst);
            let _ = call(&b).await;
            let _ = call(&b).await;
            b.inner.down.store(false, Ordering::SeqCst);
            call(&b).await.unwrap();
        }
        assert!(!b.is_open(), "two failures in a row, never three");
    }
}
