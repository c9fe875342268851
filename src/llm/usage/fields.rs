//! Where each provider puts its counts and its generated output, in one table per question: what
//! a body or an event says it used ([`reported`]), whether an event closes its stream's usage
//! ([`is_final`]), and how many bytes of output an event carries ([`generated_bytes`]).
//!
//! | provider | counts | closes the stream | output |
//! |---|---|---|---|
//! | OpenAI chat, completions, embeddings | `usage.prompt_tokens`, `completion_tokens` | a usage chunk without choices | `choices[].delta` content, refusal, reasoning, tool and function arguments; `choices[].text` |
//! | OpenAI Responses | `response.usage.input_tokens`, `output_tokens` | `response.completed` | `delta` |
//! | Anthropic Messages | `message.usage` then `usage`: `input_tokens` + cache reads and writes, `output_tokens` | `message_delta` | `delta` text, thinking, `partial_json` |
//! | Gemini, Vertex AI | `usageMetadata`: `promptTokenCount` (+ tool-use prompt), `candidatesTokenCount` + `thoughtsTokenCount` | a chunk with a `finishReason` | `candidates[].content.parts[]`: text, function calls, code |
//! | Bedrock Converse | `usage.inputTokens` + cache reads and writes, `outputTokens` | the `metadata` event | `delta` text, `toolUse.input`, `reasoningContent.text` |
//! | Bedrock InvokeModel | `amazon-bedrock-invocationMetrics` (streams), else the model's own (Anthropic's above) | the metrics chunk | the model's own: Anthropic's, Nova's `contentBlockDelta`, Llama's `generation`, Titan's `outputText` |
//! | Ollama | `prompt_eval_count`, `eval_count` (embeddings: none) | `"done": true` | `message` content, thinking, tool arguments; `response`, `thinking` |
//!
//! Counts are cumulative where a stream repeats them, so the caller keeps the largest seen. Each
//! provider's cache reads and writes and reasoning tokens are read too ([`Detail`]), within the
//! prompt and output counts: OpenAI's `cached_tokens` and `reasoning_tokens` (chat and Responses),
//! Anthropic's `cache_read_input_tokens` and `cache_creation_input_tokens`, Gemini's
//! `cachedContentTokenCount` and `thoughtsTokenCount`, Bedrock's cache reads and writes.

use serde_json::Value;

pub use crate::hold::Detail;

/// The prompt and output counts one body or event reports, each where it says so.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reported {
    pub prompt: Option<u64>,
    pub output: Option<u64>,
    /// What of them the provider says more of: cache reads and writes (within the prompt),
    /// reasoning (within the output).
    pub detail: Detail,
}

/// The largest of two counts, where either says.
fn max(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

impl Reported {
    /// Both counts taken together: the largest of each.
    fn merge(self, other: Reported) -> Reported {
        Reported {
            prompt: max(self.prompt, other.prompt),
            output: max(self.output, other.output),
            detail: self.detail.merge(other.detail),
        }
    }
}

/// Every top-level field [`reported`] reads (of `message` and `response`, their `usage`; of
/// `embeddings`, only whether it is an array): what [`super::skim`] keeps of a JSON body.
pub(super) const COUNTED: [&str; 8] = [
    "usage",
    "message",
    "response",
    "usageMetadata",
    "amazon-bedrock-invocationMetrics",
    "prompt_eval_count",
    "eval_count",
    "embeddings",
];

/// What `v` reports it used, in any of the formats read. (A top-level field read here is one of
/// [`COUNTED`]: a JSON body is read for those alone.)
pub fn reported(v: &Value) -> Reported {
    let mut found = Reported::default();
    // OpenAI and Anthropic (`usage`, `message.usage`), the Responses API (`response.usage`),
    // Bedrock Converse (`usage`, camel-cased).
    for usage in [&v["usage"], &v["message"]["usage"], &v["response"]["usage"]] {
        if usage.is_object() {
            found = found.merge(openai_or_anthropic(usage)).merge(bedrock(usage));
        }
    }
    let gemini = &v["usageMetadata"];
    if gemini.is_object() {
        let n = |field: &str| gemini[field].as_u64();
        let prompt = n("promptTokenCount").map(|p| p.saturating_add(n("toolUsePromptTokenCount").unwrap_or(0)));
        let output = match (n("candidatesTokenCount"), n("thoughtsTokenCount")) {
            (None, None) => None,
            (c, t) => Some(c.unwrap_or(0).saturating_add(t.unwrap_or(0))),
        };
        let detail =
            Detail { cache_read: n("cachedContentTokenCount"), cache_write: None, reasoning: n("thoughtsTokenCount") };
        found = found.merge(Reported { prompt, output, detail });
    }
    let metrics = &v["amazon-bedrock-invocationMetrics"];
    if metrics.is_object() {
        let n = |field: &str| metrics[field].as_u64();
        let prompt = n("inputTokenCount").map(|i| {
            i.saturating_add(n("cacheReadInputTokenCount").unwrap_or(0))
                .saturating_add(n("cacheWriteInputTokenCount").unwrap_or(0))
        });
        let detail = Detail {
            cache_read: n("cacheReadInputTokenCount"),
            cache_write: n("cacheWriteInputTokenCount"),
            reasoning: None,
        };
        found = found.merge(Reported { prompt, output: n("outputTokenCount"), detail });
    }
    // Ollama, at the top level; its embeddings report the prompt alone.
    if let Some(prompt) = v["prompt_eval_count"].as_u64() {
        let output = v["eval_count"].as_u64().or_else(|| v["embeddings"].is_array().then_some(0));
        found = found.merge(Reported { prompt: Some(prompt), output, detail: Detail::default() });
    } else if let Some(output) = v["eval_count"].as_u64() {
        found = found.merge(Reported { prompt: None, output: Some(output), detail: Detail::default() });
    }
    found
}

fn openai_or_anthropic(usage: &Value) -> Reported {
    let n = |field: &str| usage[field].as_u64();
    let prompt = n("prompt_tokens").or_else(|| {
        n("input_tokens").map(|i| {
            i.saturating_add(n("cache_creation_input_tokens").unwrap_or(0))
                .saturating_add(n("cache_read_input_tokens").unwrap_or(0))
        })
    });
    // Embeddings report no completion: their output is nothing.
    let output = n("completion_tokens")
        .or_else(|| n("output_tokens"))
        .or_else(|| (n("prompt_tokens").is_some() && n("total_tokens").is_some()).then_some(0));
    // OpenAI's chat (`*_tokens_details`) and Responses (`input_`/`output_tokens_details`);
    // Anthropic's cache reads and writes.
    let detail = Detail {
        cache_read: usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .or_else(|| usage["input_tokens_details"]["cached_tokens"].as_u64())
            .or_else(|| n("cache_read_input_tokens")),
        cache_write: n("cache_creation_input_tokens"),
        reasoning: usage["completion_tokens_details"]["reasoning_tokens"]
            .as_u64()
            .or_else(|| usage["output_tokens_details"]["reasoning_tokens"].as_u64()),
    };
    Reported { prompt, output, detail }
}

fn bedrock(usage: &Value) -> Reported {
    let n = |field: &str| usage[field].as_u64();
    let prompt = n("inputTokens").map(|i| {
        i.saturating_add(n("cacheReadInputTokens").unwrap_or(0)).saturating_add(n("cacheWriteInputTokens").unwrap_or(0))
    });
    let detail =
        Detail { cache_read: n("cacheReadInputTokens"), cache_write: n("cacheWriteInputTokens"), reasoning: None };
    Reported { prompt, output: n("outputTokens"), detail }
}

/// Whether a streamed event is the one that closes its stream's usage: Anthropic's
/// `message_delta` (the final output count), the Responses API's `response.completed`, an
/// OpenAI-style usage chunk with no choices (`stream_options.include_usage`; a server that puts a
/// running count in every chunk puts it beside choices), Gemini's chunk with a finish reason,
/// Bedrock's `metadata` event or invocation metrics, Ollama's `done`.
pub fn is_final(v: &Value) -> bool {
    if v["usageMetadata"].is_object() {
        let finished = v["candidates"].as_array().into_iter().flatten().any(|c| c["finishReason"].is_string());
        return finished || v["promptFeedback"]["blockReason"].is_string();
    }
    if v["amazon-bedrock-invocationMetrics"].is_object() {
        return true;
    }
    if v["done"].as_bool() == Some(true) {
        return v["eval_count"].is_u64() || v["embeddings"].is_array();
    }
    match v["type"].as_str() {
        Some("message_delta") => v["usage"]["output_tokens"].is_u64(),
        // An incomplete or failed response (max_output_tokens reached, a content filter) ends
        // with its usage too.
        Some("response.completed" | "response.incomplete" | "response.failed") => v["response"]["usage"].is_object(),
        Some(_) => false,
        None => v["usage"].is_object() && v["choices"].as_array().is_none_or(Vec::is_empty),
    }
}

/// Bytes of generated output in one streamed event: text, refusals, reasoning and thinking,
/// tool-call and function-call arguments, in every format read. Arguments sent as a JSON object
/// rather than a string (Gemini, Ollama) count as their JSON text.
pub fn generated_bytes(v: &Value) -> u64 {
    let mut bytes = 0u64;
    let mut add = |s: Option<&str>| bytes = bytes.saturating_add(s.map_or(0, |s| len(s.as_bytes())));
    // OpenAI chat and completions.
    for c in v["choices"].as_array().into_iter().flatten() {
        let delta = &c["delta"];
        for field in ["content", "refusal", "reasoning_content", "reasoning"] {
            add(delta[field].as_str());
        }
        add(delta["function_call"]["arguments"].as_str());
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            add(call["function"]["arguments"].as_str());
        }
        add(c["text"].as_str());
        // Whole messages in a stream (Mistral Large's own chunks on Bedrock).
        add(c["message"]["content"].as_str());
    }
    // Mistral's own chunks on Bedrock; Cohere's (a bare `text`: the Responses API's events, which
    // have a type, repeat their deltas' text in `text` when done, and are not counted twice).
    for o in v["outputs"].as_array().into_iter().flatten() {
        add(o["text"].as_str());
    }
    if v["type"].is_null() {
        add(v["text"].as_str());
    }
    // Anthropic's text, thinking and input_json deltas; Bedrock's text, tool input and reasoning;
    // the Responses API's delta strings; Nova's deltas inside an InvokeModel stream.
    for delta in [&v["delta"], &v["contentBlockDelta"]["delta"]] {
        for field in ["text", "thinking", "partial_json"] {
            add(delta[field].as_str());
        }
        add(delta["toolUse"]["input"].as_str());
        add(delta["reasoningContent"]["text"].as_str());
    }
    add(v["delta"].as_str());
    // Llama's and Titan's own stream chunks on Bedrock.
    add(v["generation"].as_str());
    add(v["outputText"].as_str());
    // Ollama's chat and generate.
    let message = &v["message"];
    add(message["content"].as_str());
    add(message["thinking"].as_str());
    add(v["response"].as_str());
    add(v["thinking"].as_str());
    let mut objects = 0u64;
    for call in message["tool_calls"].as_array().into_iter().flatten() {
        objects = objects.saturating_add(json_len(&call["function"]["arguments"]));
    }
    // Gemini's parts.
    for candidate in v["candidates"].as_array().into_iter().flatten() {
        for part in candidate["content"]["parts"].as_array().into_iter().flatten() {
            add(part["text"].as_str());
            add(part["executableCode"]["code"].as_str());
            add(part["codeExecutionResult"]["output"].as_str());
            if part["functionCall"].is_object() {
                objects = objects.saturating_add(json_len(&part["functionCall"]));
            }
        }
    }
    bytes.saturating_add(objects)
}

/// The length of a JSON value as text: what a tool call's arguments cost to generate.
fn json_len(v: &Value) -> u64 {
    match v {
        Value::Null => 0,
        Value::String(s) => len(s.as_bytes()),
        v => len(v.to_string().as_bytes()),
    }
}

pub fn len(b: &[u8]) -> u64 {
    u64::try_from(b.len()).unwrap_or(u64::MAX)
}
