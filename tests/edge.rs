//! The books at the edge, against a real tollgate process over gRPC: what a key, a header, a body
//! or a count can make tollgate hold, and what it must refuse. Each test is a path on which budget
//! was once created or lost.

mod support;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::auth::v3::authorization_client::AuthorizationClient;
use envoy_types::pb::envoy::service::auth::v3::check_response::HttpResponse;
use envoy_types::pb::envoy::service::auth::v3::{CheckRequest, CheckResponse, OkHttpResponse};
use support::checks::{check, check_of, http, reason};
use support::procs::Tollgate;
use tollgate::proto::admission_client::AdmissionClient;
use tollgate::proto::{CommitRequest, ReleaseRequest, ReserveRequest, ReserveResponse};
use tonic::transport::Channel;

const POLICY: &str = r#"
models:
  m: { max_output_tokens: 64 }
  cached: { max_output_tokens: 64, cache_read_weight: 0.5 }
  slow: { max_output_tokens: 100, pool: gpu }
pools:
  gpu:
    max_sequences: 4
    prefill_tokens_per_second: 1000
    decode_tokens_per_second: 100
    max_queue_delay_ms: 60000
tenants:
  acme:
    limits: { tokens_per_minute: 60, burst_tokens: 1000 }
  solo:
    limits: { tokens_per_minute: 60000, burst_tokens: 60000, max_concurrency: 1 }
  big:
    limits: { tokens_per_minute: 6000000, burst_tokens: 6000000 }
  hurried:
    default_deadline_ms: 500
"#;

struct Edge {
    tollgate: Tollgate,
    authz: AuthorizationClient<Channel>,
    admission: AdmissionClient<Channel>,
}

impl Edge {
    async fn start() -> Edge {
        let tollgate = Tollgate::start(POLICY);
        let authz = AuthorizationClient::connect(tollgate.endpoint()).await.unwrap();
        let admission = AdmissionClient::connect(tollgate.endpoint()).await.unwrap();
        Edge { tollgate, authz, admission }
    }

    async fn check(&mut self, request: CheckRequest) -> CheckResponse {
        let log = self.tollgate.log();
        self.authz.check(request).await.unwrap_or_else(|e| panic!("gRPC error {e}\n{log}")).into_inner()
    }

    async fn reserve(&mut self, r: ReserveRequest) -> ReserveResponse {
        self.admission.reserve(r).await.unwrap().into_inner()
    }

    async fn release(&mut self, id: &str) {
        self.admission.release(ReleaseRequest { reservation_id: id.into() }).await.unwrap();
    }
}

fn ok(r: &CheckResponse) -> &OkHttpResponse {
    match &r.http_response {
        Some(HttpResponse::OkResponse(ok)) => ok,
        other => panic!("expected admission, got {other:?}"),
    }
}

/// An upstream header the admitted response sets.
fn upstream<'a>(r: &'a CheckResponse, name: &str) -> Option<&'a str> {
    ok(r).headers.iter().filter_map(|h| h.header.as_ref()).find(|h| h.key == name).map(|h| h.value.as_str())
}

const BODY: &[u8] = br#"{"model":"m","max_tokens":10}"#;

fn reserve(tenant: &str, key: &str, max_tokens: u64) -> ReserveRequest {
    ReserveRequest {
        tenant: tenant.into(),
        model: "m".into(),
        prompt_tokens: 5,
        max_tokens,
        idempotency_key: key.into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_http_request_is_a_new_attempt_with_its_own_hold() {
    let mut e = Edge::start().await;
    let keyed = [("x-tenant-id", "solo"), ("idempotency-key", "order-7")];
    let first = e.check(check(&keyed, BODY)).await;
    let id = upstream(&first, "x-tollgate-reservation").unwrap().to_string();
    // The same key while the first request runs: a second request that would reach the backend,
    // so it needs a slot of its own, and solo has one.
    let second = e.check(check(&keyed, BODY)).await;
    assert_eq!(reason(&second), "concurrency", "{second:?}");
    e.release(&id).await;
    let third = e.check(check(&keyed, BODY)).await;
    let again = upstream(&third, "x-tollgate-reservation").unwrap().to_string();
    assert_ne!(again, id, "a new attempt holds under a new id");
    e.release(&again).await;
    let fourth = e.check(check(&keyed, BODY)).await;
    let last = upstream(&fourth, "x-tollgate-reservation").unwrap().to_string();
    e.release(&last).await;
    let fifth = e.check(check(&keyed, BODY)).await;
    assert_eq!(reason(&fifth), "invalid_request", "max_attempts (3) bounds the attempts of one key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reserve_answer_is_given_back_without_a_second_charge() {
    let mut e = Edge::start().await;
    let first = e.reserve(reserve("acme", "r-1", 10)).await;
    assert!(first.admitted, "{first:?}");
    let again = e.reserve(reserve("acme", "r-1", 10)).await;
    assert!(again.admitted);
    assert_eq!(again.reservation_id, first.reservation_id, "the same reservation");
    assert_eq!(again.attempts, 2);
    assert_eq!(again.remaining_tokens, first.remaining_tokens, "charged once");
    // The same key for another request is a mistake, not a replay.
    for other in [reserve("acme", "r-1", 20), ReserveRequest { model: "slow".into(), ..reserve("acme", "r-1", 10) }] {
        let r = e.reserve(other).await;
        assert!(!r.admitted);
        assert_eq!(r.reason, "invalid_request", "{r:?}");
        assert!(r.message.contains("idempotency"), "{}", r.message);
    }
    let mut user = reserve("acme", "r-1", 10);
    user.user = "bob".into();
    assert_eq!(e.reserve(user).await.reason, "invalid_request");

    // Release is as idempotent as commit: a repeat answers the first refund, given once.
    let released = e.admission.release(ReleaseRequest { reservation_id: first.reservation_id.clone() }).await.unwrap();
    let again = e.admission.release(ReleaseRequest { reservation_id: first.reservation_id.clone() }).await.unwrap();
    let (released, again) = (released.into_inner(), again.into_inner());
    assert_eq!((released.refunded_tokens, released.duplicate), (15, false));
    assert_eq!((again.state.as_str(), again.refunded_tokens, again.duplicate), ("released", 15, true));
}

/// Commit over gRPC says how much of the prompt came from the provider's cache: those tokens count
/// at the model's weight; a count past the stated maximum is refused and charges nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_s_cached_prompt_tokens_count_at_the_models_weight() {
    let mut e = Edge::start().await;
    let held = e.reserve(ReserveRequest { model: "cached".into(), prompt_tokens: 100, ..reserve("big", "", 10) }).await;
    assert!(held.admitted, "{held:?}");
    let commit = |cache_read_tokens| CommitRequest {
        reservation_id: held.reservation_id.clone(),
        prompt_tokens: 100,
        completion_tokens: 10,
        cache_read_tokens,
        cache_write_tokens: None,
        reasoning_tokens: Some(4),
    };
    let status = e.admission.commit(commit(Some(1u64 << 60))).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("cache_read_tokens"), "{status:?}");
    let c = e.admission.commit(commit(Some(40))).await.unwrap().into_inner();
    assert_eq!((c.state.as_str(), c.duplicate, c.used_tokens), ("committed", false, 60 + 20 + 10), "{c:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_counts_past_the_stated_maximum_are_refused_and_charge_nothing() {
    let mut e = Edge::start().await;
    let huge = 1u64 << 60;
    let r = e.reserve(ReserveRequest { prompt_tokens: huge, ..reserve("big", "", 10) }).await;
    assert_eq!(r.reason, "invalid_request", "{r:?}");
    assert!(r.message.contains("1000000000"), "the message states the maximum: {}", r.message);
    let r = e.reserve(ReserveRequest { prompt_bytes: huge, prompt_tokens: 0, ..reserve("big", "", 10) }).await;
    assert_eq!(r.reason, "invalid_request", "{r:?}");
    let length = huge.to_string();
    let d = e.check(check(&[("x-tenant-id", "big"), ("content-length", &length)], BODY)).await;
    assert_eq!(reason(&d), "invalid_request");

    let held = e.reserve(reserve("big", "", 10)).await;
    assert!(held.admitted);
    for (prompt, completion) in [(huge, 1), (1, huge), (u64::MAX, u64::MAX)] {
        let status = e
            .admission
            .commit(CommitRequest {
                reservation_id: held.reservation_id.clone(),
                prompt_tokens: prompt,
                completion_tokens: completion,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    }
    let c = e
        .admission
        .commit(CommitRequest {
            reservation_id: held.reservation_id.clone(),
            prompt_tokens: 5,
            completion_tokens: 5,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (c.state.as_str(), c.duplicate, c.used_tokens),
        ("committed", false, 10),
        "the refusals changed nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_names_its_model_or_ceiling_twice_is_refused() {
    let mut e = Edge::start().await;
    for body in [
        &br#"{"model":"m","max_tokens":10,"model":"slow"}"#[..],
        br#"{"model":"m","max_tokens":10,"max_tokens":60}"#,
        br#"{"model":"m","max_tokens":10,"max_completion_tokens":1,"max_completion_tokens":60}"#,
    ] {
        let d = e.check(check(&[("x-tenant-id", "big")], body)).await;
        assert_eq!(reason(&d), "invalid_request", "{}", String::from_utf8_lossy(body));
    }
}

/// A cut body holds the worst case of what it cannot see: the model's longest prompt when its
/// length is unknown, and always the model's output ceiling, since what follows the cut could
/// name a second `max_tokens` (a backend keeping the last would generate that many).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_body_holds_the_worst_case_of_what_it_cannot_see() {
    let mut e = Edge::start().await;
    // Chunked: no content-length, and Envoy sent only the first bytes.
    let cut = br#"{"model":"m","max_tokens":10,"messages":[{"role":"user","content":"and on and on"#;
    let d = e.check(check(&[("x-tenant-id", "big"), ("x-envoy-auth-partial-body", "true")], cut)).await;
    assert_eq!(upstream(&d, "x-tollgate-reserved-tokens"), Some("131136"), "max_prompt_tokens + max_output_tokens");
    let with_length = [("x-tenant-id", "big"), ("x-envoy-auth-partial-body", "true"), ("content-length", "4000")];
    let d = e.check(check(&with_length, cut)).await;
    assert_eq!(
        upstream(&d, "x-tollgate-reserved-tokens"),
        Some("1064"),
        "content-length known: 4000 / 4 + 64, not + 10"
    );
    // The same body whole holds what it asks.
    let whole = br#"{"model":"m","max_tokens":10,"messages":[{"role":"user","content":"and on and on"}]}"#;
    let d = e.check(check(&[("x-tenant-id", "big")], whole)).await;
    assert_eq!(upstream(&d, "x-tollgate-reserved-tokens"), Some(&*(whole.len().div_ceil(4) + 10).to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_a_client_forges_never_reach_the_backend() {
    let mut e = Edge::start().await;
    let forged = [
        ("x-tenant-id", "big"),
        ("x-tollgate-reservation", "big:00000000000000000000000000000000"),
        ("x-tollgate-reserved-tokens", "1"),
        ("x-tollgate-unmetered", "store_unavailable"),
        ("x-tollgate-anything", "else"),
    ];
    let d = e.check(check(&forged, BODY)).await;
    let ok = ok(&d);
    for name in ["x-tollgate-unmetered", "x-tollgate-anything"] {
        assert!(ok.headers_to_remove.iter().any(|h| h == name), "{name} is removed: {ok:?}");
    }
    let id = upstream(&d, "x-tollgate-reservation").unwrap();
    assert_ne!(id, "big:00000000000000000000000000000000", "the real reservation overwrites the forged one");
    assert_eq!(upstream(&d, "x-tollgate-reserved-tokens"), Some("18"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_header_that_is_not_utf8_is_refused() {
    let mut e = Edge::start().await;
    let mut request = http(&[], BODY);
    request.header_map = Some(HeaderMap {
        headers: vec![HeaderValue {
            key: "x-tenant-id".into(),
            raw_value: vec![b'a', 0xff, b'c'],
            ..Default::default()
        }],
    });
    let d = e.check(check_of(request)).await;
    assert_eq!(reason(&d), "invalid_request", "{d:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_deadline_means_none_given_on_every_interface() {
    let mut e = Edge::start().await;
    // The pool needs 1,100 ms for this request; the tenant's default deadline is 500 ms.
    let body = br#"{"model":"slow","max_tokens":100,"messages":[]}"#;
    for headers in [&[("x-tenant-id", "hurried")][..], &[("x-tenant-id", "hurried"), ("x-request-deadline-ms", "0")]] {
        let d = e.check(check(headers, body)).await;
        assert_eq!(reason(&d), "deadline", "{headers:?}");
    }
    let r = e
        .reserve(ReserveRequest {
            model: "slow".into(),
            max_tokens: 100,
            prompt_tokens: 100,
            deadline_ms: 0,
            ..reserve("hurried", "", 100)
        })
        .await;
    assert_eq!(r.reason, "deadline", "{r:?}");
}
