//! The `tollgate.v1.Admission` service: Reserve for callers not behind Envoy, and the phases
//! ext_authz cannot carry (Commit, Renew, Release).

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::headers;
use crate::admission::{Admission, AdmissionError, Attributes, Decision, IdempotencyKey, KeyRepeat};
use crate::estimate::PromptSize;
use crate::hold::{CommitOutcome, Counted, Detail, Ending, ReleaseOutcome, RenewOutcome};
use crate::proto::admission_server;
use crate::proto::{
    CommitRequest, CommitResponse, OutputEstimateRequest, OutputEstimateResponse, PoolSpeeds, PoolStatusRequest,
    PoolStatusResponse, ReleaseRequest, ReleaseResponse, RenewRequest, RenewResponse, ReserveRequest, ReserveResponse,
};
use crate::store::Store;

#[derive(Debug)]
pub struct AdmissionService<S> {
    admission: Arc<Admission<S>>,
}

impl<S> AdmissionService<S> {
    pub fn new(admission: Arc<Admission<S>>) -> Self {
        AdmissionService { admission }
    }
}

pub(super) fn status(e: AdmissionError) -> Status {
    match e {
        AdmissionError::BadReservationId(_) | AdmissionError::BadName(_) | AdmissionError::TooLarge { .. } => {
            Status::invalid_argument(e.to_string())
        }
        AdmissionError::Store(s) if s.is_transient() => Status::unavailable(s.to_string()),
        AdmissionError::Store(s) => Status::internal(s.to_string()),
    }
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

#[tonic::async_trait]
impl<S: Store> admission_server::Admission for AdmissionService<S> {
    #[tracing::instrument(name = "reserve", skip_all)]
    async fn reserve(&self, request: Request<ReserveRequest>) -> Result<Response<ReserveResponse>, Status> {
        let wait_ms = headers::caller_wait_ms(request.metadata());
        let r = request.into_inner();
        let priority = non_empty(r.priority).map(|p| p.parse()).transpose().map_err(Status::invalid_argument)?;
        let attributes = Attributes {
            tenant: non_empty(r.tenant),
            plan: non_empty(r.plan),
            user: non_empty(r.user),
            model: non_empty(r.model),
            priority,
            deadline_ms: (r.deadline_ms > 0).then_some(r.deadline_ms),
            wait_ms,
            // A caller repeating a Reserve lost its answer: it gets the same hold back.
            idempotency: non_empty(r.idempotency_key).map(|key| IdempotencyKey { key, repeat: KeyRepeat::ReturnHold }),
            prompt: if r.prompt_tokens > 0 {
                PromptSize::Tokens(r.prompt_tokens)
            } else {
                PromptSize::Bytes(r.prompt_bytes)
            },
            max_tokens: (r.max_tokens > 0).then_some(r.max_tokens),
            stream: false,
            input_only: false,
            outputs: 1,
        };
        let reply = match self.admission.reserve(&attributes).await {
            Decision::Admitted(a) => {
                let tokens = a.headroom.tokens;
                ReserveResponse {
                    admitted: true,
                    reservation_id: a.reservation_id,
                    reserved_tokens: a.reserved_tokens,
                    http_status: 200,
                    attempts: u64::from(a.attempts),
                    replayed: a.replayed,
                    remaining_tokens: tokens.map_or(-1, |w| w.remaining),
                    limit_tokens: tokens.map_or(0, |w| w.limit),
                    reset_tokens_ms: tokens.map_or(0, |w| w.reset_ms),
                    shadow_reason: a.shadow.map(|r| r.code().to_string()).unwrap_or_default(),
                    soft_limit: a.soft_limit.map(|b| b.name()).unwrap_or_default(),
                    tier: a.tier.as_str().to_string(),
                    ..Default::default()
                }
            }
            Decision::Unmetered(_) => ReserveResponse {
                admitted: true,
                unmetered: true,
                http_status: 200,
                attempts: 1,
                remaining_tokens: -1,
                ..Default::default()
            },
            Decision::Denied(d) => {
                let tokens = d.headroom.tokens;
                ReserveResponse {
                    admitted: false,
                    reason: d.reason.code().to_string(),
                    http_status: u32::from(d.reason.http_status()),
                    retry_after_ms: d.retry_after_ms.unwrap_or(0),
                    should_retry: d.should_retry(),
                    message: d.message,
                    remaining_tokens: tokens.map_or(-1, |w| w.remaining),
                    limit_tokens: tokens.map_or(0, |w| w.limit),
                    reset_tokens_ms: tokens.map_or(0, |w| w.reset_ms),
                    ..Default::default()
                }
            }
        };
        Ok(Response::new(reply))
    }

    #[tracing::instrument(name = "commit", skip_all)]
    async fn commit(&self, request: Request<CommitRequest>) -> Result<Response<CommitResponse>, Status> {
        let r = request.into_inner();
        let detail = Detail {
            cache_read: r.cache_read_tokens,
            cache_write: r.cache_write_tokens,
            reasoning: r.reasoning_tokens,
        };
        let counted = Counted::Exact { prompt: r.prompt_tokens, output: r.completion_tokens, detail };
        let o = self.admission.commit_counted(&r.reservation_id, counted).await.map_err(status)?;
        match &o {
            CommitOutcome::NotFound => {
                Err(Status::not_found(format!("reservation {} is unknown or long settled", r.reservation_id)))
            }
            CommitOutcome::Released => Err(Status::failed_precondition(format!(
                "reservation {} was released; it cannot be committed",
                r.reservation_id
            ))),
            CommitOutcome::Forwarded => {
                tracing::debug!(reservation = %r.reservation_id, "commit forwarded to the replica that holds it");
                Ok(Response::new(CommitResponse { state: o.state().to_string(), ..Default::default() }))
            }
            CommitOutcome::Committed(u) => {
                tracing::debug!(reservation = %r.reservation_id, state = o.state(), used = u.used, duplicate = u.duplicate, "committed");
                Ok(Response::new(CommitResponse {
                    state: o.state().to_string(),
                    duplicate: u.duplicate,
                    used_tokens: u.used,
                    reserved_tokens: u.held,
                    refunded_tokens: u.refunded,
                    overrun_tokens: u.overrun,
                    metered: u.metered,
                    ending: u.ending.map_or("", Ending::as_str).to_string(),
                }))
            }
        }
    }

    #[tracing::instrument(name = "renew", skip_all)]
    async fn renew(&self, request: Request<RenewRequest>) -> Result<Response<RenewResponse>, Status> {
        let r = request.into_inner();
        let o = self.admission.renew(&r.reservation_id, r.lease_ms).await.map_err(status)?;
        let lease_remaining_ms = match o {
            RenewOutcome::NotFound => {
                return Err(Status::not_found(format!("reservation {} is unknown", r.reservation_id)));
            }
            RenewOutcome::Renewed { lease_remaining_ms } => lease_remaining_ms,
            RenewOutcome::Settled(_) | RenewOutcome::Forwarded => 0,
        };
        Ok(Response::new(RenewResponse { state: o.state().to_string(), lease_remaining_ms }))
    }

    #[tracing::instrument(name = "release", skip_all)]
    async fn release(&self, request: Request<ReleaseRequest>) -> Result<Response<ReleaseResponse>, Status> {
        let r = request.into_inner();
        let o = self.admission.release(&r.reservation_id).await.map_err(status)?;
        let (refunded_tokens, duplicate) = match o {
            ReleaseOutcome::NotFound => {
                return Err(Status::not_found(format!("reservation {} is unknown", r.reservation_id)));
            }
            ReleaseOutcome::Released { refunded, repeated } => (refunded, repeated),
            ReleaseOutcome::Settled(_) | ReleaseOutcome::Forwarded => (0, false),
        };
        Ok(Response::new(ReleaseResponse { state: o.state().to_string(), refunded_tokens, duplicate }))
    }

    #[tracing::instrument(name = "pool_status", skip_all)]
    async fn pool_status(&self, request: Request<PoolStatusRequest>) -> Result<Response<PoolStatusResponse>, Status> {
        let pool = request.into_inner().pool;
        let crate::admission::PoolStatus { load: v, provider } =
            self.admission.pool_status(&pool).await.map_err(status)?;
        let speeds = self.admission.pool_speeds(&pool).map_err(status)?;
        Ok(Response::new(PoolStatusResponse {
            holds: v.holds,
            work_ms: v.work_ms,
            kv_tokens: v.kv_tokens,
            share: v.share,
            resumes_in_ms: v.resumes_in_ms,
            speeds: speeds
                .into_iter()
                .map(|(model, s)| PoolSpeeds {
                    model,
                    prefill_tokens_per_second: s.prefill_tokens_per_second(),
                    decode_tokens_per_second: s.decode_tokens_per_second(),
                    prefill_samples: s.prefill.samples,
                    decode_samples: s.decode.samples,
                })
                .collect(),
            provider: provider.as_ref().map(super::budgets::limit_states).unwrap_or_default(),
        }))
    }

    #[tracing::instrument(name = "output_estimate", skip_all)]
    async fn output_estimate(
        &self,
        request: Request<OutputEstimateRequest>,
    ) -> Result<Response<OutputEstimateResponse>, Status> {
        let r = request.into_inner();
        let view = self.admission.output_estimate(&r.tenant, &r.model).await.map_err(status)?;
        let policy = self.admission.policy();
        let adaptive = self.admission.tenant_policy(&policy, &r.tenant).and_then(|t| t.adaptive_output);
        Ok(Response::new(OutputEstimateResponse {
            samples: view.samples,
            quantile: adaptive.map_or(0.0, |a| a.quantile),
            reserved_output_tokens: view.quantile_tokens,
            in_use: adaptive.is_some_and(|a| view.samples >= a.min_samples),
            used_tokens: view.used_tokens,
            overrun_tokens: view.overrun_tokens,
            overrun_ratio: if view.used_tokens == 0 {
                0.0
            } else {
                view.overrun_tokens as f64 / view.used_tokens as f64
            },
        }))
    }
}
