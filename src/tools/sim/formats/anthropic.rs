//! Anthropic Messages.

use serde_json::{Value, json};

use super::{Ask, Read, event, messages_bytes};

pub(super) fn read(v: &Value) -> Read {
    Read {
        content_bytes: messages_bytes(&v["messages"]),
        max_tokens: v["max_tokens"].as_u64(),
        stream: v["stream"].as_bool(),
    }
}

fn stop_reason(ask: &Ask, output: u64) -> &'static str {
    if output == ask.max_tokens { "max_tokens" } else { "end_turn" }
}

pub(super) fn answer(ask: &Ask, output: u64, content: &str) -> Value {
    json!({
        "id": "msg_sim", "type": "message", "role": "assistant", "model": ask.model,
        "content": [{"type": "text", "text": content}],
        "stop_reason": stop_reason(ask, output),
        "usage": {"input_tokens": ask.prompt_tokens, "output_tokens": output},
    })
}

pub(super) fn opening(ask: &Ask) -> Vec<Vec<u8>> {
    vec![
        event(
            Some("message_start"),
            &json!({"type": "message_start", "message": {"id": "msg_sim", "type": "message", "role": "assistant",
                "model": ask.model, "content": [], "usage": {"input_tokens": ask.prompt_tokens, "output_tokens": 1}}}),
        ),
        event(
            Some("content_block_start"),
            &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
    ]
}

pub(super) fn step(text: &str) -> Vec<u8> {
    event(
        Some("content_block_delta"),
        &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
    )
}

pub(super) fn closing(ask: &Ask, output: u64) -> Vec<Vec<u8>> {
    vec![
        event(Some("content_block_stop"), &json!({"type": "content_block_stop", "index": 0})),
        event(
            Some("message_delta"),
            &json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(ask, output)}, "usage": {"output_tokens": output}}),
        ),
        event(Some("message_stop"), &json!({"type": "message_stop"})),
    ]
}
