//! Which API a request came by, from its path alone: the shape of its body (where the model, the
//! output ceiling and `stream` are), what its path itself says (a model, a stream), what it asks
//! for (generation, embeddings, a free token count), and whose error shape a refusal takes.
//!
//! | path | API | model from | streams when |
//! |---|---|---|---|
//! | `/v1/chat/completions`, `/v1/completions`, `/v1/responses` (also under `/openai/v1/`) | OpenAI | body | `"stream": true` |
//! | `/v1/embeddings` (also under `/openai/v1/`) | OpenAI embeddings | body | never |
//! | `/openai/deployments/{deployment}/…` the same four, `?api-version=` | Azure OpenAI | path: the deployment | `"stream": true` |
//! | `/v1/messages` (`/count_tokens`: free) | Anthropic | body | `"stream": true` |
//! | `/{v1,v1beta,v1alpha}/models/{model}:generateContent`, `:streamGenerateContent`, `:countTokens` (free), `:embedContent`, `:batchEmbedContents` | Gemini | path | `streamGenerateContent` |
//! | `/{v1,v1beta1}/projects/{p}/locations/{l}/publishers/google/models/{model}:…` the same | Vertex AI, Gemini | path | `streamGenerateContent` |
//! | `…/publishers/anthropic/models/{model}:rawPredict`, `:streamRawPredict` | Vertex AI, Claude | path | `"stream": true` |
//! | `/model/{id}/converse`, `/converse-stream`, `/invoke`, `/invoke-with-response-stream`, `/count-tokens` (free) | Bedrock | path, percent-decoded | `-stream` |
//! | `/api/chat`, `/api/generate` | Ollama | body | unless `"stream": false` |
//! | `/api/embed`, `/api/embeddings` | Ollama embeddings | body | never |
//!
//! A path is matched with its escapes decoded (but `%2F`), as the backend's router matches it.
//! Under the prefixes only those APIs use (`/api/`, `/model/`, `/openai/deployments/`, `/v1beta`,
//! `/v1alpha/`, `…/projects/…`), a path not in the table is [`Work::Unknown`] and refused: its
//! ceiling and model may be anywhere. Any other path is read as OpenAI's, as before there were
//! others: a body with `model` and `max_tokens` is admitted by them whatever its path.

/// The shape of a request body: which fields carry the output ceiling and `stream`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// `max_completion_tokens`, `max_output_tokens` or `max_tokens`; `stream`.
    OpenAi,
    /// `max_tokens`; `stream`.
    Anthropic,
    /// `generationConfig.maxOutputTokens`.
    Gemini,
    /// `inferenceConfig.maxTokens`.
    Converse,
    /// The model's own body on Bedrock's InvokeModel: Anthropic's `max_tokens`, Nova's
    /// `inferenceConfig.max_new_tokens`, Llama's `max_gen_len`, Titan's
    /// `textGenerationConfig.maxTokenCount`.
    Invoke,
    /// `options.num_predict` (negative: until the context is full); `stream`, true unless false.
    Ollama,
}

/// Whose error shape a refusal takes, so the client's SDK reads it as its provider's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Family {
    /// `{"error": {"message", "type", "code"}}`: OpenAI's, which Anthropic's SDK also reads.
    #[default]
    OpenAi,
    /// The same shape with Anthropic's top-level `"type": "error"`, and its
    /// `anthropic-ratelimit-*` headers beside OpenAI's.
    Anthropic,
    /// `{"error": {"code", "message", "status"}}`.
    Gemini,
    /// `{"message"}` with `x-amzn-errortype`.
    Bedrock,
    /// `{"error": "…"}`.
    Ollama,
}

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// Generated output: held at its ceiling.
    Generate,
    /// Embeddings: the input alone, no output held.
    Embed,
    /// A token count: passes free, with no hold.
    CountTokens,
    /// A path under one of the APIs' prefixes that tollgate does not read: refused.
    Unknown,
}

/// A request's API, as its path says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub body: Body,
    pub family: Family,
    pub work: Work,
    /// The model (or deployment) the path names, percent-decoded.
    pub model: Option<String>,
    /// Whether the path alone says the response streams (`None`: the body says).
    pub stream: Option<bool>,
}

impl Endpoint {
    const fn new(body: Body, family: Family, work: Work) -> Self {
        Endpoint { body, family, work, model: None, stream: None }
    }

    fn model(mut self, model: &str) -> Self {
        self.model = Some(percent_decoded(model));
        self
    }

    fn stream(mut self, stream: bool) -> Self {
        self.stream = Some(stream);
        self
    }
}

/// The endpoint of a request to `path` (query string and all).
pub fn endpoint(path: &str) -> Endpoint {
    use {Body as B, Family as F, Work as W};
    // Decoded as the backend's router decodes it (`/api/c%68at` is Ollama's `/api/chat`), but for
    // `%2F`, which stays inside its segment (a Bedrock ARN's slashes).
    let decoded = path_decoded(path.split(['?', '#']).next().unwrap_or(""));
    let path = &*decoded;
    let openai = |rest: &str| match rest {
        "embeddings" => Some(Endpoint::new(B::OpenAi, F::OpenAi, W::Embed).stream(false)),
        "chat/completions" | "completions" | "responses" => Some(Endpoint::new(B::OpenAi, F::OpenAi, W::Generate)),
        _ => None,
    };
    if let Some(rest) = path.strip_prefix("/openai/deployments/")
        && let Some((deployment, rest)) = rest.split_once('/')
        && let Some(e) = openai(rest)
    {
        return e.model(deployment);
    }
    if let Some(e) = path.strip_prefix("/openai/v1/").or_else(|| path.strip_prefix("/v1/")).and_then(openai) {
        return e;
    }
    match path {
        "/v1/messages" => return Endpoint::new(B::Anthropic, F::Anthropic, W::Generate),
        "/v1/messages/count_tokens" => return Endpoint::new(B::Anthropic, F::Anthropic, W::CountTokens),
        "/api/chat" | "/api/generate" => return Endpoint::new(B::Ollama, F::Ollama, W::Generate),
        "/api/embed" | "/api/embeddings" => return Endpoint::new(B::Ollama, F::Ollama, W::Embed).stream(false),
        _ => {}
    }
    if let Some(rest) = path.strip_prefix("/model/")
        && let Some((id, action)) = rest.rsplit_once('/')
    {
        let bedrock = |body, work| Endpoint::new(body, F::Bedrock, work).model(id);
        match action {
            "converse" => return bedrock(B::Converse, W::Generate).stream(false),
            "converse-stream" => return bedrock(B::Converse, W::Generate).stream(true),
            "invoke" => return bedrock(B::Invoke, W::Generate).stream(false),
            "invoke-with-response-stream" => return bedrock(B::Invoke, W::Generate).stream(true),
            "count-tokens" => return bedrock(B::Invoke, W::CountTokens).stream(false),
            _ => {}
        }
    }
    if let Some(e) = google(path) {
        return e;
    }
    // Under a prefix that only those APIs use, a path not in the table is one tollgate cannot
    // read: refused, never read as OpenAI's (its ceiling and model may be elsewhere).
    let family = if path.starts_with("/api/") {
        Some(F::Ollama)
    } else if path.starts_with("/model/") {
        Some(F::Bedrock)
    } else if path.starts_with("/openai/deployments/") {
        Some(F::OpenAi)
    } else if path.starts_with("/v1beta") || path.starts_with("/v1alpha/") || path.contains("/projects/") {
        Some(F::Gemini)
    } else {
        None
    };
    match family {
        Some(family) => Endpoint::new(B::OpenAi, family, W::Unknown),
        None => Endpoint::new(B::OpenAi, F::OpenAi, W::Generate),
    }
}

/// `path` with its `%XX` escapes decoded, but for `%2F` (and a malformed escape), kept as sent;
/// borrowed, with no allocation, when it has none (nearly every request).
fn path_decoded(path: &str) -> std::borrow::Cow<'_, str> {
    if !path.contains('%') {
        return std::borrow::Cow::Borrowed(path);
    }
    let mut out = String::with_capacity(path.len());
    let mut rest = path;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let escape = &rest[at..];
        let byte = escape.get(1..3).and_then(|h| u8::from_str_radix(h, 16).ok());
        match byte {
            Some(b) if b.is_ascii() && b != b'/' && b != 0 => {
                out.push(char::from(b));
                rest = &escape[3..];
            }
            _ => {
                out.push('%');
                rest = &escape[1..];
            }
        }
    }
    out.push_str(rest);
    std::borrow::Cow::Owned(out)
}

/// Gemini's API and Vertex AI's publishers: `…/models/{model}:{method}`.
fn google(path: &str) -> Option<Endpoint> {
    use {Body as B, Family as F, Work as W};
    let (resource, method) = path.rsplit_once(':')?;
    let (parent, model) = resource.rsplit_once("/models/")?;
    let gemini_api = matches!(parent, "/v1" | "/v1beta" | "/v1alpha");
    let vertex = (parent.starts_with("/v1/projects/") || parent.starts_with("/v1beta1/projects/"))
        && parent.contains("/locations/");
    if model.is_empty() || model.contains('/') {
        return None;
    }
    let gemini = |work| Endpoint::new(B::Gemini, F::Gemini, work).model(model);
    let e = match method {
        _ if !(gemini_api || vertex && parent.ends_with("/publishers/google")) => {
            let anthropic = |stream| Endpoint::new(B::Anthropic, F::Anthropic, W::Generate).model(model).stream(stream);
            return match method {
                "rawPredict" if vertex && parent.ends_with("/publishers/anthropic") => Some(anthropic(false)),
                "streamRawPredict" if vertex && parent.ends_with("/publishers/anthropic") => Some(anthropic(true)),
                _ => None,
            };
        }
        "generateContent" => gemini(W::Generate).stream(false),
        "streamGenerateContent" => gemini(W::Generate).stream(true),
        "countTokens" => gemini(W::CountTokens).stream(false),
        "embedContent" | "batchEmbedContents" => gemini(W::Embed).stream(false),
        _ => return None,
    };
    Some(e)
}

/// `%XX` escapes decoded (Bedrock's `amazon.nova-lite-v1%3A0`); a malformed escape is kept as it is.
fn percent_decoded(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| char::from(c).to_digit(16).and_then(|d| u8::try_from(d).ok());
        match (b[i], b.get(i + 1).copied().and_then(hex), b.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(hi), Some(lo)) => {
                out.push(hi << 4 | lo);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a path is read as: its body, family, work, model and stream.
    type Read = (Body, Family, Work, Option<&'static str>, Option<bool>);

    fn read(path: &str) -> Read {
        let e = endpoint(path);
        (e.body, e.family, e.work, e.model.map(|m| &*m.leak()), e.stream)
    }

    #[test]
    fn each_row_of_the_table() {
        use {Body as B, Family as F, Work as W};
        let rows: &[(&str, Read)] = &[
            ("/v1/chat/completions", (B::OpenAi, F::OpenAi, W::Generate, None, None)),
            ("/openai/v1/responses", (B::OpenAi, F::OpenAi, W::Generate, None, None)),
            ("/v1/embeddings", (B::OpenAi, F::OpenAi, W::Embed, None, Some(false))),
            (
                "/openai/deployments/my-gpt4o/chat/completions?api-version=2024-10-21",
                (B::OpenAi, F::OpenAi, W::Generate, Some("my-gpt4o"), None),
            ),
            (
                "/openai/deployments/emb/embeddings?api-version=2024-10-21",
                (B::OpenAi, F::OpenAi, W::Embed, Some("emb"), Some(false)),
            ),
            ("/v1/messages", (B::Anthropic, F::Anthropic, W::Generate, None, None)),
            ("/v1/messages/count_tokens", (B::Anthropic, F::Anthropic, W::CountTokens, None, None)),
            (
                "/v1/models/gemini-2.0-flash:generateContent",
                (B::Gemini, F::Gemini, W::Generate, Some("gemini-2.0-flash"), Some(false)),
            ),
            (
                "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse",
                (B::Gemini, F::Gemini, W::Generate, Some("gemini-2.0-flash"), Some(true)),
            ),
            (
                "/v1beta/models/gemini-2.0-flash:countTokens",
                (B::Gemini, F::Gemini, W::CountTokens, Some("gemini-2.0-flash"), Some(false)),
            ),
            (
                "/v1beta/models/text-embedding-004:embedContent",
                (B::Gemini, F::Gemini, W::Embed, Some("text-embedding-004"), Some(false)),
            ),
            (
                "/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.0-flash:streamGenerateContent",
                (B::Gemini, F::Gemini, W::Generate, Some("gemini-2.0-flash"), Some(true)),
            ),
            (
                "/v1/projects/p/locations/us-east5/publishers/anthropic/models/claude-sonnet-4@20250514:streamRawPredict",
                (B::Anthropic, F::Anthropic, W::Generate, Some("claude-sonnet-4@20250514"), Some(true)),
            ),
            (
                "/model/amazon.nova-lite-v1%3A0/converse",
                (B::Converse, F::Bedrock, W::Generate, Some("amazon.nova-lite-v1:0"), Some(false)),
            ),
            (
                "/model/anthropic.claude-3-haiku-20240307-v1%3A0/invoke-with-response-stream",
                (B::Invoke, F::Bedrock, W::Generate, Some("anthropic.claude-3-haiku-20240307-v1:0"), Some(true)),
            ),
            ("/model/m/converse-stream", (B::Converse, F::Bedrock, W::Generate, Some("m"), Some(true))),
            ("/api/chat", (B::Ollama, F::Ollama, W::Generate, None, None)),
            ("/api/embed", (B::Ollama, F::Ollama, W::Embed, None, Some(false))),
            // Anything else is read as OpenAI's.
            ("/custom/generate", (B::OpenAi, F::OpenAi, W::Generate, None, None)),
            ("/v1/models/a/b:generateContent", (B::OpenAi, F::OpenAi, W::Generate, None, None)),
            // Escapes are decoded as the backend's router decodes them.
            ("/api/c%68at", (B::Ollama, F::Ollama, W::Generate, None, None)),
            (
                "/model/anthropic.claude-opus-4/convers%65",
                (B::Converse, F::Bedrock, W::Generate, Some("anthropic.claude-opus-4"), Some(false)),
            ),
            (
                "/v1beta/models/gemini-2.5-pro%3AgenerateContent",
                (B::Gemini, F::Gemini, W::Generate, Some("gemini-2.5-pro"), Some(false)),
            ),
            (
                "/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A1%3Ainference-profile%2Fus.nova/converse",
                (
                    B::Converse,
                    F::Bedrock,
                    W::Generate,
                    Some("arn:aws:bedrock:us-east-1:1:inference-profile/us.nova"),
                    Some(false),
                ),
            ),
            // Under those APIs' prefixes, a path tollgate does not read is refused, never read as
            // OpenAI's.
            ("/api/pull", (B::OpenAi, F::Ollama, W::Unknown, None, None)),
            ("/model/m/somethingElse", (B::OpenAi, F::Bedrock, W::Unknown, None, None)),
            ("/openai/deployments/d/extensions/chat/completions", (B::OpenAi, F::OpenAi, W::Unknown, None, None)),
            ("/v1beta/tunedModels/t:generateContent", (B::OpenAi, F::Gemini, W::Unknown, None, None)),
            ("/v1/projects/p/locations/l/endpoints/e:generateContent", (B::OpenAi, F::Gemini, W::Unknown, None, None)),
            (
                "/v1/projects/p/publishers/google/models/g:generateContent",
                (B::OpenAi, F::Gemini, W::Unknown, None, None),
            ),
        ];
        for (path, want) in rows {
            assert_eq!(&read(path), want, "{path}");
        }
    }

    #[test]
    fn percent_escapes_are_decoded_and_malformed_ones_kept() {
        assert_eq!(percent_decoded("a%3Ab%2fc"), "a:b/c");
        assert_eq!(percent_decoded("100%"), "100%");
        assert_eq!(percent_decoded("%zz%4"), "%zz%4");
    }
}
