//! A circuit breaker in front of a store: a store that keeps failing is not called again until
//! it has had time to come back, so a decision never waits out a command timeout against a store
//! that is known to be down.
//!
//! - **Closed** (normal): every call goes through. `failures` transient errors in a row (the store
//!   unreachable, or slower than its command timeout) open the breaker. A script error is an answer
//!   from a live store and counts as a success here.
//! - **Open**: every call fails at once with [`StoreError::Unavailable`], for `open_for`.
//! - **Half-open**: after `open_for`, one call goes through as a probe while the others still fail
//!   at once. Its success closes the breaker; its failure opens it again, for twice as long each
//!   time (at most `max_open`), so a store that stays down is probed less and less often.
//!
//! The probe is a real call (the next decision's), so recovery needs traffic; under none there is
//! nothing to decide anyway, and the first call after `open_for` is the probe.

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
    inner: S,
    settings: BreakerSettings,
    state: Mutex<State>,
    clock: Arc<dyn Clock>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Breaker<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Breaker").field("inner", &self.inner).field("state", &*self.lock()).finish_non_exhaustive()
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// What the breaker lets a call do.
enum Pass {
    Call,
    Probe,
    Refuse(Duration),
}

impl<S> Breaker<S> {
    pub fn new(inner: S, settings: BreakerSettings) -> Self {
        Breaker::with_clock(inner, settings, Arc::new(SystemClock))
    }

    pub fn with_clock(inner: S, settings: BreakerSettings, clock: Arc<dyn Clock>) -> Self {
        Breaker { inner, settings, state: Mutex::new(State::Closed { failures: 0 }), clock }
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// True while calls are refused without reaching the store.
    pub fn is_open(&self) -> bool {
        !matches!(*self.lock(), State::Closed { .. })
    }

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

impl<S: Store> Store for Breaker<S> {
    async fn load(&self, script: &Script) -> Result<(), StoreError> {
        self.inner.load(script).await
    }

    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        let probe = match self.pass() {
            Pass::Call => false,
            Pass::Probe => true,
            Pass::Refuse(wait) => {
                return Err(StoreError::Unavailable(format!(
                    "circuit open: the store failed its last calls; next probe in {} ms",
                    wait.as_millis()
                )));
            }
        };
        let result = self.inner.eval(script, keys, args).await;
        let reached = !matches!(&result, Err(e) if e.is_transient());
        self.record(probe, reached);
        result
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
        calls: AtomicU32,
    }

    impl Store for Switch {
        async fn load(&self, _: &Script) -> Result<(), StoreError> {
            Ok(())
        }

        async fn eval(&self, script: &Script, _: Vec<String>, _: Vec<String>) -> Result<Reply, StoreError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
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
        b.eval(&Script::new("probe", "return 1".into()), vec![], vec![]).await
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
    async fn a_probe_after_the_open_time_closes_it_when_the_store_is_back() {
        let (b, clock) = breaker();
        fail(&b, 3).await;
        b.inner.down.store(false, Ordering::SeqCst);
        clock.advance_ms(39);
        assert!(call(&b).await.is_err(), "still open: no probe before open_for");
        clock.advance_ms(1);
        assert_eq!(call(&b).await.unwrap(), Reply::Int(1), "the probe goes through");
        assert!(!b.is_open());
        assert_eq!(reached(&b), 4);
    }

    #[tokio::test]
    async fn a_failed_probe_opens_it_for_longer_up_to_the_maximum() {
        let (b, clock) = breaker();
        fail(&b, 3).await;
        clock.advance_ms(40);
        assert!(call(&b).await.is_err(), "the probe fails");
        assert_eq!(reached(&b), 4);
        // Open for 80 ms now: a call 79 ms later is refused without reaching the store.
        clock.advance_ms(79);
        assert!(call(&b).await.is_err());
        assert_eq!(reached(&b), 4);
        clock.advance_ms(1);
        assert!(call(&b).await.is_err(), "the second probe fails");
        assert_eq!(reached(&b), 5);
        let State::Open { open_for, .. } = *b.lock() else { panic!("open") };
        assert_eq!(open_for, Duration::from_millis(100), "doubled to 160, held at the maximum");
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
