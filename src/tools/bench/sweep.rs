//! A sweep of offered rates, several runs each, and the capacity the service can defend: the
//! highest rate up to which every rate's p99 stays under a target in every run, with the p99 moving
//! less than a bound between runs (its spread, max/min), without errors, at the offered rate.
//! The reserve/commit/expire design puts the claim where the spread closes, not where the service still survives, and so
//! does this: a rate whose tail moves more between two runs of the same binary than across the
//! sweep describes the machine, not the service.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::Serialize;

use super::{BenchError, BenchOptions, Control, Report, median, run_with};

/// What to sweep.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    /// Everything but the rate.
    pub base: BenchOptions,
    pub rates: Vec<u32>,
    pub runs: u32,
    /// p99 every run must stay under, at a defended rate.
    pub p99_target: Duration,
    /// Largest p99 spread (max/min over the runs) at a defended rate.
    pub spread_bound: f64,
}

/// One run's figures, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct RunFigures {
    pub achieved: f64,
    pub cycles: usize,
    pub errors: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    pub store_calls_per_cycle: Option<f64>,
    pub overshoot: Option<f64>,
    /// Tokens offered over tokens the quota allows (2.0: twice the quota).
    pub offered_over_allowed: Option<f64>,
}

impl From<&Report> for RunFigures {
    fn from(r: &Report) -> Self {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        RunFigures {
            achieved: r.achieved_rate,
            cycles: r.cycles,
            errors: r.errors,
            p50_ms: ms(r.p50),
            p99_ms: ms(r.p99),
            p999_ms: ms(r.p999),
            max_ms: ms(r.max),
            store_calls_per_cycle: r.store_calls_per_cycle,
            overshoot: r.quota.map(|q| q.overshoot()),
            offered_over_allowed: r.quota.map(|q| q.offered as f64 / q.allowed.max(1) as f64),
        }
    }
}

/// One offered rate over all its runs. Percentiles are the median of the runs'.
#[derive(Debug, Clone, Serialize)]
pub struct RateSummary {
    pub offered: u32,
    pub achieved: f64,
    pub errors: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub p99_min_ms: f64,
    pub p99_max_ms: f64,
    /// p99 max / min over the runs.
    pub spread: f64,
    /// Meets the target and the bound (on its own; see [`SweepReport::defended_capacity`]).
    pub within: bool,
    /// Most store calls per cycle of the runs, with `--store-stats`.
    pub store_calls_max: Option<f64>,
    /// Largest overshoot of the runs, with `--quota`.
    pub overshoot_max: Option<f64>,
    pub runs: Vec<RunFigures>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SweepReport {
    pub target: String,
    pub mode: &'static str,
    pub p99_target_ms: f64,
    pub spread_bound: f64,
    pub rates: Vec<RateSummary>,
    /// The highest offered rate up to which every swept rate is within target and bound.
    pub defended_capacity: Option<u32>,
    /// Ctrl-C stopped the sweep; the figures cover what ran.
    pub stopped_early: bool,
}

fn summarize(offered: u32, runs: Vec<RunFigures>, o: &SweepOptions) -> RateSummary {
    let p99s: Vec<f64> = runs.iter().map(|r| r.p99_ms).collect();
    let (lo, hi) = (p99s.iter().copied().fold(f64::INFINITY, f64::min), p99s.iter().copied().fold(0.0, f64::max));
    let errors = runs.iter().map(|r| r.errors).sum();
    let achieved = runs.iter().map(|r| r.achieved).sum::<f64>() / runs.len().max(1) as f64;
    let spread = if lo > 0.0 { hi / lo } else { f64::INFINITY };
    let target_ms = o.p99_target.as_secs_f64() * 1000.0;
    let within = !runs.is_empty()
        && hi <= target_ms
        && spread <= o.spread_bound
        && errors == 0
        && achieved >= 0.98 * f64::from(offered);
    RateSummary {
        offered,
        achieved,
        errors,
        p50_ms: median(runs.iter().map(|r| r.p50_ms).collect()),
        p99_ms: median(p99s.clone()),
        p999_ms: median(runs.iter().map(|r| r.p999_ms).collect()),
        p99_min_ms: lo,
        p99_max_ms: hi,
        spread,
        within,
        store_calls_max: runs.iter().filter_map(|r| r.store_calls_per_cycle).reduce(f64::max),
        overshoot_max: runs.iter().filter_map(|r| r.overshoot).reduce(f64::max),
        runs,
    }
}

/// Runs the sweep, drawing a progress bar on stderr.
pub async fn sweep(o: &SweepOptions, control: Arc<Control>) -> Result<SweepReport, BenchError> {
    let mut rates = o.rates.clone();
    rates.sort_unstable();
    let mut summaries = Vec::new();
    let mut stopped_early = false;
    'rates: for &rate in &rates {
        let options = BenchOptions { rate, ..o.base.clone() };
        let total = ((options.warmup + options.duration).as_secs_f64() * f64::from(rate)) as u64;
        let mut runs = Vec::new();
        for run in 1..=o.runs.max(1) {
            if control.stop.load(Ordering::Relaxed) {
                stopped_early = true;
                break 'rates;
            }
            let bar = tokio::spawn(progress(control.clone(), rate, run, o.runs, total));
            let report = run_with(&options, control.clone()).await;
            bar.abort();
            let report = report?;
            eprintln!("\r{:<78}", format!("rate {rate}/s run {run}/{}: {report}", o.runs));
            if control.stop.load(Ordering::Relaxed) {
                stopped_early = true;
                if report.cycles > 0 {
                    runs.push(RunFigures::from(&report));
                }
                summaries.push(summarize(rate, runs, o));
                break 'rates;
            }
            runs.push(RunFigures::from(&report));
        }
        summaries.push(summarize(rate, runs, o));
    }
    let defended_capacity = summaries.iter().take_while(|s| s.within).map(|s| s.offered).last();
    Ok(SweepReport {
        target: o.base.target.clone(),
        mode: if o.base.http { "http" } else { "grpc" },
        p99_target_ms: o.p99_target.as_secs_f64() * 1000.0,
        spread_bound: o.spread_bound,
        rates: summaries,
        defended_capacity,
        stopped_early,
    })
}

async fn progress(control: Arc<Control>, rate: u32, run: u32, runs: u32, total: u64) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        let sent = control.sent.load(Ordering::Relaxed).min(total);
        let filled = (30 * sent / total.max(1)) as usize;
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\rrate {rate}/s run {run}/{runs} [{}{}] {:>3}%",
            "#".repeat(filled),
            "-".repeat(30 - filled),
            100 * sent / total.max(1)
        );
        let _ = err.flush();
    }
}

impl SweepReport {
    /// The sweep as a Markdown table, with the defended capacity under it.
    pub fn markdown(&self) -> String {
        let hits = self.rates.iter().any(|r| r.store_calls_max.is_some());
        let quota = self.rates.iter().any(|r| r.overshoot_max.is_some());
        let mut out = format!(
            "{} cycles against {}; p99 target {} ms, spread bound {}x\n\n| offered /s | achieved /s | errors | p50 ms | p99 ms | p99.9 ms | p99 range ms | spread | within |{}{}\n|---|---|---|---|---|---|---|---|---|{}{}\n",
            self.mode,
            self.target,
            self.p99_target_ms,
            self.spread_bound,
            if hits { " store calls per cycle (lease hits), worst run |" } else { "" },
            if quota { " tokens admitted vs quota (highest run) |" } else { "" },
            if hits { "---|" } else { "" },
            if quota { "---|" } else { "" },
        );
        for r in &self.rates {
            out.push_str(&format!(
                "| {} | {:.0} | {} | {:.3} | {:.3} | {:.3} | {:.3} – {:.3} | {:.2}x | {} |",
                r.offered,
                r.achieved,
                r.errors,
                r.p50_ms,
                r.p99_ms,
                r.p999_ms,
                r.p99_min_ms,
                r.p99_max_ms,
                r.spread,
                if r.within { "yes" } else { "no" }
            ));
            if let Some(calls) = r.store_calls_max {
                out.push_str(&format!(" {calls:.3} ({:.1}%) |", Report::hits(calls) * 100.0));
            }
            if quota {
                let offered = r.runs.iter().filter_map(|f| f.offered_over_allowed).reduce(f64::max).unwrap_or(0.0);
                out.push_str(&format!(" {:+.2}% (offered {offered:.2}x) |", r.overshoot_max.unwrap_or(0.0) * 100.0));
            }
            out.push('\n');
        }
        out.push_str(&match self.defended_capacity {
            Some(rate) => format!("\ndefended capacity: {rate} cycles/s\n"),
            None => "\ndefended capacity: none of the swept rates\n".to_string(),
        });
        if self.stopped_early {
            out.push_str("(stopped early by Ctrl-C: the figures cover what ran)\n");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(p99: f64) -> RunFigures {
        RunFigures {
            achieved: 1000.0,
            cycles: 1000,
            errors: 0,
            p50_ms: 0.5,
            p99_ms: p99,
            p999_ms: 2.0,
            max_ms: 3.0,
            store_calls_per_cycle: None,
            overshoot: None,
            offered_over_allowed: None,
        }
    }

    fn options() -> SweepOptions {
        SweepOptions {
            base: BenchOptions {
                target: String::new(),
                http: false,
                stream: false,
                last_byte: false,
                rate: 0,
                duration: Duration::ZERO,
                warmup: Duration::ZERO,
                tenants: vec![],
                model: String::new(),
                connections: 1,
                store_stats: None,
                quota: None,
                prompt_bytes: None,
            },
            rates: vec![],
            runs: 3,
            p99_target: Duration::from_millis(1),
            spread_bound: 1.3,
        }
    }

    #[test]
    fn a_rate_is_within_only_if_every_run_meets_the_target_and_the_spread_is_bounded() {
        let o = options();
        assert!(summarize(1000, vec![figures(0.7), figures(0.8), figures(0.75)], &o).within);
        let wide = summarize(1000, vec![figures(0.5), figures(0.9), figures(0.6)], &o);
        assert!(!wide.within, "spread 1.8x");
        assert!((wide.spread - 1.8).abs() < 1e-9);
        assert_eq!(wide.p99_ms, 0.6, "the median run");
        assert!(!summarize(1000, vec![figures(0.9), figures(1.1), figures(0.95)], &o).within, "one run over 1 ms");
    }
}
