//! The meter against every format it reads, as the stand-in backend writes them (OpenAI chat with
//! and without its usage chunk, the Responses API, Anthropic Messages, Gemini, Bedrock's event
//! stream (Converse, and InvokeModel's base64 chunks), Ollama's JSON lines, and each as one JSON
//! body but InvokeModel's, whose counts come in headers), with known text and known usage, cut
//! at any point and fed in any pieces. Properties:
//!
//! - once the event that closes the usage has wholly passed, the charge is exactly that usage;
//! - before it (or in a stream that reports none), the output charged is never below the output
//!   text that wholly passed (its bytes over `bytes_per_token`, rounded down: the slack is the
//!   event the cut falls in), and never above all the text the stream carries, plus one token;
//! - a JSON body is exact when whole, and metered from the bytes that passed when cut.

use proptest::prelude::*;
use tollgate::llm::usage::{Measured, Meter};
use tollgate::tools::sim::formats::{self, Api, Ask, Text, Writer};

const STREAMS: [Api; 8] = [
    Api::Chat,
    Api::Responses,
    Api::Messages,
    Api::Gemini,
    Api::Converse,
    Api::Invoke,
    Api::OllamaChat,
    Api::OllamaGenerate,
];

/// A stream as the events it is made of: each one's bytes, and the output text it carries.
struct Events {
    events: Vec<(Vec<u8>, u64)>,
    /// The index of the event whose arrival makes the usage final; none if it never is.
    closing: Option<usize>,
}

fn stream(ask: &Ask, steps: &[u64], writer: &mut Writer) -> Events {
    let mut events: Vec<(Vec<u8>, u64)> = formats::opening(ask).into_iter().map(|e| (e, 0)).collect();
    for &tokens in steps {
        let text = writer.take(tokens);
        events.push((formats::step(ask, &text), text.len() as u64));
    }
    let output = steps.iter().sum();
    let closing = formats::closing(ask, output);
    // Which closing event carries the final usage: the last one of each format but Anthropic's
    // (message_delta, before message_stop) and Bedrock's (metadata, already last).
    let final_at = match ask.api {
        Api::Chat if !ask.include_usage => None,
        // The usage chunk, before [DONE].
        Api::Chat => Some(events.len() + closing.len() - 2),
        Api::Messages => Some(events.len() + closing.len() - 2),
        _ => Some(events.len() + closing.len() - 1),
    };
    events.extend(closing.into_iter().map(|e| (e, 0)));
    Events { events, closing: final_at }
}

fn content_type(api: Api) -> &'static str {
    api.stream_content_type()
}

/// Feeds `bytes` to a fresh meter in pieces cut at `cuts`.
fn meter(content_type: &str, bytes: &[u8], cuts: &[usize], bytes_per_token: f64) -> Measured {
    let mut m = Meter::new(Some(content_type), None, bytes_per_token);
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    cuts.sort_unstable();
    let mut from = 0;
    for cut in cuts.into_iter().chain([bytes.len()]) {
        m.feed(&bytes[from..cut]);
        from = cut;
    }
    m.measured()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn a_stream_is_exact_once_its_usage_passed_and_never_below_what_passed(
        api in prop::sample::select(STREAMS.to_vec()),
        include_usage in any::<bool>(),
        words in any::<bool>(),
        seed in any::<u64>(),
        prompt in 1u64..5000,
        steps in prop::collection::vec(1u64..30, 0..25),
        cut in any::<prop::sample::Index>(),
        pieces in prop::collection::vec(any::<usize>(), 0..6),
        bytes_per_token in prop::sample::select(vec![1.0, 3.6, 4.0, 4.375]),
    ) {
        let output: u64 = steps.iter().sum();
        let ask = Ask { api, model: "m".into(), prompt_tokens: prompt, max_tokens: output.max(1), stream: true, include_usage };
        let mut writer = Writer::new(if words { Text::Words } else { Text::Tok }, seed);
        let s = stream(&ask, &steps, &mut writer);
        let bytes: Vec<u8> = s.events.iter().flat_map(|(e, _)| e.iter().copied()).collect();
        let cut = cut.index(bytes.len() + 1);
        let passed = &bytes[..cut];
        let measured = meter(content_type(api), passed, &pieces, bytes_per_token);

        // The events wholly before the cut.
        let mut end = 0;
        let mut whole = 0;
        let mut text = 0u64;
        for (e, t) in &s.events {
            if end + e.len() > cut {
                break;
            }
            end += e.len();
            whole += 1;
            text += t;
        }
        let all_text: u64 = s.events.iter().map(|(_, t)| t).sum();
        let tokens = |bytes: u64| bytes as f64 / bytes_per_token;
        match measured {
            Measured::Exact { prompt: p, output: o, .. } => {
                // Its closing event passed, or is the one cut (whole but for its line's end).
                prop_assert!(s.closing.is_some_and(|c| c < whole || (c == whole && cut > end)), "exact before its usage: {measured:?}");
                prop_assert_eq!((p, o), (prompt, output));
            }
            Measured::Metered { output: o } => {
                prop_assert!(s.closing.is_none_or(|c| whole <= c), "metered after its usage passed: {measured:?}");
                prop_assert!(o as f64 >= tokens(text).floor(), "{o} below the {text} bytes that passed");
                // A running count (Anthropic's placeholder 1) may stand above the text.
                prop_assert!(o as f64 <= tokens(all_text).ceil() + 1.0, "{o} above all {all_text} bytes");
            }
            Measured::AsHeld => prop_assert!(false, "a stream it reads charged as held"),
        }
    }

    #[test]
    fn a_json_body_is_exact_whole_and_metered_from_its_size_cut(
        api in prop::sample::select(vec![Api::Chat, Api::Responses, Api::Embeddings, Api::Messages, Api::Gemini, Api::Converse, Api::OllamaChat, Api::OllamaGenerate]),
        prompt in 1u64..5000,
        output in 1u64..200,
        cut in any::<prop::sample::Index>(),
        pieces in prop::collection::vec(any::<usize>(), 0..6),
    ) {
        let output = if api == Api::Embeddings { 0 } else { output };
        let ask = Ask { api, model: "m".into(), prompt_tokens: prompt, max_tokens: output.max(1), stream: false, include_usage: false };
        let body = formats::answer(&ask, output, &mut Writer::new(Text::Tok, 0)).to_string().into_bytes();
        let cut = cut.index(body.len() + 1);
        let measured = meter("application/json", &body[..cut], &pieces, 4.0);
        if cut == body.len() {
            prop_assert_eq!(measured, Measured::exact(prompt, output));
        } else {
            prop_assert_eq!(measured, Measured::Metered { output: (cut as u64).div_ceil(4) });
        }
    }
}

/// A provider's fixture in `tests/fuzz/corpus/` (the fuzzers' seeds too).
fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz/corpus").join(name)).unwrap()
}

/// Each provider's recorded response, read whole and in pieces of every size, is charged what it
/// reports.
#[test]
fn each_providers_response_fixture_is_read_as_it_reports() {
    use tollgate::hold::Detail;
    use tollgate::llm::usage::aws;
    // Bedrock's event stream, written from its fixture's event lines (type, tab, payload), as
    // Bedrock frames it (the `p` padding included, as Bedrock sends it).
    let converse_stream: Vec<u8> = String::from_utf8(fixture("converse-stream.events"))
        .unwrap()
        .lines()
        .flat_map(|l| {
            let (kind, payload) = l.split_once('\t').unwrap();
            aws::encode(kind, payload.as_bytes())
        })
        .collect();
    let said = |cache_read, cache_write, reasoning| Detail { cache_read, cache_write, reasoning };
    let gemini = Measured::Exact { prompt: 11, output: 9 + 25, detail: said(Some(0), None, Some(25)) };
    let converse = Measured::Exact { prompt: 17, output: 13, detail: said(Some(0), Some(0), None) };
    let cases = [
        ("gemini-stream.sse", "text/event-stream", fixture("gemini-stream.sse"), gemini),
        ("converse.json", "application/json", fixture("converse.json"), converse),
        ("converse-stream.events", "application/vnd.amazon.eventstream", converse_stream, Measured::exact(17, 7)),
        ("ollama-chat.ndjson", "application/x-ndjson", fixture("ollama-chat.ndjson"), Measured::exact(26, 4)),
        ("anthropic-stream.sse", "text/event-stream", fixture("anthropic-stream.sse"), Measured::exact(9, 4)),
    ];
    for (name, content_type, bytes, want) in cases {
        for piece in [1, 7, 64, bytes.len().max(1)] {
            let cuts: Vec<usize> = (piece..bytes.len()).step_by(piece).collect();
            assert_eq!(meter(content_type, &bytes, &cuts, 4.0), want, "{name} in pieces of {piece}");
        }
    }
}

/// Each provider's recorded request yields the model, the ceiling and the stream its API says.
#[test]
fn each_providers_request_fixture_is_read_as_its_api_says() {
    use tollgate::llm::body::{Body, parse};
    let read = |body, name| parse(body, &fixture(name), false).unwrap();
    assert_eq!(
        (read(Body::Gemini, "gemini.json").max_tokens, read(Body::Gemini, "gemini.json").model),
        (Some(256), None)
    );
    assert_eq!(read(Body::Converse, "converse-request.json").max_tokens, Some(512));
    let ollama = read(Body::Ollama, "ollama.json");
    assert_eq!((ollama.model.as_deref(), ollama.max_tokens, ollama.stream), (Some("llama3.2"), Some(128), Some(true)));
}
