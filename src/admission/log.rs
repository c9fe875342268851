//! One log line per decision, for operators to search: at debug level under the target
//! `decision`, so `--log info,decision=debug` turns it on without the rest of the debug output.
//! Its field names are stable (docs/operations.md, "Logs"): `tenant`, `user`, `model`, `outcome`,
//! `reason`, `reservation_id`, `reserved_tokens`, `retry_after_ms`, `store_mode`, `latency_ms`.

use std::time::Duration;

use super::{Attributes, Decision, Denial};
use crate::config::{OnStoreError, Policy};

/// Where a decision was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreMode {
    /// By the store's scripts.
    Store,
    /// From this replica's lease, without a store call.
    Lease,
    /// The store could not be reached: the tenant's `on_store_error` decided.
    Unreachable(OnStoreError),
    /// Without the store: a request that costs nothing, or one refused before any limit was read
    /// (no tenant, an unknown model).
    NotNeeded,
}

impl StoreMode {
    /// As the log's `store_mode` says it.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreMode::Store => "store",
            StoreMode::Lease => "lease",
            StoreMode::Unreachable(mode) => mode.as_str(),
            StoreMode::NotNeeded => "none",
        }
    }
}

/// Writes the decision's line (when the filter lets `decision` debug lines through).
pub fn decision(policy: &Policy, a: &Attributes, decision: &Decision, store: StoreMode, took: Duration) {
    if !tracing::enabled!(target: "decision", tracing::Level::DEBUG) {
        return;
    }
    let (outcome, reason, reservation_id, reserved_tokens, retry_after_ms) = match decision {
        Decision::Admitted(ok) => (
            if ok.shadow.is_some() { "shadow" } else { "admitted" },
            ok.shadow.map_or("ok", |would| would.code()),
            Some(ok.reservation_id.as_str()),
            Some(ok.reserved_tokens),
            None,
        ),
        Decision::Unmetered(why) => ("unmetered", why.code(), None, None, None),
        Decision::Denied(no) => ("denied", no.reason.code(), None, None, no.retry_after_ms),
    };
    tracing::debug!(
        target: "decision",
        tenant = a.tenant.as_deref().or(policy.anonymous_tenant.as_deref()),
        user = a.user.as_deref(),
        model = a.model.as_deref(),
        outcome,
        reason,
        reservation_id,
        reserved_tokens,
        retry_after_ms,
        store_mode = store.as_str(),
        latency_ms = millis(took),
        "decision"
    );
}

/// Writes the line of a request refused before admission could read it (a body that is not JSON,
/// a header that is not UTF-8 or too long): nothing is known of it but the reason, and why.
pub fn refused_unread(denial: &Denial, took: Duration) {
    tracing::debug!(
        target: "decision",
        outcome = "denied",
        reason = denial.reason.code(),
        store_mode = StoreMode::NotNeeded.as_str(),
        latency_ms = millis(took),
        detail = %denial.message,
        "decision"
    );
}

/// A duration in milliseconds, to the microsecond.
fn millis(took: Duration) -> f64 {
    (took.as_secs_f64() * 1e6).round() / 1e3
}
