//! A settled hold's ledger entry as one JSON line: how the embedded store's ledger file writes
//! it and how `tollgate ledger` reads it off Redis, so both give the same line. The scripts that
//! settle holds append the entries (`lua/common.lua` lists the fields).

/// Fields whose values are whole numbers, written as JSON numbers.
const NUMBERS: [&str; 13] = [
    "prompt_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "reasoning_tokens",
    "reserved_tokens",
    "charged_tokens",
    "cost_nanos",
    "reserved_cost_nanos",
    "reserved_at_ms",
    "settled_at_ms",
    "counted_before",
    "counted_after",
];

/// One entry as a JSON object: `entry` is its stream id, then its fields; empty values are `null`.
pub fn entry_json<'a>(entry: &str, fields: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut map = serde_json::Map::new();
    map.insert("entry".into(), entry.into());
    for (field, value) in fields {
        let value = match value {
            "" => serde_json::Value::Null,
            v if NUMBERS.contains(&field) => v.parse::<u64>().map_or_else(|_| v.into(), Into::into),
            v => v.into(),
        };
        map.insert(field.into(), value);
    }
    serde_json::Value::Object(map).to_string()
}
