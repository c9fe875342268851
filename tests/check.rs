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

/// What a request's path says is read: a token count passes free (for a known tenant), an
/// embedding holds its input alone, a Gemini path names its model, and a refusal of a Gemini or
/// Bedrock request comes in that API's shape, with tollgate's reason header beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_path_decides_what_is_read_and_how_a_refusal_reads() {
    use support::checks::{check_of, http, reservation};
    let t = Tollgate::start(POLICY);
    let mut client = AuthorizationClient::connect(t.endpoint()).await.unwrap();
    let at = |path: &str, tenant: &str, body: &[u8]| {
        check_of(envoy_types::pb::envoy::service::auth::v3::attribute_context::HttpRequest {
            path: path.into(),
            ..http(&[("x-tenant-id", tenant)], body)
        })
    };
    let header = |r: &envoy_types::pb::envoy::service::auth::v3::CheckResponse, name: &str| {
        let headers = match &r.http_response {
            Some(HttpResponse::OkResponse(ok)) => &ok.headers,
            Some(HttpResponse::DeniedResponse(d)) => &d.headers,
            _ => panic!(),
        };
        headers.iter().filter_map(|h| h.header.as_ref()).find(|h| h.key == name).map(|h| h.value.clone())
    };

    let count = client.check(at("/v1beta/models/m:countTokens", "acme", b"{}")).await.unwrap().into_inner();
    assert_eq!((reason(&count), header(&count, "x-tollgate-unmetered")), ("admitted".into(), Some("free".into())));
    assert_eq!(reservation(&count), None, "no hold");
    let stranger = client.check(at("/v1beta/models/m:countTokens", "nobody", b"{}")).await.unwrap().into_inner();
    assert_eq!(reason(&stranger), "unauthenticated", "free, but only for a known tenant");

    // 40 bytes of input at 4 a token: held 10, not 10 + the model's 64.
    let embed = br#"{"model":"m","input":"twenty bytes long.."}"#;
    let r = client.check(at("/v1/embeddings", "acme", embed)).await.unwrap().into_inner();
    assert_eq!(reservation(&r).map(|(_, n)| n), Some(embed.len().div_ceil(4) as u64), "{r:?}");

    // The model from the path, the ceiling from generationConfig (a top-level max_tokens is not
    // Gemini's, and is not read).
    let gemini = br#"{"contents":[],"max_tokens":1,"generationConfig":{"maxOutputTokens":30}}"#;
    let r = client.check(at("/v1/models/m:generateContent", "acme", gemini)).await.unwrap().into_inner();
    assert_eq!(reservation(&r).map(|(_, n)| n), Some(gemini.len().div_ceil(4) as u64 + 30), "{r:?}");

    // Several outputs a request (OpenAI's n): each held at the ceiling.
    let several = br#"{"model":"m","max_tokens":10,"n":3}"#;
    let r = client.check(at("/v1/chat/completions", "acme", several)).await.unwrap().into_inner();
    assert_eq!(reservation(&r).map(|(_, n)| n), Some(several.len().div_ceil(4) as u64 + 30), "{r:?}");
    // And the completions API's list of prompts: a completion for each.
    let prompts = br#"{"model":"m","max_tokens":10,"prompt":["a","b","c"]}"#;
    let r = client.check(at("/v1/completions", "acme", prompts)).await.unwrap().into_inner();
    assert_eq!(reservation(&r).map(|(_, n)| n), Some(prompts.len().div_ceil(4) as u64 + 30), "{r:?}");

    // Under Ollama's prefix, a path tollgate does not read is refused in Ollama's shape, whatever
    // the body says; an escape is decoded as Ollama's router decodes it.
    let ollama_like = br#"{"model":"m","max_tokens":1,"options":{"num_predict":-1}}"#;
    let r = client.check(at("/api/pull", "acme", ollama_like)).await.unwrap().into_inner();
    assert_eq!(reason(&r), "invalid_request");
    let Some(HttpResponse::DeniedResponse(d)) = &r.http_response else { panic!() };
    assert!(d.body.contains(r#""error":"tollgate does not read the API at /api/pull""#), "{}", d.body);
    let r = client.check(at("/api/c%68at", "acme", ollama_like)).await.unwrap().into_inner();
    assert_eq!(
        reservation(&r).map(|(_, n)| n),
        Some(ollama_like.len().div_ceil(4) as u64 + 64),
        "num_predict -1: the ceiling"
    );

    for (path, status) in [("/v1/models/nope:generateContent", 400), ("/model/nope/converse", 400)] {
        let r = client.check(at(path, "acme", b"{}")).await.unwrap().into_inner();
        assert_eq!(reason(&r), "invalid_request", "{path}");
        let Some(HttpResponse::DeniedResponse(d)) = &r.http_response else { panic!() };
        assert_eq!(d.status.as_ref().unwrap().code, status);
        let body: serde_json::Value = serde_json::from_str(&d.body).unwrap();
        if path.starts_with("/model/") {
            assert_eq!(header(&r, "x-amzn-errortype").as_deref(), Some("ValidationException"));
            assert!(body["message"].as_str().unwrap().contains("\"nope\" is not served here"), "{body}");
        } else {
            assert_eq!(
                (body["error"]["code"].as_u64(), body["error"]["status"].as_str()),
                (Some(400), Some("INVALID_ARGUMENT"))
            );
        }
    }
}

/// The Gateway API Inference Extension's headers, as the policy allows: the fairness id as the
/// tenant (`server.tenant_header`), the objective as the tier (`server.objectives`), `x-priority`
/// before it, an objective the policy does not list leaving the tenant's default. The tier a
/// request was decided at is in ext_authz's dynamic metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inference_extensions_fairness_id_and_objective_name_the_tenant_and_the_tier() {
    use envoy_types::pb::google::protobuf::value::Kind;
    let policy = "server:\n  tenant_header: x-gateway-inference-fairness-id\n  \
                  objectives: { chat: critical, offline: sheddable }\n\
                  models:\n  m: { max_output_tokens: 64 }\ntenants:\n  acme:\n    limits: { tokens_per_minute: 6000 }\n";
    let t = Tollgate::start(policy);
    let mut client = AuthorizationClient::connect(t.endpoint()).await.unwrap();
    let body = br#"{"model":"m","max_tokens":10}"#;
    let fairness = ("x-gateway-inference-fairness-id", "acme");
    let objective = "x-gateway-inference-objective";
    for (extra, tier) in [
        (vec![(objective, "chat")], "critical"),
        (vec![(objective, "offline")], "sheddable"),
        (vec![(objective, "not-listed")], "standard"),
        (vec![(objective, "offline"), ("x-priority", "critical")], "critical"),
        (vec![], "standard"),
    ] {
        let headers: Vec<(&str, &str)> = std::iter::once(fairness).chain(extra.iter().copied()).collect();
        let reply = client.check(check(&headers, body)).await.unwrap().into_inner();
        assert_eq!(reason(&reply), "admitted", "{headers:?}: {reply:?}");
        let fields = reply.dynamic_metadata.expect("metadata").fields;
        let got = match fields.get("tier").and_then(|v| v.kind.as_ref()) {
            Some(Kind::StringValue(s)) => s.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(got, tier, "{headers:?}");
    }
    // Without the fairness id there is no tenant: x-tenant-id is not read.
    let reply = client.check(check(&[("x-tenant-id", "acme")], body)).await.unwrap().into_inner();
    assert_eq!(reason(&reply), "unauthenticated");
}
