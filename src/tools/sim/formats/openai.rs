//! OpenAI: chat completions, the Responses API, embeddings.

use serde_json::{Value, json};

use super::{Api, Ask, Read, event, messages_bytes, stopped, text_bytes};

pub(super) fn read(api: Api, v: &Value) -> Read {
    let content_bytes = match (api, &v["input"]) {
        (Api::Responses, Value::String(s)) | (Api::Embeddings, Value::String(s)) => s.len(),
        (Api::Responses, Value::Array(items)) => items.iter().map(|m| text_bytes(&m["content"])).sum(),
        (Api::Embeddings, Value::Array(items)) => items.iter().map(|i| i.as_str().map_or(0, str::len)).sum(),
        _ => messages_bytes(&v["messages"]),
    };
    let max_tokens = match api {
        Api::Responses => v["max_output_tokens"].as_u64(),
        _ => v["max_completion_tokens"].as_u64().or(v["max_tokens"].as_u64()),
    };
    Read { content_bytes, max_tokens, stream: v["stream"].as_bool() }
}

pub(super) fn answer(ask: &Ask, output: u64, content: &str) -> Value {
    let (prompt, model) = (ask.prompt_tokens, &ask.model);
    match ask.api {
        Api::Responses => json!({
            "id": "resp_sim", "object": "response", "status": "completed", "model": model,
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": content}]}],
            "usage": {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output},
        }),
        Api::Embeddings => json!({
            "object": "list", "model": model,
            "data": [{"object": "embedding", "index": 0, "embedding": [0.0, 0.5, 1.0]}],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
        }),
        _ => json!({
            "id": "chatcmpl-sim", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": stopped(ask, output)}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output},
        }),
    }
}

pub(super) fn opening(ask: &Ask) -> Vec<Vec<u8>> {
    match ask.api {
        Api::Responses => vec![event(
            Some("response.created"),
            &json!({"type": "response.created", "response": {"id": "resp_sim", "status": "in_progress"}}),
        )],
        _ => Vec::new(),
    }
}

pub(super) fn step(ask: &Ask, text: &str) -> Vec<u8> {
    match ask.api {
        Api::Responses => event(
            Some("response.output_text.delta"),
            &json!({"type": "response.output_text.delta", "output_index": 0, "delta": text}),
        ),
        _ => event(
            None,
            &json!({"id": "chatcmpl-sim", "object": "chat.completion.chunk", "created": 0, "model": ask.model,
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]}),
        ),
    }
}

pub(super) fn closing(ask: &Ask, output: u64) -> Vec<Vec<u8>> {
    let prompt = ask.prompt_tokens;
    if ask.api == Api::Responses {
        return vec![event(
            Some("response.completed"),
            &json!({"type": "response.completed", "response": {"id": "resp_sim", "status": "completed",
                "usage": {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output}}}),
        )];
    }
    let mut out = vec![event(
        None,
        &json!({"id": "chatcmpl-sim", "object": "chat.completion.chunk", "created": 0, "model": ask.model,
            "choices": [{"index": 0, "delta": {}, "finish_reason": stopped(ask, output)}]}),
    )];
    if ask.include_usage {
        out.push(event(
            None,
            &json!({"id": "chatcmpl-sim", "object": "chat.completion.chunk", "created": 0, "model": ask.model,
                "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}}),
        ));
    }
    out.push(b"data: [DONE]\n\n".to_vec());
    out
}
