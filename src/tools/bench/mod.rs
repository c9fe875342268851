//! `tollgate bench`: an open-loop load generator for the full admission cycle: Check (reserve),
//! then Commit, against a running tollgate over gRPC; or, in HTTP mode, a chat completion through
//! Envoy to the simulated backend, which commits its own usage.
//!
//! Open loop: every send time is fixed before the run (a constant rate), and each cycle's latency
//! is measured from its *scheduled* send time, not from when it was actually sent. A server that
//! stalls therefore cannot hide the queue it built: the requests scheduled during the stall are
//! charged the whole wait (no coordinated omission). The requests vary as real traffic does (see
//! [`RequestMix`]).

// Measurement arithmetic (rates, percentiles, simulated lengths), not token accounting: float
// casts here round a figure for display or a schedule, and saturate where they must.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

pub mod burst;
pub mod decision;
pub mod floor;
pub mod overload;
mod report;
pub mod sweep;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::auth::v3::authorization_client::AuthorizationClient;
use envoy_types::pb::envoy::service::auth::v3::{AttributeContext, CheckRequest, CheckResponse, attribute_context};
use tokio::sync::Mutex;
use tonic::transport::{Channel, Endpoint};

pub use report::{QuotaFigures, Report};

/// The median (of an even count, the upper middle), the lowest and the highest of `v`; zeros
/// when it is empty.
fn spread_of(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    match (v.first(), v.last()) {
        (Some(&lo), Some(&hi)) => (v[v.len() / 2], lo, hi),
        _ => (0.0, 0.0, 0.0),
    }
}

/// The median of `v` ([`spread_of`]'s); 0 when it is empty.
fn median(v: Vec<f64>) -> f64 {
    spread_of(v).0
}

use crate::tools::sim::lengths::{OutputLengths, Sampler};

use crate::proto::CommitRequest;
use crate::proto::admission_client::AdmissionClient;

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// tollgate's gRPC endpoint, e.g. `http://127.0.0.1:50051`; in HTTP mode, Envoy's. Several,
    /// comma separated, are replicas: cycle `i` goes to replica `i mod n`, its Check and its Commit
    /// both (as a sidecar's would).
    pub target: String,
    /// Drive HTTP chat completions through Envoy instead of gRPC cycles.
    pub http: bool,
    /// HTTP mode: the requests stream, and a cycle's latency is to the first byte of the body
    /// (time to first token) instead of to the last.
    pub stream: bool,
    /// With `stream`: time to the last byte after all (a whole stream, every chunk of it).
    pub last_byte: bool,
    /// Cycles per second, fixed for the run.
    pub rate: u32,
    pub duration: Duration,
    /// Cycles sent before measuring starts (connections warm, caches full).
    pub warmup: Duration,
    /// Tenants the load is spread over, round robin.
    pub tenants: Vec<String>,
    pub model: String,
    /// gRPC connections per target, used round robin.
    pub connections: usize,
    /// A Redis (`redis://host:port`) whose script calls are counted over each run (`INFO
    /// commandstats`): every call a decision made to the store, against the decisions sent.
    pub store_stats: Option<String>,
    /// The tenants' token quota, (tokens per minute, burst), each: what is admitted over a run is
    /// measured against `burst + rate × time` per tenant.
    pub quota: Option<(u64, u64)>,
    /// Every prompt this many bytes, instead of the realistic spread (to measure what a body's
    /// size costs).
    pub prompt_bytes: Option<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("bad target {0:?}: {1}")]
    Target(String, String),
    #[error("cannot connect to {0}: {1}")]
    Connect(String, tonic::transport::Error),
    #[error("{0}")]
    Options(String),
}

/// One cycle's outcome.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// From the scheduled send time to the Commit's reply (or to the denial).
    latency: Duration,
    admitted: bool,
    error: bool,
    /// Tokens the commit charged (its usage), when admitted.
    tokens: u64,
}

/// Shared with a running benchmark: how far it got, and a way to stop it early.
#[derive(Debug, Default)]
pub struct Control {
    /// Cycles sent so far in the current run.
    pub sent: AtomicU64,
    /// Set (by Ctrl-C) to stop scheduling; cycles already sent still finish and are reported.
    pub stop: AtomicBool,
}

/// Runs the load and reports latency percentiles over the measured window.
pub async fn run(options: &BenchOptions) -> Result<Report, BenchError> {
    run_with(options, Arc::new(Control::default())).await
}

/// [`run`], reporting progress to and taking a stop signal from `control`.
pub async fn run_with(options: &BenchOptions, control: Arc<Control>) -> Result<Report, BenchError> {
    if options.rate == 0 || options.rate > 200_000 {
        return Err(BenchError::Options("rate must be within 1..=200000 cycles/s".into()));
    }
    if options.duration.is_zero() || options.duration > Duration::from_secs(600) {
        return Err(BenchError::Options("duration must be within 1..=600 s".into()));
    }
    if options.tenants.is_empty() {
        return Err(BenchError::Options("name at least one tenant".into()));
    }
    let mut channels = Vec::new();
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
    let targets: Vec<&str> = options.target.split(',').map(str::trim).filter(|t| !t.is_empty()).collect();
    if targets.is_empty() {
        return Err(BenchError::Options("name at least one target".into()));
    }
    if !options.http {
        for target in &targets {
            let endpoint = Endpoint::from_shared(target.to_string())
                .map_err(|e| BenchError::Target(target.to_string(), e.to_string()))?
                .tcp_nodelay(true);
            let mut of_target = Vec::new();
            for _ in 0..options.connections.max(1) {
                of_target.push(endpoint.connect().await.map_err(|e| BenchError::Connect(target.to_string(), e))?);
            }
            channels.push(of_target);
        }
    }
    let store_calls_before = match &options.store_stats {
        Some(url) => Some(store_calls(url).await?),
        None => None,
    };
    let admitted_tokens = Arc::new(AtomicU64::new(0));
    let offered_tokens = Arc::new(AtomicU64::new(0));

    let interval = Duration::from_secs_f64(1.0 / f64::from(options.rate));
    let warm = (options.warmup.as_secs_f64() * f64::from(options.rate)) as u64;
    let measured = (options.duration.as_secs_f64() * f64::from(options.rate)) as u64;
    let total = warm + measured;
    let samples = Arc::new(Mutex::new(Vec::with_capacity(measured as usize)));
    let mix = Arc::new(RequestMix::new(&options.model, 1, options.prompt_bytes));

    // The schedule is kept by a thread of its own: tokio's timer ticks in whole milliseconds, so
    // at 1,000 cycles/s it would send most cycles late and charge the lateness to the server.
    // A thread's sleep is accurate to tens of microseconds.
    let start = Instant::now() + Duration::from_millis(50);
    let runtime = tokio::runtime::Handle::current();
    let tenants = options.tenants.clone();
    let dispatch_samples = samples.clone();
    let target = Arc::new(targets[0].to_string());
    let timing = (options.stream, options.last_byte);
    let tokens_total = admitted_tokens.clone();
    let offered_total = offered_tokens.clone();
    let sent_count = control.clone();
    control.sent.store(0, Ordering::Relaxed);
    let dispatcher = tokio::task::spawn_blocking(move || {
        let mut tasks = Vec::with_capacity(total as usize);
        for i in 0..total {
            if control.stop.load(Ordering::Relaxed) {
                break;
            }
            let scheduled = start + interval.mul_f64(i as f64);
            if let Some(wait) = scheduled.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let tenant = tenants[i as usize % tenants.len()].clone();
            let mix = mix.clone();
            let offered = mix.get(i);
            offered_total.fetch_add(offered.prompt_tokens + offered.output_tokens, Ordering::Relaxed);
            let samples = dispatch_samples.clone();
            let record = i >= warm;
            let tokens_total = tokens_total.clone();
            let task = if channels.is_empty() {
                let (client, target) = (http.clone(), target.clone());
                runtime.spawn(async move {
                    let request = mix.get(i);
                    let sample = http_cycle(&client, &target, tenant, &request.body, timing, scheduled).await;
                    tokens_total.fetch_add(sample.tokens, Ordering::Relaxed);
                    if record {
                        samples.lock().await.push(sample);
                    }
                })
            } else {
                let replica = &channels[i as usize % channels.len()];
                let channel = replica[(i as usize / channels.len()) % replica.len()].clone();
                runtime.spawn(async move {
                    let sample = cycle(channel, tenant, mix.get(i), scheduled).await;
                    tokens_total.fetch_add(sample.tokens, Ordering::Relaxed);
                    if record {
                        samples.lock().await.push(sample);
                    }
                })
            };
            tasks.push(task);
            control.sent.fetch_add(1, Ordering::Relaxed);
        }
        tasks
    });
    let tasks = dispatcher.await.map_err(|e| BenchError::Options(format!("dispatcher failed: {e}")))?;
    for task in tasks {
        let _ = task.await;
    }
    let elapsed = Instant::now().duration_since(start + interval.mul_f64(warm as f64));
    let samples = std::mem::take(&mut *samples.lock().await);
    let mut report = Report::new(options.rate, elapsed, samples.iter().map(|s| (s.latency, s.admitted, s.error)));
    let sent = sent_count.sent.load(Ordering::Relaxed);
    if let (Some(url), Some(before)) = (&options.store_stats, store_calls_before) {
        let calls = store_calls(url).await?.saturating_sub(before);
        report.store_calls_per_cycle = Some(calls as f64 / sent.max(1) as f64);
    }
    if let Some((per_minute, burst)) = options.quota {
        // Every cycle's send time was fixed; the run lasted from the first to the last of them.
        let seconds = sent as f64 / f64::from(options.rate);
        let allowed = options.tenants.len() as f64 * (burst as f64 + per_minute as f64 * seconds / 60.0);
        report.quota = Some(report::QuotaFigures {
            admitted: admitted_tokens.load(Ordering::Relaxed),
            allowed: allowed as u64,
            offered: offered_tokens.load(Ordering::Relaxed),
        });
    }
    Ok(report)
}

/// Script and function calls (`EVAL`, `EVALSHA`, `FCALL`) a Redis has served, from `INFO commandstats`.
async fn store_calls(url: &str) -> Result<u64, BenchError> {
    use crate::store::redis::{RedisOptions, RedisStore, RedisTarget};
    use fred::interfaces::ClientLike;
    let bad = |why: String| BenchError::Options(format!("--store-stats {url}: {why}"));
    let store = RedisStore::connect(&RedisTarget::Single(url.to_string()), RedisOptions::default())
        .await
        .map_err(|e| bad(e.to_string()))?;
    let text: Result<String, _> = store.client().custom(fred::cmd!("INFO"), vec!["commandstats"]).await;
    store.close().await;
    let text = text.map_err(|e| bad(e.to_string()))?;
    let calls = |command: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Ok(calls("fcall") + calls("evalsha") + calls("eval"))
}

/// `max_request_bytes` of the ext_authz filter in envoy/envoy.yaml.
const ENVOY_BODY_BYTES: usize = 1 << 20;

/// One request of the mix: its body, and the usage its commit reports.
#[derive(Debug)]
struct MixedRequest {
    body: String,
    prompt_tokens: u64,
    output_tokens: u64,
}

/// A realistic spread of requests, drawn once before the run (so drawing costs the run nothing):
/// prompt sizes log-normal around 1,200 bytes (about 300 tokens; from a few dozen to 32 KiB),
/// `max_tokens` of 128 to 1,024, and committed outputs log-normal around 150 tokens, cut at
/// `max_tokens`. Cycle `i` sends request `i mod 1024`. `prompt_bytes` fixes every prompt's size.
#[derive(Debug)]
struct RequestMix(Vec<MixedRequest>);

impl RequestMix {
    fn new(model: &str, seed: u64, prompt_bytes: Option<usize>) -> Self {
        let prompts = Sampler::new(OutputLengths::LogNormal { median: 1200.0, sigma: 1.0 }, seed);
        let outputs = Sampler::new(OutputLengths::LogNormal { median: 150.0, sigma: 0.8 }, seed + 1);
        let mut rng = fastrand::Rng::with_seed(seed + 2);
        let requests = (0..1024)
            .map(|_| {
                let bytes = prompt_bytes.unwrap_or_else(|| prompts.sample(32 * 1024) as usize);
                let max_tokens = [128, 256, 512, 1024][rng.usize(..4)];
                let body = format!(
                    r#"{{"model":"{model}","max_tokens":{max_tokens},"messages":[{{"role":"user","content":"{}"}}]}}"#,
                    "x".repeat(bytes)
                );
                MixedRequest {
                    prompt_tokens: (bytes as u64).div_ceil(4),
                    output_tokens: outputs.sample(max_tokens),
                    body,
                }
            })
            .collect();
        RequestMix(requests)
    }

    fn get(&self, i: u64) -> &MixedRequest {
        &self.0[i as usize % self.0.len()]
    }
}

/// One chat completion through Envoy: admitted means a 200 from the backend (which commits its
/// own usage); a tollgate denial is a denial; anything else is an error.
async fn http_cycle(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<bytes::Bytes>,
    >,
    target: &str,
    tenant: String,
    body: &str,
    (stream, last_byte): (bool, bool),
    scheduled: Instant,
) -> Sample {
    use http_body_util::BodyExt;
    let body = if stream { body.replacen('{', r#"{"stream":true,"#, 1) } else { body.to_string() };
    let request = hyper::Request::post(format!("{target}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-tenant-id", tenant)
        .body(http_body_util::Full::new(bytes::Bytes::from(body)));
    let Ok(request) = request else {
        return Sample { latency: scheduled.elapsed(), admitted: false, error: true, tokens: 0 };
    };
    let mut first_byte = None;
    let outcome = async {
        let res = client.request(request).await.ok()?;
        let status = res.status().as_u16();
        let denied = res.headers().contains_key("x-tollgate-reason");
        let mut body = res.into_body();
        while let Some(frame) = body.frame().await {
            frame.ok()?;
            first_byte.get_or_insert_with(|| scheduled.elapsed());
        }
        Some((status, denied))
    }
    .await;
    let latency = match first_byte {
        Some(first) if stream && !last_byte => first,
        _ => scheduled.elapsed(),
    };
    match outcome {
        Some((200, _)) => Sample { latency, admitted: true, error: false, tokens: 0 },
        Some((_, true)) => Sample { latency, admitted: false, error: false, tokens: 0 },
        _ => Sample { latency, admitted: false, error: true, tokens: 0 },
    }
}

/// The Check Envoy's bootstrap would send for a request of the mix: at most the first MiB of its
/// body, the rest announced by `content-length`.
fn check_request(tenant: String, mixed: &MixedRequest) -> CheckRequest {
    let body = mixed.body.as_bytes();
    let mut headers: std::collections::HashMap<String, String> =
        [("x-tenant-id".to_string(), tenant), ("content-type".into(), "application/json".into())].into();
    let sent = &body[..body.len().min(ENVOY_BODY_BYTES)];
    if sent.len() < body.len() {
        headers.insert("x-envoy-auth-partial-body".into(), "true".into());
        headers.insert("content-length".into(), body.len().to_string());
    }
    let http = attribute_context::HttpRequest {
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        headers,
        raw_body: sent.to_vec(),
        size: body.len() as i64,
        ..Default::default()
    };
    CheckRequest {
        attributes: Some(AttributeContext {
            request: Some(attribute_context::Request { http: Some(http), ..Default::default() }),
            ..Default::default()
        }),
    }
}

/// The reservation id an OK `CheckResponse` carries.
fn reservation_of(response: &CheckResponse) -> Option<String> {
    use envoy_types::pb::envoy::service::auth::v3::check_response::HttpResponse;
    match &response.http_response {
        Some(HttpResponse::OkResponse(ok)) => ok
            .headers
            .iter()
            .filter_map(|h| h.header.as_ref())
            .find(|h| h.key == crate::grpc::headers::RESERVATION)
            .map(|h| h.value.clone()),
        _ => None,
    }
}

/// One full admission: Check (reserve), then Commit of a usage below the hold.
async fn cycle(channel: Channel, tenant: String, mixed: &MixedRequest, scheduled: Instant) -> Sample {
    let mut authz = AuthorizationClient::new(channel.clone());
    let request = check_request(tenant, mixed);
    let failed = |admitted| Sample { latency: scheduled.elapsed(), admitted, error: true, tokens: 0 };
    let response = match authz.check(request).await {
        Ok(r) => r.into_inner(),
        Err(_) => return failed(false),
    };
    let id = reservation_of(&response);
    let Some(id) = id else {
        return Sample { latency: scheduled.elapsed(), admitted: false, error: false, tokens: 0 };
    };
    let mut admission = AdmissionClient::new(channel);
    let commit = CommitRequest {
        reservation_id: id,
        prompt_tokens: mixed.prompt_tokens,
        completion_tokens: mixed.output_tokens,
        ..Default::default()
    };
    match admission.commit(commit).await {
        Ok(_) => Sample {
            latency: scheduled.elapsed(),
            admitted: true,
            error: false,
            tokens: mixed.prompt_tokens + mixed.output_tokens,
        },
        Err(_) => failed(true),
    }
}
