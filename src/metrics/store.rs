//! The store's calls, counted: [`StoreCalls`] observes every script call ([`Observed`]) and records
//! its latency and failures, and whether the store last answered (`tollgate.store.available`, 1 or
//! 0). It sits outside the circuit breaker, so a call the open breaker refused at once counts as
//! the failure it is.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::ObservableGauge;

use super::Metrics;
use crate::store::observed::{Observed, Observer};
use crate::store::{Reply, StoreError};

/// `S`, timed into the metrics.
pub type Measured<S> = Observed<S, StoreCalls>;

/// What the metrics keep of store calls.
pub struct StoreCalls {
    metrics: Metrics,
    available: Arc<AtomicBool>,
    _gauge: ObservableGauge<u64>,
}

impl std::fmt::Debug for StoreCalls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreCalls").finish_non_exhaustive()
    }
}

impl StoreCalls {
    /// Times calls into `metrics`, and reports on `meter` whether the store answers.
    pub fn new(metrics: Metrics, meter: &opentelemetry::metrics::Meter) -> Self {
        let available = Arc::new(AtomicBool::new(true));
        let seen = Arc::clone(&available);
        let gauge = meter
            .u64_observable_gauge("tollgate.store.available")
            .with_description("1 while the store's last call reached it, 0 while calls fail")
            .with_callback(move |o| o.observe(u64::from(seen.load(Ordering::Relaxed)), &[]))
            .build();
        StoreCalls { metrics, available, _gauge: gauge }
    }
}

/// `inner`, its calls timed into `metrics`.
pub fn measured<S>(inner: S, metrics: Metrics, meter: &opentelemetry::metrics::Meter) -> Measured<S> {
    Observed::new(inner, StoreCalls::new(metrics, meter))
}

fn error_kind(e: &StoreError) -> &'static str {
    match e {
        StoreError::Unavailable(_) => "unavailable",
        StoreError::Script { .. } => "script",
        StoreError::BadReply { .. } => "bad_reply",
    }
}

impl Observer for StoreCalls {
    fn observe(&self, script: &'static str, took: Duration, result: Result<&Reply, &StoreError>) {
        // A script error is an answer: the store is there.
        self.available.store(!matches!(result, Err(e) if e.is_transient()), Ordering::Relaxed);
        if !self.metrics.enabled() {
            return;
        }
        let took = took.as_secs_f64();
        let name = KeyValue::new("script", script);
        match result {
            Ok(_) => self.metrics.store_duration.record(took, &[name, KeyValue::new("result", "ok")]),
            Err(e) => {
                self.metrics.store_duration.record(took, &[name.clone(), KeyValue::new("result", "error")]);
                self.metrics.store_errors.add(1, &[name, KeyValue::new("error", error_kind(e))]);
            }
        }
    }
}
