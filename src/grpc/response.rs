//! Decision → Envoy `CheckResponse`: the one place that decides statuses, headers and bodies.
//!
//! A denial is an OK gRPC reply holding a Denied response (Envoy answers the client with it); a
//! gRPC error would mean tollgate itself failed, and Envoy would answer `status_on_error`.

use envoy_types::pb::envoy::config::core::v3::{
    HeaderValue, HeaderValueOption, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::service::auth::v3::{
    CheckResponse, DeniedHttpResponse, OkHttpResponse, check_response::HttpResponse,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use envoy_types::pb::google::rpc::Status as RpcStatus;

use crate::admission::{Decision, Denial};
use crate::hold::Headroom;
use crate::llm::api::Family;

use super::refusal::refusal;

use super::headers::{
    self, MODEL_FIELD, RATELIMIT_INPUT_TOKENS, RATELIMIT_OUTPUT_TOKENS, RATELIMIT_REQUESTS, RATELIMIT_TOKENS, REASON,
    RESERVATION, RESERVATION_FIELD, RESERVED_TOKENS, SHADOW, SOFT_LIMIT, SOFT_LIMIT_FIELD, TIER_FIELD,
};

/// google.rpc.Code values Envoy reads from `CheckResponse.status`.
const RPC_OK: i32 = 0;
const RPC_PERMISSION_DENIED: i32 = 7;

/// The response to a Check. `client_own` names the `x-tollgate-*` headers the request came with:
/// tollgate's own headers go upstream only as tollgate sets them, so every one of them that this
/// answer does not overwrite is removed. A refusal takes `family`'s shape.
pub fn check_response(decision: &Decision, client_own: &[String], family: Family) -> CheckResponse {
    match decision {
        Decision::Admitted(a) => {
            let mut upstream = vec![
                header(RESERVATION, a.reservation_id.clone()),
                header(RESERVED_TOKENS, a.reserved_tokens.to_string()),
                header(headers::MODEL, a.model.clone()),
            ];
            let mut downstream = rate_limit_headers(&a.headroom, family);
            // In shadow: what the limits would have refused, for the backend and the client alike.
            if let Some(would) = a.shadow {
                upstream.push(header(SHADOW, would.code().to_string()));
                downstream.push(header(SHADOW, would.code().to_string()));
            }
            // Past a soft budget: for a route to a cheaper backend, and for the client.
            let soft = a.soft_limit.map(|b| b.name());
            if let Some(budget) = &soft {
                upstream.push(header(SOFT_LIMIT, budget.clone()));
                downstream.push(header(SOFT_LIMIT, budget.clone()));
            }
            let forecast = a.forecast.map(headers::forecast);
            if let Some(f) = &forecast {
                upstream.push(header(headers::FORECAST, f.clone()));
            }
            let ceiling = a.output_ceiling.map(|c| c.to_string());
            if let Some(c) = &ceiling {
                upstream.push(header(headers::OUTPUT_CEILING, c.clone()));
            }
            let mut response = admitted(upstream, downstream, client_own);
            // Also as dynamic metadata: for access logs (`%DYNAMIC_METADATA(envoy.filters.http.
            // ext_authz:reservation)%`), and for an ext_proc filter that forwards it instead of
            // sending the request headers.
            let tier = a.tier.as_str().to_string();
            let fields = [(RESERVATION_FIELD, Some(&a.reservation_id)), (MODEL_FIELD, Some(&a.model))]
                .into_iter()
                .chain([(SOFT_LIMIT_FIELD, soft.as_ref()), (TIER_FIELD, Some(&tier))])
                .chain([
                    (headers::FORECAST_FIELD, forecast.as_ref()),
                    (headers::OUTPUT_CEILING_FIELD, ceiling.as_ref()),
                ]);
            response.dynamic_metadata = Some(Struct {
                fields: fields
                    .filter_map(|(k, v)| Some((k.to_string(), Value { kind: Some(Kind::StringValue(v?.clone())) })))
                    .collect(),
            });
            response
        }
        Decision::Unmetered(why) => {
            admitted(vec![header(headers::UNMETERED, why.code().to_string())], Vec::new(), client_own)
        }
        Decision::Denied(d) => denied(d, family),
    }
}

fn admitted(
    headers: Vec<HeaderValueOption>,
    downstream: Vec<HeaderValueOption>,
    client_own: &[String],
) -> CheckResponse {
    let set = |name: &String| headers.iter().any(|h| h.header.as_ref().is_some_and(|h| &h.key == name));
    let headers_to_remove = client_own.iter().filter(|name| !set(name)).cloned().collect();
    CheckResponse {
        status: Some(RpcStatus { code: RPC_OK, ..Default::default() }),
        http_response: Some(HttpResponse::OkResponse(OkHttpResponse {
            headers,
            headers_to_remove,
            response_headers_to_add: downstream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn denied(d: &Denial, family: Family) -> CheckResponse {
    let shaped = refusal(family, d);
    let mut headers = vec![
        header(REASON, d.reason.code().to_string()),
        header(headers::CONTENT_TYPE, "application/json".to_string()),
    ];
    if let Some(ms) = d.retry_after_ms {
        headers.push(header(headers::RETRY_AFTER, retry_after_seconds(ms).to_string()));
        headers.push(header(headers::RETRY_AFTER_MS, ms.to_string()));
    }
    if !d.should_retry() {
        headers.push(header(headers::SHOULD_RETRY, "false".to_string()));
    }
    headers.extend(rate_limit_headers(&d.headroom, family));
    if let Some((name, value)) = shaped.header {
        headers.push(header(name, value.to_string()));
    }
    CheckResponse {
        status: Some(RpcStatus {
            code: RPC_PERMISSION_DENIED,
            message: d.reason.code().to_string(),
            ..Default::default()
        }),
        http_response: Some(HttpResponse::DeniedResponse(DeniedHttpResponse {
            status: Some(HttpStatus { code: i32::from(shaped.status) }),
            headers,
            body: shaped.body,
        })),
        ..Default::default()
    }
}

/// `retry-after` is whole seconds, rounded up, never 0 (0 would invite an immediate retry).
pub fn retry_after_seconds(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

/// OpenAI's `x-ratelimit-*` headers of the tightest scope's windows; on Anthropic's routes,
/// Anthropic's `anthropic-ratelimit-*` beside them (the reset as the RFC 3339 time it comes).
fn rate_limit_headers(h: &Headroom, family: Family) -> Vec<HeaderValueOption> {
    let mut out = Vec::new();
    let now_ms = || {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        u64::try_from(now.as_millis()).unwrap_or(u64::MAX)
    };
    let sides = h.sides();
    let windows = [
        (&RATELIMIT_TOKENS, h.tokens),
        (&RATELIMIT_REQUESTS, h.requests),
        (&RATELIMIT_INPUT_TOKENS, sides.input),
        (&RATELIMIT_OUTPUT_TOKENS, sides.output),
    ];
    for (names, window) in windows {
        let Some(w) = window else { continue };
        if let Some([limit, remaining, reset]) = names.openai {
            out.push(header(limit, w.limit.to_string()));
            out.push(header(remaining, w.remaining.max(0).to_string()));
            out.push(header(reset, duration_text(w.reset_ms)));
        }
        if family == Family::Anthropic {
            let [limit, remaining, reset] = names.anthropic;
            out.push(header(limit, w.limit.to_string()));
            out.push(header(remaining, w.remaining.max(0).to_string()));
            out.push(header(reset, rfc3339(now_ms().saturating_add(w.reset_ms))));
        }
    }
    out
}

/// A time (ms since the Unix epoch, UTC) as RFC 3339, to the second: `2026-12-02T12:41:32Z`.
fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let (day, rest) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = crate::hold::civil_date(day);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rest / 3600, rest % 3600 / 60, rest % 60)
}

/// A duration as OpenAI writes it in `x-ratelimit-reset-*`: `250ms`, `1.5s`, `6m0s`.
pub fn duration_text(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        let s = format!("{:.3}", ms as f64 / 1000.0);
        format!("{}s", s.trim_end_matches('0').trim_end_matches('.'))
    } else {
        let minutes = ms / 60_000;
        let rest = (ms % 60_000) / 1000;
        if minutes < 60 { format!("{minutes}m{rest}s") } else { format!("{}h{}m{rest}s", minutes / 60, minutes % 60) }
    }
}

fn header(key: &str, value: String) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: key.to_string(), value, ..Default::default() }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{Reason, Unmetered};

    fn headers(r: &CheckResponse) -> Vec<(String, String)> {
        let list = match &r.http_response {
            Some(HttpResponse::DeniedResponse(d)) => &d.headers,
            Some(HttpResponse::OkResponse(o)) => &o.headers,
            _ => panic!("no http response"),
        };
        list.iter().map(|h| h.header.as_ref().map(|h| (h.key.clone(), h.value.clone())).unwrap()).collect()
    }

    #[test]
    fn every_reason_has_its_status_and_retry_hints() {
        for reason in Reason::ALL {
            let retry = reason.retryable().then_some(1500);
            let d = Denial { retry_after_ms: retry, ..Denial::now(reason, "m") };
            let r = check_response(&Decision::Denied(d.clone()), &[], Family::OpenAi);
            let Some(HttpResponse::DeniedResponse(denied)) = &r.http_response else { panic!() };
            assert_eq!(denied.status.as_ref().unwrap().code, i32::from(reason.http_status()));
            let h = headers(&r);
            let get = |k: &str| h.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
            assert_eq!(get(REASON), Some(reason.code()));
            if reason.retryable() {
                assert_eq!(get("retry-after"), Some("2"), "{reason:?}: 1500 ms rounds up to 2 s");
                assert_eq!(get("retry-after-ms"), Some("1500"));
                assert_eq!(get("x-should-retry"), None, "{reason:?}: a short wait is for the SDK to retry");
            } else {
                assert_eq!(get("retry-after"), None, "{reason:?}");
                assert_eq!(get("x-should-retry"), Some("false"), "{reason:?}");
            }
            let body: serde_json::Value = serde_json::from_str(&denied.body).unwrap();
            assert_eq!(body["error"]["code"], reason.code());
        }
    }

    /// A budget spent for hours: the wait, and no retry by the SDK now; two minutes is still a
    /// wait an SDK may take, and a concurrency wait (an upper bound) always is.
    #[test]
    fn a_long_wait_says_not_to_retry_now() {
        let cases = [
            (Reason::Budget, 120_000, None),
            (Reason::Budget, 120_001, Some("false")),
            (Reason::TokenRate, 3_600_000, Some("false")),
            (Reason::Concurrency, 3_600_000, None),
        ];
        for (reason, ms, should_retry) in cases {
            let d = Denial { retry_after_ms: Some(ms), ..Denial::now(reason, "spent") };
            assert_eq!(d.should_retry(), should_retry.is_none(), "{reason:?} {ms} ms");
            for family in [Family::OpenAi, Family::Anthropic] {
                let h = headers(&check_response(&Decision::Denied(d.clone()), &[], family));
                let get = |k: &str| h.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
                assert_eq!(get("retry-after-ms"), Some(ms.to_string().as_str()));
                assert_eq!(get("x-should-retry"), should_retry, "{reason:?} {ms} ms");
            }
        }
    }

    #[test]
    fn an_unmetered_admission_carries_no_reservation_not_even_a_forged_one() {
        let forged = [RESERVATION.to_string(), headers::UNMETERED.to_string(), "x-tollgate-model".to_string()];
        let r = check_response(&Decision::Unmetered(Unmetered::StoreUnavailable), &forged, Family::OpenAi);
        assert_eq!(headers(&r), vec![(headers::UNMETERED.to_string(), "store_unavailable".to_string())]);
        let Some(HttpResponse::OkResponse(ok)) = &r.http_response else { panic!() };
        assert_eq!(ok.headers_to_remove, vec![RESERVATION.to_string(), "x-tollgate-model".to_string()]);
    }

    #[test]
    fn an_admission_leaves_its_reservation_and_model_in_the_dynamic_metadata() {
        let ok = crate::admission::Admitted {
            reservation_id: "acme:r1".into(),
            model: "m".into(),
            reserved_tokens: 10,
            attempts: 1,
            replayed: false,
            headroom: Headroom::default(),
            shadow: None,
            soft_limit: None,
            tier: crate::config::Priority::Critical,
            forecast: None,
            output_ceiling: Some(100),
        };
        let r = check_response(&Decision::Admitted(ok.clone()), &[], Family::OpenAi);
        let fields = &r.dynamic_metadata.as_ref().expect("dynamic metadata").fields;
        let text = |k: &str| match fields.get(k).and_then(|v| v.kind.as_ref()) {
            Some(Kind::StringValue(s)) => s.clone(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!((text(RESERVATION_FIELD), text(MODEL_FIELD)), ("acme:r1".to_string(), "m".to_string()));
        assert_eq!(headers::parse_output_ceiling(&text(headers::OUTPUT_CEILING_FIELD)), Some(100));
        assert!(!fields.contains_key(SOFT_LIMIT_FIELD) && headers(&r).iter().all(|(k, _)| k != SOFT_LIMIT));
        // Past a soft budget: marked upstream and to the client, and in the metadata with its tier.
        let soft = crate::admission::Admitted {
            soft_limit: Some(crate::hold::BudgetKey::new(crate::hold::Measure::Tokens, crate::hold::Period::Day)),
            tier: crate::config::Priority::Standard,
            ..ok
        };
        let r = check_response(&Decision::Admitted(soft), &[SOFT_LIMIT.to_string()], Family::OpenAi);
        let fields = &r.dynamic_metadata.as_ref().expect("dynamic metadata").fields;
        let text = |k: &str| match fields.get(k).and_then(|v| v.kind.as_ref()) {
            Some(Kind::StringValue(s)) => s.clone(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!((text(SOFT_LIMIT_FIELD), text(TIER_FIELD)), ("tokens_per_day".to_string(), "standard".to_string()));
        assert!(headers(&r).contains(&(SOFT_LIMIT.to_string(), "tokens_per_day".to_string())));
        let Some(HttpResponse::OkResponse(ok)) = &r.http_response else { panic!() };
        assert!(ok.headers_to_remove.is_empty(), "set by tollgate, not removed: {:?}", ok.headers_to_remove);
        assert!(ok.response_headers_to_add.iter().any(|h| h.header.as_ref().is_some_and(|h| h.key == SOFT_LIMIT)));
        assert!(
            check_response(&Decision::Unmetered(Unmetered::StoreUnavailable), &[], Family::OpenAi)
                .dynamic_metadata
                .is_none(),
            "no hold, nothing to commit"
        );
    }

    #[test]
    fn times_read_as_rfc_3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_795_953_600_999), "2026-11-29T12:00:00Z");
        assert_eq!(rfc3339(1_709_164_800_000), "2024-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_735_689_599_000), "2024-12-31T23:59:59Z");
    }

    /// On Anthropic's routes, Anthropic's headers beside OpenAI's, for every window there is.
    #[test]
    fn anthropic_routes_get_anthropics_rate_limit_headers() {
        use crate::hold::Window;
        let headroom = Headroom {
            tokens: Some(Window { remaining: 40, limit: 100, reset_ms: 60_000 }),
            requests: Some(Window { remaining: 0, limit: 5, reset_ms: 1_000 }),
            sides: None,
        }
        .with_sides(crate::hold::Sides {
            input: Some(Window { remaining: 7, limit: 9, reset_ms: 1_000 }),
            output: None,
        });
        let d = Denial { headroom, retry_after_ms: Some(1_000), ..Denial::now(Reason::RequestRate, "m") };
        let names = |family| -> Vec<String> {
            headers(&check_response(&Decision::Denied(d.clone()), &[], family)).into_iter().map(|(k, _)| k).collect()
        };
        let openai = names(Family::OpenAi);
        assert!(openai.contains(&"x-ratelimit-remaining-requests".to_string()), "{openai:?}");
        assert!(!openai.iter().any(|k| k.starts_with("anthropic-")), "{openai:?}");
        let r = check_response(&Decision::Denied(d.clone()), &[], Family::Anthropic);
        let h = headers(&r);
        let get = |k: &str| {
            h.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone()).unwrap_or_else(|| panic!("{k}: {h:?}"))
        };
        assert_eq!(get("anthropic-ratelimit-tokens-limit"), "100");
        assert_eq!(get("anthropic-ratelimit-tokens-remaining"), "40");
        assert_eq!(get("anthropic-ratelimit-requests-remaining"), "0");
        let reset = get("anthropic-ratelimit-requests-reset");
        assert!(reset.len() == 20 && reset.ends_with('Z') && reset.as_bytes()[10] == b'T', "{reset}");
        assert_eq!(get("x-ratelimit-remaining-tokens"), "40", "and OpenAI's");
        assert_eq!(
            (get("anthropic-ratelimit-input-tokens-limit"), get("anthropic-ratelimit-input-tokens-remaining")),
            ("9".into(), "7".into())
        );
        assert!(!h.iter().any(|(k, _)| k.contains("output-tokens")), "no output bucket, no header: {h:?}");
        assert!(!openai.iter().any(|k| k.contains("input-tokens")), "OpenAI has no header for one side: {openai:?}");
    }

    /// Every window's headers, by name, on an Anthropic route: OpenAI's for tokens and requests,
    /// Anthropic's for all four.
    #[test]
    fn every_rate_limit_header_is_named_as_its_provider_names_it() {
        use crate::hold::Window;
        let w = Some(Window { remaining: 1, limit: 2, reset_ms: 3 });
        let headroom =
            Headroom { tokens: w, requests: w, sides: None }.with_sides(crate::hold::Sides { input: w, output: w });
        let mut names: Vec<String> =
            rate_limit_headers(&headroom, Family::Anthropic).into_iter().map(|h| h.header.unwrap().key).collect();
        names.sort();
        let mut expected = Vec::new();
        for kind in ["tokens", "requests"] {
            for field in ["limit", "remaining", "reset"] {
                expected.push(format!("x-ratelimit-{field}-{kind}"));
            }
        }
        for kind in ["tokens", "requests", "input-tokens", "output-tokens"] {
            for field in ["limit", "remaining", "reset"] {
                expected.push(format!("anthropic-ratelimit-{kind}-{field}"));
            }
        }
        expected.sort();
        assert_eq!(names, expected);
    }

    #[test]
    fn durations_read_like_openai_headers() {
        assert_eq!(duration_text(250), "250ms");
        assert_eq!(duration_text(1500), "1.5s");
        assert_eq!(duration_text(2000), "2s");
        assert_eq!(duration_text(360_000), "6m0s");
        assert_eq!(retry_after_seconds(1), 1);
        assert_eq!(retry_after_seconds(1000), 1);
        assert_eq!(retry_after_seconds(1001), 2);
    }
}
