//! A command's arguments read as Redis reads them, and the errors it answers when they are wrong.

pub(super) fn arity(a: &[Vec<u8>], n: usize) -> Result<(), String> {
    if a.len() == n { Ok(()) } else { Err(arity_error()) }
}

pub(super) fn arity_error() -> String {
    "ERR wrong number of arguments".into()
}

pub(super) fn wrongtype() -> String {
    "WRONGTYPE Operation against a key holding the wrong kind of value".into()
}

pub(super) fn int_arg(v: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| "ERR value is not an integer or out of range".into())
}

pub(super) fn positive(n: i64) -> Result<u64, String> {
    u64::try_from(n).ok().filter(|&n| n > 0).ok_or_else(|| "ERR invalid expire time".into())
}

pub(super) fn float_arg(v: &[u8]) -> Result<f64, String> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|f| !f.is_nan())
        .ok_or_else(|| "ERR value is not a valid float".into())
}

pub(super) fn bound_arg(v: &[u8]) -> Result<f64, String> {
    match v {
        b"-inf" => Ok(f64::NEG_INFINITY),
        b"+inf" | b"inf" => Ok(f64::INFINITY),
        _ => float_arg(v).map_err(|_| "ERR min or max is not a float".into()),
    }
}
