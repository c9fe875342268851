//! Google Gemini (and Vertex AI's Gemini): `generateContent`, and `streamGenerateContent` as
//! server-sent events (`alt=sse`, what the Gen AI SDK asks for), every chunk a whole
//! `GenerateContentResponse` with its running `usageMetadata`.

use serde_json::{Value, json};

use super::{Ask, Read};

pub(super) fn read(v: &Value) -> Read {
    let parts = |content: &Value| -> usize {
        content["parts"].as_array().map_or(0, |ps| ps.iter().map(|p| p["text"].as_str().map_or(0, str::len)).sum())
    };
    let contents: usize = v["contents"].as_array().map_or(0, |cs| cs.iter().map(parts).sum());
    Read {
        content_bytes: contents + parts(&v["systemInstruction"]),
        max_tokens: v["generationConfig"]["maxOutputTokens"].as_u64(),
        stream: None,
    }
}

fn chunk(ask: &Ask, text: &str, finish: Option<&str>, output: Option<u64>) -> Value {
    let mut candidate = json!({"content": {"parts": [{"text": text}], "role": "model"}, "index": 0});
    let mut usage = json!({"promptTokenCount": ask.prompt_tokens});
    if let Some(reason) = finish {
        candidate["finishReason"] = json!(reason);
    }
    if let Some(output) = output {
        usage["candidatesTokenCount"] = json!(output);
        usage["totalTokenCount"] = json!(ask.prompt_tokens + output);
    }
    json!({"candidates": [candidate], "usageMetadata": usage, "modelVersion": ask.model, "responseId": "sim"})
}

fn finish_reason(ask: &Ask, output: u64) -> &'static str {
    if output == ask.max_tokens { "MAX_TOKENS" } else { "STOP" }
}

pub(super) fn answer(ask: &Ask, output: u64, content: &str) -> Value {
    chunk(ask, content, Some(finish_reason(ask, output)), Some(output))
}

fn sse(v: &Value) -> Vec<u8> {
    format!("data: {v}\r\n\r\n").into_bytes()
}

pub(super) fn step(ask: &Ask, text: &str) -> Vec<u8> {
    sse(&chunk(ask, text, None, None))
}

pub(super) fn closing(ask: &Ask, output: u64) -> Vec<Vec<u8>> {
    vec![sse(&chunk(ask, "", Some(finish_reason(ask, output)), Some(output)))]
}
