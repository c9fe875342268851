//! A store that times its calls: `Measured<S>` records each script call's latency and failures,
//! and whether the store last answered (`tollgate.store.available`, 1 or 0). It sits outside the
//! circuit breaker, so a call the open breaker refused at once counts as the failure it is.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use opentelemetry::KeyValue;
use opentelemetry::metrics::ObservableGauge;

use super::Metrics;
use crate::store::{Reply, Script, Store, StoreError};

/// `S`, timed.
pub struct Measured<S> {
    inner: S,
    metrics: Metrics,
    available: Arc<AtomicBool>,
    _gauge: ObservableGauge<u64>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Measured<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Measured").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<S> Measured<S> {
    /// Times `inner` into `metrics`, and reports on `meter` whether the store answers.
    pub fn new(inner: S, metrics: Metrics, meter: &opentelemetry::metrics::Meter) -> Self {
        let available = Arc::new(AtomicBool::new(true));
        let seen = Arc::clone(&available);
        let gauge = meter
            .u64_observable_gauge("tollgate.store.available")
            .with_description("1 while the store's last call reached it, 0 while calls fail")
            .with_callback(move |o| o.observe(u64::from(seen.load(Ordering::Relaxed)), &[]))
            .build();
        Measured { inner, metrics, available, _gauge: gauge }
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }
}

fn error_kind(e: &StoreError) -> &'static str {
    match e {
        StoreError::Unavailable(_) => "unavailable",
        StoreError::Script { .. } => "script",
        StoreError::BadReply { .. } => "bad_reply",
    }
}

impl<S: Store> Store for Measured<S> {
    async fn load(&self, script: &Script) -> Result<(), StoreError> {
        self.inner.load(script).await
    }

    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        let start = Instant::now();
        let result = self.inner.eval(script, keys, args).await;
        let took = start.elapsed().as_secs_f64();
        if !self.metrics.enabled() {
            self.available.store(!matches!(&result, Err(e) if e.is_transient()), Ordering::Relaxed);
            return result;
        }
        let name = KeyValue::new("script", script.name);
        match &result {
            Ok(_) => {
                self.available.store(true, Ordering::Relaxed);
                self.metrics.store_duration.record(took, &[name, KeyValue::new("result", "ok")]);
            }
            Err(e) => {
                // A script error is an answer: the store is there.
                self.available.store(!e.is_transient(), Ordering::Relaxed);
                self.metrics.store_duration.record(took, &[name.clone(), KeyValue::new("result", "error")]);
                self.metrics.store_errors.add(1, &[name, KeyValue::new("error", error_kind(e))]);
            }
        }
        result
    }
}
