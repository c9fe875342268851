//! Output lengths: how many tokens a simulated generation produces before it stops by itself.

use std::sync::Mutex;

/// The distribution of natural output lengths (before `max_tokens` cuts them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OutputLengths {
    /// Log-normal with this median and shape: most answers short, a long tail of long ones, as
    /// measured output lengths of chat traffic tend to be.
    LogNormal {
        median: f64,
        sigma: f64,
    },
    Fixed(u64),
}

impl Default for OutputLengths {
    fn default() -> Self {
        OutputLengths::LogNormal { median: 200.0, sigma: 0.8 }
    }
}

/// A seeded sampler, so a run can be repeated exactly.
#[derive(Debug)]
pub struct Sampler {
    lengths: OutputLengths,
    rng: Mutex<fastrand::Rng>,
}

impl Sampler {
    pub fn new(lengths: OutputLengths, seed: u64) -> Self {
        Sampler { lengths, rng: Mutex::new(fastrand::Rng::with_seed(seed)) }
    }

    /// One output length, at least 1, at most `cap`.
    pub fn sample(&self, cap: u64) -> u64 {
        let natural = match self.lengths {
            OutputLengths::Fixed(n) => n,
            OutputLengths::LogNormal { median, sigma } => {
                let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
                // Box-Muller: a standard normal from two uniforms in (0, 1].
                let (u1, u2) = (1.0 - rng.f64(), rng.f64());
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                (median.ln() + sigma * z).exp().round() as u64
            }
        };
        natural.clamp(1, cap.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_normal_samples_have_the_configured_median() {
        let s = Sampler::new(OutputLengths::LogNormal { median: 200.0, sigma: 0.8 }, 7);
        let mut v: Vec<u64> = (0..20_001).map(|_| s.sample(1_000_000)).collect();
        v.sort_unstable();
        let median = v[10_000] as f64;
        assert!((185.0..215.0).contains(&median), "median {median}");
        assert!(v[19_800] > 2 * v[10_000], "a long tail: p99 {} vs median {}", v[19_800], v[10_000]);
        assert!(v.iter().all(|&n| n >= 1));
    }

    #[test]
    fn max_tokens_caps_the_length() {
        let s = Sampler::new(OutputLengths::Fixed(500), 1);
        assert_eq!(s.sample(64), 64);
        assert_eq!(s.sample(1000), 500);
    }
}
