//! A JSON body read for its counts alone: what [`reported`](super::fields::reported) reads of it
//! is kept, and the rest (the output text, the choices, an embedding's vectors) is checked as JSON
//! and skipped, never copied into a `Value`. A completion's body is mostly its text; its usage is
//! a few numbers.

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::fields::COUNTED;

/// A JSON body as [`reported`](super::fields::reported) reads it: its top-level [`COUNTED`]
/// fields and nothing else; a top-level array (Gemini's chunks) so, chunk by chunk. `reported` of
/// it is `reported` of the whole body; an error where the whole body is not JSON.
pub fn counts_only(body: &[u8]) -> serde_json::Result<Value> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let v = CountsOnly.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// [`counts_only`]'s reader, of one value.
struct CountsOnly;

impl<'de> DeserializeSeed<'de> for CountsOnly {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for CountsOnly {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("JSON")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut kept = serde_json::Map::new();
        while let Some(field) = map.next_key_seed(Counted)? {
            match field {
                // (A later duplicate replaces an earlier one, as in a whole `Value`.)
                Some("embeddings") => {
                    let array = map.next_value_seed(IsArray)?;
                    kept.insert("embeddings".to_string(), if array { Value::Array(Vec::new()) } else { Value::Null });
                }
                Some(name) => {
                    kept.insert(name.to_string(), map.next_value()?);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Value::Object(kept))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut chunks = Vec::new();
        while let Some(chunk) = seq.next_element_seed(CountsOnly)? {
            chunks.push(chunk);
        }
        Ok(Value::Array(chunks))
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

/// A field's name, as the [`COUNTED`] one it is, if it is one.
struct Counted;

impl<'de> DeserializeSeed<'de> for Counted {
    type Value = Option<&'static str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Counted {
    type Value = Option<&'static str>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E>(self, name: &str) -> Result<Self::Value, E> {
        Ok(COUNTED.into_iter().find(|c| *c == name))
    }
}

/// Whether a value is an array, its elements skipped.
struct IsArray;

impl<'de> DeserializeSeed<'de> for IsArray {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for IsArray {
    type Value = bool;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("JSON")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(true)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(false)
    }

    fn visit_bool<E>(self, _: bool) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_i64<E>(self, _: i64) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_u64<E>(self, _: u64) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_f64<E>(self, _: f64) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_str<E>(self, _: &str) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_unit<E>(self) -> Result<bool, E> {
        Ok(false)
    }
}
