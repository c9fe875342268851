//! Ollama's native API: `/api/chat` and `/api/generate`, streamed as JSON lines unless the request
//! says `"stream": false`.

use serde_json::{Value, json};

use super::{Api, Ask, Read, messages_bytes};

pub(super) fn read(v: &Value) -> Read {
    let content = messages_bytes(&v["messages"]) + v["prompt"].as_str().map_or(0, str::len);
    let max_tokens = v["options"]["num_predict"].as_i64().and_then(|n| u64::try_from(n).ok()).filter(|&n| n > 0);
    Read { content_bytes: content, max_tokens, stream: Some(v["stream"].as_bool().unwrap_or(true)) }
}

/// One object of the answer: a piece of text, or (with `output`) the last, with the counts.
fn object(ask: &Ask, text: &str, output: Option<u64>) -> Value {
    let mut v = match ask.api {
        Api::OllamaGenerate => json!({"model": ask.model, "created_at": "2026-01-01T00:00:00Z", "response": text}),
        _ => {
            json!({"model": ask.model, "created_at": "2026-01-01T00:00:00Z", "message": {"role": "assistant", "content": text}})
        }
    };
    v["done"] = json!(output.is_some());
    if let Some(output) = output {
        v["done_reason"] = json!(if output == ask.max_tokens { "length" } else { "stop" });
        for (field, n) in [
            ("total_duration", 1),
            ("load_duration", 1),
            ("prompt_eval_count", ask.prompt_tokens),
            ("prompt_eval_duration", 1),
            ("eval_count", output),
            ("eval_duration", 1),
        ] {
            v[field] = json!(n);
        }
    }
    v
}

fn line(v: &Value) -> Vec<u8> {
    format!("{v}\n").into_bytes()
}

pub(super) fn answer(ask: &Ask, output: u64, content: &str) -> Value {
    object(ask, content, Some(output))
}

pub(super) fn step(ask: &Ask, text: &str) -> Vec<u8> {
    line(&object(ask, text, None))
}

pub(super) fn closing(ask: &Ask, output: u64) -> Vec<Vec<u8>> {
    vec![line(&object(ask, "", Some(output)))]
}
