//! What the policy says of models and of the backend pools that serve them: a model's ceilings,
//! its prices and its weighted tokens; a pool's slots, speeds and shares.

use super::{Limits, Priority};

/// Body bytes per token where a model does not say (and for a response whose model is unknown).
pub const DEFAULT_BYTES_PER_TOKEN: f64 = 4.0;

/// What a model costs to admit.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelPolicy {
    /// The output reserved when a request names no `max_tokens`; also the largest it may name.
    pub max_output_tokens: u64,
    /// Body bytes per prompt token, for the prompt estimate.
    pub bytes_per_token: f64,
    /// Learn the ratio per tenant from the prompt counts responses report, starting from (and
    /// bounded by) `bytes_per_token`.
    pub learn_bytes_per_token: bool,
    /// The longest prompt the model takes: held for a request whose size cannot be known (a
    /// chunked body Envoy cut short, with no `content-length`).
    pub max_prompt_tokens: u64,
    /// The backend pool serving this model; none means no capacity admission for it.
    pub pool: Option<String>,
    /// What its tokens cost; none: nothing (cost budgets need every model priced).
    pub price: Option<Price>,
    /// What its cached prompt tokens and reasoning tokens count in token limits and budgets.
    pub token_weights: TokenWeights,
}

/// What a prompt token the provider read from its cache, or wrote to it, and an output token spent
/// reasoning count in token limits and budgets, in thousandths of an input (or output) token:
/// exact integers, at most [`MAX_CACHE_WEIGHT_MILLI`]. A commit that reports such tokens charges
/// them at these weights (rounded up); the hold, made before anyone knew, counts every token whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenWeights {
    pub read_milli: u64,
    pub write_milli: u64,
    pub reasoning_milli: u64,
}

impl Default for TokenWeights {
    /// Every token a whole one.
    fn default() -> Self {
        TokenWeights { read_milli: 1000, write_milli: 1000, reasoning_milli: 1000 }
    }
}

/// The heaviest a weighted token may weigh: ten whole ones.
pub const MAX_CACHE_WEIGHT_MILLI: u16 = 10_000;

/// A model's price per token, in nanos of the policy's currency (a price per million tokens
/// times 1,000): exact integers, at most [`MAX_PRICE_NANOS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Price {
    pub input_nanos: u64,
    pub output_nanos: u64,
    /// Prompt tokens read from the provider's cache (the input price unless the policy says).
    pub cache_read_nanos: u64,
    /// Prompt tokens written to the provider's cache (the input price unless the policy says).
    pub cache_write_nanos: u64,
    /// Output tokens spent reasoning (the output price unless the policy says).
    pub reasoning_nanos: u64,
}

/// The highest price per token, in nanos (1,000 per million tokens): a billion tokens at it cost
/// 10^15 nanos, still exact in the scripts' doubles.
pub const MAX_PRICE_NANOS: u64 = 1_000_000;

/// A group of backend replicas serving one or more models, as capacity admission models it:
/// `max_sequences` slots, each prefilling and then decoding at the given speeds.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolPolicy {
    pub max_sequences: u64,
    pub prefill_tokens_per_ms: f64,
    /// Decode speed of one sequence.
    pub decode_tokens_per_ms: f64,
    /// The longest predicted queue delay a request may be admitted into (for `critical`; a lower
    /// tier its share of it).
    pub max_queue_delay_ms: u64,
    pub kv_cache_tokens: Option<u64>,
    /// Share of the pool `standard` and `sheddable` may use; the rest is headroom for the tiers
    /// above them. `critical` has all of it.
    pub standard_share: f64,
    pub sheddable_share: f64,
    /// How long the pool's keys outlive their last write: two of the longest lease, and a minute.
    pub idle_ttl_ms: u64,
    /// How the provider's 429s throttle the pool; `None` when they do not.
    pub upstream_throttle: Option<UpstreamThrottle>,
    /// Admission predicts from the speeds and output lengths the responses show (the speeds
    /// above are the priors); off, from the speeds above and each request's ceiling alone.
    pub calibrate: bool,
    pub queue: PoolQueue,
    /// The provider account's limits, shared by every tenant whose model the pool serves; `None`
    /// when the pool sets none.
    pub provider: Option<ProviderLimits>,
}

/// A pool's provider limits: rates and UTC period budgets, checked with the pool's holds.
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderLimits {
    pub limits: Limits,
    /// How long their scope must outlive its last write to remember what they count: a full
    /// refill of its buckets, its longest budget's period and a day.
    pub remembered_ms: u64,
}

/// Where a pool's requests wait when every slot their tier may fill is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolQueue {
    /// Admitted into the backend's own queue, while the predicted delay is within the tier's
    /// share of `max_queue_delay_ms`.
    #[default]
    Backend,
    /// Held in tollgate (the Check is answered when a slot is free), in order: higher tiers
    /// first, tenants within a tier by weight (start-time fair queueing). The backend never runs
    /// more than the tier's slots.
    Tollgate,
}

impl PoolQueue {
    pub fn as_str(self) -> &'static str {
        match self {
            PoolQueue::Backend => "backend",
            PoolQueue::Tollgate => "tollgate",
        }
    }
}

/// Adaptive throttle from the provider's 429s (additive increase, multiplicative decrease): each
/// refusal (one per cooldown) multiplies the share of the pool admitted by `decrease`, down to
/// `min_share`; the share recovers by `recover_per_ms` every millisecond; and nothing new is
/// admitted until the provider's Retry-After has passed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpstreamThrottle {
    pub decrease: f64,
    pub min_share: f64,
    pub recover_per_ms: f64,
    pub cooldown_ms: u64,
    /// The longest provider Retry-After honoured.
    pub max_retry_after_ms: u64,
}

impl PoolPolicy {
    /// How long the provider scope outlives its last write: the pool's idle TTL, or longer where
    /// its limits need it.
    pub fn provider_idle_ttl_ms(&self, provider: &ProviderLimits) -> u64 {
        self.idle_ttl_ms.max(provider.remembered_ms)
    }

    pub fn share(&self, tier: Priority) -> f64 {
        match tier {
            Priority::Critical => 1.0,
            Priority::Standard => self.standard_share,
            Priority::Sheddable => self.sheddable_share,
        }
    }

    /// The slots a tier may fill before it queues: its share of the pool, at least one.
    // Float → integer `as` saturates; a share is in (0, 1], so the product is finite, non-negative
    // and at most the pool's own size.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    pub fn slots_for(&self, tier: Priority) -> u64 {
        ((self.max_sequences as f64 * self.share(tier)).floor() as u64).max(1)
    }

    /// The longest predicted queue delay a tier may be admitted into: its share of the pool's.
    /// Lower tiers queue less, so the queue they leave behind is one a higher tier's deadline
    /// can still be met through (every slot's queue is a queue for the tiers above too).
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    pub fn queue_delay_for(&self, tier: Priority) -> u64 {
        ((self.max_queue_delay_ms as f64 * self.share(tier)).floor() as u64).max(1)
    }

    /// The KV-cache tokens a tier may fill; `None` when the pool sets no KV capacity.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    pub fn kv_for(&self, tier: Priority) -> Option<u64> {
        self.kv_cache_tokens.map(|kv| ((kv as f64 * self.share(tier)).floor() as u64).max(1))
    }

    /// Predicted slot time of one request at the policy's speeds: prefill the prompt, then decode
    /// the output (admission predicts from the calibrated speeds, `admission::fleet`). Token
    /// counts are bounded (10^9) and speeds positive, so the result is finite and non-negative;
    /// `as` saturates all the same.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    pub fn service_ms(&self, prompt_tokens: u64, output_tokens: u64) -> u64 {
        (prompt_tokens as f64 / self.prefill_tokens_per_ms + output_tokens as f64 / self.decode_tokens_per_ms).ceil()
            as u64
    }
}
