//! How many tokens to hold for a request. The prompt can be measured at admission; the output only
//! when generation stops, so admission reserves the caller's ceiling (`max_tokens`) or, when it
//! names none, the model's.

use crate::config::ModelPolicy;

/// How the prompt's size is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptSize {
    /// Counted by the caller (the Admission/Reserve API).
    Tokens(u64),
    /// Body bytes (the larger of the bytes Envoy sent and `content-length`), converted with a
    /// bytes-per-token ratio: the model's, or the one its responses taught
    /// (`admission::fleet::prompts`). Commit reconciles the estimate either way.
    Bytes(u64),
    /// Not known: Envoy sent the first bytes of a body that has no `content-length` (chunked). The
    /// model's longest prompt is held, never the few KiB that were seen.
    Unknown,
}

/// Estimated prompt tokens, a body's at `bytes_per_token` (positive).
pub fn prompt_tokens(size: PromptSize, model: &ModelPolicy, bytes_per_token: f64) -> u64 {
    match size {
        PromptSize::Tokens(n) => n,
        PromptSize::Bytes(b) => bytes_to_tokens(b, bytes_per_token),
        PromptSize::Unknown => model.max_prompt_tokens,
    }
}

/// `ceil(bytes / bytes_per_token)`, saturating. Admission bounds the bytes (2^40) first, so the
/// conversion to f64 is exact.
#[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn bytes_to_tokens(bytes: u64, bytes_per_token: f64) -> u64 {
    (bytes as f64 / bytes_per_token).ceil() as u64
}

/// Output tokens to reserve: the caller's ceiling, or the model's when the caller names none.
pub fn output_reservation(max_tokens: Option<u64>, model: &ModelPolicy) -> u64 {
    max_tokens.unwrap_or(model.max_output_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_up_to_whole_tokens() {
        let m = ModelPolicy {
            max_output_tokens: 512,
            bytes_per_token: 4.0,
            max_prompt_tokens: 1000,
            learn_bytes_per_token: true,
            pool: None,
            price: None,
            token_weights: Default::default(),
        };
        assert_eq!(prompt_tokens(PromptSize::Bytes(9), &m, 4.0), 3);
        assert_eq!(prompt_tokens(PromptSize::Bytes(9), &m, 2.5), 4);
        assert_eq!(prompt_tokens(PromptSize::Tokens(7), &m, 4.0), 7);
        assert_eq!(output_reservation(None, &m), 512);
        assert_eq!(output_reservation(Some(10), &m), 10);
        assert_eq!(prompt_tokens(PromptSize::Unknown, &m, 4.0), 1000);
    }
}
