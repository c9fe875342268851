//! The wire formats the simulated backend speaks, so commit-from-the-response (and each
//! provider's own SDK) is tested against each: OpenAI chat completions, the Responses API and
//! embeddings ([`openai`]), Anthropic Messages ([`anthropic`]), Gemini `generateContent`
//! ([`gemini`]), Bedrock Converse ([`bedrock`]) and Ollama's chat and generate ([`ollama`]). Each
//! is a request reader, a JSON answer, and the events of a stream: what comes before the tokens,
//! each step of tokens, and what closes the stream. A generated token is the text `"tok "`
//! ([`Text::Tok`], 4 bytes, so a meter at 4 bytes per token reads it exactly), or a word of a
//! small English-like vocabulary ([`Text::Words`], 1 to 10 bytes, 4.375 on average), to measure a
//! meter against.

pub mod anthropic;
pub mod bedrock;
pub mod gemini;
pub mod ollama;
pub mod openai;

use serde_json::Value;

/// Which API a request came by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Messages,
    Responses,
    Embeddings,
    Gemini,
    Converse,
    /// Bedrock's InvokeModel with a Meta Llama body, whose counts only Bedrock reports: in
    /// response headers, or in a stream's last chunk's invocation metrics.
    Invoke,
    OllamaChat,
    OllamaGenerate,
}

impl Api {
    /// The API a path names, and whether the path itself says the response streams.
    pub fn of_path(path: &str) -> Option<(Api, Option<bool>)> {
        let path = path.split('?').next().unwrap_or("");
        let openai = path.strip_prefix("/v1/").or_else(|| path.strip_prefix("/openai/v1/")).or_else(|| {
            path.strip_prefix("/openai/deployments/").and_then(|rest| rest.split_once('/').map(|(_, r)| r))
        });
        match openai {
            Some("chat/completions") => return Some((Api::Chat, None)),
            Some("responses") => return Some((Api::Responses, None)),
            Some("embeddings") => return Some((Api::Embeddings, Some(false))),
            Some("messages") => return Some((Api::Messages, None)),
            _ => {}
        }
        match path {
            "/api/chat" => return Some((Api::OllamaChat, None)),
            "/api/generate" => return Some((Api::OllamaGenerate, None)),
            _ => {}
        }
        if let Some(method) = path.rsplit_once(':').filter(|(m, _)| m.contains("/models/")).map(|(_, m)| m) {
            return match method {
                "generateContent" => Some((Api::Gemini, Some(false))),
                "streamGenerateContent" => Some((Api::Gemini, Some(true))),
                _ => None,
            };
        }
        match path.strip_prefix("/model/").and_then(|rest| rest.rsplit_once('/')).map(|(_, action)| action) {
            Some("converse") => Some((Api::Converse, Some(false))),
            Some("converse-stream") => Some((Api::Converse, Some(true))),
            Some("invoke") => Some((Api::Invoke, Some(false))),
            Some("invoke-with-response-stream") => Some((Api::Invoke, Some(true))),
            _ => None,
        }
    }

    /// The content type of its streams.
    pub fn stream_content_type(self) -> &'static str {
        match self {
            Api::Converse | Api::Invoke => "application/vnd.amazon.eventstream",
            Api::OllamaChat | Api::OllamaGenerate => "application/x-ndjson",
            _ => "text/event-stream",
        }
    }
}

/// What the simulator reads from a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Ask {
    pub api: Api,
    pub model: String,
    pub prompt_tokens: u64,
    /// The output ceiling; 0 for embeddings, which generate nothing.
    pub max_tokens: u64,
    pub stream: bool,
    /// OpenAI chat only: a stream ends with a usage chunk. The other formats always report usage.
    pub include_usage: bool,
}

/// What one API's reader takes from a body.
#[derive(Debug, Default)]
struct Read {
    content_bytes: usize,
    max_tokens: Option<u64>,
    stream: Option<bool>,
}

/// Reads a request of `api` whose path said `path_stream`.
pub fn parse(api: Api, path_stream: Option<bool>, body: &[u8], bytes_per_token: f64) -> Result<Ask, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("body is not JSON: {e}"))?;
    let read = match api {
        Api::Chat | Api::Responses | Api::Embeddings => openai::read(api, &v),
        Api::Messages => anthropic::read(&v),
        Api::Gemini => gemini::read(&v),
        Api::Converse => bedrock::read(&v),
        Api::Invoke => bedrock::read_invoke(&v),
        Api::OllamaChat | Api::OllamaGenerate => ollama::read(&v),
    };
    Ok(Ask {
        api,
        model: v["model"].as_str().unwrap_or("sim").to_string(),
        prompt_tokens: ((read.content_bytes as f64 / bytes_per_token).ceil() as u64).max(1),
        max_tokens: if api == Api::Embeddings { 0 } else { read.max_tokens.unwrap_or(4096) },
        stream: path_stream.or(read.stream).unwrap_or(false),
        include_usage: v["stream_options"]["include_usage"].as_bool().unwrap_or(false),
    })
}

/// The text of a message's `content`: a string, or the `text` of its parts.
fn text_bytes(content: &Value) -> usize {
    match content {
        Value::String(s) => s.len(),
        Value::Array(parts) => parts.iter().map(|p| p["text"].as_str().map_or(0, str::len)).sum(),
        _ => 0,
    }
}

/// The sum of `text_bytes` over the `content` of each message of a list.
fn messages_bytes(messages: &Value) -> usize {
    messages.as_array().map_or(0, |ms| ms.iter().map(|m| text_bytes(&m["content"])).sum())
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
    let content = writer.take(output.min(64));
    match ask.api {
        Api::Chat | Api::Responses | Api::Embeddings => openai::answer(ask, output, &content),
        Api::Messages => anthropic::answer(ask, output, &content),
        Api::Gemini => gemini::answer(ask, output, &content),
        Api::Converse => bedrock::answer(ask, output, &content),
        Api::Invoke => bedrock::answer_invoke(ask, output, &content),
        Api::OllamaChat | Api::OllamaGenerate => ollama::answer(ask, output, &content),
    }
}

/// What a stream sends before its first token.
pub fn opening(ask: &Ask) -> Vec<Vec<u8>> {
    match ask.api {
        Api::Chat | Api::Responses | Api::Embeddings => openai::opening(ask),
        Api::Messages => anthropic::opening(ask),
        Api::Converse => bedrock::opening(),
        Api::Gemini | Api::Invoke | Api::OllamaChat | Api::OllamaGenerate => Vec::new(),
    }
}

/// One step of generated tokens, as `text`.
pub fn step(ask: &Ask, text: &str) -> Vec<u8> {
    match ask.api {
        Api::Chat | Api::Responses | Api::Embeddings => openai::step(ask, text),
        Api::Messages => anthropic::step(text),
        Api::Gemini => gemini::step(ask, text),
        Api::Converse => bedrock::step(text),
        Api::Invoke => bedrock::step_invoke(text),
        Api::OllamaChat | Api::OllamaGenerate => ollama::step(ask, text),
    }
}

/// What a stream that generated all `output` tokens sends last.
pub fn closing(ask: &Ask, output: u64) -> Vec<Vec<u8>> {
    match ask.api {
        Api::Chat | Api::Responses | Api::Embeddings => openai::closing(ask, output),
        Api::Messages => anthropic::closing(ask, output),
        Api::Gemini => gemini::closing(ask, output),
        Api::Converse => bedrock::closing(ask, output),
        Api::Invoke => bedrock::closing_invoke(ask, output),
        Api::OllamaChat | Api::OllamaGenerate => ollama::closing(ask, output),
    }
}

/// Headers an answer carries besides its content type: Bedrock's InvokeModel reports its counts
/// in them.
pub fn answer_headers(ask: &Ask, output: u64) -> Vec<(&'static str, String)> {
    match ask.api {
        Api::Invoke => vec![
            ("x-amzn-bedrock-input-token-count", ask.prompt_tokens.to_string()),
            ("x-amzn-bedrock-output-token-count", output.to_string()),
        ],
        _ => Vec::new(),
    }
}

/// One server-sent event.
fn event(name: Option<&str>, data: &Value) -> Vec<u8> {
    match name {
        Some(name) => format!("event: {name}\ndata: {data}\n\n").into_bytes(),
        None => format!("data: {data}\n\n").into_bytes(),
    }
}

/// Why a generation stopped, in OpenAI's words.
fn stopped(ask: &Ask, output: u64) -> &'static str {
    if output == ask.max_tokens { "length" } else { "stop" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_each_format() {
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"12345678"}],"max_tokens":9,"stream":true,"stream_options":{"include_usage":true}}"#;
        let a = parse(Api::Chat, None, chat, 4.0).unwrap();
        assert_eq!((a.prompt_tokens, a.max_tokens, a.stream, a.include_usage), (2, 9, true, true));
        let messages = br#"{"model":"m","max_tokens":7,"messages":[{"role":"user","content":[{"type":"text","text":"12345678"}]}]}"#;
        let a = parse(Api::Messages, None, messages, 4.0).unwrap();
        assert_eq!((a.prompt_tokens, a.max_tokens, a.stream), (2, 7, false));
        let responses = br#"{"model":"m","input":"123456789012","max_output_tokens":5,"stream":true}"#;
        let a = parse(Api::Responses, None, responses, 4.0).unwrap();
        assert_eq!((a.prompt_tokens, a.max_tokens, a.stream), (3, 5, true));
        assert!(parse(Api::Chat, None, b"nope", 4.0).is_err());
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
