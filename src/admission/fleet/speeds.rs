//! A pool's speeds as its responses show them: time to first token per prompt token, and time per
//! output token of one sequence, each a ratio of decayed sums.

/// How fast an observation's weight decays: `e^(-age / DECAY_MS)`. After 30 s of steady traffic at
/// a new speed, what came before weighs e^-3 (5%): a halved speed is followed within 30 s.
pub const DECAY_MS: f64 = 10_000.0;

/// The policy's speed counts as this many tokens seen, until real ones outweigh it (a few
/// responses do; it decays like any other observation).
const PRIOR_TOKENS: f64 = 64.0;

/// A learned speed stays within this factor of the policy's, either way: a broken clock or a
/// backend stalled for a minute bends the model, it does not break it.
pub const BOUND: f64 = 8.0;

/// Milliseconds per token, learned as Σ time / Σ tokens over observations whose weight decays with
/// their age: longer responses count more (their timing is the surer), and with no traffic the
/// estimate stays where it was (both sums decay alike).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    time_ms: f64,
    tokens: f64,
    /// When the sums were last decayed (the admission clock, ms).
    at_ms: u64,
    /// Observations taken, ever.
    pub samples: u64,
}

impl Rate {
    /// The policy's speed, as a prior, at `now_ms`.
    pub fn prior(ms_per_token: f64, now_ms: u64) -> Self {
        Rate { time_ms: ms_per_token * PRIOR_TOKENS, tokens: PRIOR_TOKENS, at_ms: now_ms, samples: 0 }
    }

    /// One observation: `time_ms` spent on `tokens` tokens.
    // Millisecond ages are far below 2^52: the conversion is exact.
    #[allow(clippy::cast_precision_loss)]
    pub fn observe(&mut self, now_ms: u64, time_ms: f64, tokens: f64) {
        if !(time_ms.is_finite() && tokens.is_finite() && time_ms >= 0.0 && tokens > 0.0) {
            return;
        }
        let age = now_ms.saturating_sub(self.at_ms) as f64;
        let keep = (-age / DECAY_MS).exp();
        self.time_ms = self.time_ms * keep + time_ms;
        self.tokens = self.tokens * keep + tokens;
        self.at_ms = self.at_ms.max(now_ms);
        self.samples = self.samples.saturating_add(1);
    }

    /// The learned ms per token, within [`BOUND`] of the prior's.
    pub fn ms_per_token(&self, prior: f64) -> f64 {
        let learned = if self.tokens > 0.0 { self.time_ms / self.tokens } else { prior };
        learned.clamp(prior / BOUND, prior * BOUND)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream of 200-token responses, one every 250 ms, at `ms_per_token`, from `from` for `for_ms`.
    fn traffic(r: &mut Rate, from: u64, for_ms: u64, ms_per_token: f64) {
        for at in (from..from.saturating_add(for_ms)).step_by(250) {
            r.observe(at, 200.0 * ms_per_token, 200.0);
        }
    }

    #[test]
    fn learns_the_true_speed_within_ten_percent_in_a_minute() {
        // The policy says 10 ms a token; the backend takes 4.
        let mut r = Rate::prior(10.0, 0);
        traffic(&mut r, 0, 60_000, 4.0);
        let learned = r.ms_per_token(10.0);
        assert!((learned - 4.0).abs() / 4.0 < 0.10, "{learned}");
        assert!((learned - 4.0).abs() / 4.0 < 0.001, "in fact it is all but exact: {learned}");
    }

    #[test]
    fn a_halved_speed_is_followed_within_thirty_seconds() {
        let mut r = Rate::prior(10.0, 0);
        traffic(&mut r, 0, 60_000, 10.0);
        // Half the speed: twice the time a token.
        traffic(&mut r, 60_000, 30_000, 20.0);
        let learned = r.ms_per_token(10.0);
        assert!((learned - 20.0).abs() / 20.0 < 0.10, "{learned}");
        // Halfway there after 7 s (e^-0.7 ≈ 0.5).
        let mut early = Rate::prior(10.0, 0);
        traffic(&mut early, 0, 60_000, 10.0);
        traffic(&mut early, 60_000, 7_000, 20.0);
        let midway = early.ms_per_token(10.0);
        assert!((14.0..16.0).contains(&midway), "{midway}");
    }

    #[test]
    fn without_traffic_the_estimate_stays() {
        let mut r = Rate::prior(10.0, 0);
        traffic(&mut r, 0, 10_000, 5.0);
        let before = r.ms_per_token(10.0);
        // An hour later, one short response at the same speed: nothing drifted back to the prior.
        r.observe(3_600_000, 50.0, 10.0);
        assert!((r.ms_per_token(10.0) - before).abs() < 0.05, "{} against {before}", r.ms_per_token(10.0));
    }

    #[test]
    fn the_learned_speed_stays_within_its_bound_of_the_prior() {
        let mut r = Rate::prior(10.0, 0);
        r.observe(1, 1e9, 1.0);
        assert_eq!(r.ms_per_token(10.0), 10.0 * BOUND);
        let mut r = Rate::prior(10.0, 0);
        r.observe(1, 0.0, 1e9);
        assert_eq!(r.ms_per_token(10.0), 10.0 / BOUND);
    }

    #[test]
    fn nonsense_is_not_an_observation() {
        let mut r = Rate::prior(10.0, 0);
        for (time, tokens) in [(f64::NAN, 1.0), (1.0, 0.0), (-1.0, 5.0), (f64::INFINITY, 3.0), (1.0, -2.0)] {
            r.observe(5, time, tokens);
        }
        assert_eq!(r, Rate::prior(10.0, 0));
    }
}
