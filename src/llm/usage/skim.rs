//! A JSON body read for its counts alone: what [`reported`](super::fields::reported) reads of it
//! is kept, and the rest (the output text, the choices, an embedding's vectors) is skipped, never
//! copied into a `Value`. A completion's body is mostly its text; its usage is a few numbers.
//!
//! What it skips it reads as JSON's shape only: a lone surrogate, bytes that are not UTF-8 or a
//! number past `f64` in the text (a server that cut its output mid-character writes the first)
//! do not cost the counts the body reports, where a whole-body parse refused such a body and the
//! response was metered.

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::fields::COUNTED;

/// A JSON body as [`reported`](super::fields::reported) reads it: its top-level [`COUNTED`]
/// fields and nothing else (of `message` and `response`, their `usage`; of `embeddings`, whether it
/// is an array); a top-level array (Gemini's chunks) so, chunk by chunk. An error where the body's
/// shape is not JSON's.
pub(super) fn counts_only(body: &[u8]) -> serde_json::Result<Value> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let v = Skim::Counted.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// What of one value is kept.
#[derive(Clone, Copy)]
enum Skim {
    /// A body's (or a chunk's) counted fields.
    Counted,
    /// An object's `usage` (Anthropic's `message`, the Responses API's `response`).
    Usage,
    /// Whether it is an array (an empty one stands for it).
    IsArray,
}

impl<'de> DeserializeSeed<'de> for Skim {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Skim {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("JSON")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let names: &[&'static str] = match self {
            Skim::Counted => &COUNTED,
            Skim::Usage => &["usage"],
            Skim::IsArray => &[],
        };
        let mut kept = serde_json::Map::new();
        // (A later duplicate replaces an earlier one, as in a whole `Value`.)
        while let Some(field) = map.next_key_seed(OneOf(names))? {
            let Some(name) = field else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            let value = match name {
                "embeddings" => map.next_value_seed(Skim::IsArray)?,
                "message" | "response" => map.next_value_seed(Skim::Usage)?,
                _ => map.next_value()?,
            };
            kept.insert(name.to_string(), value);
        }
        Ok(match self {
            Skim::Counted | Skim::Usage => Value::Object(kept),
            Skim::IsArray => Value::Null,
        })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        if matches!(self, Skim::Counted) {
            let mut chunks = Vec::new();
            while let Some(chunk) = seq.next_element_seed(Skim::Counted)? {
                chunks.push(chunk);
            }
            return Ok(Value::Array(chunks));
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(match self {
            Skim::IsArray => Value::Array(Vec::new()),
            Skim::Counted | Skim::Usage => Value::Null,
        })
    }

    // A scalar reports nothing.
    fn visit_bool<E>(self, _: bool) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_str<E>(self, _: &str) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
}

/// A field's name, as the one of these it is, if it is one.
struct OneOf(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for OneOf {
    type Value = Option<&'static str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for OneOf {
    type Value = Option<&'static str>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E>(self, name: &str) -> Result<Self::Value, E> {
        Ok(self.0.iter().copied().find(|n| *n == name))
    }
}
