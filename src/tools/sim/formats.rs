//! The three wire formats the simulated backend speaks, so commit-from-the-response is tested
//! against each: OpenAI chat completions (`/v1/chat/completions`), Anthropic Messages
//! (`/v1/messages`) and the OpenAI Responses API (`/v1/responses`). Each is a request reader, a JSON
//! answer, and the events of a stream: what comes before the tokens, each step of tokens, and what
//! closes the stream. A generated token is the text `"tok "` ([`Text::Tok`], 4 bytes, so a meter
//! at 4 bytes per token reads it exactly), or a word of a small English-like vocabulary
//! ([`Text::Words`], 1 to 10 bytes, 4.375 on average), to measure a meter against.

use serde_json::{Value, json};

/// Which API a request came by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Messages,
    Responses,
}

impl Api {
    pub fn of_path(path: &str) -> Option<Api> {
        match path {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/messages" => Some(Api::Messages),
            "/v1/responses" => Some(Api::Responses),
            _ => None,
        }
    }
}

/// What the simulator reads from a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Ask {
    pub api: Api,
    pub model: String,
    pub prompt_tokens: u64,
    pub max_tokens: u64,
    pub stream: bool,
    /// OpenAI chat only: a stream ends with a usage chunk. The other formats always report usage.
    pub include_usage: bool,
}

pub fn parse(api: Api, body: &[u8], bytes_per_token: f64) -> Result<Ask, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("body is not JSON: {e}"))?;
    let text_bytes = |m: &Value| -> usize {
        match &m["content"] {
            Value::String(s) => s.len(),
            Value::Array(parts) => parts.iter().map(|p| p["text"].as_str().map_or(0, str::len)).sum(),
            _ => 0,
        }
    };
    let content_bytes: usize = match (api, &v["input"]) {
        (Api::Responses, Value::String(s)) => s.len(),
        (Api::Responses, Value::Array(items)) => items.iter().map(text_bytes).sum(),
        _ => v["messages"].as_array().map(|ms| ms.iter().map(text_bytes).sum()).unwrap_or(0),
    };
    let max_tokens = match api {
        Api::Chat => v["max_completion_tokens"].as_u64().or(v["max_tokens"].as_u64()),
        Api::Messages => v["max_tokens"].as_u64(),
        Api::Responses => v["max_output_tokens"].as_u64(),
    };
    Ok(Ask {
        api,
        model: v["model"].as_str().unwrap_or("sim").to_string(),
        prompt_tokens: ((content_bytes as f64 / bytes_per_token).ceil() as u64).max(1),
        max_tokens: max_tokens.unwrap_or(4096),
        stream: v["stream"].as_bool().unwrap_or(false),
        include_usage: v["stream_options"]["include_usage"].as_bool().unwrap_or(false),
    })
}

/// What a generated token reads as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Text {
    #[default]
    Tok,
    Words,
}

/// Tokens as a BPE tokenizer cuts English: a leading space on words, punctuation alone. Their
/// lengths sum to 70 over 16, 4.375 bytes per token.
const VOCABULARY: [&str; 16] = [
    " the",
    " of",
    ",",
    ".",
    " and",
    " to",
    " a",
    " in",
    " is",
    " model",
    " request",
    " tokens",
    "ing",
    " admission",
    " budget",
    " that",
];

/// Writes one response's tokens, the same sequence for the same seed.
#[derive(Debug, Clone)]
pub struct Writer {
    text: Text,
    state: u64,
}

impl Writer {
    pub fn new(text: Text, seed: u64) -> Self {
        Writer { text, state: seed }
    }

    /// The text of the next `tokens` tokens.
    pub fn take(&mut self, tokens: u64) -> String {
        let n = usize::try_from(tokens).unwrap_or(0);
        match self.text {
            Text::Tok => "tok ".repeat(n),
            Text::Words => (0..n)
                .map(|_| {
                    // A 64-bit LCG (Knuth's MMIX constants): plenty for picking words.
                    self.state =
                        self.state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                    VOCABULARY[(self.state >> 60) as usize]
                })
                .collect(),
        }
    }
}

/// The whole answer of a request that did not stream.
pub fn answer(ask: &Ask, output: u64, writer: &mut Writer) -> Value {
    let (prompt, model, content) = (ask.prompt_tokens, &ask.model, writer.take(output.min(64)));
    let stopped = if output == ask.max_tokens { "length" } else { "stop" };
    match ask.api {
        Api::Chat => json!({
            "id": "chatcmpl-sim", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": stopped}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output},
        }),
        Api::Messages => json!({
            "id": "msg_sim", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": content}],
            "stop_reason": if output == ask.max_tokens { "max_tokens" } else { "end_turn" },
            "usage": {"input_tokens": prompt, "output_tokens": output},
        }),
        Api::Responses => json!({
            "id": "resp_sim", "object": "response", "status": "completed", "model": model,
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": content}]}],
            "usage": {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output},
        }),
    }
}

/// One server-sent event.
fn event(name: Option<&str>, data: &Value) -> String {
    match name {
        Some(name) => format!("event: {name}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    }
}

/// What a stream sends before its first token.
pub fn opening(ask: &Ask) -> Vec<String> {
    match ask.api {
        Api::Chat => Vec::new(),
        Api::Messages => vec![
            event(
                Some("message_start"),
                &json!({"type": "message_start", "message": {"id": "msg_sim", "type": "message", "role": "assistant",
                    "model": ask.model, "content": [], "usage": {"input_tokens": ask.prompt_tokens, "output_tokens": 1}}}),
            ),
            event(
                Some("content_block_start"),
                &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
        ],
        Api::Responses => vec![event(
            Some("response.created"),
            &json!({"type": "response.created", "response": {"id": "resp_sim", "status": "in_progress"}}),
        )],
    }
}

/// One step of generated tokens, as `text`.
pub fn step(ask: &Ask, text: &str) -> String {
    match ask.api {
        Api::Chat => event(
            None,
            &json!({"id": "chatcmpl-sim", "object": "chat.completion.chunk", "created": 0, "model": ask.model,
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]}),
        ),
        Api::Messages => event(
            Some("content_block_delta"),
            &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
        ),
        Api::Responses => event(
            Some("response.output_text.delta"),
            &json!({"type": "response.output_text.delta", "output_index": 0, "delta": text}),
        ),
    }
}

/// What a stream that generated all `output` tokens sends last.
pub fn closing(ask: &Ask, output: u64) -> Vec<String> {
    let prompt = ask.prompt_tokens;
    match ask.api {
        Api::Chat => {
            let stopped = if output == ask.max_tokens { "length" } else { "stop" };
            let mut out = vec![event(
                None,
                &json!({"id": "chatcmpl-sim", "object": "chat.completion.chunk", "created": 0, "model": ask.model,
                    "choices": [{"index": 0, "delta": {}, "finish_reason": stopped}]}),
            )];
            if ask.include_usage {
                out.push(event(
                    None,
                    &json!({"id": "chatcmpl-sim", "object": "chat.completion.chunk", "created": 0, "model": ask.model,
                        "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}}),
                ));
            }
            out.push("data: [DONE]\n\n".to_string());
            out
        }
        Api::Messages => vec![
            event(Some("content_block_stop"), &json!({"type": "content_block_stop", "index": 0})),
            event(
                Some("message_delta"),
                &json!({"type": "message_delta", "delta": {"stop_reason": if output == ask.max_tokens { "max_tokens" } else { "end_turn" }},
                    "usage": {"output_tokens": output}}),
            ),
            event(Some("message_stop"), &json!({"type": "message_stop"})),
        ],
        Api::Responses => vec![event(
            Some("response.completed"),
            &json!({"type": "response.completed", "response": {"id": "resp_sim", "status": "completed",
                "usage": {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output}}}),
        )],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_each_format() {
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"12345678"}],"max_tokens":9,"stream":true,"stream_options":{"include_usage":true}}"#;
        let a = parse(Api::Chat, chat, 4.0).unwrap();
        assert_eq!((a.prompt_tokens, a.max_tokens, a.stream, a.include_usage), (2, 9, true, true));
        let messages = br#"{"model":"m","max_tokens":7,"messages":[{"role":"user","content":[{"type":"text","text":"12345678"}]}]}"#;
        let a = parse(Api::Messages, messages, 4.0).unwrap();
        assert_eq!((a.prompt_tokens, a.max_tokens, a.stream), (2, 7, false));
        let responses = br#"{"model":"m","input":"123456789012","max_output_tokens":5,"stream":true}"#;
        let a = parse(Api::Responses, responses, 4.0).unwrap();
        assert_eq!((a.prompt_tokens, a.max_tokens, a.stream), (3, 5, true));
        assert!(parse(Api::Chat, b"nope", 4.0).is_err());
    }

    #[test]
    fn words_average_their_vocabulary() {
        let total: usize = VOCABULARY.iter().map(|w| w.len()).sum();
        assert_eq!(total, 70);
        let text = Writer::new(Text::Words, 7).take(100_000);
        let per_token = text.len() as f64 / 100_000.0;
        assert!((per_token - 4.375).abs() < 0.05, "{per_token}");
        assert_eq!(Writer::new(Text::Words, 7).take(50), Writer::new(Text::Words, 7).take(50));
        assert_eq!(Writer::new(Text::Tok, 0).take(3), "tok tok tok ");
    }
}
