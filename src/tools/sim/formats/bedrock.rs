//! Amazon Bedrock's Converse, and ConverseStream in Amazon's event stream framing; InvokeModel and
//! its stream with a Meta Llama body (`prompt`, `max_gen_len`; `generation` back), whose counts
//! Bedrock gives in headers, or base64 chunks ending with invocation metrics.

use serde_json::{Value, json};

use super::{Ask, Read};
use crate::llm::usage::aws;

pub(super) fn read(v: &Value) -> Read {
    let content: usize = v["messages"].as_array().map_or(0, |ms| {
        ms.iter()
            .flat_map(|m| m["content"].as_array().into_iter().flatten())
            .map(|b| b["text"].as_str().map_or(0, str::len))
            .sum()
    });
    Read { content_bytes: content, max_tokens: v["inferenceConfig"]["maxTokens"].as_u64(), stream: None }
}

fn stop_reason(ask: &Ask, output: u64) -> &'static str {
    if output == ask.max_tokens { "max_tokens" } else { "end_turn" }
}

fn usage(ask: &Ask, output: u64) -> Value {
    json!({"inputTokens": ask.prompt_tokens, "outputTokens": output, "totalTokens": ask.prompt_tokens + output})
}

pub(super) fn answer(ask: &Ask, output: u64, content: &str) -> Value {
    json!({
        "output": {"message": {"role": "assistant", "content": [{"text": content}]}},
        "stopReason": stop_reason(ask, output),
        "usage": usage(ask, output),
        "metrics": {"latencyMs": 1},
    })
}

pub(super) fn opening() -> Vec<Vec<u8>> {
    vec![aws::encode("messageStart", json!({"role": "assistant"}).to_string().as_bytes())]
}

pub(super) fn step(text: &str) -> Vec<u8> {
    aws::encode("contentBlockDelta", json!({"contentBlockIndex": 0, "delta": {"text": text}}).to_string().as_bytes())
}

pub(super) fn closing(ask: &Ask, output: u64) -> Vec<Vec<u8>> {
    vec![
        aws::encode("contentBlockStop", json!({"contentBlockIndex": 0}).to_string().as_bytes()),
        aws::encode("messageStop", json!({"stopReason": stop_reason(ask, output)}).to_string().as_bytes()),
        aws::encode(
            "metadata",
            json!({"usage": usage(ask, output), "metrics": {"latencyMs": 1}}).to_string().as_bytes(),
        ),
    ]
}

pub(super) fn read_invoke(v: &Value) -> Read {
    Read {
        content_bytes: v["prompt"].as_str().map_or(0, str::len),
        max_tokens: v["max_gen_len"].as_u64(),
        stream: None,
    }
}

fn llama_stop(ask: &Ask, output: u64) -> &'static str {
    if output == ask.max_tokens { "length" } else { "stop" }
}

/// Llama's own body, with counts of its own that tollgate does not read: Bedrock's headers are
/// what says.
pub(super) fn answer_invoke(ask: &Ask, output: u64, content: &str) -> Value {
    json!({"generation": content, "prompt_token_count": ask.prompt_tokens, "generation_token_count": output,
        "stop_reason": llama_stop(ask, output)})
}

/// An InvokeModel stream's chunk: the model's own event, base64-encoded.
fn chunk(inner: &Value) -> Vec<u8> {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD.encode(inner.to_string());
    aws::encode("chunk", json!({ "bytes": bytes }).to_string().as_bytes())
}

pub(super) fn step_invoke(text: &str) -> Vec<u8> {
    chunk(&json!({"generation": text, "prompt_token_count": null, "generation_token_count": 1, "stop_reason": null}))
}

pub(super) fn closing_invoke(ask: &Ask, output: u64) -> Vec<Vec<u8>> {
    vec![chunk(&json!({"generation": "", "stop_reason": llama_stop(ask, output),
        "amazon-bedrock-invocationMetrics": {"inputTokenCount": ask.prompt_tokens, "outputTokenCount": output,
            "invocationLatency": 1, "firstByteLatency": 1}}))]
}
