//! Shadow mode through real Envoy and on `Admission/Reserve`: a tenant in shadow is decided and
//! charged as usual, admitted where its limits would refuse, marked `x-tollgate-shadow: <reason>`
//! (to the client and the backend), and counted in the metrics as a would-be denial; what is not a
//! limit (an unknown model) is refused as for any tenant.

mod support;

use std::net::SocketAddr;

use support::procs::{Envoy, Tollgate, free_port, http_get};
use support::upstream::{Upstream, post};
use tollgate::proto::ReserveRequest;
use tollgate::proto::admission_client::AdmissionClient;

const CHAT: &str = r#"{"model":"m","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#;

fn policy(admin: SocketAddr) -> String {
    format!(
        "server:\n  admin_listen: {admin}\nmodels:\n  m: {{ max_output_tokens: 64 }}\n\
         tenants:\n  acme:\n    shadow: true\n    limits: {{ tokens_per_minute: 60, burst_tokens: 100 }}\n"
    )
}

fn scrape(admin: SocketAddr) -> String {
    http_get(admin, "/metrics").1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_envoy_a_would_be_denial_is_admitted_and_marked() {
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let tollgate = Tollgate::start(&policy(admin));
    let upstream = Upstream::start(tollgate.endpoint()).await;
    let envoy = Envoy::start(tollgate.addr, upstream.port);
    let headers = [("x-tenant-id", "acme"), ("x-test-output-tokens", "64")];

    let within = post(envoy.port, "/v1/chat/completions", &headers, CHAT).await;
    assert_eq!(within.status, 200, "{within:?}");
    assert_eq!(within.header("x-tollgate-shadow"), None, "within the limits: {within:?}");
    // The first hold (and its commit, all 64 output tokens used) spent the 100-token bucket.
    let beyond = post(envoy.port, "/v1/chat/completions", &headers, CHAT).await;
    assert_eq!(beyond.status, 200, "admitted anyway: {beyond:?}");
    assert_eq!(beyond.header("x-tollgate-shadow"), Some("token_rate"), "{beyond:?}");
    assert!(beyond.header("x-test-reservation").is_some_and(|r| r.starts_with("acme:")), "held: {beyond:?}");
    let seen = beyond.header("x-test-tollgate-headers").unwrap();
    assert!(seen.contains("x-tollgate-shadow=token_rate"), "the backend is told too: {seen}");
    assert_eq!(beyond.header("x-test-commit-state"), Some("committed"), "settled as any hold");

    let metrics = scrape(admin);
    let would_be = "tollgate_decisions_total{gen_ai_request_model=\"m\",outcome=\"shadow\",reason=\"token_rate\",tenant=\"acme\",tier=\"standard\"} 1";
    assert!(metrics.contains(would_be), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_says_the_shadow_reason_and_refuses_what_is_not_a_limit() {
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let tollgate = Tollgate::start(&policy(admin));
    let mut client = AdmissionClient::connect(tollgate.endpoint()).await.unwrap();
    let ask = |max_tokens| ReserveRequest {
        tenant: "acme".into(),
        model: "m".into(),
        prompt_tokens: 30,
        max_tokens,
        ..Default::default()
    };
    let first = client.reserve(ask(60)).await.unwrap().into_inner();
    assert!(first.admitted && first.shadow_reason.is_empty(), "{first:?}");
    let second = client.reserve(ask(60)).await.unwrap().into_inner();
    assert!(second.admitted && !second.reservation_id.is_empty(), "{second:?}");
    assert_eq!(second.shadow_reason, "token_rate", "{second:?}");
    let unknown = client.reserve(ReserveRequest { model: "nope".into(), ..ask(1) }).await.unwrap().into_inner();
    assert_eq!((unknown.admitted, unknown.reason.as_str()), (false, "invalid_request"), "{unknown:?}");
}
