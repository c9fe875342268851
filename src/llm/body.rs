//! The few fields of an OpenAI-compatible (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/responses`) or Anthropic (`/v1/messages`) request body that admission needs: `model`, the
//! output ceiling (`max_completion_tokens`, `max_output_tokens` or `max_tokens`) and `stream`.
//!
//! Envoy may send only the first bytes of a body (`allow_partial_message`). Fields are collected
//! as the parser meets them, so a body cut short still yields everything before the cut. A number
//! that runs into the cut may itself be cut (`"max_tokens": 12` of `1200`), so it is dropped and
//! the model's ceiling is reserved instead: a partial body can only make the hold larger.
//!
//! A field named twice is refused: JSON leaves duplicates to the reader, and a backend that keeps
//! the last `model` or `max_tokens` would generate for a request other than the one admitted.

use std::fmt;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};

/// What admission reads from a body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BodyFields {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub stream: bool,
}

/// Why a body was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BodyError(pub String);

/// Reads the fields from `body`; `partial` says Envoy cut it short, so running out of input is
/// expected rather than an error.
pub fn parse(body: &[u8], partial: bool) -> Result<BodyFields, BodyError> {
    let mut found = Found::default();
    let mut de = serde_json::Deserializer::from_slice(body);
    let result = Collector(&mut found).deserialize(&mut de).and_then(|()| de.end());
    match result {
        Ok(()) => {}
        Err(e) if partial && e.is_eof() => {
            if found.last_was_number {
                found.max_tokens = None;
                found.max_completion_tokens = None;
                found.max_output_tokens = None;
            }
        }
        Err(e) if e.is_data() => return Err(BodyError(e.to_string())),
        Err(e) => return Err(BodyError(format!("request body is not valid JSON: {e}"))),
    }
    Ok(BodyFields {
        model: found.model,
        max_tokens: found.max_completion_tokens.or(found.max_output_tokens).or(found.max_tokens),
        stream: found.stream.unwrap_or(false),
    })
}

#[derive(Debug, Default)]
struct Found {
    model: Option<String>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    max_output_tokens: Option<u64>,
    stream: Option<bool>,
    /// The most recent value read was a token count, and nothing has been read after it.
    last_was_number: bool,
    /// The fields read so far, to refuse one named twice.
    seen: Vec<&'static str>,
}

impl Found {
    fn first<E: de::Error>(&mut self, field: &'static str) -> Result<(), E> {
        if self.seen.contains(&field) {
            return Err(E::custom(format!("the body names {field} more than once")));
        }
        self.seen.push(field);
        Ok(())
    }
}

struct Collector<'a>(&'a mut Found);

impl<'de> DeserializeSeed<'de> for Collector<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Collector<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<String>()? {
            self.0.last_was_number = false;
            match key.as_str() {
                "model" => {
                    self.0.first("model")?;
                    self.0.model = map.next_value()?;
                }
                "stream" => {
                    self.0.first("stream")?;
                    self.0.stream = map.next_value()?;
                }
                "max_tokens" => {
                    self.0.first("max_tokens")?;
                    self.0.max_tokens = map.next_value::<Option<TokenCount>>()?.map(|t| t.0);
                    self.0.last_was_number = true;
                }
                "max_completion_tokens" => {
                    self.0.first("max_completion_tokens")?;
                    self.0.max_completion_tokens = map.next_value::<Option<TokenCount>>()?.map(|t| t.0);
                    self.0.last_was_number = true;
                }
                "max_output_tokens" => {
                    self.0.first("max_output_tokens")?;
                    self.0.max_output_tokens = map.next_value::<Option<TokenCount>>()?.map(|t| t.0);
                    self.0.last_was_number = true;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// A token count: a JSON integer from 1 up. Negative, zero, fractional or string values are
/// refused with a message that says so.
struct TokenCount(u64);

impl<'de> de::Deserialize<'de> for TokenCount {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = TokenCount;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a positive integer")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<TokenCount, E> {
                if n == 0 { Err(E::custom("max_tokens must be at least 1")) } else { Ok(TokenCount(n)) }
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<TokenCount, E> {
                if n <= 0 {
                    Err(E::custom(format!("max_tokens must be at least 1, not {n}")))
                } else {
                    Ok(TokenCount(n.unsigned_abs()))
                }
            }
            fn visit_f64<E: de::Error>(self, n: f64) -> Result<TokenCount, E> {
                Err(E::custom(format!("max_tokens must be an integer, not {n}")))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_openai_and_anthropic_bodies() {
        let chat = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":64,"stream":true}"#;
        assert_eq!(
            parse(chat, false),
            Ok(BodyFields { model: Some("gpt-4o".into()), max_tokens: Some(64), stream: true })
        );
        let messages = br#"{"model":"claude","max_tokens":1024,"messages":[]}"#;
        assert_eq!(parse(messages, false).unwrap().max_tokens, Some(1024));
        let responses = br#"{"model":"gpt-4o","input":"hi","max_output_tokens":77}"#;
        assert_eq!(parse(responses, false).unwrap().max_tokens, Some(77));
        assert_eq!(parse(br#"{"model":"m","max_tokens":null}"#, false).unwrap().max_tokens, None);
    }

    #[test]
    fn a_cut_body_keeps_what_came_before_the_cut() {
        let cut = br#"{"model":"gpt-4o","max_tokens":300,"messages":[{"role":"user","content":"a very lo"#;
        assert_eq!(parse(cut, true).unwrap().max_tokens, Some(300));
        assert_eq!(parse(cut, true).unwrap().model.as_deref(), Some("gpt-4o"));
        assert!(parse(cut, false).is_err(), "a cut body Envoy did not mark partial is malformed");
    }

    #[test]
    fn a_number_at_the_cut_is_not_trusted() {
        let cut = br#"{"model":"gpt-4o","max_tokens":12"#;
        assert_eq!(parse(cut, true).unwrap().max_tokens, None);
    }

    #[test]
    fn bad_token_counts_are_refused() {
        for body in [
            &br#"{"model":"m","max_tokens":-5}"#[..],
            br#"{"model":"m","max_tokens":0}"#,
            br#"{"model":"m","max_tokens":1.5}"#,
            br#"{"model":"m","max_tokens":"10"}"#,
            br#"{"model":"m","max_tokens":1e400}"#,
            br#"[1,2]"#,
            br#"{"model":"m""#,
            br#"{"model":"m","model":"n"}"#,
            br#"{"model":"m","max_tokens":1,"max_tokens":9}"#,
            br#"{"model":"m","stream":false,"stream":true}"#,
        ] {
            assert!(parse(body, false).is_err(), "{}", String::from_utf8_lossy(body));
        }
    }
}
