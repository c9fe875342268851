//! The output lengths a tenant's requests to one model have had, as this replica saw them commit:
//! a histogram whose counts decay by sample, for the pool's expected work (the mean) and a
//! request's own finish (a high quantile).

/// Buckets of output lengths: bucket `i` holds lengths up to `2^(i/2)` (rounded up), the last one
/// everything longer. 48 buckets reach 2^23.5 (about 12 million tokens), past any model's output.
const BUCKETS: usize = 48;

/// Each sample keeps `1 - 1/WINDOW` of what came before: about the last `WINDOW` lengths count.
const WINDOW: f32 = 200.0;

/// Samples needed before the histogram stands for the tenant (until then the pool holds the
/// request's ceiling, as it always did).
pub const MIN_SAMPLES: u32 = 10;

/// The upper edge of bucket `i`.
// i < 48: 2^(i/2) < 2^24, exact in f64 and in u64.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
fn edge(i: usize) -> u64 {
    (2f64.powf(i as f64 / 2.0)).ceil() as u64
}

/// The bucket of a length.
fn bucket(len: u64) -> usize {
    (0..BUCKETS).find(|&i| len <= edge(i)).unwrap_or(BUCKETS - 1)
}

#[derive(Debug, Clone, PartialEq)]
pub struct Lengths {
    counts: [f32; BUCKETS],
    /// The decayed sum of lengths, for the mean.
    sum: f64,
    samples: u32,
}

impl Default for Lengths {
    fn default() -> Self {
        Lengths { counts: [0.0; BUCKETS], sum: 0.0, samples: 0 }
    }
}

impl Lengths {
    // Lengths are bounded (10^9) and exact in f64.
    #[allow(clippy::cast_precision_loss)]
    pub fn observe(&mut self, len: u64) {
        let keep = 1.0 - 1.0 / WINDOW;
        for c in &mut self.counts {
            *c *= keep;
        }
        self.counts[bucket(len)] += 1.0;
        self.sum = self.sum * f64::from(keep) + len as f64;
        self.samples = self.samples.saturating_add(1);
    }

    fn total(&self) -> f32 {
        self.counts.iter().sum()
    }

    /// The mean length, once there are enough samples.
    // A mean of bounded lengths: finite, non-negative, at most 10^9.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    pub fn mean(&self) -> Option<u64> {
        let total = f64::from(self.total());
        (self.samples >= MIN_SAMPLES && total > 0.0).then(|| (self.sum / total).ceil().max(1.0) as u64)
    }

    /// The length `quantile` of the samples fall at or below, as its bucket's upper edge (an
    /// estimate errs long), once there are enough samples.
    pub fn quantile(&self, quantile: f32) -> Option<u64> {
        if self.samples < MIN_SAMPLES {
            return None;
        }
        let need = quantile * self.total();
        let mut seen = 0.0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= need {
                return Some(edge(i));
            }
        }
        Some(edge(BUCKETS - 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_said_before_enough_samples() {
        let mut l = Lengths::default();
        for _ in 0..MIN_SAMPLES - 1 {
            l.observe(100);
        }
        assert_eq!((l.mean(), l.quantile(0.9)), (None, None));
        l.observe(100);
        assert_eq!(l.mean(), Some(100));
        assert_eq!(l.quantile(0.9), Some(128), "the edge of 100's bucket (90.5, 128]");
    }

    #[test]
    fn the_mean_and_a_quantile_of_a_mix() {
        let mut l = Lengths::default();
        // Nine of ten short, one long.
        for i in 0..200 {
            l.observe(if i % 10 == 9 { 1000 } else { 50 });
        }
        let mean = l.mean().unwrap();
        assert!((140..=150).contains(&mean), "{mean}");
        assert_eq!(l.quantile(0.5), Some(64));
        assert_eq!(l.quantile(0.95), Some(1024));
    }

    #[test]
    fn a_change_of_lengths_is_followed() {
        let mut l = Lengths::default();
        for _ in 0..1000 {
            l.observe(1000);
        }
        for _ in 0..600 {
            l.observe(10);
        }
        // e^-3 of the old lengths remain: 5% of the weight.
        assert_eq!(l.quantile(0.9), Some(12), "the edge of (8, 12]");
        let mean = l.mean().unwrap();
        assert!((50..=70).contains(&mean), "{mean}");
    }

    #[test]
    fn every_length_has_a_bucket() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1), 0);
        assert_eq!(bucket(2), 1);
        assert_eq!(bucket(3), 3);
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
        assert!(edge(BUCKETS - 1) > 10_000_000);
    }
}
