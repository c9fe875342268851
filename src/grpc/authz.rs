//! Envoy ext_authz `Check` = the reserve phase. This file only translates: `CheckRequest` →
//! [`Attributes`], and the decision back through [`super::response`].

use std::sync::Arc;

use envoy_types::pb::envoy::service::auth::v3::{
    AttributeContext, CheckRequest, CheckResponse, attribute_context::HttpRequest, authorization_server::Authorization,
};
use tonic::{Request, Response, Status};

use super::response::check_response;
use crate::admission::{Admission, Attributes, Decision, Denial, Reason, body};
use crate::estimate::PromptSize;
use crate::store::Store;

/// Envoy sets this when it sent only the first bytes of the body.
const PARTIAL_BODY_HEADER: &str = "x-envoy-auth-partial-body";
/// Names the model when the body cannot: OpenAI's Python SDK sends `messages` before `model`, so a
/// body cut at `max_request_bytes` may end before the model. Used only when the body has none.
pub const MODEL_HEADER: &str = "x-tollgate-model";

/// The `envoy.service.auth.v3.Authorization` service.
#[derive(Debug)]
pub struct AuthzService<S> {
    admission: Arc<Admission<S>>,
}

impl<S> AuthzService<S> {
    pub fn new(admission: Arc<Admission<S>>) -> Self {
        AuthzService { admission }
    }
}

#[tonic::async_trait]
impl<S: Store> Authorization for AuthzService<S> {
    #[tracing::instrument(name = "check", skip_all, fields(tenant, reason))]
    async fn check(&self, request: Request<CheckRequest>) -> Result<Response<CheckResponse>, Status> {
        let header = &self.admission.policy().server.tenant_header;
        let decision = match attributes(request.get_ref(), header) {
            Ok(a) => {
                let d = self.admission.reserve(&a).await;
                log_decision(&a, &d);
                d
            }
            Err(denial) => {
                tracing::debug!(reason = denial.reason.code(), message = %denial.message, "check refused before reserve");
                Decision::Denied(denial)
            }
        };
        Ok(Response::new(check_response(&decision)))
    }
}

fn log_decision(a: &Attributes, d: &Decision) {
    let span = tracing::Span::current();
    span.record("tenant", a.tenant.as_deref());
    if let Decision::Denied(no) = d {
        span.record("reason", no.reason.code());
    }
    match d {
        Decision::Admitted(ok) => tracing::debug!(
            tenant = a.tenant.as_deref(),
            reservation = %ok.reservation_id,
            tokens = ok.reserved_tokens,
            "admitted"
        ),
        Decision::Denied(no) => tracing::debug!(
            tenant = a.tenant.as_deref(),
            reason = no.reason.code(),
            retry_after_ms = no.retry_after_ms,
            "denied"
        ),
    }
}

/// A header by its lower-case name, from either of the two places Envoy may put headers.
fn header<'a>(http: &'a HttpRequest, name: &str) -> Option<&'a str> {
    if let Some(v) = http.headers.get(name) {
        return Some(v.as_str());
    }
    let map = http.header_map.as_ref()?;
    map.headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .and_then(|h| if h.value.is_empty() { std::str::from_utf8(&h.raw_value).ok() } else { Some(h.value.as_str()) })
}

/// Reads the attributes of a Check request; a request that cannot be read is refused here.
pub fn attributes(request: &CheckRequest, tenant_header: &str) -> Result<Attributes, Denial> {
    let invalid = |m: String| Denial::now(Reason::InvalidRequest, m);
    let http = request
        .attributes
        .as_ref()
        .and_then(|a: &AttributeContext| a.request.as_ref())
        .and_then(|r| r.http.as_ref())
        .ok_or_else(|| invalid("check request carries no HTTP request".into()))?;

    let text = |name: &str| header(http, name).map(str::trim).filter(|v| !v.is_empty()).map(str::to_string);
    let number = |name: &str| -> Result<Option<u64>, Denial> {
        match header(http, name).map(str::trim) {
            None | Some("") => Ok(None),
            Some(v) => {
                v.parse::<u64>().map(Some).map_err(|_| invalid(format!("{name} {v:?} is not a non-negative integer")))
            }
        }
    };

    let body_bytes: &[u8] = if http.raw_body.is_empty() { http.body.as_bytes() } else { &http.raw_body };
    let partial = header(http, PARTIAL_BODY_HEADER).is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let fields = body::parse(body_bytes, partial).map_err(|e| invalid(e.0))?;
    let declared = number("content-length")?.unwrap_or(0);
    let size = (http.size.max(0) as u64).max(declared).max(body_bytes.len() as u64);

    let model = match (fields.model, text(MODEL_HEADER)) {
        (Some(model), _) | (None, Some(model)) => Some(model),
        (None, None) if partial => {
            return Err(invalid(format!(
                "no model in the first {} bytes of the body Envoy sent; send {MODEL_HEADER}, put \"model\" first, \
                 or raise the ext_authz filter's max_request_bytes",
                body_bytes.len()
            )));
        }
        (None, None) => None,
    };
    let priority = text("x-priority").map(|p| p.parse()).transpose().map_err(invalid)?;
    Ok(Attributes {
        tenant: text(tenant_header),
        user: text("x-user-id"),
        model,
        priority,
        deadline_ms: number("x-request-deadline-ms")?,
        idempotency_key: text("idempotency-key"),
        prompt: PromptSize::Bytes(size),
        max_tokens: fields.max_tokens,
        stream: fields.stream,
    })
}
