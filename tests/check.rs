//! Envoy's Check called directly over gRPC with inputs Envoy itself would never send: every one
//! is answered with a Denied response and the right reason, never a gRPC error or a crash.

mod support;

use envoy_types::pb::envoy::service::auth::v3::CheckRequest;
use envoy_types::pb::envoy::service::auth::v3::authorization_client::AuthorizationClient;
use envoy_types::pb::envoy::service::auth::v3::check_response::HttpResponse;
use support::checks::{check, reason};
use support::procs::Tollgate;

const POLICY: &str = "models:\n  m: { max_output_tokens: 64 }\ntenants:\n  acme:\n    limits: { tokens_per_minute: 60, burst_tokens: 1000 }\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inputs_envoy_would_never_send_are_refused_cleanly() {
    let t = Tollgate::start(POLICY);
    let mut client = AuthorizationClient::connect(t.endpoint()).await.unwrap();
    let body = br#"{"model":"m","max_tokens":10}"#;
    let huge = "u".repeat(64 * 1024);
    let cut = br#"{"messages":[{"role":"user","content":"a long prompt, cut here"#;
    let cases: Vec<(&str, CheckRequest, &str)> = vec![
        ("no attributes", CheckRequest { attributes: None }, "invalid_request"),
        ("oversized user header", check(&[("x-tenant-id", "acme"), ("x-user-id", &huge)], body), "invalid_request"),
        ("oversized tenant header", check(&[("x-tenant-id", &huge)], body), "invalid_request"),
        (
            "oversized idempotency key",
            check(&[("x-tenant-id", "acme"), ("idempotency-key", &huge)], body),
            "invalid_request",
        ),
        ("binary body", check(&[("x-tenant-id", "acme")], &[0xff, 0xfe, 0x00, 0x7b]), "invalid_request"),
        ("bad content-length", check(&[("x-tenant-id", "acme"), ("content-length", "lots")], body), "invalid_request"),
        ("tenant with a space", check(&[("x-tenant-id", "ac me")], body), "invalid_request"),
        (
            "cut before the model",
            check(&[("x-tenant-id", "acme"), ("x-envoy-auth-partial-body", "true")], cut),
            "invalid_request",
        ),
    ];
    for (what, request, expected) in cases {
        let reply = client.check(request).await.unwrap_or_else(|e| panic!("{what}: gRPC error {e}")).into_inner();
        assert_eq!(reason(&reply), expected, "{what}");
        if what == "cut before the model" {
            let Some(HttpResponse::DeniedResponse(d)) = &reply.http_response else { panic!() };
            assert!(d.body.contains("x-tollgate-model"), "the refusal says how to fix it: {}", d.body);
        }
    }
    // None of it charged anything: the whole 1000-token bucket is still there.
    let whole = format!(r#"{{"model":"m","max_tokens":64,"pad":"{}"}}"#, "p".repeat(3700));
    let reply = client.check(check(&[("x-tenant-id", "acme")], whole.as_bytes())).await.unwrap().into_inner();
    assert_eq!(reason(&reply), "admitted", "{reply:?}\n{}", t.log());
}
