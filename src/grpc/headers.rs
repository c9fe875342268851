//! Every header name tollgate reads or writes, once, with what it means. HTTP header names are
//! case-insensitive; Envoy hands them over lower-cased, and these are written so.

use crate::admission::Forecast;

// What a request carries in (Envoy's Check).

/// The caller's user within its tenant: a scope of its own when the policy limits users.
pub const USER: &str = "x-user-id";
/// The claimed tier: `critical`, `standard` or `sheddable` (capped by the tenant's `max_priority`).
pub const PRIORITY: &str = "x-priority";
/// The Gateway API Inference Extension's objective: a tier, as `server.objectives` maps it.
pub const OBJECTIVE: &str = "x-gateway-inference-objective";
/// How long the caller will wait, in ms from now: capacity admission refuses what cannot finish.
pub const DEADLINE: &str = "x-request-deadline-ms";
/// Groups the attempts of one request; a retried Check is a new attempt with a hold of its own.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The whole body's size, when Envoy sent only its first bytes.
pub const CONTENT_LENGTH: &str = "content-length";
/// What a response body is: which usage reader, or none, reads it.
pub const CONTENT_TYPE: &str = "content-type";
/// A compressed response is not read: its hold is charged as held.
pub const CONTENT_ENCODING: &str = "content-encoding";
/// Response: Bedrock's InvokeModel reports its counts here rather than in its body.
pub const BEDROCK_INPUT_TOKENS: &str = "x-amzn-bedrock-input-token-count";
/// Response: the output count beside [`BEDROCK_INPUT_TOKENS`].
pub const BEDROCK_OUTPUT_TOKENS: &str = "x-amzn-bedrock-output-token-count";
/// Envoy sets this when it sent only the first bytes of the body.
pub const PARTIAL_BODY: &str = "x-envoy-auth-partial-body";

// tollgate's own namespace: a client's values under it never reach the backend.

/// The prefix of every header tollgate sets.
pub const OWN_PREFIX: &str = "x-tollgate-";
/// Upstream: the reservation the backend commits against.
pub const RESERVATION: &str = "x-tollgate-reservation";
/// Upstream: how many tokens the hold took.
pub const RESERVED_TOKENS: &str = "x-tollgate-reserved-tokens";
/// To the client: why a request was refused (a reason code).
pub const REASON: &str = "x-tollgate-reason";
/// Upstream: admitted without a hold (the store was down and the tenant fails open).
pub const UNMETERED: &str = "x-tollgate-unmetered";
/// Upstream and to the client: the tenant is in shadow and its limits would have refused the
/// request, for this reason; it was admitted (and held) anyway.
pub const SHADOW: &str = "x-tollgate-shadow";
/// Upstream and to the client: the tenant's soft budget the request is past (`tokens_per_day`);
/// admitted all the same, and one tier lower in its pool. An Envoy route may match it to send the
/// request to a cheaper backend (ext_authz's `clear_route_cache`; envoy/envoy.yaml's economy route).
pub const SOFT_LIMIT: &str = "x-tollgate-soft-limit";
/// Upstream: the model the hold was made for, which the commit from the response meters by. On
/// a request, set by a trusted filter (never a client), it names the model when the body cannot:
/// OpenAI's Python SDK sends `messages` before `model`, so a body cut at `max_request_bytes` may
/// end before the model. Used only when the body names none.
pub const MODEL: &str = "x-tollgate-model";
/// Upstream: what capacity admission predicted for a request holding pool work,
/// `start=<ms>;output=<tokens>` (see [`forecast`]): the commit from the response times the pool
/// and counts the stream's remaining work by it.
pub const FORECAST: &str = "x-tollgate-forecast";
/// Upstream: the most output the request itself allows (its `max_tokens`, times its outputs),
/// which the commit from the response holds a metered count to; absent when it named no limit.
pub const OUTPUT_CEILING: &str = "x-tollgate-output-ceiling";
/// Response: the backend says it commits itself (`caller`), so ext_proc leaves the hold to it.
pub const COMMIT: &str = "x-tollgate-commit";

/// Every header the commit from the response reads (`super::ext_proc`, a debug assertion says it
/// reads no other): of the request, its path, size and what `Check` set; of the response, its
/// status, framing, a provider's retry hints and counts, and whether the backend commits itself.
/// `envoy/envoy.yaml`'s ext_proc filter forwards these alone (`forward_rules`: a client's other
/// headers are neither serialized by Envoy nor decoded here), and `tests/deploy.rs` checks that it
/// names each and no other.
pub const EXT_PROC_READS: [&str; 14] = [
    ":path",
    CONTENT_LENGTH,
    CONTENT_ENCODING,
    RESERVATION,
    MODEL,
    FORECAST,
    OUTPUT_CEILING,
    ":status",
    CONTENT_TYPE,
    COMMIT,
    RETRY_AFTER,
    RETRY_AFTER_MS,
    BEDROCK_INPUT_TOKENS,
    BEDROCK_OUTPUT_TOKENS,
];

// Retry hints, on a refusal to the client and read from a provider's 429.

/// Whole seconds, rounded up.
pub const RETRY_AFTER: &str = "retry-after";
/// The same in milliseconds.
pub const RETRY_AFTER_MS: &str = "retry-after-ms";
/// `false` where retrying cannot help, or the wait is past what an SDK should sleep through (see
/// `Denial::should_retry`; OpenAI's and Anthropic's SDKs read it).
pub const SHOULD_RETRY: &str = "x-should-retry";
/// A window's rate-limit headers, each `[limit, remaining, reset]`: OpenAI's
/// `x-ratelimit-{limit,remaining,reset}-{tokens,requests}` (it has none for one side of a
/// request), and, on Anthropic's routes, `anthropic-ratelimit-{kind}-{limit,remaining,reset}`,
/// the reset as an RFC 3339 time. Put together once, at compile time, not for every response.
pub struct RateLimitNames {
    /// OpenAI's names, where it has them.
    pub openai: Option<[&'static str; 3]>,
    /// Anthropic's names.
    pub anthropic: [&'static str; 3],
}

/// A window's [`RateLimitNames`] from its kind (`tokens`, `input-tokens`): Anthropic's, and with
/// `openai`, OpenAI's too.
macro_rules! rate_limit_names {
    (@anthropic $kind:literal) => {
        [
            concat!("anthropic-ratelimit-", $kind, "-limit"),
            concat!("anthropic-ratelimit-", $kind, "-remaining"),
            concat!("anthropic-ratelimit-", $kind, "-reset"),
        ]
    };
    ($kind:literal) => {
        RateLimitNames { openai: None, anthropic: rate_limit_names!(@anthropic $kind) }
    };
    ($kind:literal, openai) => {
        RateLimitNames {
            openai: Some([
                concat!("x-ratelimit-limit-", $kind),
                concat!("x-ratelimit-remaining-", $kind),
                concat!("x-ratelimit-reset-", $kind),
            ]),
            anthropic: rate_limit_names!(@anthropic $kind),
        }
    };
}

/// The tightest scope's token window.
pub const RATELIMIT_TOKENS: RateLimitNames = rate_limit_names!("tokens", openai);
/// Its request window.
pub const RATELIMIT_REQUESTS: RateLimitNames = rate_limit_names!("requests", openai);
/// Its input-token window (the prompt's side).
pub const RATELIMIT_INPUT_TOKENS: RateLimitNames = rate_limit_names!("input-tokens");
/// Its output-token window.
pub const RATELIMIT_OUTPUT_TOKENS: RateLimitNames = rate_limit_names!("output-tokens");

// Envoy's dynamic metadata.

/// The namespace Envoy files a Check's `dynamic_metadata` under (an ext_proc filter can forward it
/// to tollgate with `metadata_options`).
pub const AUTHZ_NAMESPACE: &str = "envoy.filters.http.ext_authz";
/// Fields of that metadata: the reservation and the model, as in the upstream headers.
pub const RESERVATION_FIELD: &str = "reservation";
/// The model field of that metadata.
pub const MODEL_FIELD: &str = "model";
/// The forecast field of that metadata, as [`FORECAST`].
pub const FORECAST_FIELD: &str = "forecast";
/// The output ceiling field of that metadata, as [`OUTPUT_CEILING`].
pub const OUTPUT_CEILING_FIELD: &str = "output_ceiling";
/// The soft budget the request is past (only then), and the tier it was decided at (always).
pub const SOFT_LIMIT_FIELD: &str = "soft_limit";
pub const TIER_FIELD: &str = "tier";

/// The [`FORECAST`] header's value.
pub fn forecast(f: Forecast) -> String {
    format!("start={};output={}", f.start_delay_ms, f.output_tokens)
}

/// A [`FORECAST`] value read back; `None` if it is not one.
pub fn parse_forecast(value: &str) -> Option<Forecast> {
    let (start, output) = value.trim().split_once(';')?;
    Some(Forecast {
        start_delay_ms: start.strip_prefix("start=")?.parse().ok()?,
        output_tokens: output.strip_prefix("output=")?.parse().ok()?,
    })
}

/// An [`OUTPUT_CEILING`] value (or its metadata field's) read back; `None` if it is not one.
pub fn parse_output_ceiling(value: &str) -> Option<u64> {
    value.trim().parse().ok()
}

/// A gRPC call's deadline as its caller sent it (`grpc-timeout`: Envoy's ext_authz `timeout`, a
/// client's deadline).
pub const GRPC_TIMEOUT: &str = "grpc-timeout";

/// How long admission may keep a caller waiting for a slot: its `grpc-timeout` (digits, then a
/// unit: H M S m u n) less a tenth and 20 ms, so the answer reaches it in time. `None` without one
/// (or an unreadable one).
pub fn caller_wait_ms(metadata: &tonic::metadata::MetadataMap) -> Option<u64> {
    let value = metadata.get(GRPC_TIMEOUT)?.to_str().ok()?;
    let unit_at = value.len().checked_sub(1)?;
    let amount: u64 = value.get(..unit_at)?.parse().ok()?;
    let ms = match value.get(unit_at..)? {
        "H" => amount.saturating_mul(3_600_000),
        "M" => amount.saturating_mul(60_000),
        "S" => amount.saturating_mul(1_000),
        "m" => amount,
        "u" => amount / 1_000,
        "n" => amount / 1_000_000,
        _ => return None,
    };
    Some(ms.saturating_sub(ms / 10).saturating_sub(20))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_callers_wait_leaves_it_time_for_the_answer() {
        let wait = |v: &str| {
            let mut m = tonic::metadata::MetadataMap::new();
            m.insert(GRPC_TIMEOUT, v.parse().unwrap());
            caller_wait_ms(&m)
        };
        assert_eq!(wait("500m"), Some(430));
        assert_eq!(wait("3S"), Some(2680));
        assert_eq!(wait("2500000u"), Some(2230));
        assert_eq!(wait("10m"), Some(0));
        assert_eq!(wait("5x"), None);
        assert_eq!(wait("S"), None);
        assert_eq!(caller_wait_ms(&tonic::metadata::MetadataMap::new()), None);
    }

    #[test]
    fn an_output_ceiling_is_a_whole_number_or_none() {
        assert_eq!(parse_output_ceiling("100"), Some(100));
        assert_eq!(parse_output_ceiling(" 100 "), Some(100));
        for bad in ["", "-1", "1.5", "ten", "18446744073709551616"] {
            assert_eq!(parse_output_ceiling(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_forecast_reads_back_as_written() {
        let f = Forecast { start_delay_ms: 12, output_tokens: 120 };
        assert_eq!(forecast(f), "start=12;output=120");
        assert_eq!(parse_forecast(&forecast(f)), Some(f));
        for bad in ["", "start=1", "start=x;output=2", "output=2;start=1", "start=1;output=-2"] {
            assert_eq!(parse_forecast(bad), None, "{bad:?}");
        }
    }
}
