//! `tollgate sim-load`: open-loop HTTP load of several request classes through Envoy, reporting
//! per class what was admitted, what was denied and why, and the latency of what was admitted.
//!
//! Each class has its own fixed rate; send times are decided by the schedule, not by replies, and
//! latency counts from the scheduled send time. A request still unanswered at the client timeout
//! counts as a timeout, with the timeout as its latency (it is not dropped from the tail).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::Mutex;
use tokio::time::{Instant, MissedTickBehavior};

use crate::grpc::headers;

/// One kind of traffic.
#[derive(Debug, Clone)]
pub struct Class {
    pub name: String,
    pub tenant: String,
    /// `x-priority`, when set.
    pub priority: Option<String>,
    /// `x-request-deadline-ms`, when set.
    pub deadline_ms: Option<u64>,
    /// Requests per second.
    pub rate: f64,
    pub max_tokens: u64,
    /// Fixes the simulated output length (`x-sim-output-tokens`); otherwise the backend draws it.
    pub output_tokens: Option<u64>,
    pub prompt_bytes: usize,
    pub stream: bool,
}

impl Class {
    /// A class of `max_tokens` requests from `tenant` at `rate` a second, at a tier and with a
    /// deadline when given: 800-byte prompts, the backend's own output lengths, not streamed.
    pub fn new(name: &str, tenant: &str, priority: &str, deadline_ms: Option<u64>, rate: f64, max_tokens: u64) -> Self {
        Class {
            name: name.into(),
            tenant: tenant.into(),
            priority: Some(priority.into()),
            deadline_ms,
            rate,
            max_tokens,
            output_tokens: None,
            prompt_bytes: 800,
            stream: false,
        }
    }
}

/// The whole load.
#[derive(Debug, Clone)]
pub struct LoadPlan {
    /// Envoy's HTTP address, e.g. `http://127.0.0.1:10000`.
    pub target: String,
    pub duration: Duration,
    pub timeout: Duration,
    pub classes: Vec<Class>,
    /// A refused request that may retry (a `retry-after-ms`, no `x-should-retry: false`) waits
    /// exactly its hint and is sent again, up to this many times (0: never), as an SDK does.
    pub retries: u32,
}

/// What one class saw.
#[derive(Debug, Clone, Default)]
pub struct ClassReport {
    pub name: String,
    pub sent: u64,
    pub admitted: u64,
    /// Denials by `x-tollgate-reason`.
    pub denied: BTreeMap<String, u64>,
    /// Answers that were neither a success nor a tollgate denial (e.g. Envoy's own 503).
    pub failed: u64,
    pub timed_out: u64,
    /// Latency (ms) of every admitted request, and of every timeout (as the timeout).
    pub latencies_ms: Vec<f64>,
    /// Output tokens the admitted requests' usage reported.
    pub output_tokens: u64,
    /// Admitted requests that finished after their deadline, and their output tokens (work the
    /// caller had given up on).
    pub late: u64,
    pub late_tokens: u64,
    /// The class's requests name a deadline.
    pub deadline: bool,
    /// Refused requests that retried on their hint; of them, admitted at the first retry, and
    /// admitted at a later one, with how long after the first retry (ms): how late its hint was.
    pub retried: u64,
    pub first_retry_admitted: u64,
    pub later_admitted: u64,
    pub lateness_ms: Vec<f64>,
}

impl ClassReport {
    /// Nearest-rank percentile of the admitted latencies (timeouts included), in ms.
    pub fn percentile(&self, per_mille: usize) -> Option<f64> {
        let mut v = self.latencies_ms.clone();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let rank = (per_mille * v.len()).div_ceil(1000).clamp(1, v.len());
        Some(v[rank - 1])
    }

    pub fn denied_total(&self) -> u64 {
        self.denied.values().sum()
    }
}

enum Outcome {
    /// Latency (ms) and the output tokens its usage reported.
    Admitted(f64, u64),
    Denied(String),
    Failed,
    TimedOut(f64),
}

/// How a request fared with its hints: whether it was refused and retried, and when it was
/// admitted after retrying, at which retry and how long after the first (ms).
#[derive(Debug, Default, Clone, Copy)]
struct Followed {
    retried: bool,
    admitted_at: Option<(u32, f64)>,
}

/// How the refused requests that retried on their hint fared, over every class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HintTotals {
    pub retried: u64,
    /// Of them, admitted at the first retry, and at a later one.
    pub first: u64,
    pub later: u64,
    /// The most that could have been admitted at a first retry with the admissions each class
    /// got: its retried requests, or its admissions if fewer (an admission at a first retry is
    /// both). With the pool kept busy, a different timing of the hints moves room between
    /// requests; it does not make more of it.
    pub room: u64,
}

impl HintTotals {
    pub fn over(reports: &[ClassReport]) -> HintTotals {
        reports.iter().fold(HintTotals::default(), |t, c| HintTotals {
            retried: t.retried + c.retried,
            first: t.first + c.first_retry_admitted,
            later: t.later + c.later_admitted,
            room: t.room + c.retried.min(c.admitted),
        })
    }
}

/// Runs the plan and reports per class, in the plan's order.
pub async fn run(plan: &LoadPlan) -> Vec<ClassReport> {
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let reports = Arc::new(Mutex::new(
        plan.classes
            .iter()
            .map(|c| ClassReport { name: c.name.clone(), deadline: c.deadline_ms.is_some(), ..Default::default() })
            .collect::<Vec<_>>(),
    ));
    let start = Instant::now() + Duration::from_millis(20);
    let end = start + plan.duration;
    let mut schedulers = Vec::new();
    for (index, class) in plan.classes.iter().cloned().enumerate() {
        if class.rate <= 0.0 {
            continue;
        }
        let (client, reports, target, timeout) = (client.clone(), reports.clone(), plan.target.clone(), plan.timeout);
        let retries = plan.retries;
        schedulers.push(tokio::spawn(async move {
            let mut ticks = tokio::time::interval_at(start, Duration::from_secs_f64(1.0 / class.rate));
            // Open loop: a late tick is sent at once, never skipped.
            ticks.set_missed_tick_behavior(MissedTickBehavior::Burst);
            let class = Arc::new(class);
            let mut requests = Vec::new();
            loop {
                let scheduled = ticks.tick().await;
                if scheduled >= end {
                    break;
                }
                let (client, class, target) = (client.clone(), class.clone(), target.clone());
                requests.push(tokio::spawn(async move {
                    send(&client, &target, &class, scheduled, timeout, retries).await
                }));
            }
            let mut outcomes = Vec::with_capacity(requests.len());
            for r in requests {
                outcomes.push(r.await.unwrap_or((Outcome::Failed, Followed::default())));
            }
            let mut all = reports.lock().await;
            let report = &mut all[index];
            for (outcome, followed) in outcomes {
                report.sent += 1;
                report.retried += u64::from(followed.retried);
                match followed.admitted_at {
                    Some((1, _)) => report.first_retry_admitted += 1,
                    Some((_, late)) => {
                        report.later_admitted += 1;
                        report.lateness_ms.push(late);
                    }
                    None => {}
                }
                match outcome {
                    Outcome::Admitted(ms, tokens) => {
                        report.admitted += 1;
                        report.latencies_ms.push(ms);
                        report.output_tokens += tokens;
                        if class.deadline_ms.is_some_and(|d| ms > d as f64) {
                            report.late += 1;
                            report.late_tokens += tokens;
                        }
                    }
                    Outcome::Denied(reason) => *report.denied.entry(reason).or_default() += 1,
                    Outcome::Failed => report.failed += 1,
                    Outcome::TimedOut(ms) => {
                        report.timed_out += 1;
                        report.latencies_ms.push(ms);
                    }
                }
            }
        }));
    }
    for s in schedulers {
        let _ = s.await;
    }
    Arc::try_unwrap(reports).map(Mutex::into_inner).unwrap_or_default()
}

/// The simulated fleet's slots and the slot time its ended generations took (µs), from its
/// `GET /sim/stats` at `sim` (its base URL); `None` when it does not answer.
pub async fn fleet_busy(sim: &str) -> Option<(u64, u64)> {
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = hyper::Request::get(format!("{sim}{}", super::backend::STATS_PATH)).body(Full::new(Bytes::new())).ok()?;
    let response = tokio::time::timeout(Duration::from_secs(2), client.request(req)).await.ok()?.ok()?;
    let body = response.into_body().collect().await.ok()?.to_bytes();
    let stats: serde_json::Value = serde_json::from_slice(&body).ok()?;
    Some((stats["slots"].as_u64()?, stats["busy_micros"].as_u64()?))
}

/// The fleet's utilisation between two [`fleet_busy`] readings `elapsed` apart.
pub fn utilisation((slots, before): (u64, u64), (_, after): (u64, u64), elapsed: Duration) -> f64 {
    let capacity = slots as f64 * elapsed.as_micros() as f64;
    if capacity > 0.0 { after.saturating_sub(before) as f64 / capacity } else { 0.0 }
}

/// Sends one request, and (up to `retries` times) again after each hint it is refused with.
async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    target: &str,
    class: &Class,
    scheduled: Instant,
    timeout: Duration,
    retries: u32,
) -> (Outcome, Followed) {
    let (mut attempt, mut first_retry) = (0, None::<Instant>);
    loop {
        let (outcome, hint) = send_once(client, target, class, scheduled, timeout).await;
        if let (Outcome::Denied(_), Some(ms)) = (&outcome, hint)
            && attempt < retries
            && Instant::now() + ms < scheduled + timeout
        {
            tokio::time::sleep(ms).await;
            first_retry.get_or_insert_with(Instant::now);
            attempt += 1;
            continue;
        }
        let since_first = first_retry.map_or(0.0, |at| at.elapsed().as_secs_f64() * 1000.0);
        let admitted_at = (matches!(outcome, Outcome::Admitted(..)) && attempt > 0).then_some((attempt, since_first));
        return (outcome, Followed { retried: attempt > 0, admitted_at });
    }
}

/// One attempt: its outcome, and for a refusal a client may retry, its hint.
async fn send_once(
    client: &Client<HttpConnector, Full<Bytes>>,
    target: &str,
    class: &Class,
    scheduled: Instant,
    timeout: Duration,
) -> (Outcome, Option<Duration>) {
    let mut body = serde_json::json!({
        "model": "sim",
        "max_tokens": class.max_tokens,
        "messages": [{"role": "user", "content": "x".repeat(class.prompt_bytes)}],
    });
    if class.stream {
        body["stream"] = true.into();
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    let mut req = hyper::Request::post(format!("{target}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-tenant-id", &class.tenant);
    if let Some(p) = &class.priority {
        req = req.header("x-priority", p);
    }
    if let Some(d) = class.deadline_ms {
        req = req.header("x-request-deadline-ms", d.to_string());
    }
    if let Some(n) = class.output_tokens {
        req = req.header("x-sim-output-tokens", n.to_string());
    }
    let Ok(req) = req.body(Full::new(Bytes::from(body.to_string()))) else { return (Outcome::Failed, None) };
    let exchange = async {
        let res = client.request(req).await.ok()?;
        let status = res.status().as_u16();
        let header = |name: &str| res.headers().get(name).and_then(|v| v.to_str().ok());
        let reason = header(headers::REASON).map(str::to_string);
        let hint = header(headers::RETRY_AFTER_MS)
            .and_then(|ms| ms.parse().ok())
            .filter(|_| header(headers::SHOULD_RETRY) != Some("false"))
            .map(Duration::from_millis);
        let body = res.into_body().collect().await.ok()?.to_bytes();
        Some((status, reason, output_tokens(&body), hint))
    };
    match tokio::time::timeout_at(scheduled + timeout, exchange).await {
        Err(_) => (Outcome::TimedOut(timeout.as_secs_f64() * 1000.0), None),
        Ok(None) => (Outcome::Failed, None),
        Ok(Some((200, _, tokens, _))) => (Outcome::Admitted(scheduled.elapsed().as_secs_f64() * 1000.0, tokens), None),
        Ok(Some((_, Some(reason), _, hint))) => (Outcome::Denied(reason), hint),
        Ok(Some(_)) => (Outcome::Failed, None),
    }
}

/// The output tokens a chat completion's usage reports: its JSON body's, or its stream's usage
/// chunk's (0 when it reports none).
fn output_tokens(body: &[u8]) -> u64 {
    let count = |v: &serde_json::Value| v["usage"]["completion_tokens"].as_u64();
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        return count(&v).unwrap_or(0);
    }
    String::from_utf8_lossy(body)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find_map(|v| count(&v))
        .unwrap_or(0)
}

/// The demo's mix: interactive chat (critical, 2 s deadline, short answers) and standard
/// requests from tenant `acme`, and a batch flood (sheddable, long answers) from tenant `batchco`.
pub fn mixed(interactive_rate: f64, standard_rate: f64, batch_rate: f64) -> Vec<Class> {
    let class = Class::new;
    vec![
        Class { stream: true, ..class("interactive", "acme", "critical", Some(2_000), interactive_rate, 64) },
        class("standard", "acme", "standard", None, standard_rate, 256),
        class("batch", "batchco", "sheddable", None, batch_rate, 1024),
    ]
}

/// A table of the reports, one row per class.
pub fn table(reports: &[ClassReport]) -> String {
    let mut out = String::from(
        "| class | sent | admitted | denied (by reason) | failed | timed out | p50 ms | p99 ms | within deadline |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in reports {
        let denied = if r.denied.is_empty() {
            "0".to_string()
        } else {
            r.denied.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
        };
        let pct = |p| r.percentile(p).map_or("-".to_string(), |v| format!("{v:.0}"));
        // Of the admitted requests of a class with a deadline, those that finished within it.
        let within = match r.admitted {
            0 => "-".to_string(),
            n if r.deadline => format!("{} of {n}", n - r.late),
            _ => "-".to_string(),
        };
        let share = if r.sent == 0 { 0.0 } else { 100.0 * r.admitted as f64 / r.sent as f64 };
        out.push_str(&format!(
            "| {} | {} | {} ({share:.0}%) | {} | {} | {} | {} | {} | {within} |\n",
            r.name,
            r.sent,
            r.admitted,
            denied,
            r.failed,
            r.timed_out,
            pct(500),
            pct(990)
        ));
    }
    let HintTotals { retried, first, later, room } = HintTotals::over(reports);
    if retried > 0 {
        let pct = |n: u64| 100.0 * n as f64 / retried as f64;
        out.push_str(&format!(
            "\nrefused and retried on the hint: {retried}; admitted at the first retry {first} ({:.0}%), at a later one {later}; \
             at most, with the admissions each class got: {room} ({:.0}%)\n",
            pct(first),
            pct(room)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_class_admits_no_more_of_its_retries_than_it_admits() {
        let class = |retried, first_retry_admitted, later_admitted, admitted| ClassReport {
            retried,
            first_retry_admitted,
            later_admitted,
            admitted,
            ..ClassReport::default()
        };
        // Batch: 10 retried, 3 admitted in all; standard: 2 retried, 5 admitted in all.
        let totals = HintTotals::over(&[class(10, 1, 1, 3), class(2, 2, 0, 5)]);
        assert_eq!(totals, HintTotals { retried: 12, first: 3, later: 1, room: 5 });
    }
}
