//! What reported counts charge a hold: tokens against every limit and budget, nanos against money
//! budgets. The prompt tokens a provider read from its cache, or wrote to it, and the output tokens
//! it spent reasoning count at the weight and cost the price the model's policy gave them when
//! the hold was made; the rest count whole.
//! `lua/common.lua`'s `charged_for` is the same arithmetic for the holds kept in the store (the
//! conformance tests commit one set of counts to both and compare).

// Token arithmetic: no unchecked +, -, * (see Cargo.toml's [lints] for the casts).
#![warn(clippy::arithmetic_side_effects)]

use crate::config::{Price, TokenWeights};

/// What a provider says more of its counts: the prompt tokens read from its cache and written to
/// it (each within the prompt), the output tokens spent reasoning (within the output). Each is
/// `None` where the response did not say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Detail {
    pub cache_read: Option<u64>,
    pub cache_write: Option<u64>,
    pub reasoning: Option<u64>,
}

/// The largest of two counts, where either says.
fn max(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

impl Detail {
    /// Each count the largest either says.
    pub fn merge(self, other: Detail) -> Detail {
        Detail {
            cache_read: max(self.cache_read, other.cache_read),
            cache_write: max(self.cache_write, other.cache_write),
            reasoning: max(self.reasoning, other.reasoning),
        }
    }
}

/// What counts charge: tokens, and what they cost (nanos of the policy's currency).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charge {
    pub tokens: u64,
    pub cost: u64,
}

/// What `prompt` and `output` tokens charge at `price` and `weights`, `detail` saying how many of
/// the prompt came from the provider's cache and how many of the output went to reasoning: cache
/// reads first, then writes, each capped at what the prompt has left, and reasoning capped at the
/// output, so no count charges more than there was. A weighted count is rounded up: a weighted
/// token never counts as nothing unless its weight is zero.
pub fn charge(price: Price, weights: TokenWeights, prompt: u64, output: u64, detail: Detail) -> Charge {
    let read = detail.cache_read.unwrap_or(0).min(prompt);
    let written = detail.cache_write.unwrap_or(0).min(prompt.saturating_sub(read));
    let plain = prompt.saturating_sub(read).saturating_sub(written);
    let reasoning = detail.reasoning.unwrap_or(0).min(output);
    let answer = output.saturating_sub(reasoning);
    let weighted = |n: u64, milli: u64| n.saturating_mul(milli).div_ceil(1000);
    let tokens = plain
        .saturating_add(weighted(read, weights.read_milli))
        .saturating_add(weighted(written, weights.write_milli))
        .saturating_add(answer)
        .saturating_add(weighted(reasoning, weights.reasoning_milli));
    let cost = [(plain, price.input_nanos), (read, price.cache_read_nanos), (written, price.cache_write_nanos)]
        .into_iter()
        .chain([(answer, price.output_nanos), (reasoning, price.reasoning_nanos)])
        .fold(0u64, |sum, (n, nanos)| sum.saturating_add(n.saturating_mul(nanos)));
    Charge { tokens, cost }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRICE: Price = Price {
        input_nanos: 3000,
        output_nanos: 15000,
        cache_read_nanos: 300,
        cache_write_nanos: 3750,
        reasoning_nanos: 15000,
    };
    const WEIGHTS: TokenWeights = TokenWeights { read_milli: 100, write_milli: 1250, reasoning_milli: 1000 };

    fn cached(read: u64, write: u64) -> Detail {
        Detail { cache_read: Some(read), cache_write: Some(write), reasoning: None }
    }

    #[test]
    fn without_cached_tokens_every_token_counts_whole_at_its_price() {
        let c = charge(PRICE, WEIGHTS, 1000, 200, Detail::default());
        assert_eq!(c, Charge { tokens: 1200, cost: 1000 * 3000 + 200 * 15000 });
        let whole = TokenWeights::default();
        assert_eq!(charge(PRICE, whole, 1000, 200, cached(400, 100)).tokens, 1200, "weight 1: as if uncached");
    }

    #[test]
    fn cached_reads_and_writes_count_at_their_weights_and_prices() {
        // 1,000 prompt tokens: 600 read from the cache (60), 200 written (250), 200 plain.
        let c = charge(PRICE, WEIGHTS, 1000, 50, cached(600, 200));
        assert_eq!(c.tokens, 200 + 60 + 250 + 50);
        assert_eq!(c.cost, 200 * 3000 + 600 * 300 + 200 * 3750 + 50 * 15000);
    }

    #[test]
    fn a_weighted_count_is_rounded_up_and_never_past_the_prompt() {
        assert_eq!(charge(PRICE, WEIGHTS, 7, 0, cached(7, 0)).tokens, 1, "0.7 of a token counts as 1");
        assert_eq!(charge(PRICE, WEIGHTS, 30, 0, cached(30, 0)).tokens, 3, "no float error: 30 x 0.1 is 3");
        // Counts that say more cache than prompt are capped: reads first, then writes.
        let c = charge(PRICE, WEIGHTS, 100, 0, cached(80, 80));
        assert_eq!(c.tokens, 8 + 25);
        assert_eq!(c.cost, 80 * 300 + 20 * 3750);
        let free = TokenWeights { read_milli: 0, write_milli: 0, reasoning_milli: 1000 };
        assert_eq!(charge(PRICE, free, 100, 5, cached(100, 0)).tokens, 5);
    }

    #[test]
    fn reasoning_tokens_count_at_their_weight_and_price_within_the_output() {
        let weights = TokenWeights { reasoning_milli: 500, ..TokenWeights::default() };
        let price = Price { reasoning_nanos: 20000, ..PRICE };
        let thought = Detail { reasoning: Some(300), ..Detail::default() };
        // 400 output tokens, 300 of them reasoning at half weight: 100 + 150.
        let c = charge(price, weights, 10, 400, thought);
        assert_eq!(c, Charge { tokens: 10 + 100 + 150, cost: 10 * 3000 + 100 * 15000 + 300 * 20000 });
        let past = Detail { reasoning: Some(900), ..Detail::default() };
        assert_eq!(charge(price, weights, 0, 400, past).tokens, 200, "never more reasoning than output");
        assert_eq!(charge(price, TokenWeights::default(), 0, 400, thought).tokens, 400, "weight 1: as output");
    }

    #[test]
    fn the_largest_counts_hold_without_overflow() {
        let max = TokenWeights { read_milli: 10_000, write_milli: 10_000, reasoning_milli: 10_000 };
        let c = charge(PRICE, max, u64::MAX, u64::MAX, cached(u64::MAX, 0));
        assert_eq!(c.tokens, u64::MAX);
        assert_eq!(c.cost, u64::MAX);
    }
}
