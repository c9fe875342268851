//! Amazon Bedrock's Converse, and ConverseStream in Amazon's event stream framing.

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
