//! Envoy's `ExternalProcessor` = the commit phase, from the response itself, so the loop closes
//! in front of a backend that knows nothing of tollgate.
//!
//! One gRPC stream per HTTP request. Envoy sends the request headers (with the reservation and its
//! model, which `Check` added), the response headers and the response body as it streams, in
//! observability mode: it does not wait for tollgate, so the response is never held up. tollgate
//! reads the usage the response reports (or meters the text that passes, see
//! [`crate::llm::usage`]), renews the lease by time while the response is pending or streams (a
//! third of the tenant's lease after the last renewal, until the stream ends: the response is
//! over, the client left, or the route's timeout passed; each renewal on a task of its own, so the
//! stream is read on while the store answers), and when the response ends
//! settles the hold by how the response ended ([`crate::llm::settlement`] has the rules).
//!
//! A backend that commits itself says so with `x-tollgate-commit: caller` on its response, and
//! tollgate leaves the hold to it; a route whose backends all commit turns the filter off
//! (`ExtProcPerRoute { disabled: true }`). Only the backend's word counts: a client's request header
//! could claim it commits and so run for free (and `Check` strips every `x-tollgate-*` a client
//! sends anyway). Both committing is harmless, since commit is idempotent. A tollgate restart
//! mid-stream leaves the hold to expiry.
//!
//! Watching each response, it also teaches capacity admission the fleet (`admission::fleet`): a
//! stream's time from its first body bytes to its last over the tokens between times its pool's
//! decode speed; its time to first token over its prompt times the pool's prefill, when admission
//! predicted it would start at once (the `x-tollgate-forecast` Check sent upstream says; a request
//! that queued in the backend shows its queue, not its prefill). While a stream flows it reports
//! its remaining work to its pool (a task of its own, one at a time, each time the remainder has
//! fallen by a quarter), so the pool's queue frees as generation proceeds, not only at commit.
//!
//! A configuration may skip the request headers and forward `Check`'s dynamic metadata instead
//! (`metadata_options`): the reservation is read from whichever comes first. It saves one message
//! a request but opens the stream on the response's path, and a client that leaves before the
//! response then opens no stream at all, so its hold waits out its lease; docs/BENCHMARKS.md has
//! the measurements that kept the request headers in `envoy/envoy.yaml`.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Phase;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Reply;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, HeadersResponse, ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use envoy_types::pb::google::protobuf::{Struct, value::Kind};

use super::headers::{self, AUTHZ_NAMESPACE, COMMIT, FORECAST_FIELD, MODEL_FIELD, RESERVATION, RESERVATION_FIELD};
use crate::admission::fleet::Timing;
use crate::admission::retry::Settlement;
use crate::admission::{Admission, AdmissionError, Forecast};
use crate::config::DEFAULT_BYTES_PER_TOKEN;
use crate::hold::id as ids;
use crate::hold::{Ending, RenewOutcome};
use crate::llm::api::{self, Work};
use crate::llm::settlement::{self, Stop, Verdict};
use crate::llm::usage::{Measured, Meter};
use crate::store::Store;

/// The `envoy.service.ext_proc.v3.ExternalProcessor` service.
#[derive(Debug)]
pub struct ExtProcService<S> {
    admission: Arc<Admission<S>>,
}

impl<S> ExtProcService<S> {
    pub fn new(admission: Arc<Admission<S>>) -> Self {
        ExtProcService { admission }
    }
}

type Replies = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl<S: Store> ExternalProcessor for ExtProcService<S> {
    type ProcessStream = Replies;

    async fn process(&self, request: Request<Streaming<ProcessingRequest>>) -> Result<Response<Replies>, Status> {
        let mut inbound = request.into_inner();
        let (replies, out) = mpsc::channel(16);
        let admission = Arc::clone(&self.admission);
        // The exchange outlives this call: it settles the hold when the response ends, or when the
        // stream is cut short.
        tokio::spawn(async move {
            let mut exchange = Exchange::new();
            // A renewal under way, on a task of its own: the stream is read on while the store
            // answers it, so a slow store never holds up a reply Envoy waits for.
            let mut renewal: Option<tokio::task::JoinHandle<Result<RenewOutcome, AdmissionError>>> = None;
            loop {
                // While the response is pending (a queue at the backend, a slow first token) or
                // streams, the hold is renewed by time, not only when bytes arrive.
                let due = exchange.next_renewal().filter(|_| renewal.is_none());
                let message = tokio::select! {
                    message = inbound.message() => message,
                    () = tokio::time::sleep_until(due.unwrap_or_else(far_future)), if due.is_some() => {
                        renewal = exchange.start_renewal(&admission);
                        continue;
                    }
                    done = async { renewal.as_mut().expect("a renewal under way").await }, if renewal.is_some() => {
                        renewal = None;
                        exchange.renewed(done);
                        continue;
                    }
                };
                // The stream ends cleanly, or with an error when Envoy resets it (the client left,
                // or the route's timeout passed).
                let Ok(Some(message)) = message else { break };
                // In observability mode Envoy expects no reply; otherwise, continue.
                if let Some(reply) = exchange.read(message, &admission).await {
                    let _ = replies.send(Ok(reply)).await;
                }
                exchange.report_progress(&admission);
                if exchange.settled {
                    break;
                }
            }
            exchange.settle(&admission, Stop::CutShort).await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }
}

/// One request's response, as tollgate follows it.
struct Exchange {
    reservation: Option<String>,
    model: Option<String>,
    /// How often a long stream renews its lease: a third of its tenant's lease.
    renew_every: Option<Duration>,
    /// Someone else commits this hold.
    caller_commits: bool,
    /// The request generates nothing (an embedding, by its path).
    input_only: bool,
    /// The request body's size (`content-length`; none for a compressed body, whose size says
    /// nothing of its tokens): with a reported prompt count, it teaches the prompt estimate.
    prompt_bytes: Option<u64>,
    status: Option<u16>,
    meter: Option<Meter>,
    /// On tokio's clock, which the renewal timer sleeps on.
    last_renewal: tokio::time::Instant,
    settled: bool,
    /// What capacity admission predicted, when the request holds pool work.
    forecast: Option<Forecast>,
    /// The most output the request allows, as Check read it: a metered count is held to it.
    output_ceiling: Option<u64>,
    /// The stream's timing, and its progress reports.
    watch: Watch,
}

/// A response's timing as it passes, and the remaining work last reported to its pool.
#[derive(Default)]
struct Watch {
    /// The request left for the backend (its headers reached tollgate).
    sent: Option<std::time::Instant>,
    /// The first chunk that carried output, and the output metered by then.
    first_output: Option<(std::time::Instant, u64)>,
    /// The last chunk that added output, and the output metered by then.
    last_output: Option<(std::time::Instant, u64)>,
    /// Output tokens at which the remaining work is next worked out (so not at every chunk).
    next_look: u64,
    /// The remaining work (ms) last reported, or predicted at the start.
    reported_ms: Option<u64>,
    /// A report under way.
    report: Option<tokio::task::JoinHandle<()>>,
    /// Set once the pool no longer holds the work (settled, expired): nothing more to report.
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Watch {
    /// A chunk passed, and the stream has generated `output` tokens by it.
    fn passed(&mut self, output: u64) {
        if output == 0 || self.last_output.is_some_and(|(_, seen)| seen >= output) {
            return;
        }
        let now = std::time::Instant::now();
        self.first_output.get_or_insert((now, output));
        self.last_output = Some((now, output));
    }
}

/// A progress report goes when the remaining work has fallen to this fraction of the last one...
const REPORT_AT: f64 = 0.75;
/// ...and by at least this much (ms): short requests are not worth a store call.
const MIN_REPORT_MS: u64 = 250;

impl Exchange {
    fn new() -> Self {
        Exchange {
            reservation: None,
            model: None,
            renew_every: None,
            caller_commits: false,
            input_only: false,
            prompt_bytes: None,
            status: None,
            meter: None,
            last_renewal: tokio::time::Instant::now(),
            settled: false,
            forecast: None,
            output_ceiling: None,
            watch: Watch::default(),
        }
    }

    /// Takes one message; returns the reply Envoy waits for, if it waits.
    async fn read<S: Store>(
        &mut self,
        message: ProcessingRequest,
        admission: &Arc<Admission<S>>,
    ) -> Option<ProcessingResponse> {
        let observing = message.observability_mode;
        if self.reservation.is_none()
            && let Some(metadata) = &message.metadata_context
        {
            let (reservation, model, forecast, ceiling) = forwarded(metadata);
            self.learn(reservation, model, admission);
            self.forecast = forecast.and_then(headers::parse_forecast);
            self.output_ceiling = ceiling.and_then(headers::parse_output_ceiling);
        }
        let reply = match message.request? {
            Phase::RequestHeaders(h) => {
                let headers = h.headers.unwrap_or_default();
                self.input_only = header(&headers, ":path").is_some_and(|p| api::endpoint(p).work == Work::Embed);
                self.prompt_bytes = header(&headers, headers::CONTENT_LENGTH)
                    .filter(|_| header(&headers, headers::CONTENT_ENCODING).is_none())
                    .and_then(|v| v.trim().parse().ok());
                if self.reservation.is_none() {
                    self.learn(header(&headers, RESERVATION), header(&headers, headers::MODEL), admission);
                    self.forecast = header(&headers, headers::FORECAST).and_then(headers::parse_forecast);
                    self.output_ceiling =
                        header(&headers, headers::OUTPUT_CEILING).and_then(headers::parse_output_ceiling);
                }
                self.watch.sent = Some(std::time::Instant::now());
                Reply::RequestHeaders(HeadersResponse::default())
            }
            Phase::ResponseHeaders(h) => {
                let headers = h.headers.unwrap_or_default();
                self.status = header(&headers, ":status").and_then(|s| s.parse().ok());
                if self.status == Some(429)
                    && let Some(id) = &self.reservation
                    && let Err(e) = admission.upstream_refused(id, retry_after_ms(&headers)).await
                {
                    tracing::warn!(error = %e, reservation = %id, "throttling the pool after a provider 429 failed");
                }
                self.caller_commits |= header(&headers, COMMIT) == Some("caller");
                let policy = admission.policy();
                let bytes_per_token = self
                    .model
                    .as_deref()
                    .and_then(|m| policy.models.get(m))
                    .map_or(DEFAULT_BYTES_PER_TOKEN, |m| m.bytes_per_token);
                let mut meter = Meter::new(
                    header(&headers, headers::CONTENT_TYPE),
                    header(&headers, headers::CONTENT_ENCODING),
                    bytes_per_token,
                );
                let count = |name| header(&headers, name).and_then(|v| v.trim().parse::<u64>().ok());
                if let (Some(prompt), Some(output)) =
                    (count(headers::BEDROCK_INPUT_TOKENS), count(headers::BEDROCK_OUTPUT_TOKENS))
                {
                    meter.reported(prompt, output);
                }
                if self.input_only {
                    meter.input_only();
                }
                if let Some(ceiling) = self.output_ceiling {
                    meter.cap_output(ceiling);
                }
                self.meter = Some(meter);
                if h.end_of_stream {
                    self.settle(admission, Stop::Complete).await;
                }
                Reply::ResponseHeaders(HeadersResponse::default())
            }
            Phase::ResponseBody(b) => {
                if let Some(meter) = &mut self.meter {
                    meter.feed(&b.body);
                    self.watch.passed(meter.output_so_far());
                }
                // (Its renewal is the timer's, in `process`: a chunk never waits on the store.)
                if b.end_of_stream {
                    self.settle(admission, Stop::Complete).await;
                }
                Reply::ResponseBody(BodyResponse::default())
            }
            Phase::ResponseTrailers(_) => {
                self.settle(admission, Stop::Complete).await;
                Reply::ResponseTrailers(TrailersResponse::default())
            }
            Phase::RequestBody(_) => Reply::RequestBody(BodyResponse::default()),
            Phase::RequestTrailers(_) => Reply::RequestTrailers(TrailersResponse::default()),
        };
        (!observing).then(|| ProcessingResponse { response: Some(reply), ..Default::default() })
    }

    /// The reservation `Check` made for this request, and its model: from the request headers (as
    /// shipped), or from the metadata Envoy forwards with each message (if a configuration does).
    fn learn<S: Store>(&mut self, reservation: Option<&str>, model: Option<&str>, admission: &Admission<S>) {
        let Some(id) = reservation else { return };
        let policy = admission.policy();
        self.renew_every = ids::parse_reservation_id(id)
            .and_then(|r| admission.settling_policy(&policy, r.tenant))
            .map(|t| Duration::from_millis(t.lease_ttl_ms) / 3);
        self.reservation = Some(id.to_string());
        self.model = model.map(str::to_string);
    }

    /// When the hold is next due a renewal: a third of its lease after the last, while it is
    /// tollgate's to settle. `None` before the reservation is known, or once it is someone else's.
    fn next_renewal(&self) -> Option<tokio::time::Instant> {
        let every = self.renew_every.filter(|_| self.reservation.is_some() && !self.caller_commits && !self.settled)?;
        Some(self.last_renewal + every)
    }

    /// Starts renewing the lease of a hold whose response is pending or streaming (every third
    /// of a lease), on a task of its own; `None` when none is due.
    fn start_renewal<S: Store>(
        &mut self,
        admission: &Arc<Admission<S>>,
    ) -> Option<tokio::task::JoinHandle<Result<RenewOutcome, AdmissionError>>> {
        let (Some(id), Some(every)) = (self.reservation.clone(), self.renew_every) else { return None };
        if self.caller_commits || self.last_renewal.elapsed() < every {
            return None;
        }
        self.last_renewal = tokio::time::Instant::now();
        let admission = Arc::clone(admission);
        Some(tokio::spawn(async move { admission.renew(&id, 0).await }))
    }

    /// What a renewal answered.
    fn renewed(&mut self, done: Result<Result<RenewOutcome, AdmissionError>, tokio::task::JoinError>) {
        let id = self.reservation.as_deref().unwrap_or_default();
        match done {
            Ok(Ok(RenewOutcome::Renewed { .. } | RenewOutcome::Forwarded)) => {}
            // Settled already (by its caller, or expired): nothing left to keep alive.
            Ok(Ok(RenewOutcome::Settled(_) | RenewOutcome::NotFound)) => self.renew_every = None,
            Ok(Err(e)) => tracing::warn!(error = %e, reservation = id, "renewing a pending or streaming hold failed"),
            Err(e) => tracing::warn!(error = %e, reservation = id, "a renewal's task failed"),
        }
    }

    /// Commits or releases the hold, once, by how the response ended (the rules: `crate::llm::settlement`).
    async fn settle<S: Store>(&mut self, admission: &Arc<Admission<S>>, stop: Stop) {
        if std::mem::replace(&mut self.settled, true) {
            return;
        }
        let Some(id) = self.reservation.as_deref() else { return };
        if self.caller_commits {
            return;
        }
        match settlement::verdict(self.status, self.meter.as_mut(), stop) {
            Verdict::Commit(measured, ending) => {
                // (A count held to the request's ceiling says nothing of the real length or speed.)
                if let (Some(model), Ending::Completed | Ending::Metered) = (&self.model, ending) {
                    let timing = self.timing(measured);
                    if timing != Timing::default() {
                        admission.observed(id, model, timing);
                    }
                }
                if let (Some(model), Some(bytes), Measured::Exact { prompt, .. }) =
                    (&self.model, self.prompt_bytes, measured)
                {
                    admission.observed_prompt(id, model, bytes, prompt);
                }
                admission.commit_from_response(id, measured, ending).await;
            }
            Verdict::Release(ending) => release(admission, id, ending).await,
        }
    }

    /// What a stream that ran to its end showed of its pool's speeds: its decode, from the first
    /// chunk that carried output to the last, over the tokens generated between them; its prefill,
    /// the time to that first chunk less the decode of the tokens it carried. Tokens are counted
    /// as the meter counted them as they passed, scaled to the final count (so a meter's error in
    /// bytes per token does not become an error in speed).
    // Durations in ms and token counts: far below 2^52, exact in f64.
    #[allow(clippy::cast_precision_loss)]
    fn timing(&self, measured: Measured) -> Timing {
        let none = Timing::default();
        let (Some(forecast), Some(meter)) = (self.forecast, &self.meter) else { return none };
        let (Some((first, m_first)), Some((last, m_last))) = (self.watch.first_output, self.watch.last_output) else {
            return none;
        };
        let (prompt, output) = match measured {
            Measured::Exact { prompt, output, .. } => (Some(prompt), output),
            Measured::Metered { output } => (None, output),
            Measured::AsHeld => return none,
        };
        // A handful of tokens says little of a speed.
        if !meter.streams() || output < 4 || m_last <= m_first {
            return none;
        }
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let scale = output as f64 / m_last as f64;
        let between = (m_last - m_first) as f64 * scale;
        let decode_ms = ms(last.duration_since(first));
        let per_token = decode_ms / between;
        let first_token = match (self.watch.sent, prompt) {
            (Some(sent), Some(prompt)) if forecast.start_delay_ms == 0 && prompt > 0 => {
                let ttft = ms(first.duration_since(sent)) - m_first as f64 * scale * per_token;
                Some((ttft.max(0.0), prompt))
            }
            _ => None,
        };
        Timing { first_token, decode: Some((decode_ms, between)) }
    }

    /// While a stream flows, tells its pool the work it has left, each time that has fallen by a
    /// quarter (a store call on a task of its own, one at a time; never one per chunk).
    fn report_progress<S: Store>(&mut self, admission: &Arc<Admission<S>>) {
        let (Some(id), Some(model), Some(forecast), Some(meter)) =
            (&self.reservation, &self.model, self.forecast, &self.meter)
        else {
            return;
        };
        let w = &mut self.watch;
        let stopped = w.stop.load(std::sync::atomic::Ordering::Relaxed);
        if stopped || self.settled || self.caller_commits || !meter.streams() {
            return;
        }
        if w.report.as_ref().is_some_and(|r| !r.is_finished()) {
            return;
        }
        let passed = meter.output_so_far();
        if passed < w.next_look {
            return;
        }
        w.next_look = passed.saturating_add((forecast.output_tokens / 16).max(1));
        let Some(left) = admission.work_left(id, model, forecast.output_tokens, passed) else {
            w.stop.store(true, std::sync::atomic::Ordering::Relaxed);
            return;
        };
        let reported = *w
            .reported_ms
            .get_or_insert_with(|| admission.work_left(id, model, forecast.output_tokens, 0).unwrap_or(left));
        #[allow(clippy::cast_precision_loss)]
        let fallen_enough =
            (left as f64) <= reported as f64 * REPORT_AT && reported.saturating_sub(left) >= MIN_REPORT_MS;
        if !fallen_enough {
            return;
        }
        w.reported_ms = Some(left);
        let (admission, id, stop) = (Arc::clone(admission), id.clone(), Arc::clone(&w.stop));
        w.report = Some(tokio::spawn(async move {
            match admission.progress(&id, left).await {
                Ok(Some(_)) => {}
                Ok(None) => stop.store(true, std::sync::atomic::Ordering::Relaxed),
                // The next report says it again; the commit frees it all the same.
                Err(e) => tracing::debug!(error = %e, reservation = %id, "reporting a stream's progress failed"),
            }
        }));
    }
}

/// The reservation, model, forecast and output ceiling `Check` left in the request's dynamic
/// metadata, as Envoy forwards it.
fn forwarded(metadata: &Metadata) -> (Option<&str>, Option<&str>, Option<&str>, Option<&str>) {
    match metadata.filter_metadata.get(AUTHZ_NAMESPACE) {
        Some(check) => (
            text(check, RESERVATION_FIELD),
            text(check, MODEL_FIELD),
            text(check, FORECAST_FIELD),
            text(check, headers::OUTPUT_CEILING_FIELD),
        ),
        None => (None, None, None, None),
    }
}

async fn release<S: Store>(admission: &Admission<S>, id: &str, ending: Ending) {
    match admission.release_ended(id, ending).await {
        Ok(outcome) => tracing::debug!(
            reservation = id,
            state = outcome.state(),
            ending = ending.as_str(),
            "released: the response generated nothing"
        ),
        Err(e) if e.is_transient() => {
            tracing::warn!(error = %e, reservation = id, "release from the response could not reach the store; retrying");
            admission.retry(Settlement::Release { id: id.to_string(), ending });
        }
        Err(e) => tracing::warn!(error = %e, reservation = id, "release from the response failed"),
    }
}

/// A provider's Retry-After: `retry-after-ms`, or `retry-after` in whole seconds (an HTTP date is
/// not read: no wait is assumed).
fn retry_after_ms(headers: &HeaderMap) -> Option<u64> {
    if let Some(ms) = header(headers, headers::RETRY_AFTER_MS).and_then(|v| v.trim().parse::<u64>().ok()) {
        return Some(ms);
    }
    header(headers, headers::RETRY_AFTER).and_then(|v| v.trim().parse::<u64>().ok()).map(|s| s.saturating_mul(1000))
}

/// A string field of forwarded metadata.
fn text<'a>(metadata: &'a Struct, field: &str) -> Option<&'a str> {
    match metadata.fields.get(field)?.kind.as_ref()? {
        Kind::StringValue(s) => Some(s),
        _ => None,
    }
}

/// A header's value, from `value` or `raw_value` (newer Envoys send the raw bytes). Only those
/// the shipped config forwards are read ([`headers::EXT_PROC_READS`]).
fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    debug_assert!(headers::EXT_PROC_READS.contains(&name), "{name} is not forwarded to ext_proc");
    let h = headers.headers.iter().find(|h| h.key.eq_ignore_ascii_case(name))?;
    if !h.value.is_empty() {
        return Some(&h.value);
    }
    std::str::from_utf8(&h.raw_value).ok()
}

/// An instant no timer reaches (for a `select!` branch switched off by its guard).
fn far_future() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(86_400 * 365)
}
