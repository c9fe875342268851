//! What a response says it used, read as it streams past: the usage block of an OpenAI, vLLM or
//! Anthropic response, or, where the response carries none, a meter of what was generated.
//!
//! Formats read:
//!
//! - JSON (`application/json`): the top-level `usage` of OpenAI chat completions, completions and
//!   embeddings (`prompt_tokens`, `completion_tokens`) and of Anthropic Messages and the OpenAI
//!   Responses API (`input_tokens`, `output_tokens`; Anthropic's cache reads and writes count as
//!   input).
//! - Server-sent events (`text/event-stream`): every `data:` payload is read; usage may come in
//!   OpenAI's final chunk (`stream_options.include_usage`), Anthropic's `message_start`
//!   (`message.usage`, the input) and `message_delta` (`usage`, the output so far), or the
//!   Responses API's `response.completed` (`response.usage`). Counts are cumulative, so the largest
//!   seen is the count. Generated output is metered as it passes, whatever carries it: OpenAI
//!   `choices[].delta` content, refusals, reasoning, tool-call and function-call arguments, and
//!   `choices[].text`; Anthropic `delta` text, thinking and tool input (`partial_json`); Responses
//!   `delta` strings.
//!
//! A stream's counts are exact only once its final usage has arrived: OpenAI's usage chunk (no
//! choices, or `[DONE]` after usage), Anthropic's `message_delta`, Responses' `response.completed`.
//! A stream cut before that (the client left) is metered from all the output that passed, or from
//! the partial count if that is larger: `message_start`'s placeholder output of 1 never stands for
//! a hundred deltas that passed after it.
//!
//! A compressed body (any `content-encoding` but `identity`) is never parsed, nor is a content type
//! tollgate does not read: their usage is unknown, and the hold is charged as it was made (as an
//! expired hold is under `charge_reserved`), never a count mis-read from bytes it cannot read. A
//! JSON body past [`MAX_JSON_BODY`] is not buffered further and is metered from its size.

/// The largest JSON response body buffered to read its usage.
pub const MAX_JSON_BODY: usize = 8 << 20;

/// The longest server-sent-event line kept while it is incomplete.
const MAX_EVENT_LINE: usize = 1 << 20;

/// What a response used, as far as it says: exact counts it reported, or the output metered from
/// the text that passed (bytes per token) with the prompt that was held at admission.
pub use crate::hold::Counted as Measured;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Json,
    Events,
    /// Compressed, or a content type tollgate does not read: only its size is known.
    Opaque,
}

/// Reads one response body as it streams.
#[derive(Debug)]
pub struct Meter {
    format: Format,
    bytes_per_token: f64,
    /// JSON: the body so far. Events: the current, incomplete line.
    pending: Vec<u8>,
    overflowed: bool,
    prompt: Option<u64>,
    output: Option<u64>,
    /// A stream's final usage has arrived: its counts are the response's last word.
    final_usage: bool,
    /// Bytes of generated text seen (events), or of the whole body (opaque).
    text_bytes: u64,
}

impl Meter {
    /// A meter for a response with these headers. `bytes_per_token` is the model's, for metering.
    pub fn new(content_type: Option<&str>, content_encoding: Option<&str>, bytes_per_token: f64) -> Self {
        let compressed = content_encoding.is_some_and(|e| !e.trim().eq_ignore_ascii_case("identity"));
        let kind = content_type.map(|c| c.split(';').next().unwrap_or("").trim().to_ascii_lowercase());
        let format = match kind.as_deref() {
            _ if compressed => Format::Opaque,
            Some("text/event-stream") => Format::Events,
            Some(k) if k == "application/json" || k.ends_with("+json") => Format::Json,
            _ => Format::Opaque,
        };
        Meter {
            format,
            bytes_per_token,
            pending: Vec::new(),
            overflowed: false,
            prompt: None,
            output: None,
            final_usage: false,
            text_bytes: 0,
        }
    }

    /// Reads the next piece of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        match self.format {
            Format::Json => {
                // Its size, for a body too large to read: metered from that.
                self.text_bytes = self.text_bytes.saturating_add(len(chunk));
                if self.pending.len().saturating_add(chunk.len()) > MAX_JSON_BODY {
                    self.overflowed = true;
                    self.pending = Vec::new();
                } else if !self.overflowed {
                    self.pending.extend_from_slice(chunk);
                }
            }
            Format::Events => {
                for &b in chunk {
                    if b == b'\n' {
                        let line = std::mem::take(&mut self.pending);
                        self.event_line(&line);
                    } else if self.pending.len() < MAX_EVENT_LINE {
                        self.pending.push(b);
                    }
                }
            }
            Format::Opaque => self.text_bytes = self.text_bytes.saturating_add(len(chunk)),
        }
    }

    /// Whether the body can be read at all.
    fn opaque(&self) -> bool {
        self.format == Format::Opaque
    }

    /// Whether generated output has passed yet: only a stream says so as it goes. (A JSON body
    /// arrives whole, and a failed response's body is an error message, not output.)
    pub fn saw_output(&self) -> bool {
        self.format == Format::Events && (self.text_bytes > 0 || self.output.is_some_and(|o| o > 0))
    }

    /// What the whole body used, at its end (or at a disconnect: what passed until then).
    pub fn measured(&mut self) -> Measured {
        match self.format {
            Format::Json if !self.overflowed => {
                let body = std::mem::take(&mut self.pending);
                if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) {
                    self.read_usage(&v);
                }
                self.text_bytes = len(&body);
            }
            Format::Events if !self.pending.is_empty() => {
                let line = std::mem::take(&mut self.pending);
                self.event_line(&line);
            }
            _ => {}
        }
        let complete = self.format != Format::Events || self.final_usage;
        match (self.prompt, self.output) {
            (Some(prompt), Some(output)) if complete => Measured::Exact { prompt, output },
            _ if self.opaque() => Measured::AsHeld,
            (_, partial) => {
                let metered = tokens_of(self.text_bytes, self.bytes_per_token);
                Measured::Metered { output: metered.max(partial.unwrap_or(0)) }
            }
        }
    }

    fn event_line(&mut self, line: &[u8]) {
        let Some(data) = line.strip_prefix(b"data:") else { return };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            // OpenAI's end of stream: whatever usage came before it was the last.
            self.final_usage |= self.output.is_some();
            return;
        }
        if data.is_empty() {
            return;
        }
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else { return };
        self.read_usage(&v);
        self.final_usage |= carries_final_usage(&v);
        self.text_bytes = self.text_bytes.saturating_add(generated_text(&v));
    }

    /// Takes the usage counts an event or a body carries, wherever its format puts them.
    fn read_usage(&mut self, v: &serde_json::Value) {
        for usage in [&v["usage"], &v["message"]["usage"], &v["response"]["usage"]] {
            if !usage.is_object() {
                continue;
            }
            let n = |field: &str| usage[field].as_u64();
            let input = n("prompt_tokens").or_else(|| {
                n("input_tokens").map(|i| {
                    i.saturating_add(n("cache_creation_input_tokens").unwrap_or(0))
                        .saturating_add(n("cache_read_input_tokens").unwrap_or(0))
                })
            });
            // Embeddings report no completion: their output is nothing.
            let output = n("completion_tokens")
                .or_else(|| n("output_tokens"))
                .or_else(|| (n("prompt_tokens").is_some() && n("total_tokens").is_some()).then_some(0));
            if let Some(i) = input {
                self.prompt = Some(self.prompt.map_or(i, |p| p.max(i)));
            }
            if let Some(o) = output {
                self.output = Some(self.output.map_or(o, |p| p.max(o)));
            }
        }
    }
}

/// Whether a streamed event is the one that closes its stream's usage: Anthropic's
/// `message_delta` (the final output count), the Responses API's `response.completed`, or an
/// OpenAI-style usage chunk with no choices (`stream_options.include_usage`; a server that puts a
/// running count in every chunk puts it beside choices).
fn carries_final_usage(v: &serde_json::Value) -> bool {
    match v["type"].as_str() {
        Some("message_delta") => v["usage"]["output_tokens"].is_u64(),
        Some("response.completed") => v["response"]["usage"].is_object(),
        Some(_) => false,
        None => v["usage"].is_object() && v["choices"].as_array().is_none_or(Vec::is_empty),
    }
}

/// Bytes of generated output in one streamed event: text, refusals, reasoning and thinking,
/// tool-call and function-call arguments, in the formats read.
fn generated_text(v: &serde_json::Value) -> u64 {
    let mut bytes = 0u64;
    let mut add = |s: Option<&str>| bytes = bytes.saturating_add(s.map_or(0, |s| len(s.as_bytes())));
    if let Some(choices) = v["choices"].as_array() {
        for c in choices {
            let delta = &c["delta"];
            for field in ["content", "refusal", "reasoning_content", "reasoning"] {
                add(delta[field].as_str());
            }
            add(delta["function_call"]["arguments"].as_str());
            for call in delta["tool_calls"].as_array().into_iter().flatten() {
                add(call["function"]["arguments"].as_str());
            }
            add(c["text"].as_str());
        }
    }
    // Anthropic's text_delta, thinking_delta and input_json_delta.
    for field in ["text", "thinking", "partial_json"] {
        add(v["delta"][field].as_str());
    }
    add(v["delta"].as_str());
    bytes
}

fn len(b: &[u8]) -> u64 {
    u64::try_from(b.len()).unwrap_or(u64::MAX)
}

/// `ceil(bytes / bytes_per_token)`; a response body is far below 2^53 bytes.
#[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn tokens_of(bytes: u64, bytes_per_token: f64) -> u64 {
    (bytes as f64 / bytes_per_token).ceil() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(run("application/json; charset=utf-8", &[a, b]), Measured::Exact { prompt: 12, output: 7 });
    }

    #[test]
    fn embeddings_report_no_output() {
        let body = r#"{"data":[],"usage":{"prompt_tokens":8,"total_tokens":8}}"#;
        assert_eq!(run("application/json", &[body]), Measured::Exact { prompt: 8, output: 0 });
    }

    #[test]
    fn anthropic_and_responses_json_usage_is_exact() {
        let messages =
            r#"{"type":"message","usage":{"input_tokens":10,"cache_read_input_tokens":5,"output_tokens":3}}"#;
        assert_eq!(run("application/json", &[messages]), Measured::Exact { prompt: 15, output: 3 });
        let responses = r#"{"object":"response","usage":{"input_tokens":4,"output_tokens":9,"total_tokens":13}}"#;
        assert_eq!(run("application/json", &[responses]), Measured::Exact { prompt: 4, output: 9 });
    }

    #[test]
    fn an_openai_stream_with_its_usage_chunk_is_exact_across_any_split() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"tok tok \"}}]}\n\n\
                      data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n\
                      data: [DONE]\n\n";
        for cut in 1..stream.len() {
            let (a, b) = stream.split_at(cut);
            assert_eq!(run("text/event-stream", &[a, b]), Measured::Exact { prompt: 5, output: 2 }, "cut at {cut}");
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
        assert_eq!(run("text/event-stream", &[stream]), Measured::Exact { prompt: 25, output: 15 });
    }

    #[test]
    fn the_responses_api_stream_takes_its_completed_usage() {
        let stream = "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n\
                      event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":3,\"output_tokens\":2}}}\n\n";
        assert_eq!(run("text/event-stream", &[stream]), Measured::Exact { prompt: 3, output: 2 });
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
}
