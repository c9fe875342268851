//! `tollgate sim-backend`: a stand-in OpenAI-compatible inference server.
//!
//! It behaves the way admission control has to reckon with: `slots` sequences run at once and
//! everything else waits in a FIFO queue; a request holds its slot for prefill (prompt tokens at
//! the prefill speed) and then decode (one token at a time at the decode speed); the output stops
//! at a length drawn from [`OutputLengths`] or at `max_tokens`, whichever comes first.
//!
//! With `--tollgate` it commits its usage itself and says so (`x-tollgate-commit: caller`), so
//! Envoy's commit from the response leaves its holds alone; without, Envoy commits them.
//!
//! `POST /v1/chat/completions` answers JSON with a `usage` block, or with `"stream": true` a
//! server-sent event stream whose last chunk carries `usage` when `stream_options.include_usage`
//! is set; `/v1/messages` and `/v1/responses` answer as Anthropic's Messages API and OpenAI's
//! Responses API do, usage included (see [`super::formats`]). A request carrying `x-tollgate-reservation` is committed to tollgate with its real
//! usage when generation ends, and renewed every `renew_every` while it runs. A client that
//! disconnects stops its generation, and the tokens produced so far are committed: real usage,
//! not the hold. A test may fix one request's output with `x-sim-output-tokens`.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use super::formats::{self, Api};
use super::lengths::{OutputLengths, Sampler};
use crate::proto::admission_client::AdmissionClient;
use crate::proto::{CommitRequest, RenewRequest};

/// How the simulated fleet behaves.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub slots: usize,
    pub prefill_tokens_per_second: f64,
    /// Decode speed of one sequence.
    pub decode_tokens_per_second: f64,
    pub lengths: OutputLengths,
    pub seed: u64,
    /// Prompt bytes per token, for the usage it reports.
    pub bytes_per_token: f64,
    /// tollgate's gRPC endpoint; usage is committed there when set.
    pub tollgate: Option<String>,
    pub renew_every: Duration,
    /// What the generated tokens read as.
    pub text: formats::Text,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            slots: 4,
            prefill_tokens_per_second: 5_000.0,
            decode_tokens_per_second: 50.0,
            lengths: OutputLengths::default(),
            seed: 1,
            bytes_per_token: 4.0,
            tollgate: None,
            renew_every: Duration::from_secs(30),
            text: formats::Text::Tok,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("bad tollgate endpoint {0:?}: {1}")]
    Endpoint(String, String),
    #[error("bad configuration: {0}")]
    Config(String),
}

/// Counters of what the backend did, for tests, the demo and the overload bench; and the one
/// setting a bench may change while it runs.
#[derive(Debug, Default)]
pub struct SimStats {
    pub completed: AtomicU64,
    pub disconnected: AtomicU64,
    pub commits: AtomicU64,
    pub renewals: AtomicU64,
    /// Sequences on a slot now (prefilling or decoding).
    pub running: AtomicU64,
    /// Output tokens generated, and those of them generated for a client that left before the end.
    pub tokens: AtomicU64,
    pub cut_tokens: AtomicU64,
    /// Time spent decoding them, summed over sequences (µs): `tokens` over it is the decode speed
    /// one sequence achieved (a step's sleep runs a little long on a loaded machine).
    pub decode_micros: AtomicU64,
    /// The decode speed from now on (an `f64`'s bits; 0: the configured one): a bench slows the
    /// fleet mid-run with it.
    pub decode_override: AtomicU64,
    /// Slot time of the generations that ended (µs, prefill and decode): its growth over slots
    /// times the time passed is the fleet's utilisation (`GET /sim/stats`).
    pub busy_micros: AtomicU64,
}

impl SimStats {
    /// Every sequence decodes at `tokens_per_second` from its next step on.
    pub fn set_decode_speed(&self, tokens_per_second: f64) {
        self.decode_override.store(tokens_per_second.to_bits(), Ordering::Relaxed);
    }
}

struct Sim {
    config: SimConfig,
    slots: Arc<Semaphore>,
    sampler: Sampler,
    tollgate: Option<AdmissionClient<Channel>>,
    stats: Arc<SimStats>,
    /// Seeds each response's text, so runs repeat.
    seeds: AtomicU64,
}

impl Sim {
    /// The decode speed now: the configured one unless a bench changed it.
    fn decode_tokens_per_second(&self) -> f64 {
        match self.stats.decode_override.load(Ordering::Relaxed) {
            0 => self.config.decode_tokens_per_second,
            bits => f64::from_bits(bits),
        }
    }

    fn next_seed(&self) -> u64 {
        self.config.seed.wrapping_add(self.seeds.fetch_add(1, Ordering::Relaxed))
    }
}

/// Serves until `shutdown` is cancelled. Returns the counters, shared with the running server.
pub async fn serve(
    listener: TcpListener,
    config: SimConfig,
    shutdown: CancellationToken,
    stats: Arc<SimStats>,
) -> Result<(), SimError> {
    if config.slots == 0 || !(config.prefill_tokens_per_second > 0.0 && config.decode_tokens_per_second > 0.0) {
        return Err(SimError::Config("slots and both speeds must be positive".into()));
    }
    let tollgate = match &config.tollgate {
        Some(url) => Some(AdmissionClient::new(
            Endpoint::from_shared(url.clone())
                .map_err(|e| SimError::Endpoint(url.clone(), e.to_string()))?
                .tcp_nodelay(true)
                .connect_lazy(),
        )),
        None => None,
    };
    let sim = Arc::new(Sim {
        slots: Arc::new(Semaphore::new(config.slots)),
        sampler: Sampler::new(config.lengths, config.seed),
        config,
        tollgate,
        stats,
        seeds: AtomicU64::new(0),
    });
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!("sim-backend accept failed: {e}");
                    continue;
                }
            },
            () = shutdown.cancelled() => return Ok(()),
        };
        let _ = stream.set_nodelay(true);
        let sim = sim.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let sim = sim.clone();
                async move {
                    let commits_itself = sim.tollgate.is_some();
                    let reservation = req.headers().get("x-tollgate-reservation").cloned();
                    let reserved = req.headers().get("x-tollgate-reserved-tokens").cloned();
                    let mut response = handle(sim, req).await?;
                    // Echoed, so a client (a test) can look its hold up.
                    if let Some(id) = reservation {
                        response.headers_mut().insert("x-sim-reservation", id);
                    }
                    if let Some(tokens) = reserved {
                        response.headers_mut().insert("x-sim-reserved-tokens", tokens);
                    }
                    if commits_itself {
                        // Envoy's commit from the response leaves this backend's holds to it.
                        response
                            .headers_mut()
                            .insert("x-tollgate-commit", hyper::header::HeaderValue::from_static("caller"));
                    }
                    Ok::<_, Infallible>(response)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

/// The fleet's counters, as JSON (slots, running, busy_micros, completed, tokens).
pub const STATS_PATH: &str = "/sim/stats";

type Body = BoxBody<Bytes, Infallible>;
type Chunks = mpsc::Sender<Result<Frame<Bytes>, Infallible>>;
/// Where a streaming generation sends its tokens, and how a step of tokens becomes an SSE frame.
type Sink<'a> = (&'a Chunks, &'a (dyn Fn(u64) -> Frame<Bytes> + Sync));

fn json(status: StatusCode, value: serde_json::Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(value.to_string())).boxed())
        .unwrap_or_default()
}

fn error(status: StatusCode, message: &str) -> Response<Body> {
    json(status, serde_json::json!({"error": {"message": message, "type": "invalid_request_error"}}))
}

async fn handle(sim: Arc<Sim>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    if req.uri().path() == STATS_PATH && req.method() == hyper::Method::GET {
        let s = &sim.stats;
        return Ok(json(
            StatusCode::OK,
            serde_json::json!({
                "slots": sim.config.slots,
                "running": s.running.load(Ordering::Relaxed),
                "busy_micros": s.busy_micros.load(Ordering::Relaxed),
                "completed": s.completed.load(Ordering::Relaxed),
                "tokens": s.tokens.load(Ordering::Relaxed),
            }),
        ));
    }
    let (api, path_stream) = match Api::of_path(req.uri().path()) {
        Some(api) if req.method() == hyper::Method::POST => api,
        _ => {
            return Ok(error(
                StatusCode::NOT_FOUND,
                "the simulator serves POST /v1/chat/completions, /v1/messages, /v1/responses, /v1/embeddings, \
                 Gemini's generateContent, Bedrock's converse and Ollama's /api/chat and /api/generate, \
                 and GET /sim/stats",
            ));
        }
    };
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    let reservation = header("x-tollgate-reservation");
    let fixed_output = header("x-sim-output-tokens").and_then(|v| v.parse::<u64>().ok());
    let body = match Limited::new(req.into_body(), 16 << 20).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Ok(error(StatusCode::BAD_REQUEST, "body unreadable or over 16 MiB")),
    };
    let ask = match formats::parse(api, path_stream, &body, sim.config.bytes_per_token) {
        Ok(a) => a,
        Err(e) => return Ok(error(StatusCode::BAD_REQUEST, &e)),
    };
    let output = match fixed_output {
        // Embeddings generate nothing.
        _ if ask.max_tokens == 0 => 0,
        Some(n) => n.clamp(1, ask.max_tokens),
        None => sim.sampler.sample(ask.max_tokens),
    };

    // The queue: a slot is taken in arrival order, and held for the whole generation.
    let Ok(slot) = sim.slots.clone().acquire_owned().await else {
        return Ok(error(StatusCode::SERVICE_UNAVAILABLE, "simulator shutting down"));
    };
    let mut generation = Generation::new(sim.clone(), reservation, ask.prompt_tokens);
    if !ask.stream {
        generation.run(output, None).await;
        generation.finish().await;
        drop(slot);
        let mut writer = formats::Writer::new(sim.config.text, sim.next_seed());
        let mut response = json(StatusCode::OK, formats::answer(&ask, output, &mut writer));
        for (name, value) in formats::answer_headers(&ask, output) {
            if let Ok(value) = hyper::header::HeaderValue::from_str(&value) {
                response.headers_mut().insert(name, value);
            }
        }
        return Ok(response);
    }

    let (tx, rx): (Chunks, _) = mpsc::channel(16);
    tokio::spawn(async move {
        let _slot = slot;
        let frame = |bytes: Vec<u8>| Ok(Frame::data(Bytes::from(bytes)));
        for opening in formats::opening(&ask) {
            let _ = tx.send(frame(opening)).await;
        }
        let writer = std::sync::Mutex::new(formats::Writer::new(sim.config.text, sim.next_seed()));
        let chunk = |tokens: u64| {
            let text = writer.lock().unwrap_or_else(|p| p.into_inner()).take(tokens);
            Frame::data(Bytes::from(formats::step(&ask, &text)))
        };
        let complete = generation.run(output, Some((&tx, &chunk))).await;
        if complete {
            for closing in formats::closing(&ask, output) {
                let _ = tx.send(frame(closing)).await;
            }
        }
        generation.finish().await;
    });
    let body = StreamBody::new(ReceiverStream::new(rx)).boxed();
    Ok(Response::builder()
        .header("content-type", api.stream_content_type())
        .header("cache-control", "no-cache")
        .body(body)
        .unwrap_or_default())
}

/// One request's time on a slot. Dropped unfinished (the client went away while it ran), it still
/// commits the tokens produced so far.
struct Generation {
    sim: Arc<Sim>,
    reservation: Option<String>,
    prompt: u64,
    produced: u64,
    done: bool,
    began: std::time::Instant,
}

impl Generation {
    fn new(sim: Arc<Sim>, reservation: Option<String>, prompt: u64) -> Self {
        sim.stats.running.fetch_add(1, Ordering::Relaxed);
        Generation { sim, reservation, prompt, produced: 0, done: false, began: std::time::Instant::now() }
    }

    /// Prefill, then decode `output` tokens, streaming each step's tokens to `sink` when there is
    /// one; stops early (returning false) when the stream's client is gone.
    async fn run(&mut self, output: u64, sink: Option<Sink<'_>>) -> bool {
        let config = &self.sim.config;
        let started = Instant::now();
        let mut last_renewal = started;
        tokio::time::sleep(Duration::from_secs_f64(self.prompt as f64 / config.prefill_tokens_per_second)).await;
        while self.produced < output {
            // Decode in steps of about 20 ms of tokens: fine enough for streaming, cheap to simulate.
            let speed = self.sim.decode_tokens_per_second();
            let step = ((speed * 0.02).round() as u64).max(1);
            let tokens = step.min(output - self.produced);
            let began = Instant::now();
            tokio::time::sleep(Duration::from_secs_f64(tokens as f64 / speed)).await;
            self.produced += tokens;
            self.sim.stats.tokens.fetch_add(tokens, Ordering::Relaxed);
            self.sim.stats.decode_micros.fetch_add(began.elapsed().as_micros() as u64, Ordering::Relaxed);
            if let Some((tx, chunk)) = sink
                && tx.send(Ok(chunk(tokens))).await.is_err()
            {
                self.sim.stats.disconnected.fetch_add(1, Ordering::Relaxed);
                self.sim.stats.cut_tokens.fetch_add(self.produced, Ordering::Relaxed);
                return false;
            }
            if last_renewal.elapsed() >= config.renew_every {
                last_renewal = Instant::now();
                self.renew().await;
            }
        }
        self.sim.stats.completed.fetch_add(1, Ordering::Relaxed);
        true
    }

    async fn renew(&self) {
        if let (Some(client), Some(id)) = (&self.sim.tollgate, &self.reservation) {
            let request = RenewRequest { reservation_id: id.clone(), lease_ms: 0 };
            match client.clone().renew(request).await {
                Ok(_) => {
                    self.sim.stats.renewals.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => tracing::warn!(reservation = %id, "renew failed: {e}"),
            }
        }
    }

    /// Commits the usage once.
    async fn finish(&mut self) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        commit(self.sim.clone(), self.reservation.take(), self.prompt, self.produced).await;
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.sim.stats.running.fetch_sub(1, Ordering::Relaxed);
        let busy = u64::try_from(self.began.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.sim.stats.busy_micros.fetch_add(busy, Ordering::Relaxed);
        if self.done {
            return;
        }
        self.sim.stats.disconnected.fetch_add(1, Ordering::Relaxed);
        self.sim.stats.cut_tokens.fetch_add(self.produced, Ordering::Relaxed);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(commit(self.sim.clone(), self.reservation.take(), self.prompt, self.produced));
        }
    }
}

async fn commit(sim: Arc<Sim>, reservation: Option<String>, prompt: u64, completion: u64) {
    let (Some(client), Some(id)) = (&sim.tollgate, reservation) else { return };
    let request = CommitRequest {
        reservation_id: id.clone(),
        prompt_tokens: prompt,
        completion_tokens: completion,
        ..Default::default()
    };
    match client.clone().commit(request).await {
        Ok(_) => {
            sim.stats.commits.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => tracing::warn!(reservation = %id, "commit failed: {e}"),
    }
}
