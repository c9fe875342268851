//! Attributes + policy + store → [`Decision`]. Plain Rust types only: the gRPC edge converts to and
//! from these, and nothing here knows about tonic.
//!
//! Everything that can be decided without the store is decided first (identity, model, bounds,
//! unsatisfiable size), so a bad request costs no round trip and can never charge anything.

pub mod body;
mod decision;
pub mod ids;

use std::sync::Arc;

pub use decision::{Admitted, Decision, Denial, Reason};

use crate::config::{Policy, TenantPolicy};
use crate::estimate::{self, PromptSize};
use crate::store::{
    CommitOutcome, Protocol, Refusal, ReleaseOutcome, RenewOutcome, ReserveCall, ReserveOutcome, ScopeLimits, Store,
    StoreError, keys,
};

/// Request priority tier (`x-priority`, or the tenant's default). As a pool fills, `sheddable` is
/// refused first, then `standard`; `critical` only when the pool truly cannot serve it. Ordered
/// from lowest to highest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    Sheddable,
    #[default]
    Standard,
    Critical,
}

impl Priority {
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Critical => "critical",
            Priority::Standard => "standard",
            Priority::Sheddable => "sheddable",
        }
    }
}

impl std::str::FromStr for Priority {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "critical" => Ok(Priority::Critical),
            "standard" => Ok(Priority::Standard),
            "sheddable" => Ok(Priority::Sheddable),
            other => Err(format!("priority {other:?} is not one of critical, standard, sheddable")),
        }
    }
}

/// One request, as admission sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attributes {
    /// Verified tenant identity; `None` when the request carried none.
    pub tenant: Option<String>,
    pub user: Option<String>,
    pub model: Option<String>,
    /// The claimed tier; `None` takes the tenant's default.
    pub priority: Option<Priority>,
    /// Relative deadline (ms).
    pub deadline_ms: Option<u64>,
    pub idempotency_key: Option<String>,
    pub prompt: PromptSize,
    /// The caller's output ceiling.
    pub max_tokens: Option<u64>,
    pub stream: bool,
}

/// A Commit / Renew / Release that could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    #[error("{0:?} is not a reservation id tollgate issued")]
    BadReservationId(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The admission service over a store.
#[derive(Debug)]
pub struct Admission<S> {
    policy: Arc<Policy>,
    protocol: Protocol<S>,
}

impl<S: Store> Admission<S> {
    pub fn new(policy: Arc<Policy>, protocol: Protocol<S>) -> Self {
        Admission { policy, protocol }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn protocol(&self) -> &Protocol<S> {
        &self.protocol
    }

    /// The reserve phase.
    pub async fn reserve(&self, a: &Attributes) -> Decision {
        match self.plan(a) {
            Ok(plan) => self.hold(plan).await,
            Err(denial) => Decision::Denied(denial),
        }
    }

    /// Checks everything that needs no store and works out what to hold where.
    fn plan<'a>(&'a self, a: &'a Attributes) -> Result<Plan<'a>, Denial> {
        use Reason::{InvalidRequest, Unauthenticated, Unsatisfiable};
        let header = &self.policy.server.tenant_header;
        let tenant = a
            .tenant
            .as_deref()
            .or(self.policy.anonymous_tenant.as_deref())
            .ok_or_else(|| Denial::now(Unauthenticated, format!("no tenant identity: {header} is missing")))?;
        ids::check_tenant(tenant).map_err(|e| Denial::now(InvalidRequest, format!("tenant id {e}")))?;
        let tp = self
            .policy
            .tenant(tenant)
            .ok_or_else(|| Denial::now(Unauthenticated, format!("tenant {tenant:?} has no policy")))?;
        if let Some(user) = &a.user {
            ids::check_user(user).map_err(|e| Denial::now(InvalidRequest, format!("user id {e}")))?;
        }
        if let Some(key) = &a.idempotency_key {
            ids::check_idempotency_key(key).map_err(|e| Denial::now(InvalidRequest, format!("idempotency-key {e}")))?;
        }
        let model_name = a.model.as_deref().ok_or_else(|| Denial::now(InvalidRequest, "the request names no model"))?;
        let model = self
            .policy
            .models
            .get(model_name)
            .ok_or_else(|| Denial::now(InvalidRequest, format!("model {model_name:?} is not served here")))?;
        if let Some(n) = a.max_tokens
            && (n == 0 || n > model.max_output_tokens)
        {
            return Err(Denial::now(
                InvalidRequest,
                format!("max_tokens {n} is outside 1..={} for model {model_name}", model.max_output_tokens),
            ));
        }

        let hold =
            estimate::prompt_tokens(a.prompt, model).saturating_add(estimate::output_reservation(a.max_tokens, model));
        let scopes = scopes(tenant, a.user.as_deref(), model_name, tp);
        for s in &scopes {
            if let Some(largest) = s.largest
                && hold > largest
            {
                return Err(Denial::now(
                    Unsatisfiable,
                    format!("request needs {hold} tokens but scope {} can never hold more than {largest}", s.label),
                ));
            }
        }
        Ok(Plan { tenant, tp, hold, scopes, attributes: a })
    }

    async fn hold(&self, plan: Plan<'_>) -> Decision {
        let id = ids::new_reservation_id(plan.tenant);
        let call = ReserveCall {
            tenant: plan.tenant,
            id: &id,
            hold: plan.hold,
            lease_ms: plan.tp.lease_ttl_ms,
            idle_ttl_ms: plan.tp.idle_ttl_ms,
            retention_ms: self.policy.record_retention_ms,
            expired_usage: plan.tp.expired_usage,
            sweep_batch: self.policy.sweep_batch,
            idempotency_key: plan.attributes.idempotency_key.as_deref(),
            max_attempts: self.policy.max_attempts,
            concurrency_retry_cap_ms: self.policy.concurrency_retry_ms,
            scopes: plan.scopes.iter().map(|s| (s.key.clone(), s.limits)).collect(),
        };
        match self.protocol.reserve(&call).await {
            Ok(ReserveOutcome::Admitted { id, held, attempts, headroom }) => {
                Decision::Admitted(Admitted { reservation_id: id, reserved_tokens: held, attempts, headroom })
            }
            Ok(ReserveOutcome::Denied { reason, scope, retry_after_ms, headroom }) => {
                let scope = plan.scopes.get(scope).map_or("?", |s| s.label.as_str());
                let (reason, message) = match reason {
                    Refusal::TokenRate => (Reason::TokenRate, format!("token rate limit of scope {scope} reached")),
                    Refusal::RequestRate => {
                        (Reason::RequestRate, format!("request rate limit of scope {scope} reached"))
                    }
                    Refusal::Concurrency => {
                        (Reason::Concurrency, format!("all concurrency slots of scope {scope} are held"))
                    }
                    Refusal::Budget => (Reason::Budget, format!("daily token budget of scope {scope} is spent")),
                    Refusal::Attempts => (
                        Reason::InvalidRequest,
                        format!("idempotency key used more than {} times", self.policy.max_attempts),
                    ),
                };
                let retry_after_ms = reason.retryable().then_some(retry_after_ms);
                Decision::Denied(Denial { reason, message, retry_after_ms, headroom })
            }
            Err(e) => {
                tracing::error!(error = %e, tenant = plan.tenant, "reserve failed; failing closed");
                Decision::Denied(Denial {
                    retry_after_ms: Some(1_000),
                    ..Denial::now(Reason::StoreUnavailable, "admission store unavailable")
                })
            }
        }
    }

    /// The commit phase: reconcile a hold against actual usage.
    pub async fn commit(
        &self,
        reservation_id: &str,
        prompt: u64,
        output: u64,
    ) -> Result<CommitOutcome, AdmissionError> {
        let tenant = tenant_of(reservation_id)?;
        Ok(self.protocol.commit(tenant, reservation_id, prompt, output).await?)
    }

    /// Extends a live hold's lease by `lease_ms` (0 = the tenant's lease TTL; never more than it).
    pub async fn renew(&self, reservation_id: &str, lease_ms: u64) -> Result<RenewOutcome, AdmissionError> {
        let tenant = tenant_of(reservation_id)?;
        let (ttl, idle) = match self.policy.tenant(tenant) {
            Some(tp) => (tp.lease_ttl_ms, tp.idle_ttl_ms),
            None => return Ok(RenewOutcome { state: "not_found".into(), lease_remaining_ms: 0 }),
        };
        let lease = if lease_ms == 0 { ttl } else { lease_ms.min(ttl) };
        Ok(self.protocol.renew(tenant, reservation_id, lease, idle).await?)
    }

    /// Gives a hold back without usage.
    pub async fn release(&self, reservation_id: &str) -> Result<ReleaseOutcome, AdmissionError> {
        let tenant = tenant_of(reservation_id)?;
        Ok(self.protocol.release(tenant, reservation_id).await?)
    }
}

struct Plan<'a> {
    tenant: &'a str,
    tp: &'a TenantPolicy,
    hold: u64,
    scopes: Vec<Scope>,
    attributes: &'a Attributes,
}

/// One scope a request charges.
struct Scope {
    /// For messages: `tenant`, `user alice`, `model gpt-4o`.
    label: String,
    key: String,
    limits: ScopeLimits,
    largest: Option<u64>,
}

/// The scopes a request charges: the tenant, then its user and model where the policy limits them.
fn scopes(tenant: &str, user: Option<&str>, model: &str, tp: &TenantPolicy) -> Vec<Scope> {
    let scope = |label: String, key: String, limits: &crate::config::Limits| Scope {
        label,
        key,
        limits: limits.scope_limits(),
        largest: limits.largest_admissible(),
    };
    let mut out = vec![scope("tenant".into(), keys::tenant_scope(tenant), &tp.limits)];
    if let Some(user) = user
        && let Some(limits) = tp.user_limits(user)
    {
        out.push(scope(format!("user {user}"), keys::user_scope(tenant, user), limits));
    }
    if let Some(limits) = tp.models.get(model) {
        out.push(scope(format!("model {model}"), keys::model_scope(tenant, model), limits));
    }
    out
}

fn tenant_of(reservation_id: &str) -> Result<&str, AdmissionError> {
    ids::parse_reservation_id(reservation_id)
        .ok_or_else(|| AdmissionError::BadReservationId(reservation_id.to_string()))
}
