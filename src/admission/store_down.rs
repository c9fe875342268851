//! When the store cannot be reached: each tenant's `on_store_error` refuses, admits unmetered, or
//! admits within this replica's share of its limits (`local`), the share counted by heartbeats.

// Token arithmetic: no unchecked +, -, * (see Cargo.toml's [lints] for the casts).
#![warn(clippy::arithmetic_side_effects)]

use super::denials::refusal_reason;
use super::plan::Plan;
use super::{Admission, AdmissionError, Decision, Denial, Unmetered};
use crate::config::OnStoreError;
use crate::metrics::Outcome;
use crate::store::{COMPACT_RECORD, Heard, Store};
use std::sync::atomic::Ordering;

/// How often a replica says it is alive, and how long it counts after its last heartbeat.
pub const HEARTBEAT_MS: u64 = 1_000;
pub const HEARTBEAT_TTL_MS: u64 = 3 * HEARTBEAT_MS;
/// How long a replica that reads only an older record form is remembered after the last heartbeat
/// that heard it: longer than a pod's restart or its crash-loop back-off (Kubernetes waits 5
/// minutes at most).
pub const OLDER_REPLICA_MEMORY_MS: u64 = 15 * 60 * 1_000;

impl<S: Store> Admission<S> {
    /// Says this replica is alive, and counts the replicas on the store, for `on_store_error:
    /// local`, and learns whether every one of them reads compact records, none that does not
    /// heard for [`OLDER_REPLICA_MEMORY_MS`] (then this one's reserves write them). A store that
    /// does not answer keeps the last count, and records are written in full until a heartbeat
    /// is answered again.
    pub async fn heartbeat(&self) -> Result<Heard, AdmissionError> {
        let heard = self.protocol.heartbeat(&self.replica, HEARTBEAT_TTL_MS, OLDER_REPLICA_MEMORY_MS).await;
        let compact = matches!(heard, Ok(h) if h.record_form >= COMPACT_RECORD);
        match (self.compact_records.swap(compact, Ordering::Relaxed), compact, &heard) {
            (false, true, _) => tracing::info!("every replica heard reads compact reservation records: writing them"),
            (true, false, Ok(_)) => {
                tracing::info!("a replica that reads only full reservation records was heard: writing them in full");
            }
            (true, false, Err(_)) => {
                tracing::info!("a heartbeat failed: writing reservation records in full until one is answered");
            }
            _ => {}
        }
        let heard = heard?;
        self.local.counted(heard.replicas);
        Ok(heard)
    }

    /// Whether this replica's reserves write compact records: its last heartbeat heard only
    /// replicas that read them.
    pub fn writes_compact_records(&self) -> bool {
        self.compact_records.load(Ordering::Relaxed)
    }

    /// The replicas this one last counted.
    pub fn replicas(&self) -> u64 {
        self.local.replicas()
    }

    /// Heartbeats every [`HEARTBEAT_MS`] until `shutdown`.
    pub async fn run_heartbeat(&self, shutdown: tokio_util::sync::CancellationToken) {
        let mut ticks = tokio::time::interval(std::time::Duration::from_millis(HEARTBEAT_MS));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {
                    if let Err(e) = self.heartbeat().await {
                        tracing::debug!(error = %e, replicas = self.replicas(), "heartbeat failed; keeping the last count");
                    }
                }
                () = shutdown.cancelled() => break,
            }
        }
    }

    /// What a reserve's answer said each scope's daily budget has left, kept for the local share
    /// of a tenant whose store-down mode is `local`.
    pub(super) fn saw_budgets(&self, plan: &Plan, left: &[Option<u64>]) {
        if plan.tp.on_store_error != OnStoreError::Local {
            return;
        }
        if left.iter().all(Option::is_none) {
            return;
        }
        let day = self.clock.now_ms() / crate::hold::DAY_MS;
        let seen = plan.scopes.iter().zip(left).filter_map(|(scope, left)| left.map(|l| (scope.key.as_str(), l)));
        self.local.saw_budgets(day, seen);
    }

    /// A store failure, under the tenant's `on_store_error`: refuse, or admit unmetered.
    pub(super) fn on_store_error(&self, plan: &Plan, denial: Denial) -> Decision {
        let decision = self.by_store_down_mode(plan, denial);
        let outcome = match &decision {
            Decision::Admitted(_) => Outcome::Admitted,
            Decision::Unmetered(_) => Outcome::Unmetered,
            Decision::Denied(_) => Outcome::Denied,
        };
        self.metrics.degraded(&plan.tenant, plan.tp.on_store_error.as_str(), outcome);
        decision
    }

    pub(super) fn by_store_down_mode(&self, plan: &Plan, denial: Denial) -> Decision {
        match plan.tp.on_store_error {
            OnStoreError::FailClosed => Decision::Denied(denial),
            OnStoreError::FailOpen => {
                tracing::warn!(tenant = %plan.tenant, "store unavailable; admitting unmetered (fail_open)");
                Decision::Unmetered(Unmetered::StoreUnavailable)
            }
            OnStoreError::Local => {
                let scopes = plan.scopes.iter().map(|s| (s.key.as_str(), &s.limits));
                let hold = plan.prompt.saturating_add(plan.ceiling);
                match self.local.admit(scopes, hold, std::time::Instant::now(), self.clock.now_ms()) {
                    Ok(()) => {
                        tracing::debug!(tenant = %plan.tenant, "store unavailable; admitted within the local share");
                        Decision::Unmetered(Unmetered::StoreUnavailable)
                    }
                    Err(refusal) => {
                        let scope = plan.scopes.get(refusal.scope).map_or("?", |s| s.label.as_str());
                        let (reason, message) = refusal_reason(refusal.reason, scope, plan.policy.max_attempts);
                        Decision::Denied(Denial {
                            retry_after_ms: Some(refusal.retry_after_ms),
                            ..Denial::now(
                                reason,
                                format!("{message}: this replica's share while the store is unreachable"),
                            )
                        })
                    }
                }
            }
        }
    }
}
