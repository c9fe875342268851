//! What a response says it used, read as it streams past, or, where it says nothing, a meter of
//! what was generated. Where each provider puts its counts and its output: [`fields`].
//!
//! Framings read:
//!
//! - JSON (`application/json`, `+json`): one body (or, as Gemini streams without `alt=sse`, an
//!   array of its chunks), read whole at its end, for its counts alone (`skim`).
//! - Server-sent events (`text/event-stream`): every `data:` payload is an event (OpenAI,
//!   Anthropic, the Responses API, Gemini with `alt=sse`).
//! - Newline-delimited JSON (`application/x-ndjson`): every line is an event (Ollama's streams).
//! - Amazon's event stream (`application/vnd.amazon.eventstream`): every message is an event, its
//!   model's own inside a `chunk` (Bedrock's ConverseStream and InvokeModelWithResponseStream;
//!   see [`aws`]).
//! - Counts in response headers (Bedrock's InvokeModel: `x-amzn-bedrock-input-token-count` and
//!   `-output-token-count`), given with [`Meter::reported`].
//!
//! Counts are cumulative where a stream repeats them, so the largest seen is the count. A stream's
//! counts are exact only once its final usage has arrived (an event [`fields::is_final`] names);
//! a stream cut before that (the client left) is metered from all the output that passed, or from
//! the partial count if that is larger: Anthropic's `message_start` placeholder output of 1 never
//! stands for a hundred deltas that passed after it.
//!
//! A compressed body (any `content-encoding` but `identity`) is never parsed, nor is a content type
//! tollgate does not read, nor an event stream whose framing breaks: their usage is unknown, and
//! the hold is charged as it was made (as an expired hold is under `charge_reserved`), never a
//! count mis-read from bytes it cannot read. A JSON body past [`MAX_JSON_BODY`] is not buffered
//! further and is metered from its size.

pub mod aws;
pub mod fields;
mod skim;

use fields::len;

/// The largest JSON response body buffered to read its usage.
pub const MAX_JSON_BODY: usize = 8 << 20;

/// The longest event (a line, or an event-stream message) kept while it is incomplete.
const MAX_EVENT: usize = 1 << 20;

/// What a response used, as far as it says: exact counts it reported, or the output metered from
/// the text that passed (bytes per token) with the prompt that was held at admission.
pub use crate::hold::Counted as Measured;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Json,
    /// Server-sent events: a `data:` line is an event.
    Events,
    /// Newline-delimited JSON: a line is an event.
    Lines,
    /// Amazon's event stream: a message is an event.
    AwsEvents,
    /// Compressed, or a content type tollgate does not read: only its size is known.
    Opaque,
}

/// Reads one response body as it streams.
#[derive(Debug)]
pub struct Meter {
    format: Format,
    bytes_per_token: f64,
    /// JSON: the body so far. Events and lines: the current, incomplete line. AWS: the current,
    /// incomplete message.
    pending: Vec<u8>,
    overflowed: bool,
    prompt: Option<u64>,
    output: Option<u64>,
    /// A stream's final usage has arrived: its counts are the response's last word.
    final_usage: bool,
    /// The request generates nothing (embeddings): without its counts, no output is charged.
    input_only: bool,
    /// Cache reads and writes and reasoning, as far as the response said.
    detail: fields::Detail,
    /// Bytes of generated text seen (events), or of the whole body (opaque, JSON).
    text_bytes: u64,
    /// The most output the request itself allowed (its `max_tokens`): a count metered from bytes
    /// never goes past it.
    ceiling: Option<u64>,
    /// The last metered count was held to the ceiling.
    capped: bool,
}

impl Meter {
    /// A meter for a response with these headers. `bytes_per_token` is the model's, for metering.
    pub fn new(content_type: Option<&str>, content_encoding: Option<&str>, bytes_per_token: f64) -> Self {
        let compressed = content_encoding.is_some_and(|e| !e.trim().eq_ignore_ascii_case("identity"));
        let kind = content_type.map(|c| c.split(';').next().unwrap_or("").trim().to_ascii_lowercase());
        let format = match kind.as_deref() {
            _ if compressed => Format::Opaque,
            Some("text/event-stream") => Format::Events,
            Some("application/x-ndjson" | "application/ndjson" | "application/jsonl") => Format::Lines,
            Some("application/vnd.amazon.eventstream") => Format::AwsEvents,
            Some(k) if k == "application/json" || k.ends_with("+json") => Format::Json,
            _ => Format::Opaque,
        };
        Meter {
            format,
            bytes_per_token,
            pending: Vec::new(),
            overflowed: false,
            prompt: None,
            output: None,
            final_usage: false,
            input_only: false,
            detail: fields::Detail::default(),
            text_bytes: 0,
            ceiling: None,
            capped: false,
        }
    }

    /// The request generates nothing (an embedding): a response whose counts cannot be read
    /// charges the prompt held and no output, however large its body (a batch of vectors).
    pub fn input_only(&mut self) {
        self.input_only = true;
    }

    /// Counts the response reported in its headers (Bedrock's InvokeModel): its last word, whatever
    /// the body says.
    pub fn reported(&mut self, prompt: u64, output: u64) {
        self.prompt = Some(prompt);
        self.output = Some(output);
        self.final_usage = true;
    }

    /// Reads the next piece of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        match self.format {
            Format::Json => {
                // Its size, for a body too large to read: metered from that.
                self.text_bytes = self.text_bytes.saturating_add(len(chunk));
                if self.pending.len().saturating_add(chunk.len()) > MAX_JSON_BODY {
                    self.overflowed = true;
                    self.pending = Vec::new();
                } else if !self.overflowed {
                    self.pending.extend_from_slice(chunk);
                }
            }
            Format::Events | Format::Lines => {
                for &b in chunk {
                    // A line ends at LF, CR or CRLF (the CRLF's LF then ends an empty line).
                    if b == b'\n' || b == b'\r' {
                        let line = std::mem::take(&mut self.pending);
                        self.line(&line);
                    } else if self.pending.len() < MAX_EVENT {
                        self.pending.push(b);
                    }
                }
            }
            Format::AwsEvents => {
                self.pending.extend_from_slice(chunk);
                self.aws_messages();
            }
            Format::Opaque => self.text_bytes = self.text_bytes.saturating_add(len(chunk)),
        }
    }

    /// Whether generated output has passed yet: only a stream says so as it goes. (A JSON body
    /// arrives whole, and a failed response's body is an error message, not output.)
    pub fn saw_output(&self) -> bool {
        self.streams() && (self.text_bytes > 0 || self.output.is_some_and(|o| o > 0))
    }

    /// Whether the body is a stream of events (its output arrives as it is generated).
    pub fn streams(&self) -> bool {
        matches!(self.format, Format::Events | Format::Lines | Format::AwsEvents)
    }

    /// Holds a metered count to `ceiling`, the most output the request allowed: bytes over
    /// `bytes_per_token` only estimate the tokens, and the backend stops at the request's limit.
    /// (Counts the backend reports stand as reported, past it or not.)
    pub fn cap_output(&mut self, ceiling: u64) {
        self.ceiling = Some(ceiling);
    }

    /// Whether the last metered count was held to the request's ceiling.
    pub fn capped(&self) -> bool {
        self.capped
    }

    /// Output tokens a stream has generated so far: its running count, or its text metered.
    pub fn output_so_far(&self) -> u64 {
        if !self.streams() {
            return 0;
        }
        tokens_of(self.text_bytes, self.bytes_per_token).max(self.output.unwrap_or(0))
    }

    /// What the whole body used, at its end (or at a disconnect: what passed until then).
    pub fn measured(&mut self) -> Measured {
        self.capped = false;
        match self.format {
            Format::Json if !self.overflowed => {
                let body = std::mem::take(&mut self.pending);
                match skim::counts_only(&body) {
                    // Gemini's stream as one JSON array of its chunks.
                    Ok(serde_json::Value::Array(chunks)) => chunks.iter().for_each(|c| self.take_counts(c)),
                    Ok(v) => self.take_counts(&v),
                    Err(_) => {}
                }
                self.text_bytes = len(&body);
            }
            Format::Events | Format::Lines if !self.pending.is_empty() => {
                let line = std::mem::take(&mut self.pending);
                self.line(&line);
            }
            _ => {}
        }
        let complete = !self.streams() || self.final_usage;
        match (self.prompt, self.output) {
            (Some(prompt), Some(output)) if complete => Measured::Exact { prompt, output, detail: self.detail },
            _ if self.input_only => Measured::Metered { output: 0 },
            _ if self.format == Format::Opaque => Measured::AsHeld,
            (_, partial) => {
                // Only the estimate from bytes is held to the ceiling: a count the backend gave
                // (a running count, or its output without a prompt count) stands.
                let estimate = tokens_of(self.text_bytes, self.bytes_per_token);
                let held = self.ceiling.map_or(estimate, |c| estimate.min(c));
                let output = held.max(partial.unwrap_or(0));
                // (Capped: the ceiling, not a count the backend gave, decided the charge.)
                self.capped = held < estimate && output == held;
                Measured::Metered { output }
            }
        }
    }

    /// One line of a stream: a server-sent event's `data:`, or a JSON line.
    fn line(&mut self, line: &[u8]) {
        let data = match self.format {
            Format::Events => match line.strip_prefix(b"data:") {
                Some(data) => data.trim_ascii(),
                None => return,
            },
            _ => line.trim_ascii(),
        };
        // OpenAI's end of stream says nothing of its own: a usage chunk before it closed the usage,
        // or none did, and a running count beside choices is not the last word.
        if data.is_empty() || data == b"[DONE]" {
            return;
        }
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
            self.event(&v);
        }
    }

    /// Every whole message of an event stream received so far.
    fn aws_messages(&mut self) {
        let mut at = 0;
        loop {
            match aws::next(&self.pending[at..], MAX_EVENT) {
                aws::Frame::Incomplete => break,
                aws::Frame::Broken => {
                    // Not an event stream after all: unreadable from here on.
                    self.format = Format::Opaque;
                    self.pending = Vec::new();
                    return;
                }
                aws::Frame::Message { len, event } => {
                    at += len;
                    if let Some(v) = event {
                        self.event(&v);
                    }
                }
            }
        }
        self.pending.drain(..at);
    }

    /// One streamed event: its counts, whether it closes the stream, the output it carries.
    fn event(&mut self, v: &serde_json::Value) {
        if fields::is_final(v) {
            // The last word: what it says replaces what came before (Anthropic's placeholder
            // output of 1 is not kept over a final 0).
            let r = fields::reported(v);
            self.prompt = r.prompt.or(self.prompt);
            self.output = r.output.or(self.output);
            self.detail = self.detail.merge(r.detail);
            self.final_usage = true;
        } else {
            self.take_counts(v);
        }
        self.text_bytes = self.text_bytes.saturating_add(fields::generated_bytes(v));
    }

    /// Keeps the largest counts seen.
    fn take_counts(&mut self, v: &serde_json::Value) {
        let r = fields::reported(v);
        self.detail = self.detail.merge(r.detail);
        if let Some(p) = r.prompt {
            self.prompt = Some(self.prompt.map_or(p, |q| q.max(p)));
        }
        if let Some(o) = r.output {
            self.output = Some(self.output.map_or(o, |q| q.max(o)));
        }
    }
}

/// `ceil(bytes / bytes_per_token)`; a response body is far below 2^53 bytes.
#[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn tokens_of(bytes: u64, bytes_per_token: f64) -> u64 {
    (bytes as f64 / bytes_per_token).ceil() as u64
}

#[cfg(test)]
mod tests;
