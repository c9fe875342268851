//! A store whose calls are watched: [`Observed`] times every script call and tells its
//! [`Observer`] how it went, so the metrics can count store latency and failures without the store
//! knowing them (the metrics implement the observer; the store imports nothing above it).

use std::time::{Duration, Instant};

use super::{Reply, Script, Store, StoreError};

/// Told of every script call once it has answered.
pub trait Observer: Send + Sync + 'static {
    /// `script` answered `result` after `took`.
    fn observe(&self, script: &'static str, took: Duration, result: Result<&Reply, &StoreError>);
}

/// `S`, each call timed and shown to `O`.
#[derive(Debug)]
pub struct Observed<S, O> {
    inner: S,
    observer: O,
}

impl<S, O> Observed<S, O> {
    /// `inner`, each call shown to `observer`.
    pub fn new(inner: S, observer: O) -> Self {
        Observed { inner, observer }
    }

    /// The store underneath.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S: Store, O: Observer> Store for Observed<S, O> {
    async fn load(&self, script: &Script) -> Result<(), StoreError> {
        self.inner.load(script).await
    }

    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        let start = Instant::now();
        let result = self.inner.eval(script, keys, args).await;
        self.observer.observe(script.name, start.elapsed(), result.as_ref());
        result
    }
}
