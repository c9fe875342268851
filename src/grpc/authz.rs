//! Envoy ext_authz `Check` = the reserve phase. This file only translates: `CheckRequest` →
//! [`Attributes`] (read as the API its path names: [`crate::llm::api`]), and the decision back
//! through [`super::response`], a refusal in that API's shape. A token count passes free.

use std::collections::HashMap;
use std::sync::Arc;

use envoy_types::pb::envoy::service::auth::v3::{
    AttributeContext, CheckRequest, CheckResponse, attribute_context::HttpRequest, authorization_server::Authorization,
};
use tonic::{Request, Response, Status};

use super::response::check_response;
use crate::admission::log::{self, StoreMode};
use crate::admission::{Admission, Attributes, Decision, Denial, IdempotencyKey, KeyRepeat, Reason};
use crate::config::{Priority, ServerSettings};
use crate::estimate::PromptSize;
use crate::llm::api::{self, Endpoint, Work};
use crate::llm::body;
use crate::store::Store;

use super::headers::{self, OWN_PREFIX, PARTIAL_BODY};

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
        let arrived = std::time::Instant::now();
        let policy = self.admission.policy();
        let identity = IdentityHeaders::of(&policy.server);
        let own = own_headers(request.get_ref());
        let endpoint = api::endpoint(http(request.get_ref()).map_or("", |h| h.path.as_str()));
        let decision = match attributes_at(request.get_ref(), identity, &endpoint) {
            Ok(a) => {
                let a = Attributes { wait_ms: headers::caller_wait_ms(request.metadata()), ..a };
                let d = match endpoint.work {
                    Work::CountTokens => self.admission.pass_free(&a),
                    Work::Generate | Work::Embed => self.admission.reserve(&a).await,
                    Work::Unknown => {
                        let d = Decision::Denied(Denial::now(
                            Reason::InvalidRequest,
                            format!(
                                "tollgate does not read the API at {}",
                                http(request.get_ref()).map_or("", |h| h.path.as_str())
                            ),
                        ));
                        log::decision(&policy, &a, &d, StoreMode::NotNeeded, arrived.elapsed());
                        d
                    }
                };
                record_on_span(&a, &d);
                d
            }
            Err(denial) => {
                log::refused_unread(&denial, arrived.elapsed());
                Decision::Denied(denial)
            }
        };
        Ok(Response::new(check_response(&decision, &own, endpoint.family)))
    }
}

/// The call's span names its tenant and, for a refusal, the reason (the decision's own log line
/// is written by admission, `admission::log`).
fn record_on_span(a: &Attributes, d: &Decision) {
    let span = tracing::Span::current();
    span.record("tenant", a.tenant.as_deref());
    if let Decision::Denied(no) = d {
        span.record("reason", no.reason.code());
    }
}

/// A header by its lower-case name, from either of the two places Envoy may put headers. A value
/// that is not UTF-8 is refused, never read as absent: an unreadable tenant is not "no tenant".
fn header<'a>(http: &'a HttpRequest, name: &str) -> Result<Option<&'a str>, Denial> {
    if let Some(v) = http.headers.get(name) {
        return Ok(Some(v.as_str()));
    }
    let Some(h) = http.header_map.as_ref().and_then(|m| m.headers.iter().find(|h| h.key.eq_ignore_ascii_case(name)))
    else {
        return Ok(None);
    };
    if !h.value.is_empty() {
        return Ok(Some(h.value.as_str()));
    }
    std::str::from_utf8(&h.raw_value)
        .map(Some)
        .map_err(|_| Denial::now(Reason::InvalidRequest, format!("header {name} is not UTF-8")))
}

/// The HTTP request a Check is about.
fn http(request: &CheckRequest) -> Option<&HttpRequest> {
    request.attributes.as_ref().and_then(|a: &AttributeContext| a.request.as_ref()).and_then(|r| r.http.as_ref())
}

/// The `x-tollgate-*` headers the request came with: none of them may reach the backend as sent.
fn own_headers(request: &CheckRequest) -> Vec<String> {
    let Some(http) = http(request) else {
        return Vec::new();
    };
    let keys = http.headers.keys().chain(http.header_map.iter().flat_map(|m| m.headers.iter().map(|h| &h.key)));
    // Only a header under the prefix is copied (lower-cased), never every header of every request.
    let ours = |k: &&String| k.get(..OWN_PREFIX.len()).is_some_and(|p| p.eq_ignore_ascii_case(OWN_PREFIX));
    let mut own: Vec<String> = keys.filter(ours).map(|k| k.to_ascii_lowercase()).collect();
    own.sort();
    own.dedup();
    own
}

/// The headers that carry who a request is for, as Envoy sets them from verified identity.
#[derive(Debug, Clone, Copy)]
pub struct IdentityHeaders<'a> {
    pub tenant: &'a str,
    /// The plan an unlisted tenant is admitted under; none: not read.
    pub plan: Option<&'a str>,
    /// The tiers of the Inference Extension's objectives; none: the objective is not read.
    pub objectives: Option<&'a HashMap<String, Priority>>,
}

impl<'a> IdentityHeaders<'a> {
    pub fn of(server: &'a ServerSettings) -> IdentityHeaders<'a> {
        IdentityHeaders {
            tenant: &server.tenant_header,
            plan: server.plan_header.as_deref(),
            objectives: (!server.objectives.is_empty()).then_some(&server.objectives),
        }
    }
}

/// Reads the attributes of a Check request, as the API its path names; a request that cannot be
/// read is refused here.
pub fn attributes(request: &CheckRequest, identity: IdentityHeaders<'_>) -> Result<Attributes, Denial> {
    let endpoint = api::endpoint(http(request).map_or("", |h| h.path.as_str()));
    attributes_at(request, identity, &endpoint)
}

/// The same, for a request whose path was already read as `endpoint` (Check reads it once).
fn attributes_at(
    request: &CheckRequest,
    identity: IdentityHeaders<'_>,
    endpoint: &Endpoint,
) -> Result<Attributes, Denial> {
    let invalid = |m: String| Denial::now(Reason::InvalidRequest, m);
    let http = http(request).ok_or_else(|| invalid("check request carries no HTTP request".into()))?;

    let text = |name: &str| -> Result<Option<String>, Denial> {
        Ok(header(http, name)?.map(str::trim).filter(|v| !v.is_empty()).map(str::to_string))
    };
    let number = |name: &str| -> Result<Option<u64>, Denial> {
        match header(http, name)?.map(str::trim) {
            None | Some("") => Ok(None),
            Some(v) => {
                v.parse::<u64>().map(Some).map_err(|_| invalid(format!("{name} {v:?} is not a non-negative integer")))
            }
        }
    };

    let body_bytes: &[u8] = if http.raw_body.is_empty() { http.body.as_bytes() } else { &http.raw_body };
    let partial = header(http, PARTIAL_BODY)?.is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let fields = body::parse(endpoint.body, body_bytes, partial).map_err(|e| invalid(e.0))?;
    // The whole body's size: content-length, or a size Envoy reports beyond the bytes it sent
    // (a size equal to what was sent says nothing about what was cut).
    let seen = u64::try_from(body_bytes.len()).unwrap_or(u64::MAX);
    let declared = number(headers::CONTENT_LENGTH)?.or(u64::try_from(http.size).ok().filter(|&n| n > seen));
    let prompt = match declared {
        // A chunked body, cut short: its size is unknown, so the worst case is held.
        None if partial => PromptSize::Unknown,
        declared => PromptSize::Bytes(declared.unwrap_or(0).max(seen)),
    };

    // The path's model (Gemini, Bedrock, an Azure deployment), else the body's, else the header's.
    let model = match (endpoint.model.clone().or(fields.model), text(headers::MODEL)?) {
        (Some(model), _) | (None, Some(model)) => Some(model),
        (None, None) if partial => {
            return Err(invalid(format!(
                "no model in the first {} bytes of the body Envoy sent; send {}, put \"model\" first, \
                 or raise the ext_authz filter's max_request_bytes",
                body_bytes.len(),
                headers::MODEL
            )));
        }
        (None, None) => None,
    };
    let priority = match text(headers::PRIORITY)? {
        Some(p) => Some(p.parse().map_err(invalid)?),
        // An objective the policy does not list says nothing: the tenant's default tier applies.
        None => match identity.objectives {
            Some(tiers) => text(headers::OBJECTIVE)?.and_then(|o| tiers.get(&o).copied()),
            None => None,
        },
    };
    Ok(Attributes {
        tenant: text(identity.tenant)?,
        plan: identity.plan.map(text).transpose()?.flatten(),
        user: text(headers::USER)?,
        model,
        priority,
        // 0 is "none given", as on Admission/Reserve: the tenant's default applies.
        deadline_ms: number(headers::DEADLINE)?.filter(|&ms| ms > 0),
        // The gRPC call's own deadline, read with its metadata (`check`).
        wait_ms: None,
        // A retried HTTP request reaches the backend too: a new attempt with its own hold.
        idempotency: text(headers::IDEMPOTENCY_KEY)?.map(|key| IdempotencyKey { key, repeat: KeyRepeat::NewAttempt }),
        prompt,
        max_tokens: fields.max_tokens.filter(|_| endpoint.work == Work::Generate),
        // Ollama streams unless told not to; the others only when told to (or by their path).
        stream: endpoint.stream.or(fields.stream).unwrap_or(endpoint.body == body::Body::Ollama),
        input_only: endpoint.work == Work::Embed,
        outputs: fields.outputs,
    })
}
