//! A refusal in the shape of the API the request came by, so the client's own SDK shows the reason
//! and retries what its provider's endpoint would have it retry. Every shape keeps tollgate's
//! reason header and retry hints beside it (see [`super::response`]).
//!
//! | API | body | status, and what names the error |
//! |---|---|---|
//! | OpenAI, Azure, Anthropic | `{"type": "error", "error": {"message", "type", "code": <reason>}}` (a spent budget's `type` on OpenAI's routes: `insufficient_quota`) | the reason's |
//! | Gemini, Vertex AI | `{"error": {"code": <status>, "message", "status"}}` | the reason's, but `deadline`'s: Google's `DEADLINE_EXCEEDED` is 504; `status` is Google's name for it |
//! | Bedrock | `{"message"}` | `x-amzn-errortype` and the status that error has on Bedrock |
//! | Ollama | `{"error": "…"}` | the reason's |

use crate::admission::{Denial, Reason};
use crate::llm::api::Family;

/// The header botocore reads an error's code from.
pub const AMZN_ERROR_TYPE: &str = "x-amzn-errortype";

/// A refusal's status, body, and any header its shape adds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub body: String,
    pub header: Option<(&'static str, &'static str)>,
}

/// The refusal of `d` in `family`'s shape.
pub fn refusal(family: Family, d: &Denial) -> Refusal {
    let status = d.reason.http_status();
    match family {
        Family::OpenAi | Family::Anthropic => Refusal { status, body: openai_body(d, family), header: None },
        Family::Gemini => {
            let (status, name) = google_status(d.reason);
            Refusal {
                status,
                body: serde_json::json!({ "error": { "code": status, "message": d.message, "status": name } })
                    .to_string(),
                header: None,
            }
        }
        Family::Bedrock => {
            let (status, error) = bedrock_error(d.reason);
            Refusal {
                status,
                body: serde_json::json!({ "message": d.message }).to_string(),
                header: Some((AMZN_ERROR_TYPE, error)),
            }
        }
        Family::Ollama => Refusal { status, body: serde_json::json!({ "error": d.message }).to_string(), header: None },
    }
}

/// The OpenAI error shape, which OpenAI and Anthropic SDKs both parse (the top-level `type` is
/// Anthropic's, and OpenAI's SDK passes over it). On OpenAI's routes a spent budget is of OpenAI's
/// type `insufficient_quota`, as its quota errors are; a rate's stays `rate_limit_error`.
pub fn openai_body(d: &Denial, family: Family) -> String {
    let kind = match (family, d.reason) {
        (Family::OpenAi, Reason::Budget) => "insufficient_quota",
        (_, reason) => reason.error_type(),
    };
    serde_json::json!({
        "type": "error",
        "error": {
            "message": d.message,
            "type": kind,
            "code": d.reason.code(),
        }
    })
    .to_string()
}

/// Google's canonical code for a reason, with the HTTP status Google pairs it with (the reason's
/// own, but for `DEADLINE_EXCEEDED`, which Google answers 504).
fn google_status(reason: Reason) -> (u16, &'static str) {
    let name = match reason {
        Reason::TokenRate | Reason::RequestRate | Reason::Concurrency | Reason::Budget => "RESOURCE_EXHAUSTED",
        Reason::QueueFull | Reason::ProviderRate | Reason::ProviderBudget | Reason::StoreUnavailable => "UNAVAILABLE",
        Reason::Deadline => return (504, "DEADLINE_EXCEEDED"),
        Reason::Unsatisfiable => "FAILED_PRECONDITION",
        Reason::InvalidRequest => "INVALID_ARGUMENT",
        Reason::Unauthenticated => "UNAUTHENTICATED",
    };
    (reason.http_status(), name)
}

/// Bedrock's error for a reason, with the status Bedrock gives it: botocore retries throttling
/// (`ThrottlingException`) and any 503, and nothing else here. A spent budget is a quota that
/// waiting seconds will not lift; a request that cannot finish in time is the model's timeout,
/// which is not retried either. (botocore reads neither `retry-after` nor `x-should-retry`: a rate
/// refusal with a long wait is still throttling, which it retries a few times with its own backoff.)
fn bedrock_error(reason: Reason) -> (u16, &'static str) {
    match reason {
        Reason::TokenRate | Reason::RequestRate | Reason::Concurrency => (429, "ThrottlingException"),
        Reason::Budget => (400, "ServiceQuotaExceededException"),
        Reason::QueueFull | Reason::ProviderRate | Reason::ProviderBudget | Reason::StoreUnavailable => {
            (503, "ServiceUnavailableException")
        }
        Reason::Deadline => (408, "ModelTimeoutException"),
        Reason::Unsatisfiable | Reason::InvalidRequest => (400, "ValidationException"),
        Reason::Unauthenticated => (403, "AccessDeniedException"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_family_has_its_shape_for_every_reason() {
        for reason in Reason::ALL {
            let d = Denial::now(reason, "why");
            let json = |r: &Refusal| serde_json::from_str::<serde_json::Value>(&r.body).unwrap();
            let openai = refusal(Family::OpenAi, &d);
            assert_eq!(
                (openai.status, json(&openai)["error"]["code"].as_str(), json(&openai)["type"].as_str()),
                (reason.http_status(), Some(reason.code()), Some("error"))
            );
            let gemini = refusal(Family::Gemini, &d);
            let g = json(&gemini);
            let google = if reason == Reason::Deadline { 504 } else { reason.http_status() };
            assert_eq!(
                (gemini.status, g["error"]["code"].as_u64(), g["error"]["message"].as_str()),
                (google, Some(u64::from(google)), Some("why"))
            );
            assert!(
                g["error"]["status"].as_str().is_some_and(|s| s.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
            );
            let bedrock = refusal(Family::Bedrock, &d);
            assert_eq!(json(&bedrock)["message"], "why");
            let (_, error) = bedrock.header.unwrap();
            // botocore retries a 503 whatever its code, and throttling codes at any status.
            let retried = bedrock.status == 503 || error == "ThrottlingException";
            assert_eq!(retried, reason.retryable() && reason != Reason::Budget, "{reason:?}");
            assert_eq!(json(&refusal(Family::Ollama, &d))["error"], "why");
            let anthropic = json(&refusal(Family::Anthropic, &d));
            assert_eq!(
                (anthropic["type"].as_str(), anthropic["error"]["type"].as_str()),
                (Some("error"), Some(reason.error_type()))
            );
            let quota = reason == Reason::Budget;
            let kind = json(&openai)["error"]["type"].clone();
            assert_eq!(kind == "insufficient_quota", quota, "{reason:?}: {kind}");
        }
    }

    /// Google's status name and Bedrock's error and status for each reason, as docs/providers.md
    /// tables them.
    #[test]
    fn google_and_bedrock_name_each_reason_as_the_docs_say() {
        use Reason::*;
        let expected = [
            (TokenRate, "RESOURCE_EXHAUSTED", 429, "ThrottlingException"),
            (RequestRate, "RESOURCE_EXHAUSTED", 429, "ThrottlingException"),
            (Concurrency, "RESOURCE_EXHAUSTED", 429, "ThrottlingException"),
            (Budget, "RESOURCE_EXHAUSTED", 400, "ServiceQuotaExceededException"),
            (QueueFull, "UNAVAILABLE", 503, "ServiceUnavailableException"),
            (ProviderRate, "UNAVAILABLE", 503, "ServiceUnavailableException"),
            (ProviderBudget, "UNAVAILABLE", 503, "ServiceUnavailableException"),
            (StoreUnavailable, "UNAVAILABLE", 503, "ServiceUnavailableException"),
            (Deadline, "DEADLINE_EXCEEDED", 408, "ModelTimeoutException"),
            (Unsatisfiable, "FAILED_PRECONDITION", 400, "ValidationException"),
            (InvalidRequest, "INVALID_ARGUMENT", 400, "ValidationException"),
            (Unauthenticated, "UNAUTHENTICATED", 403, "AccessDeniedException"),
        ];
        for reason in Reason::ALL {
            assert_eq!(expected.iter().filter(|(r, ..)| *r == reason).count(), 1, "{reason:?} tabled once");
        }
        for (reason, google, status, error) in expected {
            let d = Denial::now(reason, "why");
            let gemini = refusal(Family::Gemini, &d);
            let body: serde_json::Value = serde_json::from_str(&gemini.body).unwrap();
            assert_eq!(body["error"]["status"], google, "{reason:?}");
            let bedrock = refusal(Family::Bedrock, &d);
            let (name, value) = bedrock.header.unwrap();
            assert_eq!((bedrock.status, name, value), (status, "x-amzn-errortype", error), "{reason:?}");
        }
    }
}
