//! A stand-in OpenAI-compatible backend for tests (tollgate does not own the backend, so a small
//! fake is fair here). It answers `/v1/chat/completions` with a `usage` block and, like a real
//! integration, commits that usage to tollgate with the reservation id Envoy forwarded.
//!
//! Test controls, as request headers: `x-test-output-tokens: N` sets the completion tokens
//! (default: min(max_tokens, 16)); `x-test-skip-commit: 1` plays a client that never comes back;
//! `x-test-status: N` answers that status with an error body and no usage, commits nothing, and
//! leaves the hold to Envoy's commit from the response (with `x-test-retry-after: S`, it carries
//! `retry-after: S`). `x-test-gzip: 1` answers 200 with a `content-encoding: gzip` body (opaque
//! bytes whose plain text would read as usage), commits nothing and leaves the hold to Envoy.
//! `x-test-silent-commit: 1` commits as usual but does not say so, so Envoy commits too.
//! `x-test-delay-ms: N` waits N ms before answering (a queue at the backend, a slow first token).
//! `x-test-cached-tokens: N` reports N of the prompt as read from the provider's cache
//! (`prompt_tokens_details.cached_tokens`), commits nothing and leaves the hold to Envoy.
//! It echoes what it saw in `x-test-reservation`, `x-test-reserved-tokens` and
//! `x-test-commit-state`, and every `x-tollgate-*` header that reached it, sorted, as
//! `x-test-tollgate-headers: name=value;name=value`.
//!
//! Started with an output quota ([`Upstream::with_output_quota`]), it plays a provider account
//! that reckons each request's output at its `max_tokens` when it arrives (as providers do): a
//! bucket of one minute's tokens refilled over the minute, a request it cannot take answered 429
//! with `retry-after` (counted: [`Upstream::refused`]), one it takes generating all of them.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::task::JoinHandle;
use tollgate::proto::CommitRequest;
use tollgate::proto::admission_client::AdmissionClient;
use tonic::transport::Channel;

pub struct Upstream {
    pub port: u16,
    task: JoinHandle<()>,
    quota: Option<Arc<Quota>>,
}

/// A provider's output tokens a minute: a bucket of one minute's, and the requests it refused.
struct Quota {
    per_minute: f64,
    bucket: Mutex<(f64, Instant)>,
    refused: AtomicU64,
}

impl Quota {
    /// Takes `tokens` if the bucket holds them; else the seconds until it would.
    fn take(&self, tokens: u64) -> Result<(), u64> {
        let mut bucket = self.bucket.lock().unwrap();
        let (level, at) = *bucket;
        let now = Instant::now();
        let level = (level + now.duration_since(at).as_secs_f64() * self.per_minute / 60.0).min(self.per_minute);
        #[allow(clippy::cast_precision_loss)]
        let tokens = tokens as f64;
        if level < tokens {
            *bucket = (level, now);
            self.refused.fetch_add(1, Ordering::Relaxed);
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            return Err(((tokens - level) * 60.0 / self.per_minute).ceil() as u64);
        }
        *bucket = (level - tokens, now);
        Ok(())
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Upstream {
    pub async fn start(tollgate_endpoint: String) -> Upstream {
        Upstream::serve(tollgate_endpoint, None).await
    }

    /// A provider account allowing `per_minute` output tokens a minute (see the module's doc).
    pub async fn with_output_quota(tollgate_endpoint: String, per_minute: u64) -> Upstream {
        #[allow(clippy::cast_precision_loss)]
        let per_minute = per_minute as f64;
        let quota = Quota { per_minute, bucket: Mutex::new((per_minute, Instant::now())), refused: AtomicU64::new(0) };
        Upstream::serve(tollgate_endpoint, Some(Arc::new(quota))).await
    }

    /// The requests the provider account refused (429).
    pub fn refused(&self) -> u64 {
        self.quota.as_ref().map_or(0, |q| q.refused.load(Ordering::Relaxed))
    }

    async fn serve(tollgate_endpoint: String, quota: Option<Arc<Quota>>) -> Upstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let channel = Channel::from_shared(tollgate_endpoint).unwrap().connect_lazy();
        let client = AdmissionClient::new(channel);
        let shared = quota.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                let (client, quota) = (client.clone(), shared.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| handle(req, client.clone(), quota.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Upstream { port, task, quota }
    }
}

async fn handle(
    req: Request<Incoming>,
    mut client: AdmissionClient<Channel>,
    quota: Option<Arc<Quota>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    let mut own: Vec<String> = req
        .headers()
        .iter()
        .filter(|(k, _)| k.as_str().starts_with("x-tollgate-"))
        .map(|(k, v)| format!("{}={}", k.as_str(), v.to_str().unwrap_or("?")))
        .collect();
    own.sort();
    let reservation = header("x-tollgate-reservation");
    let reserved = header("x-tollgate-reserved-tokens").unwrap_or_default();
    let output: Option<u64> = header("x-test-output-tokens").and_then(|v| v.parse().ok());
    let cached: Option<u64> = header("x-test-cached-tokens").and_then(|v| v.parse().ok());
    let skip = header("x-test-skip-commit").is_some() || cached.is_some();
    let silent = header("x-test-silent-commit").is_some() || cached.is_some();
    if let Some(status) = header("x-test-status").and_then(|s| s.parse::<u16>().ok()) {
        let response = Response::builder()
            .status(status)
            .header("retry-after", header("x-test-retry-after").unwrap_or_else(|| "0".into()))
            .header("content-type", "application/json")
            .header("x-test-reservation", reservation.unwrap_or_default())
            .body(Full::new(Bytes::from(r#"{"error":{"message":"injected","type":"server_error"}}"#)))
            .unwrap();
        return Ok(response);
    }
    if header("x-test-gzip").is_some() {
        let response = Response::builder()
            .header("content-type", "application/json")
            .header("content-encoding", "gzip")
            .header("x-test-reservation", reservation.unwrap_or_default())
            .header("x-test-reserved-tokens", reserved)
            .body(Full::new(Bytes::from(r#"{"usage":{"prompt_tokens":1,"completion_tokens":1}}"#)))
            .unwrap();
        return Ok(response);
    }
    if let Some(ms) = header("x-test-delay-ms").and_then(|v| v.parse::<u64>().ok()) {
        // A backend that queues the request, or is slow to its first token.
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let max_tokens = json["max_tokens"].as_u64().or(json["max_completion_tokens"].as_u64()).unwrap_or(16);
    let prompt = (body.len() as u64).div_ceil(4);
    let mut completion = output.unwrap_or(max_tokens.min(16));
    if let Some(quota) = &quota {
        if let Err(wait) = quota.take(max_tokens) {
            let response = Response::builder()
                .status(429)
                .header("retry-after", wait.to_string())
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(r#"{"error":{"message":"provider quota","type":"rate_limit_error"}}"#)))
                .unwrap();
            return Ok(response);
        }
        completion = max_tokens;
    }

    let mut commit_state = String::from("skipped");
    if let (Some(id), false) = (&reservation, skip) {
        let request = CommitRequest {
            reservation_id: id.clone(),
            prompt_tokens: prompt,
            completion_tokens: completion,
            ..Default::default()
        };
        commit_state = match client.commit(request).await {
            Ok(r) => r.into_inner().state,
            Err(status) => format!("error: {}", status.message()),
        };
    }
    let mut usage = serde_json::json!({
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    });
    if let Some(cached) = cached {
        usage["usage"]["prompt_tokens_details"] = serde_json::json!({ "cached_tokens": cached });
    }
    let response = Response::builder()
        .header("content-type", "application/json")
        .header("x-test-reservation", reservation.unwrap_or_default())
        .header("x-test-reserved-tokens", reserved)
        .header("x-test-commit-state", commit_state)
        .header("x-test-tollgate-headers", own.join(";"))
        .body(Full::new(Bytes::from(usage.to_string())))
        .unwrap();
    let mut response = response;
    if !silent {
        // This backend commits itself: Envoy's commit from the response leaves its holds alone.
        response.headers_mut().insert("x-tollgate-commit", hyper::header::HeaderValue::from_static("caller"));
    }
    Ok(response)
}

/// What a client saw.
#[derive(Debug)]
pub struct HttpReply {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: String,
}

impl HttpReply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("body {:?} is not JSON: {e}", self.body))
    }
}

/// POSTs to Envoy on 127.0.0.1:`port`.
pub async fn post(port: u16, path: &str, headers: &[(&str, &str)], body: impl Into<Bytes>) -> HttpReply {
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut req = Request::post(format!("http://127.0.0.1:{port}{path}")).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(body.into())).unwrap();
    let res = tokio::time::timeout(std::time::Duration::from_secs(10), client.request(req))
        .await
        .expect("request timed out")
        .expect("request failed");
    let status = res.status().as_u16();
    let headers = res.headers().clone();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    HttpReply { status, headers, body: String::from_utf8_lossy(&body).into_owned() }
}

/// A chat completion body with about `content_len` bytes of prompt, `model` first (as most SDKs
/// other than OpenAI's Python one send it).
pub fn chat_body(model: &str, max_tokens: Option<i64>, content_len: usize) -> String {
    let max = max_tokens.map(|n| format!(r#","max_tokens":{n}"#)).unwrap_or_default();
    format!(r#"{{"model":{model:?}{max},"messages":[{{"role":"user","content":"{}"}}]}}"#, "x".repeat(content_len))
}

/// The same with `messages` first, as OpenAI's Python SDK sends it: a cut body loses the model.
pub fn chat_body_messages_first(model: &str, max_tokens: i64, content_len: usize) -> String {
    format!(
        r#"{{"messages":[{{"role":"user","content":"{}"}}],"model":{model:?},"max_tokens":{max_tokens}}}"#,
        "x".repeat(content_len)
    )
}
