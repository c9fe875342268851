//! The loop closes in front of a backend that knows nothing of tollgate: real Envoy, tollgate's
//! ext_authz and ext_proc, and the simulated backend in its mode that commits nothing. Each hold
//! must end committed with what the backend generated (exactly when the response reports usage,
//! metered when not) or released when nothing was generated, with nobody calling Commit.

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::procs::{Envoy, OwnRedis, Tollgate, free_port};
use support::stack::Stack;
use support::upstream::post;
use tokio_util::sync::CancellationToken;
use tollgate::proto::admission_client::AdmissionClient;
use tollgate::proto::{CommitRequest, CommitResponse, PoolStatusRequest, ReleaseRequest, RenewRequest, ReserveRequest};
use tollgate::tools::sim::backend::{self, SimConfig, SimStats};
use tollgate::tools::sim::formats::Text;

const POLICY: &str = "models:\n  sim: { max_output_tokens: 4096, bytes_per_token: 4 }\n  m: { max_output_tokens: 4096, pool: provider }\n\
                      \x20 cached: { max_output_tokens: 4096, cache_read_weight: 0.25 }\n\
                      pools:\n  provider: { max_sequences: 8, prefill_tokens_per_second: 100000, decode_tokens_per_second: 1000, max_queue_delay_ms: 60000 }\n\
                      tenants:\n  acme:\n    lease_ttl_ms: 60000\n    limits: { max_concurrency: 100 }\n  brief:\n    lease_ttl_ms: 600\n  queued:\n    lease_ttl_ms: 600\n    limits: { max_concurrency: 1 }\n  probe:\n    limits: { tokens_per_minute: 60, burst_tokens: 100000 }\n";
const CHAT: &str = "/v1/chat/completions";

/// tollgate and Envoy in front of the simulated backend, generating "tok " at this speed.
async fn start(decode_tokens_per_second: f64) -> Stack {
    Stack::sim(POLICY, decode_tokens_per_second, Text::Tok, |c| c).await
}

fn chat(stream: bool, include_usage: bool) -> String {
    let options = if include_usage { r#","stream_options":{"include_usage":true}"# } else { "" };
    format!(
        r#"{{"model":"sim","max_tokens":100,"stream":{stream}{options},"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(200)
    )
}

const TENANT: (&str, &str) = ("x-tenant-id", "acme");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_response_is_committed_with_its_exact_usage() {
    let stack = start(10_000.0).await;
    let r = post(stack.envoy.port, CHAT, &[TENANT], chat(false, false)).await;
    assert_eq!(r.status, 200, "{r:?}\n{}", stack.diagnostics());
    let id = r.header("x-sim-reservation").unwrap().to_string();
    let usage = &r.json()["usage"];
    let c = stack.charged(&id).await;
    let reported = usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap();
    assert_eq!((c.used_tokens, c.metered), (reported, false), "charged what the response reported");
    assert_eq!(c.ending, "completed", "{c:?}");
    assert_eq!(usage["completion_tokens"], 40);
}

/// A response that says how much of its prompt the provider read from its cache is charged those
/// tokens at the model's weight (a quarter here), from the response alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_prompt_tokens_a_response_reports_count_at_the_models_weight() {
    let stack = Stack::test_upstream(POLICY).await;
    let body = format!(
        r#"{{"model":"cached","max_tokens":100,"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(4000)
    );
    let r = post(stack.envoy.port, CHAT, &[TENANT, ("x-test-cached-tokens", "800")], body).await;
    assert_eq!(r.status, 200, "{r:?}\n{}", stack.diagnostics());
    let usage = &r.json()["usage"];
    let (prompt, output) = (usage["prompt_tokens"].as_u64().unwrap(), usage["completion_tokens"].as_u64().unwrap());
    let c = stack.charged(r.header("x-test-reservation").unwrap()).await;
    assert_eq!((c.used_tokens, c.metered), (prompt - 800 + 200 + output, false), "{c:?}");
}

/// The usage chunk of an OpenAI stream, from the SSE body.
fn stream_usage(body: &str) -> Option<(u64, u64)> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find_map(|v| Some((v["usage"]["prompt_tokens"].as_u64()?, v["usage"]["completion_tokens"].as_u64()?)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_with_a_usage_chunk_is_committed_exactly() {
    let stack = start(10_000.0).await;
    let r = post(stack.envoy.port, CHAT, &[TENANT], chat(true, true)).await;
    assert_eq!(r.status, 200, "{r:?}");
    let (prompt, output) = stream_usage(&r.body).expect("a usage chunk");
    let c = stack.charged(r.header("x-sim-reservation").unwrap()).await;
    assert_eq!((c.used_tokens, c.metered), (prompt + output, false));
}

/// With commits from responses batched by tenant (`store.commit_window_ms`), each lands within
/// its window all the same, charged the response's own usage, JSON and streams alike; the
/// batches' sizes are in the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_commits_from_responses_land_with_each_its_own_usage() {
    let admin: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let policy = format!("server:\n  admin_listen: {admin}\nstore:\n  commit_window_ms: 50\n{POLICY}");
    let stack = Stack::sim(&policy, 10_000.0, Text::Tok, |c| c).await;
    let sends = (0..6).map(|i| post(stack.envoy.port, CHAT, &[TENANT], chat(i % 2 == 1, true)));
    for r in futures_util::future::join_all(sends).await {
        assert_eq!(r.status, 200, "{r:?}\n{}", stack.diagnostics());
        let (prompt, output) = match stream_usage(&r.body) {
            Some(counts) => counts,
            None => {
                let usage = &r.json()["usage"];
                (usage["prompt_tokens"].as_u64().unwrap(), usage["completion_tokens"].as_u64().unwrap())
            }
        };
        let c = stack.charged(r.header("x-sim-reservation").unwrap()).await;
        assert_eq!((c.used_tokens, c.metered, c.ending.as_str()), (prompt + output, false, "completed"), "{c:?}");
    }
    // (Windows and the commits they carried.)
    let windows = || {
        let (_, metrics) = support::procs::http_get(admin, "/metrics");
        let sample = |name: &str| {
            metrics.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok()).unwrap_or(0.0)
        };
        (sample("tollgate_commit_batch_count"), sample("tollgate_commit_batch_sum"))
    };
    let (batches, commits) = windows();
    assert_eq!(commits, 6.0, "every commit in a window");
    assert!((1.0..=6.0).contains(&batches), "{batches} batches");
    // A request alone in its window: its commit goes alone (commit.lua), a window of one all the same.
    let r = post(stack.envoy.port, CHAT, &[TENANT], chat(false, true)).await;
    assert_eq!(r.status, 200, "{r:?}");
    let c = stack.charged(r.header("x-sim-reservation").unwrap()).await;
    assert_eq!(c.ending, "completed", "{c:?}");
    assert_eq!(windows(), (batches + 1.0, 7.0), "a window of one counts as one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_usage_is_committed_metered() {
    let stack = start(10_000.0).await;
    let body = chat(true, false);
    let r = post(stack.envoy.port, CHAT, &[TENANT], body.clone()).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(stream_usage(&r.body), None);
    let c = stack.charged(r.header("x-sim-reservation").unwrap()).await;
    // The held prompt (body bytes / 4) and the metered output: 40 tokens of "tok " at 4 bytes each.
    let held_prompt = (body.len() as u64).div_ceil(4);
    assert_eq!((c.used_tokens, c.metered, c.ending.as_str()), (held_prompt + 40, true, "metered"), "{c:?}");
}

/// A stream without usage whose bytes read as more tokens than the request allowed (here a model
/// whose `bytes_per_token` is set too low: its 40 tokens of "tok " read as 160) is charged its
/// `max_tokens`, and its ending says the count was held to it; one that names no limit is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metered_stream_is_held_to_its_max_tokens() {
    let policy = POLICY.replace("bytes_per_token: 4 }", "bytes_per_token: 1 }");
    let stack = Stack::sim(&policy, 10_000.0, Text::Tok, |c| c).await;
    let body = chat(true, false);
    let r = post(stack.envoy.port, CHAT, &[TENANT], body.clone()).await;
    assert_eq!(r.status, 200, "{r:?}");
    let c = stack.charged(r.header("x-sim-reservation").unwrap()).await;
    let held_prompt = body.len() as u64;
    assert_eq!((c.used_tokens, c.metered, c.ending.as_str()), (held_prompt + 100, true, "metered_capped"), "{c:?}");
    // A request that names no limit runs to its backend's own default, which the policy's
    // ceiling does not bound: metered as it passed, uncapped.
    let body = body.replace(r#""max_tokens":100,"#, "");
    let r = post(stack.envoy.port, CHAT, &[TENANT], body.clone()).await;
    assert_eq!(r.status, 200, "{r:?}");
    let c = stack.charged(r.header("x-sim-reservation").unwrap()).await;
    assert_eq!((c.used_tokens, c.metered, c.ending.as_str()), (body.len() as u64 + 160, true, "metered"), "{c:?}");
}

/// A streamed request whose client reads `frames` frames of the response and leaves: what it
/// was charged.
async fn left_after(path: &str, body: String, frames: usize) -> CommitResponse {
    // 40 tokens at 20 tokens/s: two seconds of stream; the client leaves after the first chunks.
    let stack = start(20.0).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let request = hyper::Request::post(format!("http://127.0.0.1:{}{path}", stack.envoy.port))
        .header("content-type", "application/json")
        .header(TENANT.0, TENANT.1)
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let id = response.headers()["x-sim-reservation"].to_str().unwrap().to_string();
    let mut body = response.into_body();
    for _ in 0..frames {
        let frame = tokio::time::timeout(Duration::from_secs(5), body.frame()).await.unwrap();
        assert!(frame.is_some(), "the stream ended before the client left");
    }
    drop(body);
    drop(client);
    stack.charged(&id).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_is_charged_what_was_generated() {
    let c = left_after(CHAT, chat(true, false), 1).await;
    assert!(c.metered, "{c:?}");
    assert_eq!(c.ending, "client_left", "{c:?}");
    assert!(c.used_tokens < c.reserved_tokens, "charged what was generated, not the hold: {c:?}");
}

/// Anthropic's `message_start` carries a placeholder output count of 1: a stream cut after it
/// and some deltas is metered from the deltas, never taken as exact at 1 output token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anthropic_stream_cut_short_is_metered_not_taken_at_its_placeholder() {
    let c = left_after("/v1/messages", anthropic(true), 6).await;
    assert!(c.metered, "a placeholder count taken as exact: {c:?}");
    // The sim's prompt (50 held) and at least one delta's worth of output past the placeholder.
    assert!(c.used_tokens > 50 + 1, "{c:?}");
    assert!(c.used_tokens < c.reserved_tokens, "charged what was generated, not the hold: {c:?}");
}

/// Released, and entered in the ledger as the backend's refusal or failure, not the caller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_failure_before_any_output_releases_the_hold() {
    let ledger =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ext-proc-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&ledger);
    let stack = Stack::test_upstream(&format!("ledger:\n  file: {}\n{POLICY}", ledger.display())).await;
    let body = r#"{"model":"m","max_tokens":10,"messages":[]}"#;
    let mut ids = Vec::new();
    for status in ["500", "503", "429", "400"] {
        let r = post(stack.envoy.port, CHAT, &[TENANT, ("x-test-status", status)], body).await;
        assert_eq!(r.status.to_string(), status);
        let id = r.header("x-test-reservation").unwrap().to_string();
        assert_eq!(stack.settled(&id).await, "released", "{status}");
        ids.push(id);
    }
    let lines = std::fs::read_to_string(&ledger).unwrap();
    let entries: Vec<serde_json::Value> = lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let ending = |id: &str| entries.iter().find(|e| e["id"] == id).map(|e| e["ending"].clone());
    let endings: Vec<_> = ids.iter().map(|id| ending(id)).collect();
    let want = ["upstream_error", "upstream_error", "upstream_refused", "upstream_refused"].map(|e| Some(e.into()));
    assert_eq!(endings, want, "{lines}");
    let _ = std::fs::remove_file(&ledger);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_429_throttles_its_pool_until_its_retry_after() {
    let stack = Stack::test_upstream(POLICY).await;
    let (envoy, tollgate) = (&stack.envoy, &stack.tollgate);
    let mut client = AdmissionClient::connect(tollgate.endpoint()).await.unwrap();
    let body = r#"{"model":"m","max_tokens":10,"messages":[]}"#;
    let r = post(envoy.port, CHAT, &[TENANT, ("x-test-status", "429"), ("x-test-retry-after", "3")], body).await;
    assert_eq!(r.status, 429);
    let status = |client: &mut AdmissionClient<tonic::transport::Channel>| {
        let mut client = client.clone();
        async move { client.pool_status(PoolStatusRequest { pool: "provider".into() }).await.unwrap().into_inner() }
    };
    let start = Instant::now();
    let v = loop {
        let v = status(&mut client).await;
        if v.share < 1.0 {
            break v;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "the pool was never throttled\n{}", tollgate.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Halved by the 429, and recovering at 0.05 a second from then: a slow look sees a little more.
    assert!((0.5..0.52).contains(&v.share), "{v:?}");
    assert!((1..=3000).contains(&v.resumes_in_ms), "the provider's Retry-After: {v:?}");
    // Until then the pool admits nothing new: a 503 with the time left, not a trip to the provider.
    let r = post(envoy.port, CHAT, &[TENANT], body).await;
    assert_eq!((r.status, r.header("x-tollgate-reason")), (503, Some("queue_full")), "{r:?}");
    let wait: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=3).contains(&wait), "{wait}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_its_lease_is_renewed_while_it_flows() {
    // 40 tokens at 20 tokens/s: two seconds of stream against a 600 ms lease.
    let stack = start(20.0).await;
    let r = post(stack.envoy.port, CHAT, &[("x-tenant-id", "brief")], chat(true, true)).await;
    assert_eq!(r.status, 200, "{r:?}");
    let (prompt, output) = stream_usage(&r.body).expect("a usage chunk");
    // Committed, not late_committed: the lease never ran out while the stream flowed.
    let c = stack.charged(r.header("x-sim-reservation").unwrap()).await;
    assert_eq!((c.state.as_str(), c.used_tokens), ("committed", prompt + output));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_pending_longer_than_its_lease_keeps_its_hold() {
    // The backend answers after 2 s, three leases of 600 ms, and sends nothing before: the hold
    // is renewed by time, so its slot stays taken and it is committed, not late.
    let stack = Stack::test_upstream(POLICY).await;
    let tenant = ("x-tenant-id", "queued");
    let pending = [tenant, ("x-test-delay-ms", "2000"), ("x-test-skip-commit", "1"), ("x-test-silent-commit", "1")];
    let body = chat(false, false);
    let port = stack.envoy.port;
    let first = tokio::spawn({
        let body = body.clone();
        async move { post(port, CHAT, &pending, body).await }
    });
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let second = post(port, CHAT, &[tenant], body).await;
    assert_eq!(
        (second.status, second.header("x-tollgate-reason")),
        (429, Some("concurrency")),
        "the pending request still holds the one slot: {second:?}\n{}",
        stack.diagnostics()
    );
    let first = first.await.unwrap();
    assert_eq!(first.status, 200, "{first:?}");
    let id = first.header("x-test-reservation").unwrap().to_string();
    let c = stack.charged(&id).await;
    assert_eq!(c.state, "committed", "not late: {c:?}");
}

/// An Anthropic Messages or OpenAI Responses request through Envoy: the sim reports 50 prompt
/// tokens (200 bytes at 4 per token) and generates 40.
async fn other_format(path: &str, body: String) {
    let stack = start(10_000.0).await;
    let r = post(stack.envoy.port, path, &[TENANT], body).await;
    assert_eq!(r.status, 200, "{r:?}\n{}", stack.diagnostics());
    let c = stack.charged(r.header("x-sim-reservation").unwrap()).await;
    assert_eq!((c.used_tokens, c.metered), (50 + 40, false), "{path}: {c:?}\n{}", r.body);
}

fn anthropic(stream: bool) -> String {
    format!(
        r#"{{"model":"sim","max_tokens":100,"stream":{stream},"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(200)
    )
}

fn responses(stream: bool) -> String {
    format!(r#"{{"model":"sim","max_output_tokens":100,"stream":{stream},"input":"{}"}}"#, "x".repeat(200))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_json_and_streams_are_committed_exactly() {
    other_format("/v1/messages", anthropic(false)).await;
    other_format("/v1/messages", anthropic(true)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_api_json_and_streams_are_committed_exactly() {
    other_format("/v1/responses", responses(false)).await;
    other_format("/v1/responses", responses(true)).await;
}

/// A filter that skips the request headers and forwards `Check`'s dynamic metadata instead reads the
/// reservation from the metadata, and commits the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_forwarded_the_metadata_instead_of_the_request_headers_commits_the_same() {
    let stack = Stack::sim(POLICY, 10_000.0, Text::Tok, forwarding_the_metadata).await;
    let r = post(stack.envoy.port, CHAT, &[TENANT], chat(true, true)).await;
    assert_eq!(r.status, 200, "{r:?}\n{}", stack.diagnostics());
    let (prompt, completion) = stream_usage(&r.body).expect("a usage chunk");
    let c = stack.charged(r.header("x-sim-reservation").unwrap()).await;
    assert_eq!((c.used_tokens, c.metered), (prompt + completion, false), "{c:?}");
    // (The output ceiling comes the same way: `a_metered_stream_is_held_to_its_max_tokens_from_the_metadata`.)
}

/// The shipped Envoy config with ext_proc skipping the request headers and forwarding `Check`'s
/// dynamic metadata instead.
fn forwarding_the_metadata(config: String) -> String {
    const DEFERRED: &str = "                      deferred_close_timeout: 0.1s\n";
    assert!(config.contains(DEFERRED) && config.contains("request_header_mode: SEND"), "envoy.yaml changed");
    let forwarding = "                      metadata_options:\n\
                      \x20                       forwarding_namespaces: { untyped: [envoy.filters.http.ext_authz] }\n";
    config.replacen(DEFERRED, &format!("{DEFERRED}{forwarding}"), 1).replacen(
        "request_header_mode: SEND",
        "request_header_mode: SKIP",
        1,
    )
}

/// The output ceiling read from `Check`'s dynamic metadata (`output_ceiling`) holds a metered
/// count as the request header does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metered_stream_is_held_to_its_max_tokens_from_the_metadata() {
    let policy = POLICY.replace("bytes_per_token: 4 }", "bytes_per_token: 1 }");
    let stack = Stack::sim(&policy, 10_000.0, Text::Tok, forwarding_the_metadata).await;
    let body = chat(true, false);
    let r = post(stack.envoy.port, CHAT, &[TENANT], body.clone()).await;
    assert_eq!(r.status, 200, "{r:?}\n{}", stack.diagnostics());
    let c = stack.charged(r.header("x-sim-reservation").unwrap()).await;
    assert_eq!(
        (c.used_tokens, c.metered, c.ending.as_str()),
        (body.len() as u64 + 100, true, "metered_capped"),
        "{c:?}"
    );
}

/// A route whose backends commit themselves turns the filter off; other routes keep it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_can_turn_the_commit_from_the_response_off() {
    const ROUTES: &str = "                        - match: { prefix: \"/v1/\" }";
    let stack = Stack::sim(POLICY, 10_000.0, Text::Tok, |config| {
        assert!(config.contains(ROUTES), "envoy.yaml's route changed");
        let off = "                        - match: { prefix: \"/v1/messages\" }\n\
                   \x20                         route: { cluster: inference, timeout: 300s }\n\
                   \x20                         typed_per_filter_config:\n\
                   \x20                           envoy.filters.http.ext_proc:\n\
                   \x20                             \"@type\": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute\n\
                   \x20                             disabled: true\n";
        config.replacen(ROUTES, &format!("{off}{ROUTES}"), 1)
    })
    .await;
    let r = post(stack.envoy.port, "/v1/messages", &[TENANT], anthropic(false)).await;
    assert_eq!(r.status, 200, "{r:?}\n{}", stack.diagnostics());
    let id = r.header("x-sim-reservation").unwrap().to_string();
    let r = post(stack.envoy.port, CHAT, &[TENANT], chat(false, false)).await;
    stack.charged(r.header("x-sim-reservation").unwrap()).await;
    // The other route's hold was committed meanwhile; this one is still the caller's to commit.
    let mut client = stack.client().await;
    let state = client.renew(RenewRequest { reservation_id: id, lease_ms: 0 }).await.unwrap().into_inner().state;
    assert_eq!(state, "reserved");
}

/// A compressed body is never parsed: its usage is unknown, so the hold is charged as made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_response_is_charged_as_held_never_misread() {
    let stack = Stack::test_upstream(POLICY).await;
    let body = r#"{"model":"m","max_tokens":10,"messages":[]}"#;
    let r = post(stack.envoy.port, CHAT, &[TENANT, ("x-test-gzip", "1")], body).await;
    assert_eq!(r.status, 200);
    let (id, reserved) = (r.header("x-test-reservation").unwrap(), r.header("x-test-reserved-tokens").unwrap());
    let c = stack.charged(id).await;
    assert!(c.duplicate, "{c:?}");
    assert_eq!((c.used_tokens.to_string(), c.metered), (reserved.to_string(), true), "{c:?}");
}

/// The meter against true counts: streams without usage of English-like text (4.375 bytes per
/// token) metered at the model's 4 bytes per token. The error is the text's bytes per token over
/// the configured ratio, plus the noise of short outputs; docs/BENCHMARKS.md cites this run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_meter_error_on_english_like_text() {
    let stack = Stack::sim(POLICY, 100_000.0, Text::Words, |c| c).await;
    let body = chat(true, false).replace(r#""max_tokens":100"#, r#""max_tokens":400"#);
    let held_prompt = (body.len() as u64).div_ceil(4);
    let mut errors = Vec::new();
    for output in (10..=400).step_by(10) {
        let n = output.to_string();
        let r = post(stack.envoy.port, CHAT, &[TENANT, ("x-sim-output-tokens", &n)], body.clone()).await;
        assert_eq!(r.status, 200, "{r:?}");
        let c = stack.charged(r.header("x-sim-reservation").unwrap()).await;
        assert!(c.metered);
        let metered = c.used_tokens - held_prompt;
        errors.push((output, metered as f64 / output as f64 - 1.0));
    }
    let mean = errors.iter().map(|e| e.1).sum::<f64>() / errors.len() as f64;
    let (lo, hi) = errors.iter().fold((f64::MAX, f64::MIN), |(lo, hi), e| (lo.min(e.1), hi.max(e.1)));
    let long: Vec<f64> = errors.iter().filter(|e| e.0 >= 100).map(|e| e.1).collect();
    let (long_lo, long_hi) = long.iter().fold((f64::MAX, f64::MIN), |(lo, hi), e| (lo.min(*e), hi.max(*e)));
    println!(
        "meter error over {} streams of 10..400 tokens: mean {:+.1}%, range {:+.1}% to {:+.1}%; \
         outputs of 100 tokens or more: {:+.1}% to {:+.1}%",
        errors.len(),
        mean * 100.0,
        lo * 100.0,
        hi * 100.0,
        long_lo * 100.0,
        long_hi * 100.0
    );
    // 4.375 / 4 - 1 = +9.4 %, the systematic part.
    assert!((0.04..0.15).contains(&mean), "mean error {mean}");
    assert!(lo > -0.35 && hi < 0.6, "{errors:?}");
}

/// A backend that commits and does not say so: both commit, and the hold is charged once, with the
/// backend's counts (the first commit wins; the second is a duplicate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_also_commits_is_charged_once() {
    let stack = Stack::test_upstream(POLICY).await;
    let (envoy, tollgate) = (&stack.envoy, &stack.tollgate);
    let body = r#"{"model":"m","max_tokens":10,"messages":[]}"#;
    let r = post(envoy.port, CHAT, &[TENANT, ("x-test-silent-commit", "1"), ("x-test-output-tokens", "7")], body).await;
    assert_eq!((r.status, r.header("x-test-commit-state")), (200, Some("committed")), "{r:?}");
    let id = r.header("x-test-reservation").unwrap();
    let usage = &r.json()["usage"];
    let reported = usage["prompt_tokens"].as_u64().unwrap() + 7;
    // Envoy's commit from the same usage follows; both are one charge.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut client = AdmissionClient::connect(tollgate.endpoint()).await.unwrap();
    let c = client
        .commit(CommitRequest {
            reservation_id: id.into(),
            prompt_tokens: 999,
            completion_tokens: 999,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((c.duplicate, c.used_tokens, c.metered), (true, reported, false), "{c:?}");
}

/// A client that gives up before the response starts (the backend still reading a long prompt):
/// the prompt held is charged, no output, never left to expire. Seen in the tenant's bucket: the
/// held output comes back, the prompt does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_before_the_response_is_charged_the_prompt() {
    let tollgate = Tollgate::start(POLICY);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    // 10 prompt tokens a second: the 50-token prompt takes five seconds to read.
    let config = SimConfig { slots: 4, prefill_tokens_per_second: 10.0, tollgate: None, ..SimConfig::default() };
    let shutdown = CancellationToken::new();
    tokio::spawn(backend::serve(listener, config, shutdown.clone(), std::sync::Arc::new(SimStats::default())));
    let envoy = Envoy::start(tollgate.addr, port);
    let body = chat(false, false);
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        post(envoy.port, CHAT, &[("x-tenant-id", "probe")], body.clone()),
    )
    .await;
    assert!(gave_up.is_err(), "the response started early");
    let held_prompt = (body.len() as u64).div_ceil(4) as i64;
    let mut client = AdmissionClient::connect(tollgate.endpoint()).await.unwrap();
    // A one-token probe, released at once, reads the bucket: 100,000 less the prompt and its own 2
    // once the hold is settled (plus a token a second of refill); 100 less again while it is not.
    let start = Instant::now();
    loop {
        let probe = ReserveRequest {
            tenant: "probe".into(),
            model: "sim".into(),
            prompt_tokens: 1,
            max_tokens: 1,
            ..Default::default()
        };
        let r = client.reserve(probe).await.unwrap().into_inner();
        client.release(ReleaseRequest { reservation_id: r.reservation_id.clone() }).await.unwrap();
        let settled = 100_000 - held_prompt - 2;
        if r.remaining_tokens >= settled {
            assert!(r.remaining_tokens <= settled + 15, "the prompt stayed charged: {r:?}");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "never settled: {r:?}\n{}", tollgate.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
}

/// Redis stops answering (SIGSTOP) while a stream is generated, and is still stopped when it ends:
/// the commit from the response cannot reach it, is kept, and lands once Redis answers again (SIGCONT),
/// with the stream's exact usage, instead of leaving the hold to expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_could_not_reach_redis_lands_when_it_answers_again() {
    let redis = OwnRedis::start(free_port());
    let tollgate = Tollgate::start(&format!("store:\n  redis_url: redis://127.0.0.1:{}\n{POLICY}", redis.port));
    // 40 tokens at 20 a second: the stream takes two seconds.
    let (port, shutdown) = support::sim_backend(20.0, Text::Tok).await;
    let envoy = Envoy::start(tollgate.addr, port);
    let response = tokio::spawn(post(envoy.port, CHAT, &[TENANT], chat(true, true)));
    tokio::time::sleep(Duration::from_millis(700)).await;
    let signal = |which: &str| {
        let ok = std::process::Command::new("kill").args([which, &redis.child.id().to_string()]).status().unwrap();
        assert!(ok.success(), "kill {which}");
    };
    signal("-STOP");
    let r = response.await.unwrap();
    assert_eq!(r.status, 200, "{r:?}\n{}", tollgate.log());
    let (prompt, completion) = stream_usage(&r.body).expect("a usage chunk");
    let id = r.header("x-sim-reservation").unwrap().to_string();
    // The commit times out against the stopped Redis and waits for it.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(tollgate.log().contains("could not reach the store; retrying"), "{}", tollgate.log());
    signal("-CONT");
    let mut client = AdmissionClient::connect(tollgate.endpoint()).await.unwrap();
    let start = Instant::now();
    loop {
        let state =
            client.renew(RenewRequest { reservation_id: id.clone(), lease_ms: 0 }).await.map(|r| r.into_inner().state);
        if state.as_deref().is_ok_and(|s| s == "committed") {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "never committed: {state:?}\n{}", tollgate.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let c = client
        .commit(CommitRequest { reservation_id: id, prompt_tokens: 999, completion_tokens: 999, ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((c.duplicate, c.used_tokens, c.metered), (true, prompt + completion, false), "{c:?}");
    // The retry logs once its commit has landed, a moment after the hold reads committed.
    let logged = Instant::now();
    while !tollgate.log().contains("settled on retry") {
        assert!(logged.elapsed() < Duration::from_secs(5), "{}", tollgate.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
}

/// A pool `gpu` serving model `sim`, whose policy says 2,000 prefill and `decode` decode tokens a
/// second.
fn calibrated(decode: u32) -> String {
    format!(
        "models:\n  sim: {{ max_output_tokens: 4096, bytes_per_token: 4, pool: gpu }}\n\
         pools:\n  gpu: {{ max_sequences: 4, prefill_tokens_per_second: 2000, decode_tokens_per_second: {decode}, max_queue_delay_ms: 60000 }}\n\
         tenants:\n  acme:\n    limits: {{ max_concurrency: 100 }}\n"
    )
}

async fn gpu_status(stack: &Stack) -> tollgate::proto::PoolStatusResponse {
    stack.client().await.pool_status(PoolStatusRequest { pool: "gpu".into() }).await.unwrap().into_inner()
}

/// The pool's speeds follow what its streams show: the backend decodes at 200 tokens a second
/// where the policy says 100, and prefills far faster than the 2,000 it says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_learns_its_backends_speeds_from_the_streams_it_watches() {
    let admin = format!("127.0.0.1:{}", support::procs::free_port());
    let policy = format!("server:\n  admin_listen: {admin}\n{}", calibrated(100));
    let stack = Stack::sim(&policy, 200.0, Text::Tok, |c| c).await;
    let before = gpu_status(&stack).await;
    assert_eq!(before.speeds.len(), 1, "{before:?}");
    assert_eq!((before.speeds[0].decode_tokens_per_second, before.speeds[0].decode_samples), (100.0, 0));
    for _ in 0..5 {
        let r = post(stack.envoy.port, CHAT, &[TENANT], chat(true, true)).await;
        assert_eq!(r.status, 200, "{r:?}");
        assert!(r.header("x-sim-reservation").is_some());
    }
    // The last commit from the response may still be on its way.
    let start = Instant::now();
    let s = loop {
        let v = gpu_status(&stack).await;
        if v.speeds[0].decode_samples == 5 || start.elapsed() > Duration::from_secs(5) {
            break v.speeds[0].clone();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        (s.model.as_str(), s.decode_samples, s.prefill_samples),
        ("sim", 5, 5),
        "{s:?}\n{}",
        stack.diagnostics()
    );
    // (A loaded machine slows the simulator's 20 ms steps a little: what it shows is what counts.)
    assert!((140.0..250.0).contains(&s.decode_tokens_per_second), "the backend decodes at 200: {s:?}");
    assert!(s.prefill_tokens_per_second > 4_000.0, "the backend prefills far faster than 2,000: {s:?}");
    // The same speeds, exported.
    let (status, body) = support::procs::http_get(admin.parse().unwrap(), "/metrics");
    assert!(status.contains("200"), "{status}");
    for gauge in ["tollgate_pool_prefill_speed", "tollgate_pool_decode_speed"] {
        let line = body.lines().find(|l| l.starts_with(gauge) && l.contains("pool=\"gpu\""));
        assert!(line.is_some_and(|l| l.contains("model=\"sim\"")), "no {gauge} for gpu/sim in\n{body}");
    }
}

/// A live stream frees its pool work as it generates: 100 tokens at 50 a second hold 2 s of work
/// at admission, and well before the stream ends the pool holds less than 1.2 s of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_stream_frees_its_pool_work_as_it_generates() {
    let stack = Stack::sim(&calibrated(50), 50.0, Text::Tok, |c| c).await;
    let port = stack.envoy.port;
    let stream =
        tokio::spawn(
            async move { post(port, CHAT, &[TENANT, ("x-sim-output-tokens", "100")], chat(true, true)).await },
        );
    let (mut admitted, mut least) = (0, u64::MAX);
    let start = Instant::now();
    while !stream.is_finished() && start.elapsed() < Duration::from_secs(10) {
        let v = gpu_status(&stack).await;
        if v.holds == 1 {
            admitted = admitted.max(v.work_ms);
            least = least.min(v.work_ms);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = stream.await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert!(admitted >= 2_000, "held 100 tokens at 50 a second: {admitted} ms");
    assert!(least < 1_200, "the pool still held {least} ms of the stream's work\n{}", stack.diagnostics());
    let start = Instant::now();
    while gpu_status(&stack).await.holds > 0 && start.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let v = gpu_status(&stack).await;
    assert_eq!((v.holds, v.work_ms), (0, 0), "the commit took the rest off");
}

/// The hold's prompt part learns the backend's tokenizer: the backend counts a prompt token every
/// 2 bytes of text where the policy says 4 bytes of body, so the first holds are half the prompt;
/// once a dozen responses have reported their counts, a prompt is held at least in full and at
/// most a tenth above it. A model told to keep its ratio keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prompt_estimate_learns_bytes_per_token_from_reported_counts() {
    let policy = "models:\n  sim: { max_output_tokens: 4096, bytes_per_token: 4 }\n\
                  \x20 fixed: { max_output_tokens: 4096, bytes_per_token: 4, learn_bytes_per_token: false }\n\
                  tenants:\n  acme:\n    limits: { max_concurrency: 100 }\n";
    let tollgate = Tollgate::start(policy);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let config = SimConfig {
        decode_tokens_per_second: 100_000.0,
        prefill_tokens_per_second: 1_000_000.0,
        bytes_per_token: 2.0,
        tollgate: None,
        ..SimConfig::default()
    };
    let shutdown = CancellationToken::new();
    tokio::spawn(backend::serve(listener, config, shutdown.clone(), std::sync::Arc::new(SimStats::default())));
    let envoy = Envoy::start(tollgate.addr, port);
    let mut client = AdmissionClient::connect(tollgate.endpoint()).await.unwrap();
    // (held prompt, reported prompt) of one request of `text_bytes` to `model`, once settled.
    let mut ask = async |model: &str, text_bytes: usize| {
        let body = format!(
            r#"{{"model":"{model}","max_tokens":100,"messages":[{{"role":"user","content":"{}"}}]}}"#,
            "x".repeat(text_bytes)
        );
        let r = post(envoy.port, CHAT, &[TENANT], body).await;
        assert_eq!(r.status, 200, "{r:?}\n{}", tollgate.log());
        let id = r.header("x-sim-reservation").unwrap().to_string();
        let reported = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
        let start = Instant::now();
        let c = loop {
            let repeat = CommitRequest { reservation_id: id.clone(), prompt_tokens: 1, ..Default::default() };
            let c = client.commit(repeat).await.unwrap().into_inner();
            if c.duplicate || start.elapsed() > Duration::from_secs(5) {
                break c;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert!(c.duplicate, "the response's commit never came: {c:?}\n{}", tollgate.log());
        (c.reserved_tokens - 100, reported)
    };
    let (held, reported) = ask("sim", 2000).await;
    assert_eq!(reported, 1000);
    assert!((500..560).contains(&held), "the policy's ratio first: {held}");
    for i in 0..12 {
        ask("sim", 1000 + 200 * i).await;
    }
    for text_bytes in [800, 2000, 4000] {
        let (held, reported) = ask("sim", text_bytes).await;
        assert!(
            held >= reported && held * 10 <= reported * 11,
            "{text_bytes} bytes of text: {held} held for {reported}"
        );
    }
    for i in 0..12 {
        ask("fixed", 1000 + 200 * i).await;
    }
    let (held, _) = ask("fixed", 2000).await;
    assert!((500..560).contains(&held), "a model that keeps its ratio: {held}");
    shutdown.cancel();
}

/// Three tenants, each far within its own limits, burst at a pool whose provider account allows
/// 600 output tokens a minute (the test upstream plays it, reckoning each request at its
/// `max_tokens` and answering 429 past it). tollgate's `provider_limits` say the same: what the
/// account cannot take is refused at the gateway with 503 `provider_rate` and a Retry-After, and
/// the provider never answers 429; a request sent again after its Retry-After is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_past_the_providers_rate_meets_tollgates_503_not_the_providers_429() {
    let policy = "models:\n  m: { max_output_tokens: 4096, pool: account }\n\
                  pools:\n  account: { max_sequences: 64, prefill_tokens_per_second: 100000, decode_tokens_per_second: 1000, \
                  max_queue_delay_ms: 60000, provider_limits: { output_tokens_per_minute: 600 } }\n\
                  default_tenant:\n  limits: { max_concurrency: 100 }\n";
    let stack = Stack::provider_upstream(policy, 600).await;
    let port = stack.envoy.port;
    let body = r#"{"model":"m","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}"#;
    let sends = ["a", "b", "c"].into_iter().flat_map(|tenant| {
        (0..6).map(move |_| {
            let headers = [("x-tenant-id", tenant), ("x-priority", "critical")];
            async move { post(port, CHAT, &headers, body).await }
        })
    });
    let replies = futures_util::future::join_all(sends).await;
    let admitted = replies.iter().filter(|r| r.status == 200).count();
    // 600 tokens at once, and 10 a second meanwhile: six requests of 100, a seventh at most.
    assert!((6..=7).contains(&admitted), "{admitted} admitted\n{}", stack.diagnostics());
    let mut waits = Vec::new();
    for r in replies.iter().filter(|r| r.status != 200) {
        assert_eq!((r.status, r.header("x-tollgate-reason")), (503, Some("provider_rate")), "{r:?}");
        let wait: u64 = r.header("retry-after").and_then(|v| v.parse().ok()).expect("a retry-after");
        assert!((1..=10).contains(&wait), "100 tokens at 10 a second at most: {r:?}");
        waits.push(wait);
    }
    assert_eq!(stack.upstream_refusals(), 0, "the provider never refused\n{}", stack.diagnostics());
    // The hint is one the gateway honours: sent again after it, admitted, still no 429.
    let wait = waits.iter().min().copied().unwrap();
    tokio::time::sleep(Duration::from_secs(wait)).await;
    let again = post(port, CHAT, &[("x-tenant-id", "a"), ("x-priority", "critical")], body).await;
    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(stack.upstream_refusals(), 0);
}
