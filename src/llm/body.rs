//! The few fields of a request body that admission needs: `model`, the output ceiling and
//! `stream`, wherever the body's API puts them ([`Body`]: OpenAI's `max_completion_tokens`,
//! `max_output_tokens` or `max_tokens`; Anthropic's `max_tokens`; Gemini's
//! `generationConfig.maxOutputTokens`; Bedrock's `inferenceConfig.maxTokens` or the model's own;
//! Ollama's `options.num_predict`). Only the fields of the body's own API are read: a Gemini
//! backend ignores a `max_tokens`, so a hold must too.
//!
//! Envoy may send only the first bytes of a body (`allow_partial_message`). Fields are collected
//! as the parser meets them, so a body cut short still yields its model and `stream` from before
//! the cut. Never its output ceiling: the rest of the body, which tollgate never sees, could name
//! a second one (`"max_tokens": 10, …, "max_tokens": 4000`) that a backend keeping the last would
//! obey, so a cut body is held at the model's ceiling. The shipped Envoy sends bodies up to 1 MiB
//! whole, so only a prompt longer than that pays for it (docs/envoy.md, "What Envoy sends").
//!
//! A field named twice is refused: JSON leaves duplicates to the reader, and a backend that keeps
//! the last `model` or `max_tokens` would generate for a request other than the one admitted.

use std::fmt;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};

pub use super::api::Body;

/// What admission reads from a body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BodyFields {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    /// `None`: the body does not say (its API streams by its path, or by default).
    pub stream: Option<bool>,
    /// How many outputs one request generates, each up to the ceiling: OpenAI's `n` (or vLLM's
    /// `best_of`, if larger), Gemini's `candidateCount`; 1 when the body names none.
    pub outputs: u64,
}

/// Why a body was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BodyError(pub String);

/// Where a body puts its output ceiling: the field, inside an object or at the top (`""`), with
/// every spelling its API accepts. Of several present, the largest is the ceiling.
struct Ceiling {
    within: &'static [&'static str],
    names: &'static [&'static str],
    /// How the API reads it: zero and below mean "no limit" (Ollama's `-1`), not an error.
    unlimited_below_one: bool,
}

const fn at(within: &'static [&'static str], names: &'static [&'static str]) -> Ceiling {
    Ceiling { within, names, unlimited_below_one: false }
}

const TOP: &[&str] = &[""];

/// Each API's ceilings.
fn ceilings(body: Body) -> &'static [Ceiling] {
    const OPENAI: &[Ceiling] =
        &[at(TOP, &["max_completion_tokens"]), at(TOP, &["max_output_tokens"]), at(TOP, &["max_tokens"])];
    const ANTHROPIC: &[Ceiling] = &[at(TOP, &["max_tokens"])];
    const GEMINI: &[Ceiling] =
        &[at(&["generationConfig", "generation_config"], &["maxOutputTokens", "max_output_tokens"])];
    const CONVERSE: &[Ceiling] = &[at(&["inferenceConfig"], &["maxTokens"])];
    // Anthropic and Mistral, Nova, Llama, Titan.
    const INVOKE: &[Ceiling] = &[
        at(TOP, &["max_tokens"]),
        at(&["inferenceConfig"], &["max_new_tokens"]),
        at(TOP, &["max_gen_len"]),
        at(&["textGenerationConfig"], &["maxTokenCount"]),
    ];
    const OLLAMA: &[Ceiling] = &[Ceiling { within: &["options"], names: &["num_predict"], unlimited_below_one: true }];
    match body {
        Body::OpenAi => OPENAI,
        Body::Anthropic => ANTHROPIC,
        Body::Gemini => GEMINI,
        Body::Converse => CONVERSE,
        Body::Invoke => INVOKE,
        Body::Ollama => OLLAMA,
    }
}

/// Where each API puts how many outputs a request generates (each up to the ceiling).
fn multipliers(body: Body) -> &'static [Ceiling] {
    const OPENAI: &[Ceiling] = &[at(TOP, &["n"]), at(TOP, &["best_of"])];
    const GEMINI: &[Ceiling] =
        &[at(&["generationConfig", "generation_config"], &["candidateCount", "candidate_count"])];
    match body {
        Body::OpenAi => OPENAI,
        Body::Gemini => GEMINI,
        Body::Anthropic | Body::Converse | Body::Invoke | Body::Ollama => &[],
    }
}

/// Whether the API reads `model` and `stream` from the body (Gemini and Bedrock take both from
/// the path, and ignore them in a body).
fn names_model_and_stream(body: Body) -> bool {
    matches!(body, Body::OpenAi | Body::Anthropic | Body::Ollama)
}

/// Reads the fields of a `body`-shaped request from `bytes`; `partial` says Envoy cut it short,
/// so running out of input is expected rather than an error.
pub fn parse(body: Body, bytes: &[u8], partial: bool) -> Result<BodyFields, BodyError> {
    let mut found = Found::new(body);
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let result = Collector { found: &mut found, within: "" }.deserialize(&mut de).and_then(|()| de.end());
    match result {
        Ok(()) => {}
        Err(e) if partial && e.is_eof() => {}
        Err(e) if e.is_data() => return Err(BodyError(e.to_string())),
        Err(e) => return Err(BodyError(format!("request body is not valid JSON: {e}"))),
    }
    Ok(BodyFields {
        model: found.model,
        // The largest spelling present: a backend may read only one of them (vLLM's chat reads
        // max_completion_tokens or max_tokens, its Responses max_output_tokens), and holding the
        // smaller would hold less than it may generate.
        max_tokens: found.ceilings.iter().flatten().max().copied().filter(|_| !partial),
        stream: found.stream,
        outputs: found.outputs.iter().flatten().max().copied().unwrap_or(1).saturating_mul(found.prompts),
    })
}

#[derive(Debug)]
struct Found {
    body: Body,
    model: Option<String>,
    stream: Option<bool>,
    /// By position in [`ceilings`].
    ceilings: Vec<Option<u64>>,
    /// By position in [`multipliers`].
    outputs: Vec<Option<u64>>,
    /// How many prompts a completions request names (a list is a completion for each).
    prompts: u64,
    /// The fields read so far (by their first spelling), to refuse one named twice.
    seen: Vec<(&'static str, &'static str)>,
}

impl Found {
    /// Nothing found yet in a `body`-shaped request: a slot for each of its tables' fields.
    fn new(body: Body) -> Self {
        Found {
            body,
            model: None,
            stream: None,
            ceilings: vec![None; ceilings(body).len()],
            outputs: vec![None; multipliers(body).len()],
            prompts: 1,
            seen: Vec::new(),
        }
    }

    fn first<E: de::Error>(&mut self, field: (&'static str, &'static str)) -> Result<(), E> {
        if self.seen.contains(&field) {
            let name = if field.0.is_empty() { field.1.to_string() } else { format!("{}.{}", field.0, field.1) };
            return Err(E::custom(format!("the body names {name} more than once")));
        }
        self.seen.push(field);
        Ok(())
    }
}

/// Collects the fields of one object: the body (`within` is `""`) or an object inside it.
struct Collector<'a> {
    found: &'a mut Found,
    within: &'static str,
}

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
        let shape = ceilings(self.found.body);
        let top = self.within.is_empty();
        while let Some(key) = map.next_key::<String>()? {
            // Ollama is written in Go, whose JSON decoder matches a struct's fields without regard
            // to case ("Options" is its options); `options` itself is a map, read key for key.
            let key = if top && self.found.body == Body::Ollama { go_fold(key) } else { key };
            let key = key.as_str();
            if top && self.found.body == Body::OpenAi && key == "prompt" {
                // The completions API: a list of prompts is a completion (or n) for each.
                self.found.first(("", "prompt"))?;
                map.next_value_seed(PromptCount(&mut self.found.prompts))?;
                continue;
            }
            if top && names_model_and_stream(self.found.body) && (key == "model" || key == "stream") {
                if key == "model" {
                    self.found.first(("", "model"))?;
                    self.found.model = map.next_value()?;
                } else {
                    self.found.first(("", "stream"))?;
                    self.found.stream = map.next_value()?;
                }
                continue;
            }
            let place = |c: &&Ceiling| c.within.contains(&self.within) && c.names.contains(&key);
            if let Some((i, c)) = multipliers(self.found.body).iter().enumerate().find(|(_, c)| place(c)) {
                self.found.first((c.within[0], c.names[0]))?;
                let count = map.next_value_seed(CountSeed { name: c.names[0], unlimited_below_one: false })?;
                self.found.outputs[i] = count;
                continue;
            }
            let ceiling = shape.iter().enumerate().find(|(_, c)| place(c));
            if let Some((i, c)) = ceiling {
                self.found.first((c.within[0], c.names[0]))?;
                let count =
                    map.next_value_seed(CountSeed { name: c.names[0], unlimited_below_one: c.unlimited_below_one })?;
                self.found.ceilings[i] = count;
                continue;
            }
            // An object holding a ceiling, under its first spelling.
            let container = shape.iter().find(|c| c.within.contains(&key)).map(|c| c.within[0]);
            match container {
                Some(within) if top && !within.is_empty() => {
                    self.found.first((within, ""))?;
                    map.next_value_seed(Nested(Collector { found: self.found, within }))?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// An object inside the body, or `null`.
struct Nested<'a>(Collector<'a>);

impl<'de> DeserializeSeed<'de> for Nested<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for Nested<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} to be an object", self.0.within)
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        self.0.deserialize(d)
    }
}

/// A key as Go's JSON decoder matches it to a struct field: ASCII case folded, and the two
/// non-ASCII letters that fold to ASCII ones (`ſ` to `s`, the Kelvin sign to `k`).
fn go_fold(key: String) -> String {
    if key.bytes().all(|b| b.is_ascii_lowercase() || !b.is_ascii_alphabetic() && b.is_ascii()) {
        return key;
    }
    key.chars()
        .map(|c| match c {
            '\u{17F}' => 's',
            '\u{212A}' => 'k',
            c => c.to_ascii_lowercase(),
        })
        .collect()
}

/// How many prompts a completions request's `prompt` names, counted into the `u64` as they are
/// read (so a body cut inside a list still counts the prompts before the cut): a string or a list
/// of token ids is one; a list of strings, or of token-id lists, one each (at least one). An
/// object (the Responses API's stored-prompt reference) is one.
struct PromptCount<'a>(&'a mut u64);

impl<'de> DeserializeSeed<'de> for PromptCount<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptCount<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("prompt to be a string, a list or an object")
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(())
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        // A number is a token of one prompt; anything else is a prompt of its own.
        let mut prompts = 0u64;
        while let Some(item) = seq.next_element::<serde_json::Value>()? {
            if !item.is_number() {
                prompts = prompts.saturating_add(1);
                *self.0 = prompts.max(1);
            }
        }
        Ok(())
    }
}

/// A token count: a JSON integer from 1 up, or `null` (none given). Negative, zero, fractional
/// or string values are refused with a message that names the field, unless the API reads zero
/// and below as "no limit".
struct CountSeed {
    name: &'static str,
    unlimited_below_one: bool,
}

impl<'de> DeserializeSeed<'de> for CountSeed {
    type Value = Option<u64>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<u64>, D::Error> {
        d.deserialize_any(self)
    }
}

impl Visitor<'_> for CountSeed {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} to be a positive integer", self.name)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<u64>, E> {
        Ok(None)
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Option<u64>, E> {
        match n {
            0 if self.unlimited_below_one => Ok(None),
            0 => Err(E::custom(format!("{} must be at least 1", self.name))),
            n => Ok(Some(n)),
        }
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<Option<u64>, E> {
        match u64::try_from(n) {
            Ok(n) => self.visit_u64(n),
            Err(_) if self.unlimited_below_one => Ok(None),
            Err(_) => Err(E::custom(format!("{} must be at least 1, not {n}", self.name))),
        }
    }

    fn visit_f64<E: de::Error>(self, n: f64) -> Result<Option<u64>, E> {
        Err(E::custom(format!("{} must be an integer, not {n}", self.name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_openai_and_anthropic_bodies() {
        let chat = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":64,"stream":true}"#;
        assert_eq!(
            parse(Body::OpenAi, chat, false),
            Ok(BodyFields { model: Some("gpt-4o".into()), max_tokens: Some(64), stream: Some(true), outputs: 1 })
        );
        let messages = br#"{"model":"claude","max_tokens":1024,"messages":[]}"#;
        assert_eq!(parse(Body::Anthropic, messages, false).unwrap().max_tokens, Some(1024));
        let responses = br#"{"model":"gpt-4o","input":"hi","max_output_tokens":77}"#;
        assert_eq!(parse(Body::OpenAi, responses, false).unwrap().max_tokens, Some(77));
        assert_eq!(parse(Body::OpenAi, br#"{"model":"m","max_tokens":null}"#, false).unwrap().max_tokens, None);
    }

    #[test]
    fn a_cut_body_keeps_its_model_but_never_its_ceiling() {
        // What follows the cut could say "max_tokens": 4000 again, and a backend keep that one.
        let cut =
            br#"{"model":"gpt-4o","max_tokens":300,"stream":true,"messages":[{"role":"user","content":"a very lo"#;
        let read = parse(Body::OpenAi, cut, true).unwrap();
        assert_eq!((read.model.as_deref(), read.max_tokens, read.stream), (Some("gpt-4o"), None, Some(true)));
        assert!(parse(Body::OpenAi, cut, false).is_err(), "a cut body Envoy did not mark partial is malformed");
        let cut = br#"{"model":"gpt-4o","max_tokens":12"#;
        assert_eq!(parse(Body::OpenAi, cut, true).unwrap().max_tokens, None, "nor a number at the cut");
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
            assert!(parse(Body::OpenAi, body, false).is_err(), "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn each_api_reads_its_own_ceiling_and_no_other() {
        let gemini = br#"{"contents":[{"parts":[{"text":"hi"}]}],"max_tokens":5,"generationConfig":{"temperature":0.2,"maxOutputTokens":321}}"#;
        assert_eq!(parse(Body::Gemini, gemini, false).unwrap().max_tokens, Some(321));
        let snake = br#"{"generation_config":{"max_output_tokens":12}}"#;
        assert_eq!(parse(Body::Gemini, snake, false).unwrap().max_tokens, Some(12));
        assert_eq!(
            parse(Body::Gemini, br#"{"max_tokens":5,"model":"x","stream":true}"#, false).unwrap(),
            BodyFields { outputs: 1, ..BodyFields::default() }
        );
        let converse = br#"{"messages":[],"inferenceConfig":{"maxTokens":512,"temperature":0.5}}"#;
        assert_eq!(parse(Body::Converse, converse, false).unwrap().max_tokens, Some(512));
        for (invoke, want) in [
            (&br#"{"anthropic_version":"bedrock-2023-05-31","max_tokens":200,"messages":[]}"#[..], 200),
            (br#"{"schemaVersion":"messages-v1","inferenceConfig":{"max_new_tokens":300}}"#, 300),
            (br#"{"prompt":"hi","max_gen_len":400}"#, 400),
            (br#"{"inputText":"hi","textGenerationConfig":{"maxTokenCount":500}}"#, 500),
        ] {
            assert_eq!(parse(Body::Invoke, invoke, false).unwrap().max_tokens, Some(want));
        }
        let ollama = br#"{"model":"llama3.2","messages":[],"options":{"num_predict":128}}"#;
        assert_eq!(
            parse(Body::Ollama, ollama, false).unwrap(),
            BodyFields { model: Some("llama3.2".into()), max_tokens: Some(128), stream: None, outputs: 1 }
        );
        for unlimited in
            [&br#"{"model":"m","options":{"num_predict":-1}}"#[..], br#"{"model":"m","options":{"num_predict":-2}}"#]
        {
            assert_eq!(parse(Body::Ollama, unlimited, false).unwrap().max_tokens, None, "the model's ceiling");
        }
        assert_eq!(parse(Body::Ollama, br#"{"model":"m","options":null}"#, false).unwrap().max_tokens, None);
    }

    #[test]
    fn nested_ceilings_are_refused_twice_or_bad_and_dropped_at_a_cut() {
        for bad in [
            &br#"{"generationConfig":{"maxOutputTokens":1},"generation_config":{"maxOutputTokens":2}}"#[..],
            br#"{"generationConfig":{"maxOutputTokens":1,"max_output_tokens":2}}"#,
            br#"{"generationConfig":{"maxOutputTokens":0}}"#,
            br#"{"generationConfig":{"maxOutputTokens":"9"}}"#,
            br#"{"generationConfig":[1]}"#,
        ] {
            assert!(parse(Body::Gemini, bad, false).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let err = parse(Body::Converse, br#"{"inferenceConfig":{"maxTokens":-3}}"#, false).unwrap_err();
        assert!(err.0.contains("maxTokens must be at least 1"), "{err}");
        let cut = br#"{"generationConfig":{"maxOutputTokens":12},"contents":[{"parts":[{"text":"lo"#;
        assert_eq!(parse(Body::Gemini, cut, true).unwrap().max_tokens, None, "a cut body's ceiling is not read");
    }

    /// A body naming two ceilings holds the larger: the backend may read either.
    #[test]
    fn of_two_ceilings_the_larger_is_held() {
        let openai = br#"{"model":"m","max_output_tokens":1,"max_tokens":8000}"#;
        assert_eq!(parse(Body::OpenAi, openai, false).unwrap().max_tokens, Some(8000));
        let invoke = br#"{"prompt":"x","max_gen_len":2048,"max_tokens":1}"#;
        assert_eq!(parse(Body::Invoke, invoke, false).unwrap().max_tokens, Some(2048));
    }

    /// How many outputs a request generates: each up to the ceiling.
    #[test]
    fn several_outputs_are_counted() {
        let read = |body, bytes: &[u8]| parse(body, bytes, false).unwrap().outputs;
        assert_eq!(read(Body::OpenAi, br#"{"model":"m","max_tokens":100}"#), 1);
        assert_eq!(read(Body::OpenAi, br#"{"model":"m","max_tokens":100,"n":128}"#), 128);
        assert_eq!(read(Body::OpenAi, br#"{"model":"m","prompt":"x","n":2,"best_of":5}"#), 5);
        assert_eq!(read(Body::Gemini, br#"{"generationConfig":{"maxOutputTokens":100,"candidateCount":8}}"#), 8);
        assert_eq!(read(Body::Anthropic, br#"{"model":"m","max_tokens":9,"n":4}"#), 1, "not Anthropic's field");
        assert!(parse(Body::OpenAi, br#"{"model":"m","n":0}"#, false).is_err());
        assert!(parse(Body::OpenAi, br#"{"model":"m","n":2,"n":3}"#, false).is_err());
        // The completions API: a completion (n of them) for each prompt of a list.
        assert_eq!(read(Body::OpenAi, br#"{"model":"m","prompt":["a","b","c"],"n":2}"#), 6);
        assert_eq!(read(Body::OpenAi, br#"{"model":"m","prompt":[[1,2],[3],[4]]}"#), 3);
        assert_eq!(read(Body::OpenAi, br#"{"model":"m","prompt":[1,2,3]}"#), 1, "one prompt of token ids");
        assert_eq!(read(Body::OpenAi, br#"{"model":"m","prompt":[]}"#), 1);
        assert!(parse(Body::OpenAi, br#"{"model":"m","prompt":"a","prompt":["b","c"]}"#, false).is_err());
        assert!(parse(Body::OpenAi, br#"{"model":"m","prompt":7}"#, false).is_err());
        // The Responses API's stored prompt is an object: one request, one output.
        let stored = br#"{"model":"m","prompt":{"id":"pmpt_1","variables":{"x":"y"}},"input":"hi"}"#;
        assert_eq!(read(Body::OpenAi, stored), 1);
        // A body cut inside a list still counts the prompts before the cut.
        let cut = br#"{"model":"m","n":2,"prompt":["a","b","c","d"#;
        assert_eq!(parse(Body::OpenAi, cut, true).unwrap().outputs, 2 * 3);
    }

    /// Ollama (Go) reads `"Model"`, `"OPTIONS"` or `"ſtream"` as its own fields: so does the hold,
    /// and a second spelling is a field named twice. Inside `options`, keys are exact.
    #[test]
    fn ollamas_fields_are_matched_as_go_matches_them() {
        let read = |bytes: &[u8]| parse(Body::Ollama, bytes, false);
        let shouted = br#"{"Model":"llama3.2","OPTIONS":{"num_predict":4000},"\u017ftream":false}"#;
        assert_eq!(
            read(shouted),
            Ok(BodyFields { model: Some("llama3.2".into()), max_tokens: Some(4000), stream: Some(false), outputs: 1 })
        );
        for twice in [
            &br#"{"model":"a","Model":"b"}"#[..],
            br#"{"model":"m","options":{"num_predict":1},"Options":{"num_predict":9000}}"#,
            br#"{"model":"m","stream":true,"STREAM":false}"#,
        ] {
            assert!(read(twice).is_err(), "{}", String::from_utf8_lossy(twice));
        }
        let exact_inside = br#"{"model":"m","options":{"Num_Predict":5}}"#;
        assert_eq!(read(exact_inside).unwrap().max_tokens, None, "not Ollama's option: the model's ceiling");
        assert_eq!(go_fold("\u{212A}eep".into()), "keep");
        assert_eq!(parse(Body::OpenAi, br#"{"Model":"m"}"#, false).unwrap().model, None, "OpenAI keys are exact");
    }
}
