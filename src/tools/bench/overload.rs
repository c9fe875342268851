//! `tollgate bench overload`: capacity admission under overload, through real Envoy, against the
//! simulated fleet (started here, in-process, so its counters can be read). `scripts/bench-overload`
//! starts tollgate and Envoy in front of it with `deploy/overload-policy.yaml`.
//!
//! First calibration: the fleet is offered its capacity for `calibrate` seconds, and the pool's
//! learned speeds are compared with the simulator's true ones; then the simulator's decode speed is
//! halved, and 30 s later compared again (and restored).
//!
//! Then the matrix, in rounds (each round runs every cell, the cells' order rotating from round to
//! round): offered load at each multiple of the pool's capacity, 20% interactive (critical, 2 s
//! deadline, 64 tokens), 30% standard (256 tokens) sent by three tenants at 10%, 30% and 60% of
//! the standard rate, 50% batch (sheddable, 1,024 tokens); and a weighted cell at 5x, whose
//! standard tier is two tenants sending equally, one weighing twice the other (both want more
//! than their weighted share). Every request streams. Per cell:
//!
//! - interactive admitted: the share of interactive requests admitted;
//! - deadline hits: of the admitted interactive requests, the share that finished (last byte at the
//!   client) within their deadline;
//! - wasted: tokens generated for requests that finished after their deadline or whose client left,
//!   over all tokens generated;
//! - utilisation: the simulator's slots in use, sampled every 50 ms over the cell;
//! - Jain's index of the standard tenants' tokens, each over its max-min fair share of what the tier
//!   got (water-filled by weight over what each wanted: the tokens it was served, and its refused
//!   requests at the mean output): 1 when every tenant got its fair share;
//! - in the weighted cell, the heavier tenant's tokens over the lighter's (its weight ratio is 2).

// Measurement arithmetic: float casts round a figure for display or a schedule.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::proto::PoolStatusRequest;
use crate::proto::admission_client::AdmissionClient;
use crate::tools::sim::backend::{self, SimConfig, SimStats};
use crate::tools::sim::lengths::{OutputLengths, Sampler};
use crate::tools::sim::load::{self, Class, ClassReport, LoadPlan};

use super::{median, spread_of};

/// What to run.
#[derive(Debug, Clone)]
pub struct OverloadOptions {
    /// Envoy's HTTP address, e.g. `http://127.0.0.1:10000`.
    pub envoy: String,
    /// tollgate's gRPC address, for the pool's status.
    pub tollgate: String,
    pub pool: String,
    /// Where the simulated fleet listens (Envoy's upstream).
    pub sim_listen: SocketAddr,
    pub slots: usize,
    pub prefill_tokens_per_second: f64,
    pub decode_tokens_per_second: f64,
    pub median: f64,
    pub sigma: f64,
    /// Multiples of the pool's capacity to offer.
    pub loads: Vec<f64>,
    pub seconds: u64,
    pub rounds: usize,
    /// Seconds of calibration before the halved speed (0: skip calibration).
    pub calibrate: u64,
    /// Retries on the hint a refused request may make (0: none; the matrix's figures then count
    /// the retries' load too).
    pub retries: u32,
}

/// The three tiers' shares of the offered load, and each class's ceiling.
const MIX: [(&str, f64, u64); 3] = [("interactive", 0.2, 64), ("standard", 0.3, 256), ("batch", 0.5, 1024)];
/// The standard tenants' shares of the standard rate: the tier the pool serves beside the
/// interactive one, so its shares show fairness (batch is shed under overload).
const STANDARD_TENANTS: [(&str, f64); 3] = [("std-a", 0.1), ("std-b", 0.3), ("std-c", 0.6)];
/// `Class::new`'s prompt.
const PROMPT_BYTES: usize = 800;
const DEADLINE_MS: u64 = 2_000;
/// The weighted cell's load: enough that both its standard tenants want more than their weighted
/// share (at 3x the heavier one's whole demand fits its share, and the ratio shows demand).
const WEIGHTED_LOAD: f64 = 5.0;

/// One cell's figures.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cell {
    pub interactive_admitted: f64,
    pub deadline_hits: f64,
    pub wasted: f64,
    pub utilisation: f64,
    pub jain: f64,
    /// The weighted cell: heavier over lighter tenant's tokens.
    pub weight_ratio: f64,
    pub sent: u64,
    /// Refused requests that retried on their hint, the share of them admitted at the first
    /// retry and at a later one, and the median of how late the hint was for the latter (ms).
    pub retried: u64,
    pub first_retry: f64,
    pub later: f64,
    pub lateness_ms: f64,
    /// The most that could have been admitted at a first retry with the admissions each class got,
    /// as a share of the retried ([`load::HintTotals::room`]).
    pub first_retry_room: f64,
}

/// The whole run.
#[derive(Debug, Clone, Default)]
pub struct OverloadReport {
    pub capacity_rps: f64,
    /// (true, learned) decode and prefill speeds after calibration, and decode after the halving.
    pub decode: Option<(f64, f64)>,
    pub prefill: Option<(f64, f64)>,
    pub halved: Option<(f64, f64)>,
    /// Per load: every round's cell.
    pub cells: Vec<(f64, Vec<Cell>)>,
    pub weighted: Vec<Cell>,
}

#[derive(Debug, thiserror::Error)]
pub enum OverloadError {
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
    #[error("tollgate at {0}: {1}")]
    Tollgate(String, String),
    #[error("{0}")]
    Sim(String),
}

/// Mean output tokens of a request of this ceiling on the simulated fleet.
fn mean_output(o: &OverloadOptions, max_tokens: u64) -> f64 {
    let sampler = Sampler::new(OutputLengths::LogNormal { median: o.median, sigma: o.sigma }, 99);
    let n = 20_000;
    (0..n).map(|_| sampler.sample(max_tokens)).sum::<u64>() as f64 / f64::from(n)
}

/// Mean slot time (s) of a request of this ceiling on the simulated fleet.
fn mean_service_s(o: &OverloadOptions, max_tokens: u64) -> f64 {
    let prompt = PROMPT_BYTES as f64 / 4.0;
    prompt / o.prefill_tokens_per_second + mean_output(o, max_tokens) / o.decode_tokens_per_second
}

/// Requests a second the fleet completes at the matrix's mix.
pub fn capacity_rps(o: &OverloadOptions) -> f64 {
    let mean: f64 = MIX.iter().map(|(_, share, max)| share * mean_service_s(o, *max)).sum();
    o.slots as f64 / mean
}

/// Every class of the matrix streams (so its pool calibrates) with the demo's prompts.
fn class(name: &str, tenant: &str, priority: &str, deadline_ms: Option<u64>, rate: f64, max_tokens: u64) -> Class {
    Class { stream: true, ..Class::new(name, tenant, priority, deadline_ms, rate, max_tokens) }
}

/// The tier mix at `rps`, the standard tier from the given tenants at their shares.
fn mix(rps: f64, standard: &[(&str, f64)]) -> Vec<Class> {
    let mut classes = vec![class("interactive", "chat", "critical", Some(DEADLINE_MS), rps * MIX[0].1, MIX[0].2)];
    for (tenant, share) in standard {
        classes.push(class(tenant, tenant, "standard", None, rps * MIX[1].1 * share, MIX[1].2));
    }
    classes.push(class("batch", "batch", "sheddable", None, rps * MIX[2].1, MIX[2].2));
    classes
}

/// Max-min fair shares of `total` among tenants offering `demand`, by `weight` (water-filling).
fn fair_shares(total: f64, demand: &[f64], weight: &[f64]) -> Vec<f64> {
    let mut share = vec![0.0; demand.len()];
    let mut open: Vec<usize> = (0..demand.len()).collect();
    let mut left = total;
    while !open.is_empty() && left > 1e-9 {
        let weights: f64 = open.iter().map(|&i| weight[i]).sum();
        let per = left / weights;
        let (met, rest): (Vec<usize>, Vec<usize>) =
            open.iter().partition(|&&i| demand[i] - share[i] <= per * weight[i]);
        if met.is_empty() {
            for &i in &rest {
                share[i] += per * weight[i];
            }
            break;
        }
        for &i in &met {
            left -= demand[i] - share[i];
            share[i] = demand[i];
        }
        open = rest;
    }
    share
}

/// Jain's index of `x`: 1 when all are equal, 1/n when one has everything.
fn jain(x: &[f64]) -> f64 {
    let sum: f64 = x.iter().sum();
    let squares: f64 = x.iter().map(|v| v * v).sum();
    if squares == 0.0 { 1.0 } else { sum * sum / (x.len() as f64 * squares) }
}

struct Fleet {
    stats: Arc<SimStats>,
    shutdown: CancellationToken,
}

async fn start_fleet(o: &OverloadOptions) -> Result<Fleet, OverloadError> {
    let listener =
        tokio::net::TcpListener::bind(o.sim_listen).await.map_err(|e| OverloadError::Listen(o.sim_listen, e))?;
    let config = SimConfig {
        slots: o.slots,
        prefill_tokens_per_second: o.prefill_tokens_per_second,
        decode_tokens_per_second: o.decode_tokens_per_second,
        lengths: OutputLengths::LogNormal { median: o.median, sigma: o.sigma },
        ..SimConfig::default()
    };
    let (stats, shutdown) = (Arc::new(SimStats::default()), CancellationToken::new());
    let (s, d) = (Arc::clone(&stats), shutdown.clone());
    tokio::spawn(async move {
        if let Err(e) = backend::serve(listener, config, d, s).await {
            tracing::error!("sim-backend: {e}");
        }
    });
    Ok(Fleet { stats, shutdown })
}

/// Runs `classes` for `seconds`, sampling the fleet's slots in use meanwhile.
async fn cell(o: &OverloadOptions, fleet: &Fleet, classes: Vec<Class>) -> (Vec<ClassReport>, f64, u64, u64) {
    let (tokens0, cut0) = (fleet.stats.tokens.load(Ordering::Relaxed), fleet.stats.cut_tokens.load(Ordering::Relaxed));
    let plan = LoadPlan {
        target: o.envoy.clone(),
        duration: Duration::from_secs(o.seconds),
        timeout: Duration::from_secs(30),
        classes,
        retries: o.retries,
    };
    let sampling = CancellationToken::new();
    let sampler = {
        let (stats, stop, slots) = (Arc::clone(&fleet.stats), sampling.clone(), o.slots as u64);
        let window = Duration::from_secs(o.seconds);
        tokio::spawn(async move {
            let (mut sum, mut n) = (0u64, 0u64);
            let start = Instant::now();
            while !stop.is_cancelled() && start.elapsed() < window {
                tokio::time::sleep(Duration::from_millis(50)).await;
                sum += stats.running.load(Ordering::Relaxed).min(slots);
                n += 1;
            }
            if n == 0 { 0.0 } else { sum as f64 / (n * slots) as f64 }
        })
    };
    let reports = load::run(&plan).await;
    // Every cell's classes, as the demo prints them, for the log.
    eprintln!(
        "{} s at {:.2} requests/s:\n{}",
        o.seconds,
        plan.classes.iter().map(|c| c.rate).sum::<f64>(),
        load::table(&reports)
    );
    sampling.cancel();
    let utilisation = sampler.await.unwrap_or(0.0);
    let tokens = fleet.stats.tokens.load(Ordering::Relaxed) - tokens0;
    let cut = fleet.stats.cut_tokens.load(Ordering::Relaxed) - cut0;
    (reports, utilisation, tokens, cut)
}

/// Until nothing runs in the fleet and the pool holds nothing (at most 60 s).
async fn drain(o: &OverloadOptions, fleet: &Fleet, client: &mut AdmissionClient<Channel>) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        let holds = client
            .pool_status(PoolStatusRequest { pool: o.pool.clone() })
            .await
            .map(|r| r.into_inner().holds)
            .unwrap_or(0);
        if holds == 0 && fleet.stats.running.load(Ordering::Relaxed) == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The figures of one matrix cell; `tier` names the standard tier's tenants with their weights.
fn figures(
    reports: &[ClassReport],
    utilisation: f64,
    tokens: u64,
    cut: u64,
    tier: &[(&str, f64)],
    mean_output: f64,
) -> Cell {
    let by = |name: &str| reports.iter().find(|r| r.name == name).cloned().unwrap_or_default();
    let interactive = by("interactive");
    let late: u64 = reports.iter().map(|r| r.late_tokens).sum();
    let served: Vec<f64> = tier.iter().map(|(t, _)| by(t).output_tokens as f64).collect();
    let weights: Vec<f64> = tier.iter().map(|(_, w)| *w).collect();
    // What each wanted: the tokens it was served, and its refused requests at the mean output (a
    // tenant served every request got all it wanted, whatever its outputs' lengths came to).
    let demand: Vec<f64> = tier
        .iter()
        .map(|(t, _)| {
            let r = by(t);
            r.output_tokens as f64 + r.sent.saturating_sub(r.admitted) as f64 * mean_output
        })
        .collect();
    let fair = fair_shares(served.iter().sum(), &demand, &weights);
    let relative: Vec<f64> = served.iter().zip(&fair).map(|(s, f)| if *f > 0.0 { s / f } else { 1.0 }).collect();
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let hints = load::HintTotals::over(reports);
    Cell {
        interactive_admitted: ratio(interactive.admitted as f64, interactive.sent as f64),
        deadline_hits: ratio((interactive.admitted - interactive.late) as f64, interactive.admitted as f64),
        wasted: ratio((late + cut) as f64, tokens as f64),
        utilisation,
        jain: jain(&relative),
        weight_ratio: if served.len() == 2 { ratio(served[0], served[1]) } else { 0.0 },
        sent: reports.iter().map(|r| r.sent).sum(),
        retried: hints.retried,
        first_retry: ratio(hints.first as f64, hints.retried as f64),
        later: ratio(hints.later as f64, hints.retried as f64),
        first_retry_room: ratio(hints.room as f64, hints.retried as f64),
        lateness_ms: median(reports.iter().flat_map(|r| r.lateness_ms.iter().copied()).collect()),
    }
}

async fn learned(o: &OverloadOptions, client: &mut AdmissionClient<Channel>) -> Result<(f64, f64), OverloadError> {
    let status = client
        .pool_status(PoolStatusRequest { pool: o.pool.clone() })
        .await
        .map_err(|e| OverloadError::Tollgate(o.tollgate.clone(), e.message().to_string()))?
        .into_inner();
    let s = status.speeds.first().ok_or_else(|| OverloadError::Sim(format!("pool {} serves no model", o.pool)))?;
    Ok((s.decode_tokens_per_second, s.prefill_tokens_per_second))
}

pub async fn run(o: &OverloadOptions) -> Result<OverloadReport, OverloadError> {
    let fleet = start_fleet(o).await?;
    let mut client = AdmissionClient::connect(o.tollgate.clone())
        .await
        .map_err(|e| OverloadError::Tollgate(o.tollgate.clone(), e.to_string()))?;
    let capacity = capacity_rps(o);
    let mut report = OverloadReport { capacity_rps: capacity, ..Default::default() };
    let mean_standard = mean_output(o, MIX[1].2);

    if o.calibrate > 0 {
        // The true decode speed is what the simulator achieved (its steps' sleeps run a little
        // long), over the last 30 s of each phase.
        let achieved = |fleet: &Fleet| {
            (fleet.stats.tokens.load(Ordering::Relaxed), fleet.stats.decode_micros.load(Ordering::Relaxed))
        };
        let speed = |(t0, m0): (u64, u64), (t1, m1): (u64, u64)| (t1 - t0) as f64 / ((m1 - m0).max(1) as f64 / 1e6);
        // Calibration's cells follow no hints.
        let thirty = OverloadOptions { seconds: 30, retries: 0, ..o.clone() };
        let warm = OverloadOptions { seconds: o.calibrate.saturating_sub(30).max(1), ..thirty.clone() };
        cell(&warm, &fleet, mix(capacity, &STANDARD_TENANTS)).await;
        let before = achieved(&fleet);
        cell(&thirty, &fleet, mix(capacity, &STANDARD_TENANTS)).await;
        let (decode, prefill) = learned(o, &mut client).await?;
        report.decode = Some((speed(before, achieved(&fleet)), decode));
        report.prefill = Some((o.prefill_tokens_per_second, prefill));
        fleet.stats.set_decode_speed(o.decode_tokens_per_second / 2.0);
        let before = achieved(&fleet);
        cell(&thirty, &fleet, mix(capacity / 2.0, &STANDARD_TENANTS)).await;
        report.halved = Some((speed(before, achieved(&fleet)), learned(o, &mut client).await?.0));
        fleet.stats.set_decode_speed(o.decode_tokens_per_second);
        drain(o, &fleet, &mut client).await;
        // The pool relearns the restored speed before the matrix.
        cell(&thirty, &fleet, mix(capacity, &STANDARD_TENANTS)).await;
        drain(o, &fleet, &mut client).await;
    }

    let mut cells: Vec<(f64, Vec<Cell>)> = o.loads.iter().map(|&l| (l, Vec::new())).collect();
    let weighted_tenants = [("std-heavy", 2.0), ("std-light", 1.0)];
    for round in 0..o.rounds {
        // Every cell in every round, the order rotating.
        let n = cells.len() + 1;
        for k in 0..n {
            let at = (k + round) % n;
            if at < cells.len() {
                let load = cells[at].0;
                let (reports, util, tokens, cut) = cell(o, &fleet, mix(capacity * load, &STANDARD_TENANTS)).await;
                let tenants: Vec<(&str, f64)> = STANDARD_TENANTS.iter().map(|(t, _)| (*t, 1.0)).collect();
                cells[at].1.push(figures(&reports, util, tokens, cut, &tenants, mean_standard));
            } else {
                let even: Vec<(&str, f64)> = weighted_tenants.iter().map(|(t, _)| (*t, 0.5)).collect();
                let (reports, util, tokens, cut) = cell(o, &fleet, mix(capacity * WEIGHTED_LOAD, &even)).await;
                report.weighted.push(figures(&reports, util, tokens, cut, &weighted_tenants, mean_standard));
            }
            drain(o, &fleet, &mut client).await;
        }
    }
    report.cells = cells;
    fleet.shutdown.cancel();
    Ok(report)
}

/// Median, and the lowest and highest, of one figure over the rounds.
fn spread(cells: &[Cell], pick: fn(&Cell) -> f64) -> (f64, f64, f64) {
    spread_of(cells.iter().map(pick).collect())
}

/// A table with a row per offered load: its `head`ings after "offered", and each load's `row`
/// from its rounds' cells.
fn by_load(
    f: &mut std::fmt::Formatter<'_>,
    loads: &[(f64, Vec<Cell>)],
    head: &[&str],
    row: impl Fn(&[Cell]) -> Vec<String>,
) -> std::fmt::Result {
    writeln!(f, "| offered | {} |\n|{}", head.join(" | "), "---|".repeat(head.len() + 1))?;
    for (load, cells) in loads {
        writeln!(f, "| {load}x | {} |", row(cells).join(" | "))?;
    }
    Ok(())
}

impl std::fmt::Display for OverloadReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "capacity at this mix: {:.2} requests/s\n", self.capacity_rps)?;
        let off = |(truth, learned): (f64, f64)| 100.0 * (learned - truth) / truth;
        if let (Some(d), Some(p), Some(h)) = (self.decode, self.prefill, self.halved) {
            writeln!(f, "| calibration | true (achieved) | learned | off by |\n|---|---|---|---|")?;
            writeln!(f, "| decode after the warm-up (tokens/s) | {:.1} | {:.1} | {:+.1}% |", d.0, d.1, off(d))?;
            writeln!(f, "| prefill after the warm-up (tokens/s) | {:.0} | {:.0} | {:+.1}% |", p.0, p.1, off(p))?;
            writeln!(f, "| decode 30 s after it halved (tokens/s) | {:.1} | {:.1} | {:+.1}% |\n", h.0, h.1, off(h))?;
        }
        let pct = |(m, lo, hi): (f64, f64, f64)| format!("{:.1}% ({:.1}-{:.1})", m * 100.0, lo * 100.0, hi * 100.0);
        let num = |(m, lo, hi): (f64, f64, f64)| format!("{m:.3} ({lo:.3}-{hi:.3})");
        let head =
            ["requests", "interactive admitted", "deadline hits", "wasted", "utilisation", "Jain (standard tenants)"];
        by_load(f, &self.cells, &head, |cells| {
            vec![
                format!("{:.0}", spread(cells, |c| c.sent as f64).0),
                pct(spread(cells, |c| c.interactive_admitted)),
                pct(spread(cells, |c| c.deadline_hits)),
                pct(spread(cells, |c| c.wasted)),
                pct(spread(cells, |c| c.utilisation)),
                num(spread(cells, |c| c.jain)),
            ]
        })?;
        if self.cells.iter().flat_map(|(_, c)| c).any(|c| c.retried > 0) {
            writeln!(f)?;
            let head = [
                "refused and retried on the hint",
                "admitted at the first retry",
                "at most (with the admissions each class got)",
                "at a later one",
                "later by (median ms)",
            ];
            by_load(f, &self.cells, &head, |cells| {
                vec![
                    format!("{:.0}", spread(cells, |c| c.retried as f64).0),
                    pct(spread(cells, |c| c.first_retry)),
                    pct(spread(cells, |c| c.first_retry_room)),
                    pct(spread(cells, |c| c.later)),
                    num(spread(cells, |c| c.lateness_ms)),
                ]
            })?;
        }
        if !self.weighted.is_empty() {
            writeln!(
                f,
                "\nweighted, 5x (standard from two tenants sending equally, weights 2 and 1): tokens heavy/light {}; Jain over weighted fair shares {}",
                num(spread(&self.weighted, |c| c.weight_ratio)),
                num(spread(&self.weighted, |c| c.jain)),
            )?;
        }
        writeln!(f, "\nmedians over {} rounds (lowest-highest)", self.weighted.len().max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fair_shares_fill_the_small_demands_first() {
        let s = fair_shares(90.0, &[10.0, 100.0, 100.0], &[1.0, 1.0, 1.0]);
        assert!((s[0] - 10.0).abs() < 1e-9 && (s[1] - 40.0).abs() < 1e-9 && (s[2] - 40.0).abs() < 1e-9, "{s:?}");
        let w = fair_shares(90.0, &[100.0, 100.0], &[2.0, 1.0]);
        assert!((w[0] - 60.0).abs() < 1e-9 && (w[1] - 30.0).abs() < 1e-9, "{w:?}");
    }

    #[test]
    fn jain_is_one_when_equal_and_falls_with_skew() {
        assert!((jain(&[1.0, 1.0, 1.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[3.0, 0.0, 0.0]) - 1.0 / 3.0).abs() < 1e-12);
    }
}
