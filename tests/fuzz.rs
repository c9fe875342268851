//! Fuzzing on stable: property-based rounds over what tollgate reads from outside (request bodies,
//! Check attributes, response bodies as they stream, policies, and Admission requests), each case a
//! byte-level mutation of a seed from `tests/fuzz/corpus/` or made from scratch. The property is the
//! same everywhere: an answer (accepted or refused with a reason), never a panic; and a refused
//! Admission request charges nothing. A bounded round runs in the suite; a longer one:
//! `FUZZ_CASES=100000 bash scripts/test --test fuzz`. A case that fails is kept by proptest in
//! `tests/fuzz.proptest-regressions` and replayed first on every run.

mod support;

use std::path::Path;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::auth::v3::attribute_context::{HttpRequest, Request as AttrRequest};
use envoy_types::pb::envoy::service::auth::v3::{AttributeContext, CheckRequest};
use proptest::prelude::*;
use tollgate::admission::{Admission, Decision};
use tollgate::config::Policy;
use tollgate::grpc::admission::AdmissionService;
use tollgate::grpc::authz::{IdentityHeaders, attributes};

/// Check's identity headers, a plan header among them.
const IDENTITY: IdentityHeaders<'static> =
    IdentityHeaders { tenant: "x-tenant-id", plan: Some("x-tollgate-plan"), objectives: None };
use tollgate::llm::body::{self, Body};
use tollgate::llm::usage::{Measured, Meter};
use tollgate::proto::admission_server::Admission as _;
use tollgate::proto::{CommitRequest, ReleaseRequest, RenewRequest, ReserveRequest};
use tollgate::store::Protocol;
use tollgate::store::embedded::EmbeddedStore;

/// Cases per target: a bounded round in the suite; FUZZ_CASES for a longer one.
fn cases(default: u32) -> u32 {
    std::env::var("FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn corpus(name: &str) -> Vec<u8> {
    std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz/corpus").join(name)).unwrap()
}

/// One byte-level edit of an input.
#[derive(Debug, Clone)]
enum Edit {
    Flip(usize, u8),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    Truncate(usize),
    Repeat(usize, usize, u8),
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    // Bytes that matter to the parsers: JSON and SSE punctuation, digits, NUL, UTF-8 lead bytes.
    let interesting = prop::sample::select(b"{}[]\":,\\0123456789-+.eE \n\r\tnul\x00\xc3\xe2\xf0\xff:datevnt".to_vec());
    let edit = prop_oneof![
        (any::<usize>(), interesting.clone()).prop_map(|(at, b)| Edit::Flip(at, b)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(at, bytes)| Edit::Insert(at, bytes)),
        (any::<usize>(), 1usize..32).prop_map(|(at, n)| Edit::Remove(at, n)),
        any::<usize>().prop_map(Edit::Truncate),
        (any::<usize>(), 1usize..400, interesting).prop_map(|(at, n, b)| Edit::Repeat(at, n, b)),
    ];
    prop::collection::vec(edit, 0..8)
}

fn mutate(mut bytes: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for edit in edits {
        let at = |i: usize, len: usize| if len == 0 { 0 } else { i % (len + 1) };
        match edit {
            Edit::Flip(i, b) if !bytes.is_empty() => {
                let i = i % bytes.len();
                bytes[i] = *b;
            }
            Edit::Flip(..) => {}
            Edit::Insert(i, more) => {
                let i = at(*i, bytes.len());
                bytes.splice(i..i, more.iter().copied());
            }
            Edit::Remove(i, n) => {
                let i = at(*i, bytes.len());
                let end = (i + n).min(bytes.len());
                bytes.drain(i..end);
            }
            Edit::Truncate(i) => bytes.truncate(at(*i, bytes.len())),
            Edit::Repeat(i, n, b) => {
                let i = at(*i, bytes.len());
                bytes.splice(i..i, std::iter::repeat_n(*b, *n));
            }
        }
    }
    bytes
}

/// A seed from the corpus (or nothing), mutated; or bytes from scratch.
fn input(seeds: &'static [&'static str]) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => (prop::sample::select(seeds), edits()).prop_map(|(seed, e)| mutate(corpus(seed), &e)),
        1 => prop::collection::vec(any::<u8>(), 0..512),
    ]
}

const REQUESTS: &[&str] =
    &["chat.json", "responses.json", "anthropic.json", "gemini.json", "converse-request.json", "ollama.json"];
const RESPONSES: &[&str] = &[
    "completion.json",
    "openai-stream.sse",
    "anthropic-stream.sse",
    "responses-stream.sse",
    "gemini-stream.sse",
    "converse.json",
    "ollama-chat.ndjson",
];

/// Header values as clients send them, hostile ones included.
fn header_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[a-z0-9-]{1,12}",
        "[ -~]{0,40}",
        any::<String>(),
        Just("a{b}c:d".to_string()),
        Just("nul\u{0}in".to_string()),
        (1usize..10_000).prop_map(|n| "x".repeat(n)),
        any::<u64>().prop_map(|n| n.to_string()),
        Just("-1".to_string()),
        Just("18446744073709551616".to_string()),
    ]
}

fn check_request() -> impl Strategy<Value = CheckRequest> {
    let names = prop::sample::select(vec![
        "x-tenant-id",
        "x-user-id",
        "x-priority",
        "x-request-deadline-ms",
        "idempotency-key",
        "content-length",
        "x-envoy-auth-partial-body",
        "x-tollgate-model",
        "x-tollgate-reservation",
        "content-type",
    ]);
    let headers = prop::collection::vec((names, header_value()), 0..8);
    let raw_headers = prop::collection::vec(("x-[a-z]{1,8}", prop::collection::vec(any::<u8>(), 0..16)), 0..3);
    (headers, raw_headers, input(REQUESTS), any::<bool>(), any::<i64>()).prop_map(
        |(headers, raw_headers, body, raw, size)| {
            let mut http = HttpRequest { size, ..Default::default() };
            let (in_map, in_list) = headers.split_at(headers.len() / 2);
            http.headers = in_map.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
            let mut list: Vec<HeaderValue> = in_list
                .iter()
                .map(|(k, v)| HeaderValue { key: k.to_string(), value: v.clone(), ..Default::default() })
                .collect();
            list.extend(raw_headers.into_iter().map(|(k, v)| HeaderValue {
                key: k,
                raw_value: v,
                ..Default::default()
            }));
            http.header_map = Some(HeaderMap { headers: list });
            if raw {
                http.raw_body = body;
            } else {
                http.body = String::from_utf8_lossy(&body).into_owned();
            }
            CheckRequest {
                attributes: Some(AttributeContext {
                    request: Some(AttrRequest { http: Some(http), ..Default::default() }),
                    ..Default::default()
                }),
            }
        },
    )
}

const POLICY: &str = "models:\n  m: { max_output_tokens: 4096, max_prompt_tokens: 100000 }\n\
                      default_tenant:\n  limits: { tokens_per_minute: 1000000, max_concurrency: 1000 }\n";

fn admission(rt: &tokio::runtime::Runtime) -> Arc<Admission<EmbeddedStore>> {
    rt.block_on(async {
        let policy = Arc::new(Policy::parse("fuzz.yaml", POLICY).unwrap());
        Arc::new(Admission::new(policy, Protocol::new(EmbeddedStore::new().unwrap()).await.unwrap()))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(3000), ..ProptestConfig::default() })]

    #[test]
    fn request_bodies_are_read_or_refused(
        bytes in input(REQUESTS),
        partial in any::<bool>(),
        shape in prop::sample::select(vec![Body::OpenAi, Body::Anthropic, Body::Gemini, Body::Converse, Body::Invoke, Body::Ollama]),
    ) {
        let _ = body::parse(shape, &bytes, partial);
    }

    #[test]
    fn check_attributes_are_read_or_refused(request in check_request()) {
        let _ = attributes(&request, IDENTITY);
    }

    /// Response bodies, split into chunks at arbitrary points, under every content type and
    /// encoding the meter distinguishes: a count or "as held", never a panic.
    #[test]
    fn response_bodies_are_metered_or_charged_as_held(
        bytes in input(RESPONSES),
        cuts in prop::collection::vec(any::<usize>(), 0..6),
        content_type in prop::sample::select(vec![
            None,
            Some("application/json"),
            Some("text/event-stream"),
            Some("application/x-ndjson"),
            Some("application/vnd.amazon.eventstream"),
            Some("text/plain"),
            Some(""),
        ]),
        encoding in prop::sample::select(vec![None, Some("gzip"), Some("identity"), Some("br")]),
        bytes_per_token in prop::sample::select(vec![0.5, 1.0, 4.0, 1e9]),
    ) {
        let mut meter = Meter::new(content_type, encoding, bytes_per_token);
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
        cuts.sort_unstable();
        let mut from = 0;
        for cut in cuts.into_iter().chain([bytes.len()]) {
            meter.feed(&bytes[from..cut]);
            from = cut;
        }
        let _ = meter.saw_output();
        let measured = meter.measured();
        // What is charged does not depend on how the body was cut into pieces.
        let mut whole = Meter::new(content_type, encoding, bytes_per_token);
        whole.feed(&bytes);
        prop_assert_eq!(measured, whole.measured());
        // A body it cannot read is charged as held, never a count read from it.
        let readable = matches!(encoding, None | Some("identity")) && matches!(content_type, Some(t) if t.contains('/') && t != "text/plain");
        if !readable {
            prop_assert_eq!(measured, Measured::AsHeld);
        }
    }

    /// Policies: mutations of the example policy load or stop with a message naming the file.
    #[test]
    fn policies_load_or_name_what_is_wrong(bytes in input(&["policy.yaml"])) {
        let text = String::from_utf8_lossy(&bytes);
        if let Err(e) = Policy::parse("fuzz.yaml", &text) {
            prop_assert!(e.to_string().starts_with("fuzz.yaml"), "{e}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(300), ..ProptestConfig::default() })]

    /// A Check of garbage through the whole decision: admitted or refused, never a panic.
    #[test]
    fn checks_are_decided(request in check_request()) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let admission = admission(&rt);
        if let Ok(a) = attributes(&request, IDENTITY) {
            let decision = rt.block_on(admission.reserve(&a));
            if let Decision::Admitted(ok) = decision {
                rt.block_on(admission.release(&ok.reservation_id)).unwrap();
            }
        }
    }

    /// Admission requests with hostile fields: answered, and a refused reserve or a rejected call
    /// charges nothing (the tenant's next reserve sees its whole burst).
    #[test]
    fn admission_requests_are_answered_and_a_refusal_charges_nothing(
        tenant in header_value(),
        user in header_value(),
        model in prop_oneof![Just("m".to_string()), header_value()],
        key in header_value(),
        priority in header_value(),
        prompt in prop_oneof![any::<u64>(), 0u64..5000],
        max_tokens in prop_oneof![any::<u64>(), 0u64..5000],
        deadline in any::<u64>(),
        id in header_value(),
        counts in (any::<u64>(), any::<u64>()),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let service = AdmissionService::new(admission(&rt));
        rt.block_on(async {
            let request = ReserveRequest {
                tenant: tenant.clone(),
                user,
                model,
                prompt_tokens: prompt,
                max_tokens,
                priority,
                deadline_ms: deadline,
                idempotency_key: key,
                ..Default::default()
            };
            let reserved = service.reserve(tonic::Request::new(request)).await.map(tonic::Response::into_inner);
            let _ = service.commit(tonic::Request::new(CommitRequest { reservation_id: id.clone(), prompt_tokens: counts.0, completion_tokens: counts.1, ..Default::default() })).await;
            let _ = service.renew(tonic::Request::new(RenewRequest { reservation_id: id.clone(), lease_ms: counts.0 })).await;
            let _ = service.release(tonic::Request::new(ReleaseRequest { reservation_id: id })).await;
            let admitted = reserved.as_ref().is_ok_and(|r| r.admitted);
            if !admitted && tollgate::config::names::check_tenant(&tenant).is_ok() {
                // Nothing was charged: a plain probe of this tenant sees the burst untouched.
                let probe = ReserveRequest { tenant, model: "m".into(), prompt_tokens: 1, max_tokens: 1, ..Default::default() };
                let p = service.reserve(tonic::Request::new(probe)).await.map(tonic::Response::into_inner);
                if let Some(p) = p.ok().filter(|p| p.admitted) {
                    prop_assert_eq!(p.remaining_tokens, 1_000_000 - 2, "{:?} / {:?}", reserved, p);
                }
            }
            Ok(())
        })?;
    }
}
