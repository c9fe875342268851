//! What this replica has learned of the fleet from the responses it watched: each pool's speeds,
//! per model it serves ([`speeds`]), each tenant's output lengths per model ([`lengths`]), and how
//! many body bytes its prompt tokens take ([`prompts`]).
//! Capacity admission predicts a request's slot time from these rather than from the policy's
//! figures alone, which stay the priors (and the bounds: a learned speed stays within
//! [`speeds::BOUND`] of the policy's).
//!
//! In memory and per replica: every replica watches a share of the same fleet's responses and
//! learns the same speeds from it, so nothing needs sharing; a restarted replica starts again from
//! the policy and is calibrated within seconds of traffic. Bounded: speeds are kept only for the
//! policy's own pools and models, and lengths and prompt ratios for at most [`MAX_TENANTS`] tenants,
//! of the policy's models (past that all are forgotten and learned again, as the output estimates
//! are).

pub mod lengths;
pub mod prompts;
pub mod speeds;

use std::collections::HashMap;
use std::sync::{PoisonError, RwLock};

use crate::config::PoolPolicy;
use lengths::Lengths;
use prompts::PromptBytes;
use speeds::Rate;

/// Tenants whose output lengths and prompt ratios are kept (each for the policy's models it uses).
pub const MAX_TENANTS: usize = 20_000;

/// A learned prompt ratio stays within this factor of the model's `bytes_per_token`, either way:
/// a tenant of image prompts (many bytes, few tokens) or of server-side templates (the reverse)
/// moves its holds, it does not empty them.
pub const PROMPT_BOUND: f64 = 4.0;

/// The quantile of a tenant's output lengths a request is assumed to reach when its own finish is
/// judged against its deadline: the pool holds the mean (what a queue drains on average), the
/// deadline is judged on a long one.
pub const DEADLINE_QUANTILE: f32 = 0.9;

/// A pool's speeds for one model: learned, with the policy's as priors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Speeds {
    /// Time to first token, per prompt token (ms).
    pub prefill: Rate,
    /// Time per output token of one sequence (ms).
    pub decode: Rate,
    /// The policy's speeds the rates started from, in ms per token: a reload that changes them
    /// starts the pool again from its new word.
    prior: (f64, f64),
}

impl Speeds {
    fn prior_of(pool: &PoolPolicy) -> (f64, f64) {
        (1.0 / pool.prefill_tokens_per_ms, 1.0 / pool.decode_tokens_per_ms)
    }

    fn new(pool: &PoolPolicy, now_ms: u64) -> Self {
        let prior = Self::prior_of(pool);
        Speeds { prefill: Rate::prior(prior.0, now_ms), decode: Rate::prior(prior.1, now_ms), prior }
    }

    /// Learned ms per prompt token (time to first token over the prompt).
    pub fn prefill_ms_per_token(&self) -> f64 {
        self.prefill.ms_per_token(self.prior.0)
    }

    /// Learned ms per output token of one sequence.
    pub fn decode_ms_per_token(&self) -> f64 {
        self.decode.ms_per_token(self.prior.1)
    }

    /// The learned prefill speed, in tokens a second (the figure the policy states).
    pub fn prefill_tokens_per_second(&self) -> f64 {
        1000.0 / self.prefill_ms_per_token()
    }

    /// The learned decode speed of one sequence, in tokens a second.
    pub fn decode_tokens_per_second(&self) -> f64 {
        1000.0 / self.decode_ms_per_token()
    }

    /// Predicted slot time of a request: prefill the prompt, then decode the output. Token counts
    /// are bounded (10^9) and the speeds within their bounds, so the result is finite and
    /// non-negative; `as` saturates all the same.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    pub fn service_ms(&self, prompt_tokens: u64, output_tokens: u64) -> u64 {
        (prompt_tokens as f64 * self.prefill_ms_per_token() + output_tokens as f64 * self.decode_ms_per_token()).ceil()
            as u64
    }
}

/// What one response showed of its pool's speed, as the commit from the response timed it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Timing {
    /// From the request leaving for the backend to its first output token (ms), and the prompt
    /// tokens it reported: taken only for a stream that was predicted to start at once (a
    /// request that queued in the backend shows its queue, not its prefill).
    pub first_token: Option<(f64, u64)>,
    /// From the first output to the last (ms), and the output tokens generated in between: a
    /// stream's decode.
    pub decode: Option<(f64, f64)>,
}

/// This replica's picture of the fleet.
#[derive(Debug, Default)]
pub struct Fleet {
    /// Pool, then model.
    speeds: RwLock<HashMap<String, HashMap<String, Speeds>>>,
    lengths: ByTenant<Lengths>,
    prompts: ByTenant<PromptBytes>,
}

/// Something learned per tenant and model, and of every tenant's together per model (for a
/// tenant not yet seen enough); for at most [`MAX_TENANTS`] tenants.
#[derive(Debug)]
struct ByTenant<T> {
    /// Tenant, then model.
    tenants: RwLock<HashMap<String, HashMap<String, T>>>,
    models: RwLock<HashMap<String, T>>,
}

impl<T> Default for ByTenant<T> {
    fn default() -> Self {
        ByTenant { tenants: RwLock::default(), models: RwLock::default() }
    }
}

impl<T: Default> ByTenant<T> {
    /// Teaches `tenant`'s and the model's: `learn` runs on each.
    fn observe(&self, tenant: &str, model: &str, learn: impl Fn(&mut T)) {
        let mut tenants = self.tenants.write().unwrap_or_else(PoisonError::into_inner);
        if tenants.len() >= MAX_TENANTS && !tenants.contains_key(tenant) {
            tenants.clear();
        }
        learn(entry(&mut tenants, tenant, model, T::default));
        drop(tenants);
        let mut models = self.models.write().unwrap_or_else(PoisonError::into_inner);
        match models.get_mut(model) {
            Some(t) => learn(t),
            None => learn(models.entry(model.to_string()).or_default()),
        }
    }

    /// What `read` makes of `tenant`'s, once it says something; until then, of every tenant's.
    fn read<R>(&self, tenant: &str, model: &str, read: impl Fn(&T) -> Option<R>) -> Option<R> {
        let tenants = self.tenants.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(known) = tenants.get(tenant).and_then(|m| m.get(model)).and_then(&read) {
            return Some(known);
        }
        drop(tenants);
        self.models.read().unwrap_or_else(PoisonError::into_inner).get(model).and_then(read)
    }
}

/// The entry under `a` then `b`, made if missing (names are allocated only then).
fn entry<'m, T>(
    map: &'m mut HashMap<String, HashMap<String, T>>,
    a: &str,
    b: &str,
    make: impl FnOnce() -> T,
) -> &'m mut T {
    if !map.contains_key(a) {
        map.insert(a.to_string(), HashMap::new());
    }
    let inner = map.get_mut(a).expect("inserted above");
    if !inner.contains_key(b) {
        inner.insert(b.to_string(), make());
    }
    inner.get_mut(b).expect("inserted above")
}

impl Fleet {
    /// The speeds of `pool` for `model` now: learned, or the policy's before anything was (and
    /// always, for a pool that does not calibrate).
    pub fn speeds(&self, name: &str, model: &str, pool: &PoolPolicy, now_ms: u64) -> Speeds {
        if !pool.calibrate {
            return Speeds::new(pool, now_ms);
        }
        let speeds = self.speeds.read().unwrap_or_else(PoisonError::into_inner);
        match speeds.get(name).and_then(|m| m.get(model)) {
            Some(s) if s.prior == Speeds::prior_of(pool) => *s,
            _ => Speeds::new(pool, now_ms),
        }
    }

    /// Every pool and model speeds were learned for: (pool, model, speeds).
    pub fn all_speeds(&self) -> Vec<(String, String, Speeds)> {
        let speeds = self.speeds.read().unwrap_or_else(PoisonError::into_inner);
        speeds.iter().flat_map(|(p, models)| models.iter().map(|(m, s)| (p.clone(), m.clone(), *s))).collect()
    }

    /// Learns from one response of `model` on `pool` (both the policy's: the caller checked).
    /// Returns the speeds as they now stand.
    // Token counts are bounded (10^9): exact in f64.
    #[allow(clippy::cast_precision_loss)]
    pub fn observe(&self, name: &str, model: &str, pool: &PoolPolicy, now_ms: u64, t: Timing) -> Speeds {
        let mut speeds = self.speeds.write().unwrap_or_else(PoisonError::into_inner);
        let s = entry(&mut speeds, name, model, || Speeds::new(pool, now_ms));
        if s.prior != Speeds::prior_of(pool) {
            *s = Speeds::new(pool, now_ms);
        }
        if let Some((ms, prompt)) = t.first_token {
            s.prefill.observe(now_ms, ms, prompt as f64);
        }
        if let Some((ms, tokens)) = t.decode {
            s.decode.observe(now_ms, ms, tokens);
        }
        *s
    }

    /// Forgets the speeds of pools and models a reload took away.
    pub fn retain(&self, keep: impl Fn(&str, &str) -> bool) {
        let mut speeds = self.speeds.write().unwrap_or_else(PoisonError::into_inner);
        for (p, models) in speeds.iter_mut() {
            models.retain(|m, _| keep(p, m));
        }
        speeds.retain(|_, models| !models.is_empty());
    }

    /// One output length of `tenant`'s requests to `model` (one of the policy's: the caller checked).
    pub fn observe_length(&self, tenant: &str, model: &str, output: u64) {
        self.lengths.observe(tenant, model, |l| l.observe(output));
    }

    /// The output `tenant`'s requests to `model` have: (the mean, for the pool's work; the
    /// [`DEADLINE_QUANTILE`], for a request's own finish), once enough were seen; until then,
    /// every tenant's to the model, once enough of those were.
    pub fn output(&self, tenant: &str, model: &str) -> Option<(u64, u64)> {
        self.lengths.read(tenant, model, |l| Some((l.mean()?, l.quantile(DEADLINE_QUANTILE)?)))
    }

    /// One request of `tenant`'s to `model` (one of the policy's: the caller checked): its body
    /// was `bytes` long, and its response reported `tokens` prompt tokens.
    pub fn observe_prompt(&self, tenant: &str, model: &str, bytes: u64, tokens: u64) {
        if bytes > 0 && tokens > 0 {
            self.prompts.observe(tenant, model, |p| p.observe(bytes, tokens));
        }
    }

    /// Body bytes per prompt token for `tenant`'s requests to `model` (a low quantile of what
    /// was seen: [`prompts::QUANTILE`]), within [`PROMPT_BOUND`] of the model's
    /// `bytes_per_token`; until enough were seen, every tenant's to the model; until then, the
    /// model's own.
    pub fn bytes_per_token(&self, tenant: &str, model: &str, policy: f64) -> f64 {
        self.prompts
            .read(tenant, model, PromptBytes::bytes_per_token)
            .map_or(policy, |learned| learned.clamp(policy / PROMPT_BOUND, policy * PROMPT_BOUND))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_not_yet_seen_enough_gets_every_tenants_lengths() {
        let fleet = Fleet::default();
        for _ in 0..lengths::MIN_SAMPLES {
            fleet.observe_length("a", "m", 100);
        }
        assert_eq!(fleet.output("a", "m"), Some((100, 128)));
        assert_eq!(fleet.output("b", "m"), Some((100, 128)), "b has no lengths of its own yet");
        assert_eq!(fleet.output("b", "other"), None);
        for _ in 0..lengths::MIN_SAMPLES {
            fleet.observe_length("b", "m", 10);
        }
        assert_eq!(fleet.output("b", "m"), Some((10, 12)), "its own, once it has enough");
    }

    #[test]
    fn the_prompt_ratio_is_the_tenants_then_every_tenants_then_the_policys_and_bounded() {
        let fleet = Fleet::default();
        assert!((fleet.bytes_per_token("a", "m", 4.0) - 4.0).abs() < f64::EPSILON, "nothing seen: the policy's");
        for _ in 0..prompts::MIN_SAMPLES {
            fleet.observe_prompt("a", "m", 600, 100);
        }
        let a = fleet.bytes_per_token("a", "m", 4.0);
        assert!((5.5..=6.0).contains(&a), "{a}");
        assert!((fleet.bytes_per_token("b", "m", 4.0) - a).abs() < f64::EPSILON, "b has none of its own yet");
        assert!((fleet.bytes_per_token("b", "other", 4.0) - 4.0).abs() < f64::EPSILON);
        for _ in 0..prompts::MIN_SAMPLES {
            fleet.observe_prompt("b", "m", 100_000, 100);
        }
        assert!((fleet.bytes_per_token("b", "m", 4.0) - 16.0).abs() < f64::EPSILON, "at most 4x the policy's");
        fleet.observe_prompt("c", "m", 0, 100);
        fleet.observe_prompt("c", "m", 100, 0);
        assert!(fleet.prompts.tenants.read().unwrap().get("c").is_none(), "nothing to learn from");
    }

    #[test]
    fn past_max_tenants_every_tenant_is_forgotten() {
        let fleet = Fleet::default();
        for t in 0..MAX_TENANTS {
            fleet.observe_length(&format!("t{t}"), "m", 10);
        }
        assert_eq!(fleet.lengths.tenants.read().unwrap().len(), MAX_TENANTS);
        fleet.observe_length("t0", "m", 10);
        assert_eq!(fleet.lengths.tenants.read().unwrap().len(), MAX_TENANTS, "a known tenant adds none");
        fleet.observe_length("new", "m", 10);
        assert_eq!(fleet.lengths.tenants.read().unwrap().len(), 1, "a new one past the bound starts again");
    }

    #[test]
    fn speeds_start_from_the_policy_and_a_new_prior_starts_them_again() {
        let fleet = Fleet::default();
        let mut pool = crate::config::PoolPolicy {
            max_sequences: 1,
            prefill_tokens_per_ms: 1.0,
            decode_tokens_per_ms: 0.1,
            max_queue_delay_ms: 1,
            kv_cache_tokens: None,
            standard_share: 1.0,
            sheddable_share: 1.0,
            idle_ttl_ms: 1,
            upstream_throttle: None,
            calibrate: true,
            queue: crate::config::PoolQueue::Backend,
            provider: None,
        };
        assert_eq!(fleet.speeds("p", "m", &pool, 0).service_ms(100, 10), 200);
        // A backend twice as fast at decoding, for three minutes (the prior has decayed away).
        for at in (0..180_000).step_by(500) {
            fleet.observe("p", "m", &pool, at, Timing { first_token: None, decode: Some((500.0, 100.0)) });
        }
        let learned = fleet.speeds("p", "m", &pool, 180_000).decode_ms_per_token();
        assert!((learned - 5.0).abs() < 0.001, "{learned}");
        // A reload that says the pool decodes at 0.05 tokens/ms: learning starts again from it.
        pool.decode_tokens_per_ms = 0.05;
        assert_eq!(fleet.speeds("p", "m", &pool, 180_000).service_ms(100, 10), 300);
        pool.calibrate = false;
        pool.decode_tokens_per_ms = 0.1;
        assert_eq!(fleet.speeds("p", "m", &pool, 180_000).service_ms(100, 10), 200, "not calibrating");
    }
}
