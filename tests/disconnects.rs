//! The edges of a request through the shipped `envoy/envoy.yaml`: its body's size, and the end of
//! its stream, as the client's concurrency slot sees it. A body up to 1 MiB reaches tollgate whole
//! and is held at what it asks; a larger one is cut there, admitted, and held at the model's
//! output ceiling, since the rest could name a second `max_tokens`. A client that leaves mid-stream (an SDK's `stream.close()`, "stop generating") gets its
//! slot back within 250 ms: Envoy tells tollgate by closing the ext_proc stream
//! `deferred_close_timeout` after the client left, and tollgate commits what passed. And a
//! thousand streams that end normally each settle with their exact usage: the shorter close loses
//! no settlement and turns none of them into a metered one.

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::stack::Stack;
use support::upstream::post;
use tollgate::proto::CommitRequest;
use tollgate::tools::sim::formats::Text;

const POLICY: &str = "models:\n  sim: { max_output_tokens: 4096, bytes_per_token: 4 }\n\
                      tenants:\n  acme:\n    limits: { max_concurrency: 1000 }\n  single:\n    limits: { max_concurrency: 1 }\n";
const CHAT: &str = "/v1/chat/completions";

/// tollgate and the shipped Envoy in front of the simulated backend, generating at this speed.
async fn start(decode_tokens_per_second: f64) -> Stack {
    Stack::sim(POLICY, decode_tokens_per_second, Text::Tok, |c| c).await
}

fn chat(stream: bool) -> String {
    format!(
        r#"{{"model":"sim","max_tokens":100,"stream":{stream},"stream_options":{{"include_usage":true}},"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(200)
    )
}

/// Bodies on either side of the 1 MiB Envoy sends whole: each admitted (never a 413), the first
/// held at the 100 it asks, the second at the model's 4,096 with its prompt from content-length,
/// and both charged what the backend reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_past_what_envoy_sends_is_held_at_the_models_ceiling() {
    let stack = start(10_000.0).await;
    let mut admission = stack.client().await;
    for (content, ceiling) in [(1_000_000, 100), (3_000_000, 4096)] {
        let body = format!(
            r#"{{"model":"sim","max_tokens":100,"messages":[{{"role":"user","content":"{}"}}]}}"#,
            "x".repeat(content)
        );
        let r = post(stack.envoy.port, CHAT, &[("x-tenant-id", "acme")], body.clone()).await;
        assert_eq!(r.status, 200, "{content} bytes: {r:?}\n{}", stack.diagnostics());
        let reserved: u64 = r.header("x-sim-reserved-tokens").unwrap().parse().unwrap();
        assert_eq!(reserved, (body.len() as u64).div_ceil(4) + ceiling, "{content} bytes");
        let id = r.header("x-sim-reservation").unwrap().to_string();
        assert!(
            stack.settled_within(&id, Duration::from_millis(10), Duration::from_secs(5)).await.is_some(),
            "never settled"
        );
        let repeat = CommitRequest { reservation_id: id, prompt_tokens: 1, completion_tokens: 1, ..Default::default() };
        let c = admission.commit(repeat).await.unwrap().into_inner();
        assert_eq!((c.used_tokens, c.metered), ((content as u64).div_ceil(4) + 40, false), "{c:?}");
    }
}

/// A client holding the tenant's one slot reads two chunks of a long stream and leaves; the time
/// until its hold is settled (polled every 5 ms), and a new request admitted at once after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_gets_its_slot_back_within_250_ms() {
    // 40 tokens at 20 a second: two seconds of stream, of which the client reads the first chunks.
    let stack = start(20.0).await;
    let mut took = Vec::new();
    for _ in 0..3 {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let request = hyper::Request::post(format!("http://127.0.0.1:{}{CHAT}", stack.envoy.port))
            .header("content-type", "application/json")
            .header("x-tenant-id", "single")
            .body(Full::new(Bytes::from(chat(true))))
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.status(), 200, "{}", stack.diagnostics());
        let id = response.headers()["x-sim-reservation"].to_str().unwrap().to_string();
        let mut body = response.into_body();
        for _ in 0..2 {
            let frame = tokio::time::timeout(Duration::from_secs(5), body.frame()).await.unwrap();
            assert!(frame.is_some(), "the stream ended before the client left");
        }
        drop(body);
        drop(client);
        let left = Instant::now();
        let state = stack.settled_within(&id, Duration::from_millis(5), Duration::from_secs(5)).await;
        assert_eq!(state.as_deref(), Some("committed"), "{id}: charged what passed\n{}", stack.diagnostics());
        took.push(left.elapsed());
        // The slot is free: the next stream is admitted, not refused for concurrency.
    }
    eprintln!("settled after the client left: {took:?}");
    for t in &took {
        assert!(*t < Duration::from_millis(250), "the slot came back {t:?} after the client left: {took:?}");
    }
}

/// A thousand streams, 16 at a time, each committed from its response with exactly the usage it
/// reported: none lost, none metered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_normal_streams_each_settle_exactly() {
    let stack = start(20_000.0).await;
    let port = stack.envoy.port;
    let ids = futures_util::stream::iter(0..1000)
        .map(|_| async move {
            let r = post(port, CHAT, &[("x-tenant-id", "acme")], chat(true)).await;
            assert_eq!(r.status, 200, "{r:?}");
            r.header("x-sim-reservation").unwrap().to_string()
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    let mut admission = stack.client().await;
    let (mut exact, mut metered, mut open) = (0, 0, 0);
    for id in &ids {
        match stack.settled_within(id, Duration::from_millis(10), Duration::from_secs(5)).await.as_deref() {
            Some("committed") => {
                let repeat = CommitRequest {
                    reservation_id: id.clone(),
                    prompt_tokens: 999,
                    completion_tokens: 999,
                    ..Default::default()
                };
                let c = admission.commit(repeat).await.unwrap().into_inner();
                assert!(c.duplicate, "{c:?}");
                if c.metered { metered += 1 } else { exact += 1 }
            }
            _ => open += 1,
        }
    }
    eprintln!("1000 streams: {exact} exact, {metered} metered, {open} never settled");
    assert_eq!((exact, metered, open), (1000, 0, 0), "{}", stack.diagnostics());
}
