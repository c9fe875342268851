//! The simulated backend does what the tests and the demo rely on: a real FIFO queue in front of
//! its slots, JSON and SSE answers with usage, commits of real usage (partial usage when the client
//! disconnects), and renewals during long streams.

mod support;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::procs::Tollgate;
use tokio_util::sync::CancellationToken;
use tollgate::proto::admission_client::AdmissionClient;
use tollgate::proto::{CommitRequest, CommitResponse, ReserveRequest};
use tollgate::tools::sim::backend::{self, SimConfig, SimStats};
use tollgate::tools::sim::lengths::OutputLengths;
use tollgate::tools::sim::load;

const POLICY: &str = "models:\n  sim: { max_output_tokens: 4096 }\ntenants:\n  acme:\n    lease_ttl_ms: 300\n    limits: { max_concurrency: 100 }\n";

struct Sim {
    addr: String,
    stats: Arc<SimStats>,
    shutdown: CancellationToken,
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn sim(config: SimConfig) -> Sim {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let (stats, shutdown) = (Arc::new(SimStats::default()), CancellationToken::new());
    tokio::spawn(backend::serve(listener, config, shutdown.clone(), stats.clone()));
    Sim { addr, stats, shutdown }
}

fn config(tollgate: &Tollgate, decode_tps: f64) -> SimConfig {
    SimConfig {
        slots: 2,
        prefill_tokens_per_second: 100_000.0,
        decode_tokens_per_second: decode_tps,
        lengths: OutputLengths::Fixed(20),
        tollgate: Some(tollgate.endpoint()),
        ..SimConfig::default()
    }
}

async fn reserve(t: &Tollgate) -> String {
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    let request = ReserveRequest {
        tenant: "acme".into(),
        model: "sim".into(),
        prompt_tokens: 10,
        max_tokens: 500,
        ..Default::default()
    };
    let reply = client.reserve(request).await.unwrap().into_inner();
    assert!(reply.admitted, "{reply:?}");
    reply.reservation_id
}

/// What tollgate recorded for a reservation: a repeated commit returns the first one's result.
async fn recorded(t: &Tollgate, id: &str) -> CommitResponse {
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    let request =
        CommitRequest { reservation_id: id.into(), prompt_tokens: 0, completion_tokens: 0, ..Default::default() };
    let reply = client.commit(request).await.unwrap().into_inner();
    assert!(reply.duplicate, "the backend should have committed already: {reply:?}");
    reply
}

fn chat(addr: &str, reservation: &str, output: u64, stream: bool) -> hyper::Request<Full<Bytes>> {
    let body = serde_json::json!({
        "model": "sim",
        "max_tokens": 500,
        "stream": stream,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "x".repeat(40)}],
    });
    let mut req =
        hyper::Request::post(format!("{addr}/v1/chat/completions")).header("x-sim-output-tokens", output.to_string());
    if !reservation.is_empty() {
        req = req.header("x-tollgate-reservation", reservation);
    }
    req.body(Full::new(Bytes::from(body.to_string()))).unwrap()
}

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(5), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_answer_carries_usage_and_the_usage_is_committed() {
    let t = Tollgate::start(POLICY);
    let s = sim(config(&t, 10_000.0)).await;
    let id = reserve(&t).await;
    let res = client().request(chat(&s.addr, &id, 20, false)).await.unwrap();
    assert_eq!(res.status(), 200);
    let body: serde_json::Value = serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["usage"], serde_json::json!({"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}));
    let r = recorded(&t, &id).await;
    assert_eq!((r.state.as_str(), r.used_tokens), ("committed", 30));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ends_with_a_usage_chunk_then_done() {
    let t = Tollgate::start(POLICY);
    let s = sim(config(&t, 10_000.0)).await;
    let id = reserve(&t).await;
    let res = client().request(chat(&s.addr, &id, 30, true)).await.unwrap();
    assert_eq!(res.headers()["content-type"], "text/event-stream");
    let text = String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let usage: serde_json::Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 30);
    let streamed: usize = events[..events.len() - 2]
        .iter()
        .map(|e| serde_json::from_str::<serde_json::Value>(e).unwrap())
        .map(|v| v["choices"][0]["delta"]["content"].as_str().unwrap_or("").matches("tok ").count())
        .sum();
    assert_eq!(streamed, 30, "every generated token was streamed");
    assert_eq!(recorded(&t, &id).await.used_tokens, 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_stops_generation_and_its_partial_usage_is_committed() {
    let t = Tollgate::start(POLICY);
    let s = sim(config(&t, 100.0)).await;
    let id = reserve(&t).await;
    // 300 tokens at 100 tokens/s would take 3 s; read one chunk, then hang up.
    let res = client().request(chat(&s.addr, &id, 300, true)).await.unwrap();
    let mut body = res.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.is_data());
    drop(body);
    wait_for("the partial commit", || s.stats.commits.load(Ordering::Relaxed) == 1).await;
    assert_eq!(s.stats.disconnected.load(Ordering::Relaxed), 1);
    let used = recorded(&t, &id).await.used_tokens;
    assert!(used > 10 && used < 10 + 300, "partial usage, not the whole generation: {used}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_stream_renews_its_lease() {
    let t = Tollgate::start(POLICY);
    let s = sim(SimConfig { renew_every: Duration::from_millis(100), ..config(&t, 100.0) }).await;
    let id = reserve(&t).await;
    // 100 tokens at 100 tokens/s: one second, past the 300 ms lease unless renewed.
    let res = client().request(chat(&s.addr, &id, 100, true)).await.unwrap();
    res.into_body().collect().await.unwrap();
    assert!(s.stats.renewals.load(Ordering::Relaxed) >= 5, "{:?}", s.stats);
    assert_eq!(recorded(&t, &id).await.state, "committed", "renewed, so not expired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_slots_wait_in_a_fifo_queue() {
    let t = Tollgate::start(POLICY);
    let s = sim(SimConfig { slots: 1, ..config(&t, 100.0) }).await;
    let started = Instant::now();
    let c = client();
    // 30 tokens at 100 tokens/s: 300 ms each, one slot.
    let one = async { c.request(chat(&s.addr, "", 30, false)).await.map(|_| started.elapsed()) };
    let two = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        c.request(chat(&s.addr, "", 30, false)).await.map(|_| started.elapsed())
    };
    let (one, two) = tokio::join!(one, two);
    let (one, two) = (one.unwrap(), two.unwrap());
    assert!(one >= Duration::from_millis(290) && one < Duration::from_millis(550), "{one:?}");
    assert!(two >= Duration::from_millis(590), "the second waited for the slot: {two:?}");
}

/// `GET /sim/stats` counts the slot time of the generations that ended: two requests of 300 ms
/// on one of two slots are 600 ms of the 2 slots' time, and sim-load's utilisation reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_reports_its_busy_slot_time() {
    let t = Tollgate::start(POLICY);
    let s = sim(SimConfig { tollgate: None, ..config(&t, 100.0) }).await;
    let before = load::fleet_busy(&s.addr).await.expect("stats");
    assert_eq!(before, (2, 0));
    let started = Instant::now();
    let c = client();
    for _ in 0..2 {
        let res = c.request(chat(&s.addr, "", 30, false)).await.unwrap();
        assert_eq!(res.status(), 200);
    }
    let after = load::fleet_busy(&s.addr).await.expect("stats");
    let busy = Duration::from_micros(after.1);
    assert!(busy >= Duration::from_millis(590) && busy < Duration::from_millis(900), "{busy:?}");
    let u = load::utilisation(before, after, started.elapsed());
    // One slot of two busy the whole time, less the requests' own round trips.
    assert!(u > 0.3 && u <= 0.5, "{u}");
}
