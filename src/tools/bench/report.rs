//! Percentiles of one bench run.

use std::fmt;
use std::time::Duration;

/// Latency percentiles (exact, from every sample) and counts of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub offered_rate: u32,
    pub achieved_rate: f64,
    pub cycles: usize,
    pub admitted: usize,
    pub denied: usize,
    pub errors: usize,
    pub p50: Duration,
    pub p90: Duration,
    pub p99: Duration,
    pub p999: Duration,
    pub max: Duration,
    /// With `--store-stats`: every script call the store served in the run, per cycle sent (warm-up
    /// included). Strict, a cycle makes two (reserve, commit); a lease hit none.
    pub store_calls_per_cycle: Option<f64>,
    /// With `--quota`: tokens admitted over the whole run against what the quota allows.
    pub quota: Option<QuotaFigures>,
}

/// Tokens over a whole run (warm-up included), against a quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaFigures {
    /// Committed usage of the admitted cycles.
    pub admitted: u64,
    /// The quota's burst and its refill over the run's schedule, for every tenant.
    pub allowed: u64,
    /// The usage of every cycle sent, admitted or not.
    pub offered: u64,
}

impl QuotaFigures {
    /// Admitted over allowed, less one: 0.01 is 1% over what the quota allows.
    #[allow(clippy::cast_precision_loss)]
    pub fn overshoot(&self) -> f64 {
        self.admitted as f64 / self.allowed.max(1) as f64 - 1.0
    }
}

impl Report {
    pub fn new(offered_rate: u32, elapsed: Duration, samples: impl Iterator<Item = (Duration, bool, bool)>) -> Report {
        let mut latencies = Vec::new();
        let (mut admitted, mut denied, mut errors) = (0, 0, 0);
        for (latency, ok, error) in samples {
            latencies.push(latency);
            match (ok, error) {
                (_, true) => errors += 1,
                (true, false) => admitted += 1,
                (false, false) => denied += 1,
            }
        }
        latencies.sort_unstable();
        // Nearest rank, in integer arithmetic so that 99.9 % of 1,000 is exactly rank 999.
        let pct = |per_mille: usize| -> Duration {
            if latencies.is_empty() {
                return Duration::ZERO;
            }
            let rank = (per_mille * latencies.len()).div_ceil(1000);
            latencies[rank.clamp(1, latencies.len()) - 1]
        };
        Report {
            offered_rate,
            achieved_rate: latencies.len() as f64 / elapsed.as_secs_f64().max(f64::EPSILON),
            cycles: latencies.len(),
            admitted,
            denied,
            errors,
            p50: pct(500),
            p90: pct(900),
            p99: pct(990),
            p999: pct(999),
            max: latencies.last().copied().unwrap_or_default(),
            store_calls_per_cycle: None,
            quota: None,
        }
    }
}

impl Report {
    /// The share of cycles that made no store call, from the calls per cycle (each call counted
    /// as one cycle's miss: an upper bound on the misses).
    pub fn hits(store_calls_per_cycle: f64) -> f64 {
        (1.0 - store_calls_per_cycle).max(0.0)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        write!(
            f,
            "offered {}/s achieved {:.0}/s cycles {} admitted {} denied {} errors {} | p50 {:.3} ms p90 {:.3} ms p99 {:.3} ms p99.9 {:.3} ms max {:.3} ms",
            self.offered_rate,
            self.achieved_rate,
            self.cycles,
            self.admitted,
            self.denied,
            self.errors,
            ms(self.p50),
            ms(self.p90),
            ms(self.p99),
            ms(self.p999),
            ms(self.max)
        )?;
        if let Some(c) = self.store_calls_per_cycle {
            write!(f, " | store calls per cycle {c:.3} (lease hits {:.1}%)", Report::hits(c) * 100.0)?;
        }
        if let Some(q) = self.quota {
            write!(
                f,
                " | tokens admitted {} of {} allowed ({:+.2}%), {} offered",
                q.admitted,
                q.allowed,
                q.overshoot() * 100.0,
                q.offered
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let samples = (1..=1000).map(|i| (Duration::from_micros(i), true, false));
        let r = Report::new(1000, Duration::from_secs(1), samples);
        assert_eq!(r.p50, Duration::from_micros(500));
        assert_eq!(r.p99, Duration::from_micros(990));
        assert_eq!(r.p999, Duration::from_micros(999));
        assert_eq!(r.max, Duration::from_micros(1000));
        assert_eq!((r.cycles, r.admitted, r.errors), (1000, 1000, 0));
    }
}
