//! How many tokens to hold for a request. The prompt can be measured at admission; the output only
//! when generation stops, so admission reserves the caller's ceiling (`max_tokens`) or, when it
//! names none, the model's.

use crate::config::ModelPolicy;

/// How the prompt's size is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptSize {
    /// Counted by the caller (the Admission/Reserve API).
    Tokens(u64),
    /// Body bytes (the larger of the bytes Envoy sent and `content-length`), converted with the
    /// model's bytes-per-token ratio. The whole body is counted, JSON included: an overestimate,
    /// which commit reconciles.
    Bytes(u64),
}

/// Estimated prompt tokens.
pub fn prompt_tokens(size: PromptSize, model: &ModelPolicy) -> u64 {
    match size {
        PromptSize::Tokens(n) => n,
        PromptSize::Bytes(b) => (b as f64 / model.bytes_per_token).ceil() as u64,
    }
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
        let m = ModelPolicy { max_output_tokens: 512, bytes_per_token: 4.0, pool: None };
        assert_eq!(prompt_tokens(PromptSize::Bytes(9), &m), 3);
        assert_eq!(prompt_tokens(PromptSize::Tokens(7), &m), 7);
        assert_eq!(output_reservation(None, &m), 512);
        assert_eq!(output_reservation(Some(10), &m), 10);
    }
}
