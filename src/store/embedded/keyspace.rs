//! An in-memory keyspace that implements just the Redis commands tollgate's scripts call, with
//! Redis's semantics for them (lazy and incremental expiry, `WRONGTYPE`, nil as absence).
//!
//! Commands: TIME, TYPE, GET, SET (PX), DEL, PEXPIRE, PTTL, HGET, HMGET, HSET, HDEL, HINCRBY, HGETALL, HLEN, ZADD,
//! ZREM, ZRANGE (WITHSCORES), ZRANGEBYSCORE (LIMIT), XADD (MAXLEN, `*` ids), XTRIM (MINID), XLEN,
//! XRANGE. Anything else is an error, so a script that starts using a new command fails its
//! conformance test on the embedded store at once.
//!
//! Streams are the usage ledger: every entry XADD appends is also handed to the keyspace's
//! [`LedgerSink`] when it has one (the embedded store's ledger file), so a single replica keeps its
//! ledger past a restart. Trimming (`~` or exact) trims exactly.

// A Redis emulator: its arithmetic is Redis's own, on millisecond clocks and member counts far from
// any bound, so the crate's token-arithmetic lint does not apply here.
#![allow(clippy::arithmetic_side_effects)]

use std::cmp::Ordering;
use std::collections::{BTreeSet, HashMap};

/// A command's reply, as Redis would send it.
#[derive(Debug, Clone, PartialEq)]
pub enum Resp {
    Nil,
    Int(i64),
    Bulk(Vec<u8>),
    Array(Vec<Resp>),
    Status(&'static str),
}

type Hash = HashMap<Vec<u8>, Vec<u8>>;

#[derive(Debug)]
enum Value {
    Str(Vec<u8>),
    Hash(Hash),
    ZSet(ZSet),
    Stream(Stream),
}

/// A stream entry's id: milliseconds and a sequence within them.
type StreamId = (u64, u64);

/// A stream entry's fields and values, in order.
type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// A stream: entries in id order, and the last id given (ids only grow, even past trimming).
#[derive(Debug, Default)]
struct Stream {
    entries: std::collections::BTreeMap<StreamId, Fields>,
    last: StreamId,
}

/// Where appended stream entries go besides the keyspace: `(key, id, fields)`.
pub type LedgerSink = Box<dyn FnMut(&[u8], &str, &[(Vec<u8>, Vec<u8>)]) + Send>;

/// A score with the total order Redis uses for sorted sets.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Score(f64);

impl Eq for Score {}

impl PartialOrd for Score {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Score {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Debug, Default)]
struct ZSet {
    by_score: BTreeSet<(Score, Vec<u8>)>,
    scores: HashMap<Vec<u8>, Score>,
}

impl ZSet {
    fn add(&mut self, score: f64, member: Vec<u8>) -> i64 {
        let added = match self.scores.insert(member.clone(), Score(score)) {
            Some(old) => {
                self.by_score.remove(&(old, member.clone()));
                0
            }
            None => 1,
        };
        self.by_score.insert((Score(score), member));
        added
    }

    fn remove(&mut self, member: &[u8]) -> bool {
        match self.scores.remove(member) {
            Some(score) => self.by_score.remove(&(score, member.to_vec())),
            None => false,
        }
    }
}

#[derive(Debug)]
struct Entry {
    value: Value,
    expires_at: Option<u64>,
}

/// The keyspace. Expired keys vanish when touched, and [`Keyspace::purge_expired`] reclaims a
/// bounded number of untouched ones per call, so an idle tenant's keys do not stay forever.
///
/// `expiries` holds exactly one entry per key that has a TTL: a new TTL replaces the key's old
/// entry, and a key leaving the keyspace takes its entry with it. So the index is bounded by the
/// live keys, however often their TTLs move (every reserve moves several).
#[derive(Default)]
pub struct Keyspace {
    entries: HashMap<Vec<u8>, Entry>,
    expiries: BTreeSet<(u64, Vec<u8>)>,
    sink: Option<LedgerSink>,
}

impl std::fmt::Debug for Keyspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyspace").field("keys", &self.entries.len()).finish_non_exhaustive()
    }
}

type CmdResult = Result<Resp, String>;

impl Keyspace {
    /// A keyspace that hands every stream entry it appends to `sink` as well.
    pub fn with_sink(sink: LedgerSink) -> Self {
        Keyspace { sink: Some(sink), ..Keyspace::default() }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries in the expiry index: never more than [`Keyspace::len`].
    pub fn expiry_index_len(&self) -> usize {
        self.expiries.len()
    }

    /// Removes a key and its expiry entry.
    fn remove(&mut self, key: &[u8]) -> Option<Entry> {
        let entry = self.entries.remove(key)?;
        if let Some(at) = entry.expires_at {
            self.expiries.remove(&(at, key.to_vec()));
        }
        Some(entry)
    }

    /// Removes up to `limit` keys whose TTL has passed.
    pub fn purge_expired(&mut self, now: u64, limit: usize) {
        for _ in 0..limit {
            let Some((at, key)) = self.expiries.first().cloned() else { return };
            if at > now {
                return;
            }
            self.expiries.pop_first();
            self.entries.remove(&key);
        }
    }

    /// Runs one command; `now` is the store clock in milliseconds.
    pub fn command(&mut self, now: u64, args: &[Vec<u8>]) -> CmdResult {
        let Some(name) = args.first() else {
            return Err("ERR wrong number of arguments".into());
        };
        let name = String::from_utf8_lossy(name).to_ascii_uppercase();
        let a = &args[1..];
        match name.as_str() {
            "TIME" => Ok(Resp::Array(vec![
                Resp::Bulk((now / 1000).to_string().into_bytes()),
                Resp::Bulk(((now % 1000) * 1000).to_string().into_bytes()),
            ])),
            "TYPE" => {
                arity(a, 1)?;
                let t = match self.live(now, &a[0]).map(|e| &e.value) {
                    None => "none",
                    Some(Value::Str(_)) => "string",
                    Some(Value::Hash(_)) => "hash",
                    Some(Value::ZSet(_)) => "zset",
                    Some(Value::Stream(_)) => "stream",
                };
                Ok(Resp::Status(t))
            }
            "GET" => {
                arity(a, 1)?;
                match self.live(now, &a[0]).map(|e| &e.value) {
                    None => Ok(Resp::Nil),
                    Some(Value::Str(v)) => Ok(Resp::Bulk(v.clone())),
                    Some(_) => Err(wrongtype()),
                }
            }
            "SET" => self.set(now, a),
            "DEL" => {
                let mut n = 0;
                for key in a {
                    if self.live(now, key).is_some() {
                        self.remove(key);
                        n += 1;
                    }
                }
                Ok(Resp::Int(n))
            }
            "PEXPIRE" => {
                arity(a, 2)?;
                let ms = int_arg(&a[1])?;
                if self.live(now, &a[0]).is_none() {
                    return Ok(Resp::Int(0));
                }
                if ms <= 0 {
                    self.remove(&a[0]);
                } else {
                    self.set_expiry(&a[0], Some(now.saturating_add(ms.unsigned_abs())));
                }
                Ok(Resp::Int(1))
            }
            "PTTL" => {
                arity(a, 1)?;
                Ok(Resp::Int(match self.live(now, &a[0]) {
                    None => -2,
                    Some(Entry { expires_at: None, .. }) => -1,
                    Some(Entry { expires_at: Some(at), .. }) => {
                        i64::try_from(at.saturating_sub(now)).unwrap_or(i64::MAX)
                    }
                }))
            }
            "HGET" => {
                arity(a, 2)?;
                Ok(match self.hash(now, &a[0])? {
                    Some(h) => h.get(&a[1]).map_or(Resp::Nil, |v| Resp::Bulk(v.clone())),
                    None => Resp::Nil,
                })
            }
            "HMGET" => {
                if a.len() < 2 {
                    return Err(arity_error());
                }
                let h = self.hash(now, &a[0])?;
                Ok(Resp::Array(
                    a[1..]
                        .iter()
                        .map(|f| h.and_then(|h| h.get(f)).map_or(Resp::Nil, |v| Resp::Bulk(v.clone())))
                        .collect(),
                ))
            }
            "HGETALL" => {
                arity(a, 1)?;
                let mut out = Vec::new();
                if let Some(h) = self.hash(now, &a[0])? {
                    let mut fields: Vec<_> = h.iter().collect();
                    fields.sort();
                    for (f, v) in fields {
                        out.push(Resp::Bulk(f.clone()));
                        out.push(Resp::Bulk(v.clone()));
                    }
                }
                Ok(Resp::Array(out))
            }
            "HLEN" => {
                arity(a, 1)?;
                let n = self.hash(now, &a[0])?.map_or(0, HashMap::len);
                Ok(Resp::Int(i64::try_from(n).unwrap_or(i64::MAX)))
            }
            "HSET" => {
                if a.len() < 3 || a.len().is_multiple_of(2) {
                    return Err(arity_error());
                }
                let h = match &mut self.entry_or_insert(now, &a[0], || Value::Hash(HashMap::new())).value {
                    Value::Hash(h) => h,
                    _ => return Err(wrongtype()),
                };
                let mut added = 0;
                for pair in a[1..].chunks(2) {
                    if h.insert(pair[0].clone(), pair[1].clone()).is_none() {
                        added += 1;
                    }
                }
                Ok(Resp::Int(added))
            }
            "HINCRBY" => {
                arity(a, 3)?;
                let by = int_arg(&a[2])?;
                let h = match &mut self.entry_or_insert(now, &a[0], || Value::Hash(HashMap::new())).value {
                    Value::Hash(h) => h,
                    _ => return Err(wrongtype()),
                };
                let current = match h.get(&a[1]) {
                    Some(v) => int_arg(v).map_err(|_| "ERR hash value is not an integer".to_string())?,
                    None => 0,
                };
                let next = current.checked_add(by).ok_or("ERR increment or decrement would overflow")?;
                h.insert(a[1].clone(), next.to_string().into_bytes());
                Ok(Resp::Int(next))
            }
            "HDEL" => {
                if a.len() < 2 {
                    return Err(arity_error());
                }
                let (n, empty) = match self.live(now, &a[0]).map(|e| &mut e.value) {
                    None => (0, false),
                    Some(Value::Hash(h)) => {
                        let n = a[1..].iter().filter(|f| h.remove(*f).is_some()).count();
                        (n, h.is_empty())
                    }
                    Some(_) => return Err(wrongtype()),
                };
                if empty {
                    self.remove(&a[0]);
                }
                Ok(Resp::Int(n as i64))
            }
            "ZADD" => {
                if a.len() < 3 || a.len().is_multiple_of(2) {
                    return Err(arity_error());
                }
                let mut pairs = Vec::new();
                for pair in a[1..].chunks(2) {
                    pairs.push((float_arg(&pair[0])?, pair[1].clone()));
                }
                let z = match &mut self.entry_or_insert(now, &a[0], || Value::ZSet(ZSet::default())).value {
                    Value::ZSet(z) => z,
                    _ => return Err(wrongtype()),
                };
                Ok(Resp::Int(pairs.into_iter().map(|(s, m)| z.add(s, m)).sum()))
            }
            "ZREM" => {
                if a.len() < 2 {
                    return Err(arity_error());
                }
                let (n, empty) = match self.zset_mut(now, &a[0])? {
                    Some(z) => {
                        let n = a[1..].iter().filter(|m| z.remove(m)).count();
                        (n, z.scores.is_empty())
                    }
                    None => (0, false),
                };
                if empty {
                    self.remove(&a[0]);
                }
                Ok(Resp::Int(n as i64))
            }
            "ZRANGE" => self.zrange(now, a),
            "ZRANGEBYSCORE" => self.zrangebyscore(now, a),
            "XADD" => self.xadd(now, a),
            "XTRIM" => {
                arity(a, 4)?;
                if !a[1].eq_ignore_ascii_case(b"MINID") || &a[2][..] != b"~" && &a[2][..] != b"=" {
                    return Err("ERR syntax error (embedded XTRIM takes only MINID ~|= id)".into());
                }
                let min = stream_id(&a[3])?;
                Ok(Resp::Int(match self.stream_mut(now, &a[0])? {
                    Some(st) => {
                        let keep = st.entries.split_off(&min);
                        let trimmed = std::mem::replace(&mut st.entries, keep).len();
                        trimmed as i64
                    }
                    None => 0,
                }))
            }
            "XLEN" => {
                arity(a, 1)?;
                Ok(Resp::Int(self.stream_mut(now, &a[0])?.map_or(0, |st| st.entries.len() as i64)))
            }
            "XRANGE" => {
                arity(a, 3)?;
                let bound = |v: &[u8], open: StreamId| match v {
                    b"-" | b"+" => Ok(open),
                    v => stream_id(v),
                };
                let (lo, hi) = (bound(&a[1], (0, 0))?, bound(&a[2], (u64::MAX, u64::MAX))?);
                let Some(st) = self.stream_mut(now, &a[0])? else { return Ok(Resp::Array(vec![])) };
                let mut out = Vec::new();
                if lo <= hi {
                    for (id, fields) in st.entries.range(lo..=hi) {
                        let flat = fields.iter().flat_map(|(f, v)| [Resp::Bulk(f.clone()), Resp::Bulk(v.clone())]);
                        out.push(Resp::Array(vec![
                            Resp::Bulk(format_id(*id).into_bytes()),
                            Resp::Array(flat.collect()),
                        ]));
                    }
                }
                Ok(Resp::Array(out))
            }
            other => Err(format!("ERR unknown command '{other}' (not implemented by the embedded store)")),
        }
    }

    fn set(&mut self, now: u64, a: &[Vec<u8>]) -> CmdResult {
        let expiry = match a.len() {
            2 => None,
            4 if a[2].eq_ignore_ascii_case(b"PX") => Some(now.saturating_add(positive(int_arg(&a[3])?)?)),
            4 if a[2].eq_ignore_ascii_case(b"EX") => {
                Some(now.saturating_add(positive(int_arg(&a[3])?)?.saturating_mul(1000)))
            }
            _ => return Err("ERR syntax error (embedded SET takes only EX or PX)".into()),
        };
        self.remove(&a[0]);
        self.entries.insert(a[0].clone(), Entry { value: Value::Str(a[1].clone()), expires_at: None });
        self.set_expiry(&a[0], expiry);
        Ok(Resp::Status("OK"))
    }

    /// `XADD key [MAXLEN [~|=] n] * field value ...`: the id is the clock's millisecond, and a
    /// sequence within it.
    fn xadd(&mut self, now: u64, a: &[Vec<u8>]) -> CmdResult {
        let (max_len, rest) = match a.get(1) {
            Some(w) if w.eq_ignore_ascii_case(b"MAXLEN") => match a.get(2).map(Vec::as_slice) {
                Some(b"~" | b"=") => (Some(a.get(3).ok_or_else(arity_error)?), &a[4..]),
                _ => (Some(a.get(2).ok_or_else(arity_error)?), &a[3..]),
            },
            _ => (None, a.get(1..).ok_or_else(arity_error)?),
        };
        let max_len = max_len.map(|n| int_arg(n).and_then(positive)).transpose()?;
        if rest.first().map(Vec::as_slice) != Some(b"*") {
            return Err("ERR syntax error (embedded XADD takes only * as the id)".into());
        }
        let pairs = &rest[1..];
        if pairs.is_empty() || pairs.len() % 2 != 0 {
            return Err(arity_error());
        }
        let fields: Fields = pairs.chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect();
        let entry = self.entry_or_insert(now, &a[0], || Value::Stream(Stream::default()));
        let Value::Stream(st) = &mut entry.value else { return Err(wrongtype()) };
        let id = if now > st.last.0 { (now, 0) } else { (st.last.0, st.last.1 + 1) };
        st.last = id;
        st.entries.insert(id, fields.clone());
        if let Some(max) = max_len {
            while st.entries.len() as u64 > max {
                st.entries.pop_first();
            }
        }
        let id = format_id(id);
        if let Some(sink) = &mut self.sink {
            sink(&a[0], &id, &fields);
        }
        Ok(Resp::Bulk(id.into_bytes()))
    }

    fn stream_mut(&mut self, now: u64, key: &[u8]) -> Result<Option<&mut Stream>, String> {
        match self.live(now, key).map(|e| &mut e.value) {
            None => Ok(None),
            Some(Value::Stream(st)) => Ok(Some(st)),
            Some(_) => Err(wrongtype()),
        }
    }

    fn zrange(&mut self, now: u64, a: &[Vec<u8>]) -> CmdResult {
        let with_scores = match a.len() {
            3 => false,
            4 if a[3].eq_ignore_ascii_case(b"WITHSCORES") => true,
            _ => return Err("ERR syntax error (embedded ZRANGE takes only WITHSCORES)".into()),
        };
        let (start, stop) = (int_arg(&a[1])?, int_arg(&a[2])?);
        let Some(z) = self.zset(now, &a[0])? else { return Ok(Resp::Array(vec![])) };
        let len = z.by_score.len() as i64;
        let norm = |i: i64| if i < 0 { (len + i).max(0) } else { i };
        let (start, stop) = (norm(start), norm(stop).min(len - 1));
        let mut out = Vec::new();
        if start <= stop {
            let skip = usize::try_from(start).unwrap_or(usize::MAX);
            let take = usize::try_from(stop - start + 1).unwrap_or(0);
            for (score, member) in z.by_score.iter().skip(skip).take(take) {
                push_member(&mut out, score, member, with_scores);
            }
        }
        Ok(Resp::Array(out))
    }

    fn zrangebyscore(&mut self, now: u64, a: &[Vec<u8>]) -> CmdResult {
        let (offset, count) = match a.len() {
            3 => (0, usize::MAX),
            6 if a[3].eq_ignore_ascii_case(b"LIMIT") => {
                let count = int_arg(&a[5])?;
                let offset = usize::try_from(int_arg(&a[4])?.max(0)).unwrap_or(usize::MAX);
                (offset, usize::try_from(count).unwrap_or(usize::MAX))
            }
            _ => return Err("ERR syntax error (embedded ZRANGEBYSCORE takes only LIMIT)".into()),
        };
        let (min, max) = (bound_arg(&a[1])?, bound_arg(&a[2])?);
        let Some(z) = self.zset(now, &a[0])? else { return Ok(Resp::Array(vec![])) };
        let mut out = Vec::new();
        for (score, member) in z.by_score.iter().filter(|(s, _)| s.0 >= min && s.0 <= max).skip(offset).take(count) {
            push_member(&mut out, score, member, false);
        }
        Ok(Resp::Array(out))
    }

    /// The entry under `key` unless it has expired (an expired one is removed on the way).
    fn live(&mut self, now: u64, key: &[u8]) -> Option<&mut Entry> {
        let expired = matches!(self.entries.get(key), Some(Entry { expires_at: Some(at), .. }) if *at <= now);
        if expired {
            self.remove(key);
            return None;
        }
        self.entries.get_mut(key)
    }

    fn entry_or_insert(&mut self, now: u64, key: &[u8], new: impl FnOnce() -> Value) -> &mut Entry {
        if self.live(now, key).is_none() {
            self.entries.insert(key.to_vec(), Entry { value: new(), expires_at: None });
        }
        self.entries.get_mut(key).expect("inserted above")
    }

    fn hash(&mut self, now: u64, key: &[u8]) -> Result<Option<&Hash>, String> {
        match self.live(now, key).map(|e| &e.value) {
            None => Ok(None),
            Some(Value::Hash(h)) => Ok(Some(h)),
            Some(_) => Err(wrongtype()),
        }
    }

    fn zset(&mut self, now: u64, key: &[u8]) -> Result<Option<&ZSet>, String> {
        match self.live(now, key).map(|e| &e.value) {
            None => Ok(None),
            Some(Value::ZSet(z)) => Ok(Some(z)),
            Some(_) => Err(wrongtype()),
        }
    }

    fn zset_mut(&mut self, now: u64, key: &[u8]) -> Result<Option<&mut ZSet>, String> {
        match self.live(now, key).map(|e| &mut e.value) {
            None => Ok(None),
            Some(Value::ZSet(z)) => Ok(Some(z)),
            Some(_) => Err(wrongtype()),
        }
    }

    fn set_expiry(&mut self, key: &[u8], at: Option<u64>) {
        if let Some(entry) = self.entries.get_mut(key) {
            if let Some(old) = std::mem::replace(&mut entry.expires_at, at) {
                self.expiries.remove(&(old, key.to_vec()));
            }
            if let Some(at) = at {
                self.expiries.insert((at, key.to_vec()));
            }
        }
    }
}

fn format_id((ms, seq): StreamId) -> String {
    format!("{ms}-{seq}")
}

/// A stream id, `ms` or `ms-seq`.
fn stream_id(v: &[u8]) -> Result<StreamId, String> {
    let bad = || "ERR Invalid stream ID specified as stream command argument".to_string();
    let text = std::str::from_utf8(v).map_err(|_| bad())?;
    let (ms, seq) = text.split_once('-').unwrap_or((text, "0"));
    Ok((ms.parse().map_err(|_| bad())?, seq.parse().map_err(|_| bad())?))
}

fn push_member(out: &mut Vec<Resp>, score: &Score, member: &[u8], with_scores: bool) {
    out.push(Resp::Bulk(member.to_vec()));
    if with_scores {
        out.push(Resp::Bulk(format_number(score.0).into_bytes()));
    }
}

/// Formats a number the way Redis does when it turns a Lua number or a score into a string.
#[allow(clippy::cast_possible_truncation)] // a whole number under 1e17 fits an i64 exactly
pub fn format_number(n: f64) -> String {
    if n.fract() == 0.0 && n.abs() < 1e17 { format!("{}", n as i64) } else { format!("{n}") }
}

fn arity(a: &[Vec<u8>], n: usize) -> Result<(), String> {
    if a.len() == n { Ok(()) } else { Err(arity_error()) }
}

fn arity_error() -> String {
    "ERR wrong number of arguments".into()
}

fn wrongtype() -> String {
    "WRONGTYPE Operation against a key holding the wrong kind of value".into()
}

fn int_arg(v: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| "ERR value is not an integer or out of range".into())
}

fn positive(n: i64) -> Result<u64, String> {
    u64::try_from(n).ok().filter(|&n| n > 0).ok_or_else(|| "ERR invalid expire time".into())
}

fn float_arg(v: &[u8]) -> Result<f64, String> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|f| !f.is_nan())
        .ok_or_else(|| "ERR value is not a valid float".into())
}

fn bound_arg(v: &[u8]) -> Result<f64, String> {
    match v {
        b"-inf" => Ok(f64::NEG_INFINITY),
        b"+inf" | b"inf" => Ok(f64::INFINITY),
        _ => float_arg(v).map_err(|_| "ERR min or max is not a float".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(ks: &mut Keyspace, now: u64, parts: &[&str]) -> CmdResult {
        let args: Vec<Vec<u8>> = parts.iter().map(|p| p.as_bytes().to_vec()).collect();
        ks.command(now, &args)
    }

    fn bulk(s: &str) -> Resp {
        Resp::Bulk(s.as_bytes().to_vec())
    }

    #[test]
    fn keys_expire_lazily_and_by_purge() {
        let mut ks = Keyspace::default();
        cmd(&mut ks, 0, &["SET", "a", "1", "PX", "100"]).unwrap();
        cmd(&mut ks, 0, &["HSET", "h", "f", "v"]).unwrap();
        cmd(&mut ks, 0, &["PEXPIRE", "h", "50"]).unwrap();
        assert_eq!(cmd(&mut ks, 99, &["GET", "a"]), Ok(bulk("1")));
        assert_eq!(cmd(&mut ks, 100, &["GET", "a"]), Ok(Resp::Nil));
        assert_eq!(ks.len(), 1);
        ks.purge_expired(60, 10);
        assert!(ks.is_empty());
    }

    #[test]
    fn the_expiry_index_is_bounded_by_the_live_keys() {
        let mut ks = Keyspace::default();
        for i in 0..10_000u64 {
            let key = format!("k{}", i % 7);
            cmd(&mut ks, i, &["HSET", &key, "f", "v"]).unwrap();
            cmd(&mut ks, i, &["PEXPIRE", &key, "60000"]).unwrap();
            cmd(&mut ks, i, &["SET", "s", "1", "PX", "60000"]).unwrap();
            if i % 3 == 0 {
                cmd(&mut ks, i, &["DEL", &key]).unwrap();
            }
            assert!(ks.expiry_index_len() <= ks.len(), "cycle {i}: {} > {}", ks.expiry_index_len(), ks.len());
        }
        assert!(ks.len() <= 8);
    }

    #[test]
    fn sorted_set_ranges_follow_redis() {
        let mut ks = Keyspace::default();
        for (s, m) in [("30", "c"), ("10", "a"), ("20", "b")] {
            cmd(&mut ks, 0, &["ZADD", "z", s, m]).unwrap();
        }
        assert_eq!(
            cmd(&mut ks, 0, &["ZRANGEBYSCORE", "z", "-inf", "20", "LIMIT", "0", "1"]),
            Ok(Resp::Array(vec![bulk("a")]))
        );
        assert_eq!(
            cmd(&mut ks, 0, &["ZRANGE", "z", "0", "0", "WITHSCORES"]),
            Ok(Resp::Array(vec![bulk("a"), bulk("10")]))
        );
        assert_eq!(cmd(&mut ks, 0, &["ZREM", "z", "a", "b", "c"]), Ok(Resp::Int(3)));
        assert!(ks.is_empty(), "an emptied sorted set is deleted, as in Redis");
    }

    #[test]
    fn wrong_type_and_unknown_commands_are_errors() {
        let mut ks = Keyspace::default();
        cmd(&mut ks, 0, &["SET", "s", "1"]).unwrap();
        assert!(cmd(&mut ks, 0, &["HGET", "s", "f"]).unwrap_err().starts_with("WRONGTYPE"));
        assert!(cmd(&mut ks, 0, &["FLUSHALL"]).is_err());
    }
}
