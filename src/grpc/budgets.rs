//! The `tollgate.v1.Budgets` service: every limit and budget of a tenant's scopes, with what the
//! store has counted against each, for a platform team (and grpcurl); and adjustments of a period
//! budget, for the identities the policy allows.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::admission::{Adjusted, Adjustment, Admission, ScopeBudget};
use crate::hold::{BudgetKey, Measure};
use crate::proto::budgets_server;
use crate::proto::{
    AdjustBudgetRequest, AdjustBudgetResponse, GetBudgetsRequest, GetBudgetsResponse, LimitState, ScopeBudgets,
};
use crate::store::Store;
use crate::store::phase::budget::BucketLevel;

#[derive(Debug)]
pub struct BudgetsService<S> {
    admission: Arc<Admission<S>>,
}

impl<S> BudgetsService<S> {
    pub fn new(admission: Arc<Admission<S>>) -> Self {
        BudgetsService { admission }
    }
}

fn non_empty(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

#[tonic::async_trait]
impl<S: Store> budgets_server::Budgets for BudgetsService<S> {
    #[tracing::instrument(name = "budgets_get", skip_all)]
    async fn get(&self, request: Request<GetBudgetsRequest>) -> Result<Response<GetBudgetsResponse>, Status> {
        let r = request.into_inner();
        let scopes = self
            .admission
            .budgets(&r.tenant, non_empty(&r.user), non_empty(&r.model))
            .await
            .map_err(super::admission::status)?;
        let scopes = scopes.iter().map(|s| ScopeBudgets { scope: s.scope.clone(), limits: limit_states(s) }).collect();
        Ok(Response::new(GetBudgetsResponse { scopes }))
    }

    #[tracing::instrument(name = "budgets_adjust", skip_all)]
    async fn adjust(&self, request: Request<AdjustBudgetRequest>) -> Result<Response<AdjustBudgetResponse>, Status> {
        let admins = self.admission.policy().server.budget_admins.clone();
        let by = caller(&request, &admins).ok_or_else(|| {
            Status::permission_denied("only the identities server.budget_admins names may adjust budgets")
        })?;
        let r = request.into_inner();
        let budget = BudgetKey::from_name(&r.budget).ok_or_else(|| {
            Status::invalid_argument(format!(
                "budget {:?} is not a period budget: tokens_, input_tokens_, output_tokens_ or cost_, then per_hour, per_day, per_week or per_month",
                r.budget
            ))
        })?;
        if r.request_id.is_empty() {
            return Err(Status::invalid_argument("an adjustment needs a request_id, so that it is made once"));
        }
        let adjustment = Adjustment {
            tenant: &r.tenant,
            user: non_empty(&r.user),
            model: non_empty(&r.model),
            budget,
            credit: if r.reset { 0 } else { r.amount },
            reset: r.reset,
            request_id: &r.request_id,
            by: &by,
            why: &r.reason,
        };
        let (state, before, after) =
            match self.admission.adjust_budget(&adjustment).await.map_err(super::admission::status)? {
                Adjusted::Applied { before, after } => ("adjusted", before, after),
                Adjusted::Repeated { before, after } => ("repeated", before, after),
                Adjusted::Conflict => {
                    return Err(Status::already_exists(format!(
                        "request_id {:?} was first used for another adjustment",
                        r.request_id
                    )));
                }
            };
        tracing::info!(tenant = %r.tenant, budget = %budget.name(), amount = r.amount, reset = r.reset, by = %by, state, before, after, "budget adjusted");
        Ok(Response::new(AdjustBudgetResponse { state: state.into(), counted_before: before, counted_after: after }))
    }
}

/// The entry of `server.budget_admins` that admits a caller on a loopback address.
const LOOPBACK: &str = "loopback";

/// Who is calling, if `admins` allows them: the first identity of their client certificate that
/// `admins` names, or `loopback` for a caller on a loopback address when `admins` names it.
fn caller<T>(request: &Request<T>, admins: &[String]) -> Option<String> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let tls = request.extensions().get::<TlsConnectInfo<TcpConnectInfo>>();
    if let Some(certs) = tls.and_then(TlsConnectInfo::peer_certs) {
        // (`loopback` is a place, never a certificate's name.)
        let named =
            certs.iter().flat_map(|c| super::tls::identities(c)).find(|id| id != LOOPBACK && admins.contains(id));
        if named.is_some() {
            return named;
        }
    }
    let addr = request.remote_addr().or_else(|| tls.and_then(|t| t.get_ref().remote_addr()));
    let local = addr.is_some_and(|a| a.ip().is_loopback());
    (local && admins.iter().any(|a| a == LOOPBACK)).then(|| LOOPBACK.to_string())
}

/// A scope's limits, each with what the store counted against it, in the policy's names.
pub fn limit_states(s: &ScopeBudget) -> Vec<LimitState> {
    let (l, u) = (&s.limits, &s.used);
    let mut limits = Vec::new();
    let bucket = |name: &str, unit: &str, capacity: u64, b: BucketLevel| LimitState {
        name: name.into(),
        unit: unit.into(),
        limit: capacity,
        used: u64::try_from(i128::from(capacity) - i128::from(b.level)).unwrap_or(0),
        held: 0,
        remaining: b.level,
        resets_in_ms: b.full_in_ms,
    };
    if let Some(t) = l.tokens {
        limits.push(bucket("tokens_per_minute", "tokens", t.capacity.get(), u.tokens));
    }
    if let Some(b) = l.input {
        limits.push(bucket("input_tokens_per_minute", "tokens", b.capacity.get(), u.input));
    }
    if let Some(b) = l.output {
        limits.push(bucket("output_tokens_per_minute", "tokens", b.capacity.get(), u.output));
    }
    if let Some(r) = l.requests {
        limits.push(bucket("requests_per_minute", "requests", r.capacity.get(), u.requests));
    }
    if let Some(most) = l.max_concurrency {
        limits.push(LimitState {
            name: "max_concurrency".into(),
            unit: "holds".into(),
            limit: most.get(),
            used: u.in_flight,
            held: u.in_flight,
            remaining: signed(most.get()) - signed(u.in_flight),
            resets_in_ms: 0,
        });
    }
    for key in BudgetKey::all() {
        let Some(limit) = l.budget(key) else { continue };
        let period = u.period(key);
        limits.push(LimitState {
            name: key.name(),
            unit: if key.measure == Measure::Cost { "nanos" } else { "tokens" }.into(),
            limit: limit.get(),
            used: period.counted,
            held: period.held,
            remaining: signed(limit.get()) - signed(period.counted),
            resets_in_ms: period.ends_in_ms,
        });
    }
    limits
}

fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
