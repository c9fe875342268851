//! Through real Envoy: client → Envoy (ext_authz) → tollgate → the stand-in backend, which commits
//! its usage back to tollgate. Every test starts its own processes on free ports.

mod support;

use std::time::Duration;

use support::Backend;
use support::procs::{Envoy, Tollgate};
use support::upstream::{HttpReply, Upstream, chat_body, chat_body_messages_first, post};
use tollgate::proto::admission_client::AdmissionClient;
use tollgate::proto::{CommitRequest, ReleaseRequest};

const CHAT: &str = "/v1/chat/completions";

fn policy(store: &str) -> String {
    format!(
        r#"{store}
models:
  m:
    max_output_tokens: 4096
    bytes_per_token: 4
tenants:
  acme:
    limits: {{ tokens_per_minute: 60, burst_tokens: 1000 }}
  solo:
    limits: {{ tokens_per_minute: 60000, burst_tokens: 60000, max_concurrency: 1 }}
  big:
    limits: {{ tokens_per_minute: 600000, burst_tokens: 600000 }}
  lapse:
    lease_ttl_ms: 300
    expired_usage: refund
    limits: {{ tokens_per_minute: 60, burst_tokens: 1000, max_concurrency: 1 }}
  keep:
    lease_ttl_ms: 300
    expired_usage: charge_reserved
    limits: {{ tokens_per_minute: 60, burst_tokens: 1000, max_concurrency: 1 }}
"#
    )
}

/// tollgate, the backend and Envoy, wired together.
struct Stack {
    envoy: Envoy,
    /// Held so the backend lives as long as the stack.
    _upstream: Upstream,
    tollgate: Tollgate,
}

impl Stack {
    async fn start(store: &str) -> Stack {
        let tollgate = Tollgate::start(&policy(store));
        let upstream = Upstream::start(tollgate.endpoint()).await;
        let envoy = Envoy::start(tollgate.addr, upstream.port);
        Stack { envoy, _upstream: upstream, tollgate }
    }

    async fn chat(&self, tenant: &str, body: &str, extra: &[(&str, &str)]) -> HttpReply {
        let mut headers = vec![("x-tenant-id", tenant)];
        headers.extend_from_slice(extra);
        post(self.envoy.port, CHAT, &headers, body.to_string()).await
    }

    async fn client(&self) -> AdmissionClient<tonic::transport::Channel> {
        AdmissionClient::connect(self.tollgate.endpoint()).await.unwrap()
    }

    fn diagnostics(&self) -> String {
        format!("--- tollgate log ---\n{}\n--- envoy log ---\n{}", self.tollgate.log(), self.envoy.log())
    }
}

const SKIP_COMMIT: (&str, &str) = ("x-test-skip-commit", "1");

fn reason(r: &HttpReply) -> &str {
    r.header("x-tollgate-reason").unwrap_or("")
}

async fn bucket_flow(backend: Backend) {
    let stack = Stack::start(&backend.store_yaml()).await;
    let body = chat_body("m", Some(200), 10);
    let mut held = Vec::new();
    let mut hold = 0;
    loop {
        let r = stack.chat("acme", &body, &[SKIP_COMMIT]).await;
        if r.status != 200 {
            assert_eq!(r.status, 429, "{r:?}\n{}", stack.diagnostics());
            assert_eq!(reason(&r), "token_rate");
            // 1000 tokens of burst hold four requests; the fifth is short by 5 * hold - 1000
            // tokens, which refill at one per second.
            assert_eq!(held.len(), 4);
            let deficit_ms = (5 * hold - 1000) * 1000;
            let ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
            assert!(ms <= deficit_ms && ms + 3000 > deficit_ms, "retry-after-ms {ms}, deficit {deficit_ms}");
            assert_eq!(r.header("retry-after").unwrap(), ms.div_ceil(1000).to_string());
            assert_eq!(r.header("x-ratelimit-limit-tokens"), Some("1000"));
            let json = r.json();
            assert_eq!(json["error"]["code"], "token_rate");
            assert_eq!(json["error"]["type"], "rate_limit_error");
            break;
        }
        assert!(held.len() < 4, "admitted past the bucket");
        hold = r.header("x-test-reserved-tokens").unwrap().parse::<u64>().unwrap();
        assert!(r.header("x-ratelimit-remaining-tokens").is_some());
        held.push(r.header("x-test-reservation").unwrap().to_string());
    }

    // The backend reports a short generation: the unused hold comes back and admits again.
    let mut client = stack.client().await;
    let c = client
        .commit(CommitRequest {
            reservation_id: held[0].clone(),
            prompt_tokens: 5,
            completion_tokens: 5,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((c.state.as_str(), c.refunded_tokens), ("committed", hold - 10));
    let r = stack.chat("acme", &body, &[]).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-test-commit-state"), Some("committed"), "the backend committed its usage");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bucket_admits_until_spent_then_429_and_a_commit_refunds_embedded() {
    bucket_flow(Backend::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bucket_admits_until_spent_then_429_and_a_commit_refunds_redis() {
    bucket_flow(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_larger_than_the_bucket_is_400_without_retry_after() {
    let stack = Stack::start("").await;
    let r = stack.chat("acme", &chat_body("m", Some(2000), 10), &[]).await;
    assert_eq!(r.status, 400, "{r:?}");
    assert_eq!(reason(&r), "unsatisfiable");
    assert_eq!(r.header("retry-after"), None);
    assert_eq!(r.header("x-should-retry"), Some("false"));
    assert_eq!(r.json()["error"]["code"], "unsatisfiable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_concurrency_limit_gives_429_until_a_release() {
    let stack = Stack::start("").await;
    let body = chat_body("m", Some(10), 10);
    // A client cannot plant its own reservation id: tollgate's overwrites it on the way upstream.
    let first = stack.chat("solo", &body, &[SKIP_COMMIT, ("x-tollgate-reservation", "solo:forged")]).await;
    assert_eq!(first.status, 200, "{first:?}");
    assert_ne!(first.header("x-test-reservation"), Some("solo:forged"));
    let second = stack.chat("solo", &body, &[]).await;
    assert_eq!((second.status, reason(&second)), (429, "concurrency"), "{second:?}");
    assert!(second.header("retry-after").is_some());
    let id = first.header("x-test-reservation").unwrap().to_string();
    let mut client = stack.client().await;
    let released = client.release(ReleaseRequest { reservation_id: id.clone() }).await.unwrap().into_inner();
    assert_eq!(released.state, "released");
    let third = stack.chat("solo", &body, &[]).await;
    assert_eq!(third.status, 200, "{third:?}");

    // The Admission service's errors: a released hold cannot be committed; unknown and malformed ids.
    let commit = |reservation_id: String| CommitRequest {
        reservation_id,
        prompt_tokens: 1,
        completion_tokens: 1,
        ..Default::default()
    };
    let code = |r: Result<tonic::Response<_>, tonic::Status>| {
        r.map(|_: tonic::Response<tollgate::proto::CommitResponse>| ()).unwrap_err().code()
    };
    assert_eq!(code(client.commit(commit(id)).await), tonic::Code::FailedPrecondition);
    assert_eq!(code(client.commit(commit(format!("solo:{}", "0".repeat(32)))).await), tonic::Code::NotFound);
    assert_eq!(code(client.commit(commit("not-an-id".into())).await), tonic::Code::InvalidArgument);
}

/// A hold whose client never comes back is reclaimed after its lease; a late commit reconciles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_hold_expires_under_both_policies_and_a_late_commit_reconciles() {
    let stack = Stack::start("").await;
    let body = chat_body("m", Some(400), 10);
    let mut client = stack.client().await;
    for tenant in ["lapse", "keep"] {
        let first = stack.chat(tenant, &body, &[SKIP_COMMIT]).await;
        assert_eq!(first.status, 200, "{tenant}: {first:?}");
        let hold: u64 = first.header("x-test-reserved-tokens").unwrap().parse().unwrap();
        assert_eq!(reason(&stack.chat(tenant, &body, &[]).await), "concurrency", "{tenant}");
        tokio::time::sleep(Duration::from_millis(400)).await;
        // The next reserve sweeps the expired hold and takes its slot.
        let second = stack.chat(tenant, &body, &[]).await;
        assert_eq!(second.status, 200, "{tenant}: {second:?}");
        let remaining: u64 = second.header("x-ratelimit-remaining-tokens").unwrap().parse().unwrap();
        match tenant {
            // refund: the expired hold's tokens came back; only the second request's usage is gone.
            "lapse" => assert!(remaining + hold > 1000 - 5, "{tenant}: remaining {remaining}"),
            // charge_reserved: the expired hold stays charged.
            _ => assert!(remaining + 2 * hold <= 1000, "{tenant}: remaining {remaining}"),
        }
        let id = first.header("x-test-reservation").unwrap().to_string();
        let late = client
            .commit(CommitRequest {
                reservation_id: id,
                prompt_tokens: 10,
                completion_tokens: 10,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(late.state, "late_committed", "{tenant}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_the_right_reason_and_charges_nothing() {
    let stack = Stack::start("").await;
    let ok = chat_body("m", Some(10), 10);
    let long_tenant = "t".repeat(1000);
    /// What is wrong, the body, extra headers, then the expected status and reason.
    type Case<'a> = (&'a str, String, Vec<(&'a str, &'a str)>, u16, &'a str);
    let cases: Vec<Case> = vec![
        ("malformed JSON", r#"{"model": "m", "max_tokens": 10,,}"#.into(), vec![], 400, "invalid_request"),
        ("truncated JSON", r#"{"model":"m","max_tok"#.into(), vec![], 400, "invalid_request"),
        ("not an object", "[1, 2, 3]".into(), vec![], 400, "invalid_request"),
        ("negative max_tokens", chat_body("m", Some(-5), 10), vec![], 400, "invalid_request"),
        ("absurd max_tokens", chat_body("m", Some(1_000_000_000_000_000), 10), vec![], 400, "invalid_request"),
        ("string max_tokens", r#"{"model":"m","max_tokens":"lots"}"#.into(), vec![], 400, "invalid_request"),
        ("unknown model", chat_body("gpt-unknown", Some(10), 10), vec![], 400, "invalid_request"),
        ("no model", r#"{"messages":[]}"#.into(), vec![], 400, "invalid_request"),
        ("bad priority", ok.clone(), vec![("x-priority", "urgent")], 400, "invalid_request"),
        ("bad deadline", ok.clone(), vec![("x-request-deadline-ms", "-1")], 400, "invalid_request"),
    ];
    for (what, body, extra, status, code) in &cases {
        let r = stack.chat("acme", body, extra).await;
        assert_eq!((r.status, reason(&r)), (*status, *code), "{what}: {r:?}");
        assert_eq!(r.json()["error"]["code"], *code, "{what}");
    }
    let tenants: [(&str, &str, u16, &str); 5] = [
        ("missing tenant", "", 401, "unauthenticated"),
        ("unknown tenant", "nobody", 401, "unauthenticated"),
        ("tenant with {", "ac{me}", 400, "invalid_request"),
        ("tenant with :", "acme:x", 400, "invalid_request"),
        ("oversized tenant", &long_tenant, 400, "invalid_request"),
    ];
    for (what, tenant, status, code) in tenants {
        let headers: Vec<(&str, &str)> = if tenant.is_empty() { vec![] } else { vec![("x-tenant-id", tenant)] };
        let r = post(stack.envoy.port, CHAT, &headers, ok.clone()).await;
        assert_eq!((r.status, reason(&r)), (status, code), "{what}: {r:?}");
    }
    // Nothing above charged a token: a request for the whole bucket is still admitted.
    let prompt = (chat_body("m", Some(900), 10).len() as i64 + 3) / 4;
    let whole = chat_body("m", Some(1000 - prompt), 10);
    let r = stack.chat("acme", &whole, &[SKIP_COMMIT]).await;
    assert_eq!(r.status, 200, "{r:?}\n{}", stack.diagnostics());
    assert_eq!(r.header("x-test-reserved-tokens"), Some("1000"));
}

/// Envoy sends only the first MiB: the prompt estimate comes from content-length, and the
/// model's ceiling is held, not the max_tokens before the cut (the rest could name another).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_larger_than_envoy_sends_is_estimated_from_content_length() {
    let stack = Stack::start("").await;
    let body = chat_body("m", Some(10), 1_200_000);
    let r = stack.chat("big", &body, &[]).await;
    assert_eq!(r.status, 200, "{r:?}");
    let expected = (body.len() as u64).div_ceil(4) + 4096;
    assert_eq!(r.header("x-test-reserved-tokens"), Some(expected.to_string().as_str()));
}

/// OpenAI's Python SDK puts `messages` first: a cut body loses the model, and `x-tollgate-model`
/// supplies it. (Without it the request is refused, with a message that says so: see
/// tests/check.rs. Through Envoy that refusal races the client still sending its body, so it is
/// asserted on Check directly.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_body_without_its_model_is_admitted_with_the_model_header() {
    let stack = Stack::start("").await;
    let body = chat_body_messages_first("m", 10, 1_200_000);
    let r = stack.chat("big", &body, &[("x-tollgate-model", "m")]).await;
    assert_eq!(r.status, 200, "{r:?}");
    // max_tokens was past the cut too, so the model's ceiling is held.
    let expected = (body.len() as u64).div_ceil(4) + 4096;
    assert_eq!(r.header("x-test-reserved-tokens"), Some(expected.to_string().as_str()));
}

/// failure_mode_allow: false with status_on_error 503: tollgate down is not "admit everything".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_fails_closed_with_503_when_tollgate_is_down() {
    let mut stack = Stack::start("").await;
    let body = chat_body("m", Some(10), 10);
    assert_eq!(stack.chat("acme", &body, &[]).await.status, 200);
    let _ = stack.tollgate.child.kill();
    let _ = stack.tollgate.child.wait();
    let r = stack.chat("acme", &body, &[]).await;
    assert_eq!(r.status, 503, "{r:?}");
}

#[test]
fn the_envoy_bootstrap_validates() {
    let config = support::procs::envoy_config(10000, 9901, 50051, 8000);
    let out = support::procs::envoy_validate(&config);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("OK") || String::from_utf8_lossy(&out.stderr).contains("OK"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tollgate_headers_a_client_sends_never_reach_the_backend() {
    let stack = Stack::start("").await;
    let forged = "big:00000000000000000000000000000000";
    let extra = [
        SKIP_COMMIT,
        ("x-tollgate-reservation", forged),
        ("x-tollgate-reserved-tokens", "1"),
        ("x-tollgate-unmetered", "store_unavailable"),
        ("x-tollgate-output-ceiling", "1000000"),
        ("x-tollgate-anything", "else"),
    ];
    let r = stack.chat("big", &chat_body("m", Some(20), 10), &extra).await;
    assert_eq!(r.status, 200, "{r:?}\n{}", stack.diagnostics());
    let id = r.header("x-test-reservation").unwrap().to_string();
    assert_ne!(id, forged);
    let reserved = r.header("x-test-reserved-tokens").unwrap();
    // What reached the backend: tollgate's own headers, as tollgate set them, and nothing else.
    assert_eq!(
        r.header("x-test-tollgate-headers"),
        Some(
            format!(
                "x-tollgate-model=m;x-tollgate-output-ceiling=20;x-tollgate-reservation={id};x-tollgate-reserved-tokens={reserved}"
            )
            .as_str()
        ),
        "{}",
        stack.diagnostics()
    );
}
