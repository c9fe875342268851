//! How many body bytes a prompt token of one tenant's requests to one model takes, as this replica
//! saw the responses report their prompt counts: a histogram of each request's ratio whose counts
//! decay by sample, read at a low quantile so the hold errs large (a body whose JSON, images or
//! tool schemas weigh more than its text holds more tokens, never fewer).

/// Ratios kept: `2^(LOWEST_OCTAVE)` to `2^(LOWEST_OCTAVE + OCTAVES)` bytes per token; a ratio
/// outside falls in the end bucket (the estimate is bounded by the policy's ratio anyway).
const LOWEST_OCTAVE: i32 = -1;
const OCTAVES: usize = 7;
/// Buckets per octave: each 2^(1/8), about 9% wide, and read between their edges.
const PER_OCTAVE: usize = 8;
const BUCKETS: usize = OCTAVES * PER_OCTAVE;

/// Each sample keeps `1 - 1/WINDOW` of what came before: about the last `WINDOW` requests count.
const WINDOW: f32 = 200.0;

/// Samples needed before the histogram stands for the tenant (until then: every tenant's to the
/// model, then the policy's `bytes_per_token`).
pub const MIN_SAMPLES: u32 = 10;

/// The share of requests whose bytes per token the estimate may be above: a prompt is held at
/// its body over this quantile of the ratios, so nine in ten prompts are held in full.
pub const QUANTILE: f32 = 0.1;

/// The ratio `buckets` (whole or not) above the lowest one's lower edge: `ratio_at(i as f64)` is
/// the lower edge of bucket `i`, and the upper edge of `i - 1`.
#[allow(clippy::cast_precision_loss)]
fn ratio_at(buckets: f64) -> f64 {
    2f64.powf(f64::from(LOWEST_OCTAVE) + buckets / PER_OCTAVE as f64)
}

/// The bucket of a ratio.
// The logarithm of a positive finite ratio, scaled and floored: a small integer, clamped.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
fn bucket(ratio: f64) -> usize {
    let at = ((ratio.log2() - f64::from(LOWEST_OCTAVE)) * PER_OCTAVE as f64).floor();
    if at.is_nan() || at < 0.0 { 0 } else { (at as usize).min(BUCKETS - 1) }
}

#[derive(Debug, Clone, PartialEq)]
pub struct PromptBytes {
    counts: [f32; BUCKETS],
    samples: u32,
}

impl Default for PromptBytes {
    fn default() -> Self {
        PromptBytes { counts: [0.0; BUCKETS], samples: 0 }
    }
}

impl PromptBytes {
    /// One request: its body was `bytes` long, and its response reported `tokens` prompt tokens.
    /// A request with no bytes or no tokens says nothing.
    // Counts are bounded (2^40 bytes, 10^9 tokens): the ratio is finite.
    #[allow(clippy::cast_precision_loss)]
    pub fn observe(&mut self, bytes: u64, tokens: u64) {
        if bytes == 0 || tokens == 0 {
            return;
        }
        let keep = 1.0 - 1.0 / WINDOW;
        for c in &mut self.counts {
            *c *= keep;
        }
        self.counts[bucket(bytes as f64 / tokens as f64)] += 1.0;
        self.samples = self.samples.saturating_add(1);
    }

    /// The bytes per token at or below which [`QUANTILE`] of the requests fell, read between
    /// the edges of its bucket; once there are enough samples.
    pub fn bytes_per_token(&self) -> Option<f64> {
        if self.samples < MIN_SAMPLES {
            return None;
        }
        let need = QUANTILE * self.counts.iter().sum::<f32>();
        let mut seen = 0.0;
        for (i, &c) in self.counts.iter().enumerate() {
            if c > 0.0 && seen + c >= need {
                // Between the edges (geometrically), by how far into the bucket the quantile falls.
                let into = f64::from(((need - seen) / c).clamp(0.0, 1.0));
                return Some(ratio_at(i as f64 + into));
            }
            seen += c;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_said_before_enough_samples() {
        let mut p = PromptBytes::default();
        for _ in 0..MIN_SAMPLES - 1 {
            p.observe(500, 100);
        }
        assert_eq!(p.bytes_per_token(), None);
        p.observe(0, 100);
        p.observe(500, 0);
        assert_eq!(p.bytes_per_token(), None, "an empty body or prompt teaches nothing");
        p.observe(500, 100);
        let learned = p.bytes_per_token().unwrap();
        assert!((4.75..=5.0).contains(&learned), "within 5's bucket [4.76, 5.19): {learned}");
    }

    #[test]
    fn a_low_quantile_of_a_mix() {
        let mut p = PromptBytes::default();
        // Four in five requests at 6 bytes a token, one in five at 3: a tenth are at 3.
        for i in 0..500 {
            p.observe(if i % 5 == 4 { 300 } else { 600 }, 100);
        }
        let learned = p.bytes_per_token().unwrap();
        assert!((2.8..=3.3).contains(&learned), "{learned}");
    }

    #[test]
    fn a_change_of_ratio_is_followed() {
        let mut p = PromptBytes::default();
        for _ in 0..1000 {
            p.observe(800, 100);
        }
        // e^-3 of the old ratios remain: 5% of the weight, below the quantile.
        for _ in 0..600 {
            p.observe(300, 100);
        }
        let learned = p.bytes_per_token().unwrap();
        assert!((2.8..=3.1).contains(&learned), "{learned}");
    }

    #[test]
    fn every_ratio_has_a_bucket() {
        assert_eq!(bucket(0.0), 0);
        assert_eq!(bucket(0.5), 0);
        assert_eq!(bucket(1.0), PER_OCTAVE);
        assert_eq!(bucket(f64::MAX), BUCKETS - 1);
        assert_eq!(bucket(f64::NAN), 0);
        for i in 0..BUCKETS {
            assert_eq!(bucket(ratio_at(i as f64) * 1.0001), i);
        }
    }
}
