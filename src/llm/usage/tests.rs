//! The meter's tests: each format's counts, metering, and the request's ceiling.

use super::*;
use crate::hold::Detail;

fn run(content_type: &str, chunks: &[&str]) -> Measured {
    let mut m = Meter::new(Some(content_type), None, 4.0);
    for c in chunks {
        m.feed(c.as_bytes());
    }
    m.measured()
}

#[test]
fn openai_json_usage_is_exact() {
    let body = r#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":7,"total_tokens":19}}"#;
    let (a, b) = body.split_at(20);
    assert_eq!(run("application/json; charset=utf-8", &[a, b]), Measured::exact(12, 7));
}

#[test]
fn embeddings_report_no_output() {
    let body = r#"{"data":[],"usage":{"prompt_tokens":8,"total_tokens":8}}"#;
    assert_eq!(run("application/json", &[body]), Measured::exact(8, 0));
}

#[test]
fn anthropic_and_responses_json_usage_is_exact() {
    let messages = r#"{"type":"message","usage":{"input_tokens":10,"cache_read_input_tokens":5,"output_tokens":3}}"#;
    let cached = Detail { cache_read: Some(5), ..Detail::default() };
    assert_eq!(run("application/json", &[messages]), Measured::Exact { prompt: 15, output: 3, detail: cached });
    let responses = r#"{"object":"response","usage":{"input_tokens":4,"output_tokens":9,"total_tokens":13}}"#;
    assert_eq!(run("application/json", &[responses]), Measured::exact(4, 9));
}

#[test]
fn an_openai_stream_with_its_usage_chunk_is_exact_across_any_split() {
    let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"tok tok \"}}]}\n\n\
                  data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n\
                  data: [DONE]\n\n";
    for cut in 1..stream.len() {
        let (a, b) = stream.split_at(cut);
        assert_eq!(run("text/event-stream", &[a, b]), Measured::exact(5, 2), "cut at {cut}");
    }
}

#[test]
fn a_stream_without_usage_is_metered_from_its_text() {
    let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"tok tok \"}}]}\n\n\
                  data: {\"choices\":[{\"delta\":{\"content\":\"tok \"}}]}\n\ndata: [DONE]\n\n";
    assert_eq!(run("text/event-stream", &[stream]), Measured::Metered { output: 3 });
}

#[test]
fn anthropic_streams_take_input_from_the_start_and_output_from_the_last_delta() {
    let stream = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
                  event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n\
                  event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n";
    assert_eq!(run("text/event-stream", &[stream]), Measured::exact(25, 15));
}

#[test]
fn the_responses_api_stream_takes_its_completed_usage() {
    let stream = "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n\
                  event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":3,\"output_tokens\":2}}}\n\n";
    assert_eq!(run("text/event-stream", &[stream]), Measured::exact(3, 2));
}

#[test]
fn compressed_bodies_are_never_parsed() {
    let body = r#"{"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;
    let mut m = Meter::new(Some("application/json"), Some("gzip"), 4.0);
    m.feed(body.as_bytes());
    assert!(!m.saw_output());
    assert_eq!(m.measured(), Measured::AsHeld);
    let mut m = Meter::new(Some("application/octet-stream"), None, 4.0);
    m.feed(b"bytes");
    assert_eq!(m.measured(), Measured::AsHeld);
}

/// An Anthropic stream cut after its `message_start` (placeholder output 1) and a hundred
/// deltas: metered from the deltas, not taken as exact at 1.
#[test]
fn a_placeholder_count_is_never_exact() {
    let mut m = Meter::new(Some("text/event-stream"), None, 4.0);
    m.feed(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n");
    for _ in 0..100 {
        m.feed(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"word\"}}\n\n");
    }
    assert_eq!(m.measured(), Measured::Metered { output: 100 });
    // A running count larger than what the meter saw wins.
    let mut m = Meter::new(Some("text/event-stream"), None, 4.0);
    m.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"ab\"}}],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":9}}\n\n");
    assert_eq!(m.measured(), Measured::Metered { output: 9 }, "a running count beside choices is not final");
}

/// What carries output besides text is metered too: tool-call and function-call arguments,
/// reasoning, refusals (OpenAI); thinking and tool input (Anthropic).
#[test]
fn tool_calls_reasoning_and_thinking_are_metered() {
    let openai = "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"city\\\": \\\"Paris\\\"}\"}}]}}]}\n\n\
                  data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"think\"}}]}\n\n\
                  data: {\"choices\":[{\"delta\":{\"function_call\":{\"arguments\":\"abcd\"}}}]}\n\n\
                  data: {\"choices\":[{\"delta\":{\"refusal\":\"no\"}}]}\n\ndata: [DONE]\n\n";
    // 17 + 5 + 4 + 2 bytes at 4 a token.
    assert_eq!(run("text/event-stream", &[openai]), Measured::Metered { output: 7 });
    let anthropic = "data: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"hmm hmm\"}}\n\n\
                     data: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"a\\\":1}\"}}\n\n";
    // 7 + 7 bytes.
    assert_eq!(run("text/event-stream", &[anthropic]), Measured::Metered { output: 4 });
}

/// A metered count never passes the most output the request allowed: in every format, bytes
/// that read as more than `max_tokens` are charged `max_tokens`, and the meter says it capped;
/// a count the backend reports stands as reported, above the ceiling or not.
#[test]
fn a_metered_count_is_held_to_the_requests_ceiling_and_a_reported_one_is_not() {
    let text = "tok ".repeat(50);
    let openai = format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\ndata: [DONE]\n\n");
    let anthropic = format!(
        "data: {{\"type\":\"content_block_delta\",\"delta\":{{\"type\":\"text_delta\",\"text\":\"{text}\"}}}}\n\n"
    );
    let ollama = format!("{{\"message\":{{\"content\":\"{text}\"}},\"done\":false}}\n");
    let opaque_json = format!("{{\"choices\":[{{\"message\":{{\"content\":\"{text}\"}}}}]}}");
    for (content_type, body) in [
        ("text/event-stream", &openai),
        ("text/event-stream", &anthropic),
        ("application/x-ndjson", &ollama),
        ("application/json", &opaque_json),
    ] {
        let mut m = Meter::new(Some(content_type), None, 1.0);
        m.cap_output(100);
        m.feed(body.as_bytes());
        assert_eq!(m.measured(), Measured::Metered { output: 100 }, "{content_type}: {body}");
        assert!(m.capped(), "{content_type}");
        // Uncapped, the same bytes read as more.
        let mut free = Meter::new(Some(content_type), None, 1.0);
        free.feed(body.as_bytes());
        assert!(matches!(free.measured(), Measured::Metered { output } if output > 100), "{content_type}");
        // Under the ceiling, nothing is capped.
        let mut under = Meter::new(Some(content_type), None, 1.0);
        under.cap_output(100_000);
        under.feed(body.as_bytes());
        assert!(matches!(under.measured(), Measured::Metered { output } if output > 100) && !under.capped());
    }
    // A count the backend gave stands, above the ceiling or not: Ollama's output without a
    // prompt count, and a final usage chunk.
    let mut ollama_count = Meter::new(Some("application/x-ndjson"), None, 1.0);
    ollama_count.cap_output(100);
    ollama_count.feed(format!("{ollama}{{\"done\":true,\"eval_count\":180}}\n").as_bytes());
    assert_eq!(ollama_count.measured(), Measured::Metered { output: 180 });
    assert!(!ollama_count.capped());
    let reported =
        format!("{openai}data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":5,\"completion_tokens\":180}}}}\n\n");
    let mut m = Meter::new(Some("text/event-stream"), None, 1.0);
    m.cap_output(100);
    m.feed(reported.replace("data: [DONE]\n\n", "").as_bytes());
    assert_eq!(m.measured(), Measured::exact(5, 180), "the backend's word stands");
    assert!(!m.capped());
}

/// A JSON body too large to buffer is metered from its size, never charged nothing.
#[test]
fn a_json_body_too_large_to_read_is_metered_from_its_size() {
    let mut m = Meter::new(Some("application/json"), None, 4.0);
    let chunk = vec![b' '; 1 << 20];
    for _ in 0..9 {
        m.feed(&chunk);
    }
    assert_eq!(m.measured(), Measured::Metered { output: (9 << 20) / 4 });
}

#[test]
fn a_cut_stream_is_metered_from_what_passed() {
    let mut m = Meter::new(Some("text/event-stream"), None, 4.0);
    m.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"tok tok tok \"}}]}\n\ndata: {\"choi");
    assert!(m.saw_output());
    assert_eq!(m.measured(), Measured::Metered { output: 3 });
}

#[test]
fn gemini_reports_prompt_candidates_and_thoughts() {
    let body = r#"{"candidates":[{"content":{"parts":[{"text":"Hi"}],"role":"model"},"finishReason":"STOP"}],
        "usageMetadata":{"promptTokenCount":9,"cachedContentTokenCount":4,"candidatesTokenCount":3,"thoughtsTokenCount":20,"totalTokenCount":32}}"#;
    let detail = Detail { cache_read: Some(4), cache_write: None, reasoning: Some(20) };
    assert_eq!(run("application/json", &[body]), Measured::Exact { prompt: 9, output: 23, detail });
    let sse = "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"Hello\"}]}}],\"usageMetadata\":{\"promptTokenCount\":9,\"candidatesTokenCount\":1}}\r\n\r\n\
               data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\" there\"}]},\"finishReason\":\"STOP\"}],\"usageMetadata\":{\"promptTokenCount\":9,\"candidatesTokenCount\":2}}\r\n\r\n";
    assert_eq!(run("text/event-stream", &[sse]), Measured::exact(9, 2));
    let (cut, _) = sse.split_at(sse.find("\r\n\r\n").unwrap() + 4);
    assert_eq!(run("text/event-stream", &[cut]), Measured::Metered { output: 2 }, "cut before the finish");
    // Without alt=sse: one JSON array of the same chunks.
    let array = r#"[{"candidates":[{"content":{"parts":[{"text":"Hello"}]}}],"usageMetadata":{"promptTokenCount":9,"candidatesTokenCount":1}},
        {"candidates":[{"content":{"parts":[{"text":" there"}]},"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":9,"candidatesTokenCount":2}}]"#;
    assert_eq!(run("application/json", &[array]), Measured::exact(9, 2));
}

#[test]
fn bedrock_converse_and_its_event_stream() {
    let body = r#"{"output":{"message":{"role":"assistant","content":[{"text":"Hi"}]}},"stopReason":"end_turn",
        "usage":{"inputTokens":11,"outputTokens":4,"totalTokens":20,"cacheReadInputTokens":5},"metrics":{"latencyMs":120}}"#;
    let cached = Detail { cache_read: Some(5), ..Detail::default() };
    assert_eq!(run("application/json", &[body]), Measured::Exact { prompt: 16, output: 4, detail: cached });
    let mut stream = aws::encode("messageStart", br#"{"role":"assistant"}"#);
    for _ in 0..10 {
        stream.extend(aws::encode("contentBlockDelta", br#"{"contentBlockIndex":0,"delta":{"text":"word"}}"#));
    }
    let cut = stream.len();
    stream.extend(aws::encode("messageStop", br#"{"stopReason":"end_turn"}"#));
    stream.extend(aws::encode(
        "metadata",
        br#"{"usage":{"inputTokens":11,"outputTokens":12,"totalTokens":23},"metrics":{"latencyMs":9}}"#,
    ));
    let mut m = Meter::new(Some("application/vnd.amazon.eventstream"), None, 4.0);
    for piece in stream.chunks(7) {
        m.feed(piece);
    }
    assert_eq!(m.measured(), Measured::exact(11, 12));
    let mut m = Meter::new(Some("application/vnd.amazon.eventstream"), None, 4.0);
    m.feed(&stream[..cut + 5]);
    assert!(m.saw_output());
    assert_eq!(m.measured(), Measured::Metered { output: 10 }, "cut before its metadata");
    let mut m = Meter::new(Some("application/vnd.amazon.eventstream"), None, 4.0);
    m.feed(b"not an event stream at all, just bytes");
    assert_eq!(m.measured(), Measured::AsHeld, "a broken framing is unreadable");
}

#[test]
fn bedrock_invoke_counts_come_in_headers_or_metrics() {
    let mut m = Meter::new(Some("application/json"), None, 4.0);
    m.reported(30, 7);
    m.feed(br#"{"generation":"text","prompt_token_count":1,"generation_token_count":1}"#);
    assert_eq!(m.measured(), Measured::exact(30, 7));
    use base64::Engine;
    let chunk = |inner: &str| {
        let payload = serde_json::json!({"bytes": base64::engine::general_purpose::STANDARD.encode(inner)});
        aws::encode("chunk", payload.to_string().as_bytes())
    };
    let mut stream = chunk(r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"abcdefgh"}}"#);
    stream.extend(chunk(
        r#"{"type":"message_stop","amazon-bedrock-invocationMetrics":{"inputTokenCount":6,"outputTokenCount":3}}"#,
    ));
    let mut m = Meter::new(Some("application/vnd.amazon.eventstream"), None, 4.0);
    m.feed(&stream);
    assert_eq!(m.measured(), Measured::exact(6, 3));
}

#[test]
fn ollama_counts_and_lines() {
    let chat = r#"{"model":"llama3.2","message":{"role":"assistant","content":"Hi"},"done":true,"prompt_eval_count":26,"eval_count":290}"#;
    assert_eq!(run("application/json; charset=utf-8", &[chat]), Measured::exact(26, 290));
    let embed = r#"{"model":"all-minilm","embeddings":[[0.1,0.2]],"prompt_eval_count":8}"#;
    assert_eq!(run("application/json", &[embed]), Measured::exact(8, 0));
    let lines = "{\"model\":\"m\",\"message\":{\"role\":\"assistant\",\"content\":\"word\"},\"done\":false}\n\
                 {\"model\":\"m\",\"message\":{\"role\":\"assistant\",\"thinking\":\"hmmm\"},\"done\":false}\n\
                 {\"model\":\"m\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done\":true,\"prompt_eval_count\":5,\"eval_count\":3}\n";
    assert_eq!(run("application/x-ndjson", &[lines]), Measured::exact(5, 3));
    let cut = lines.rsplit_once("{\"model").unwrap().0;
    assert_eq!(run("application/x-ndjson", &[cut]), Measured::Metered { output: 2 });
    let generate = "{\"model\":\"m\",\"response\":\"abcd\",\"done\":false}\n{\"model\":\"m\",\"response\":\"efgh\",\"done\":false}\n";
    assert_eq!(run("application/x-ndjson", &[generate]), Measured::Metered { output: 2 });
}

#[test]
fn gemini_and_ollama_tool_calls_are_metered_as_their_json() {
    let gemini = "data: {\"candidates\":[{\"content\":{\"parts\":[{\"functionCall\":{\"name\":\"f\",\"args\":{\"city\":\"Paris\"}}}]}}]}\n\n";
    // {"name":"f","args":{"city":"Paris"}}: 36 bytes.
    assert_eq!(run("text/event-stream", &[gemini]), Measured::Metered { output: 9 });
    let ollama = "{\"message\":{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":{\"city\":\"Paris\"}}}]},\"done\":false}\n";
    // {"city":"Paris"}: 16 bytes.
    assert_eq!(run("application/x-ndjson", &[ollama]), Measured::Metered { output: 4 });
}

/// Cache reads and writes and reasoning, as each provider reports them.
#[test]
fn cache_and_reasoning_counts_are_read() {
    let detail = |content_type: &str, body: &str| {
        let mut m = Meter::new(Some(content_type), None, 4.0);
        m.feed(body.as_bytes());
        match m.measured() {
            Measured::Exact { detail, .. } => detail,
            other => panic!("{body}: {other:?}"),
        }
    };
    let d = |r, w, t| Detail { cache_read: r, cache_write: w, reasoning: t };
    let openai = r#"{"usage":{"prompt_tokens":2006,"completion_tokens":300,"prompt_tokens_details":{"cached_tokens":1920},"completion_tokens_details":{"reasoning_tokens":256}}}"#;
    assert_eq!(detail("application/json", openai), d(Some(1920), None, Some(256)));
    let responses = r#"{"usage":{"input_tokens":50,"input_tokens_details":{"cached_tokens":40},"output_tokens":9,"output_tokens_details":{"reasoning_tokens":4}}}"#;
    assert_eq!(detail("application/json", responses), d(Some(40), None, Some(4)));
    let anthropic = r#"{"usage":{"input_tokens":10,"cache_read_input_tokens":500,"cache_creation_input_tokens":30,"output_tokens":3}}"#;
    assert_eq!(detail("application/json", anthropic), d(Some(500), Some(30), None));
    let gemini = r#"{"usageMetadata":{"promptTokenCount":9,"cachedContentTokenCount":4,"candidatesTokenCount":3,"thoughtsTokenCount":20}}"#;
    assert_eq!(detail("application/json", gemini), d(Some(4), None, Some(20)));
    let bedrock = r#"{"usage":{"inputTokens":11,"outputTokens":4,"cacheReadInputTokens":5,"cacheWriteInputTokens":7}}"#;
    assert_eq!(detail("application/json", bedrock), d(Some(5), Some(7), None));
    assert_eq!(detail("application/json", r#"{"prompt_eval_count":1,"eval_count":2}"#), Detail::default());
    // A stream's last usage carries them too.
    let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":50,\"completion_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n";
    assert_eq!(detail("text/event-stream", stream), d(Some(32), None, None));
}

/// An embedding's response too large to read charges no output (not its size in tokens).
#[test]
fn an_embedding_whose_counts_cannot_be_read_charges_no_output() {
    let mut m = Meter::new(Some("application/json"), None, 4.0);
    m.input_only();
    for _ in 0..9 {
        m.feed(&vec![b' '; 1 << 20]);
    }
    assert_eq!(m.measured(), Measured::Metered { output: 0 });
    let mut m = Meter::new(Some("application/json"), None, 4.0);
    m.input_only();
    m.feed(br#"{"data":[],"usage":{"prompt_tokens":8,"total_tokens":8}}"#);
    assert_eq!(m.measured(), Measured::exact(8, 0));
}

/// Output in the shapes other models stream on Bedrock, lines ended by a bare CR, and the
/// Responses API's incomplete response; `[DONE]` makes no running count exact.
#[test]
fn more_shapes_of_output_and_endings() {
    let mistral = "data: {\"outputs\":[{\"text\":\"abcd\",\"stop_reason\":null}]}\n\ndata: {\"choices\":[{\"message\":{\"content\":\"efgh\"}}]}\n\ndata: {\"text\":\"ijkl\",\"is_finished\":false}\n\n";
    assert_eq!(run("text/event-stream", &[mistral]), Measured::Metered { output: 3 });
    let responses_done = "data: {\"type\":\"response.output_text.delta\",\"delta\":\"abcd\"}\n\ndata: {\"type\":\"response.output_text.done\",\"text\":\"abcd\"}\n\n";
    assert_eq!(
        run("text/event-stream", &[responses_done]),
        Measured::Metered { output: 1 },
        "the done text is not counted again"
    );
    let cr = "data: {\"choices\":[{\"delta\":{\"content\":\"abcd\"}}]}\rdata: {\"choices\":[{\"delta\":{\"content\":\"efgh\"}}]}\r";
    assert_eq!(run("text/event-stream", &[cr]), Measured::Metered { output: 2 });
    let incomplete = "data: {\"type\":\"response.output_text.delta\",\"delta\":\"ab\"}\n\ndata: {\"type\":\"response.incomplete\",\"response\":{\"usage\":{\"input_tokens\":120000,\"output_tokens\":16}}}\n\n";
    assert_eq!(run("text/event-stream", &[incomplete]), Measured::exact(120_000, 16));
    let running = "data: {\"choices\":[{\"delta\":{\"content\":\"tok tok tok tok \"}}],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":0}}\n\ndata: [DONE]\n\n";
    assert_eq!(
        run("text/event-stream", &[running]),
        Measured::Metered { output: 4 },
        "a running count is not made exact by [DONE]"
    );
}

/// A JSON body is read for its counts alone (`skim::counts_only`): whatever the body, what
/// that reports is what the whole body, read as a `Value`, reports (where that reads it at all:
/// the next test). Every JSON body these tests
/// read, and the shapes that could tell the two apart: a field named with escapes, duplicated
/// fields (the last one stands), an `embeddings` that is not an array, nested arrays, scalars,
/// counts inside the skipped output, and bodies that are not JSON at all.
#[test]
fn a_body_read_for_its_counts_reports_what_the_whole_body_does() {
    let bodies = [
        r#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":7,"total_tokens":19}}"#,
        r#"{"data":[],"usage":{"prompt_tokens":8,"total_tokens":8}}"#,
        r#"{"type":"message","usage":{"input_tokens":10,"cache_read_input_tokens":5,"output_tokens":3}}"#,
        r#"{"object":"response","usage":{"input_tokens":4,"output_tokens":9,"total_tokens":13}}"#,
        r#"{"type":"message_start","message":{"usage":{"input_tokens":3,"output_tokens":1}}}"#,
        r#"{"type":"response.completed","response":{"usage":{"input_tokens":2,"output_tokens":5}}}"#,
        r#"[{"usageMetadata":{"promptTokenCount":9,"candidatesTokenCount":1}},{"candidates":[{"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":9,"candidatesTokenCount":2,"thoughtsTokenCount":4}}]"#,
        r#"{"amazon-bedrock-invocationMetrics":{"inputTokenCount":7,"outputTokenCount":2,"cacheReadInputTokenCount":1}}"#,
        r#"{"output":{"message":{"content":[{"text":"Hi"}]}},"usage":{"inputTokens":5,"outputTokens":2,"cacheWriteInputTokens":3}}"#,
        r#"{"model":"llama3.2","message":{"role":"assistant","content":"Hi"},"done":true,"prompt_eval_count":26,"eval_count":290}"#,
        r#"{"model":"all-minilm","embeddings":[[0.1,0.2]],"prompt_eval_count":8}"#,
        r#"{"model":"all-minilm","embeddings":{"a":[1]},"prompt_eval_count":8}"#,
        r#"{"embeddings":[[1]],"embeddings":null,"prompt_eval_count":8}"#,
        r#"{"model":"m","response":"abcd","eval_count":3}"#,
        r#"{"us\u0061ge":{"prompt_tokens":1,"completion_tokens":2}}"#,
        r#"{"usage":{"prompt_tokens":1,"completion_tokens":2},"usage":{"prompt_tokens":5,"completion_tokens":6}}"#,
        r#"{"usage":{"prompt_tokens":1,"completion_tokens":2},"usage":"none"}"#,
        r#"{"choices":[{"usage":{"prompt_tokens":100,"completion_tokens":100}}],"text":"usage"}"#,
        r#"[[{"usage":{"prompt_tokens":1,"completion_tokens":1}}],{"usage":{"prompt_tokens":2,"completion_tokens":3}},7,"x",null]"#,
        r#""usage""#,
        "12",
        "null",
        "{}",
        "[]",
        r#"{"usage":{"prompt_tokens":1,"completion_tokens":2}"#,
        r#"{"usage":{"prompt_tokens":1,"completion_tokens":2}} trailing"#,
        r#"{"choices":[{"message":{"content":"unclosed}}],"usage":{"prompt_tokens":1,"completion_tokens":2}}"#,
        "",
    ];
    let reported = |v: &serde_json::Value| match v {
        serde_json::Value::Array(chunks) => chunks.iter().map(fields::reported).collect(),
        v => vec![fields::reported(v)],
    };
    for body in bodies {
        let whole = serde_json::from_slice::<serde_json::Value>(body.as_bytes());
        let counts = skim::counts_only(body.as_bytes());
        assert_eq!(whole.is_ok(), counts.is_ok(), "{body}: read as JSON by one and not the other");
        if let (Ok(whole), Ok(counts)) = (whole, counts) {
            assert_eq!(reported(&counts), reported(&whole), "{body}");
        }
    }
    // Nothing else of the body is kept: the output text, the choices, Ollama's answer beside its
    // counts, Anthropic's message beside its usage.
    let kept = |body: &str| skim::counts_only(body.as_bytes()).unwrap();
    assert_eq!(
        kept(bodies[0]),
        serde_json::json!({"usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}})
    );
    assert_eq!(kept(bodies[9]), serde_json::json!({"message": {}, "prompt_eval_count": 26, "eval_count": 290}));
    assert_eq!(kept(bodies[13]), serde_json::json!({"response": null, "eval_count": 3}));
    let message = r#"{"type":"message_start","message":{"content":[{"text":"long"}],"usage":{"input_tokens":3}}}"#;
    assert_eq!(kept(message), serde_json::json!({"message": {"usage": {"input_tokens": 3}}}));
}

/// What a JSON body's counts are read past: text a whole-body parse refuses (a lone surrogate, as
/// a server that cut its output mid-character writes; bytes that are not UTF-8; a number past
/// `f64`) does not cost the counts the body reports, where the response was metered before.
#[test]
fn counts_survive_text_a_whole_body_parse_refuses() {
    let usage = br#""usage":{"prompt_tokens":3,"completion_tokens":4}"#.as_slice();
    let texts: [&[u8]; 3] = [br#""\ud83d""#, b"\"\xff\xfe\"", b"1e400"];
    for text in texts {
        let body = [br#"{"choices":[{"message":{"content":"#.as_slice(), text, b"}}],", usage, b"}"].concat();
        assert!(serde_json::from_slice::<serde_json::Value>(&body).is_err(), "{}", String::from_utf8_lossy(&body));
        let counts = skim::counts_only(&body).unwrap();
        assert_eq!(
            fields::reported(&counts),
            fields::Reported { prompt: Some(3), output: Some(4), ..Default::default() }
        );
        let mut m = Meter::new(Some("application/json"), None, 4.0);
        m.feed(&body);
        assert_eq!(m.measured(), Measured::exact(3, 4));
    }
}
