//! Envoy `CheckRequest`s built by hand, and the reason a `CheckResponse` gives, for tests that
//! call tollgate's Check directly over gRPC.

use envoy_types::pb::envoy::service::auth::v3::check_response::HttpResponse;
use envoy_types::pb::envoy::service::auth::v3::{AttributeContext, CheckRequest, CheckResponse, attribute_context};

/// An HTTP request as Envoy describes it: headers, and the body bytes it sent.
pub fn http(headers: &[(&str, &str)], body: &[u8]) -> attribute_context::HttpRequest {
    attribute_context::HttpRequest {
        headers: headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        raw_body: body.to_vec(),
        ..Default::default()
    }
}

pub fn check_of(http: attribute_context::HttpRequest) -> CheckRequest {
    CheckRequest {
        attributes: Some(AttributeContext {
            request: Some(attribute_context::Request { http: Some(http), ..Default::default() }),
            ..Default::default()
        }),
    }
}

pub fn check(headers: &[(&str, &str)], body: &[u8]) -> CheckRequest {
    check_of(http(headers, body))
}

/// The reason code of a denial, or `admitted`.
pub fn reason(r: &CheckResponse) -> String {
    match &r.http_response {
        Some(HttpResponse::DeniedResponse(d)) => d
            .headers
            .iter()
            .filter_map(|h| h.header.as_ref())
            .find(|h| h.key == "x-tollgate-reason")
            .map(|h| h.value.clone())
            .unwrap_or_default(),
        Some(HttpResponse::OkResponse(_)) => "admitted".into(),
        other => panic!("unexpected {other:?}"),
    }
}

/// The reservation id and reserved tokens of an admission, or `None` for a denial.
pub fn reservation(r: &CheckResponse) -> Option<(String, u64)> {
    let Some(HttpResponse::OkResponse(ok)) = &r.http_response else { return None };
    let get = |name: &str| ok.headers.iter().filter_map(|h| h.header.as_ref()).find(|h| h.key == name);
    let id = get("x-tollgate-reservation")?.value.clone();
    let reserved = get("x-tollgate-reserved-tokens")?.value.parse().ok()?;
    Some((id, reserved))
}
