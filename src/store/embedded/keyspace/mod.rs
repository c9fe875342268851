//! An in-memory keyspace that implements just the Redis commands tollgate's scripts call, with
//! Redis's semantics for them (lazy and incremental expiry, `WRONGTYPE`, nil as absence).
//!
//! Commands (sorted sets in `zsets`, streams in `streams`): TIME, TYPE, GET, SET (PX), DEL, PEXPIRE (NX XX GT LT), PTTL, HGET, HMGET, HSET, HDEL, HINCRBY, HGETALL, HLEN, ZADD,
//! ZREM, ZSCORE, ZRANGE (WITHSCORES), ZRANGEBYSCORE (LIMIT), XADD (MAXLEN, `*` ids), XTRIM (MINID), XLEN,
//! XRANGE. Anything else is an error, so a script that starts using a new command fails its
//! conformance test on the embedded store at once.
//!
//! Streams are the usage ledger: every entry XADD appends is also handed to the keyspace's
//! [`LedgerSink`] when it has one (the embedded store's ledger file), so a single replica keeps its
//! ledger past a restart. Trimming (`~` or exact) trims exactly.
//!
//! The keyspace counts the bytes it holds ([`Keyspace::used`]: keys, fields, values and members,
//! with an estimate of what each costs the maps and the allocator beyond its bytes), and
//! [`Keyspace::make_room`] evicts the keys its `evictable` test picks, soonest to expire first,
//! until the count is under a cap.

// A Redis emulator: its arithmetic is Redis's own, on millisecond clocks and member counts far from
// any bound, so the crate's token-arithmetic lint does not apply here.
#![allow(clippy::arithmetic_side_effects)]

mod args;
mod streams;
mod zsets;

use std::cmp::Ordering;
use std::collections::{BTreeSet, HashMap};

use args::{arity, arity_error, bound_arg, float_arg, int_arg, positive, wrongtype};
use streams::Stream;
use zsets::ZSet;

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

#[derive(Debug)]
struct Entry {
    value: Value,
    expires_at: Option<u64>,
    /// What it holds, as [`Keyspace::used`] counts it.
    bytes: usize,
}

/// What a key costs beyond its bytes: its slot in the key map, its entry, the allocator's headers.
const KEY_COST: usize = 128;
/// What a hash field or a sorted-set member costs beyond its bytes (a member is kept twice).
const FIELD_COST: usize = 64;
/// What a key's place in the expiry index costs beyond a copy of its name.
const EXPIRY_COST: usize = 48;

/// Bytes held by one hash field and its value.
fn field_bytes(field: &[u8], value: &[u8]) -> usize {
    field.len() + value.len() + FIELD_COST
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
    /// Bytes held: every entry's `bytes` and the expiry index.
    used: usize,
    /// The keys [`Keyspace::make_room`] may evict, by expiry: those `evictable` picks that have a TTL.
    evictable: Option<fn(&[u8]) -> bool>,
    eviction_order: BTreeSet<(u64, Vec<u8>)>,
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

    /// The bytes the keyspace holds, as it counts them.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Lets [`Keyspace::make_room`] evict the keys `evictable` picks (only those with a TTL).
    pub fn evict_only(&mut self, evictable: fn(&[u8]) -> bool) {
        self.evictable = Some(evictable);
    }

    /// Evicts evictable keys, the soonest to expire first, until the keyspace holds no more than
    /// `cap` bytes. Returns whether it does.
    pub fn make_room(&mut self, cap: usize) -> bool {
        while self.used > cap {
            let Some((_, key)) = self.eviction_order.pop_first() else { return false };
            self.remove(&key);
        }
        true
    }

    /// Removes a key and its expiry entry.
    fn remove(&mut self, key: &[u8]) -> Option<Entry> {
        let entry = self.entries.remove(key)?;
        if let Some(at) = entry.expires_at {
            self.unindex(at, key);
        }
        self.uncount(entry.bytes);
        Some(entry)
    }

    /// Removes up to `limit` keys whose TTL has passed.
    pub fn purge_expired(&mut self, now: u64, limit: usize) {
        for _ in 0..limit {
            match self.expiries.first() {
                Some((at, _)) if *at <= now => {}
                _ => return,
            }
            let Some((_, key)) = self.expiries.pop_first() else { return };
            self.remove(&key);
        }
    }

    /// A key under `key` holding `value`, counted.
    fn insert(&mut self, key: &[u8], value: Value) -> &mut Entry {
        let bytes = key.len() + KEY_COST + value_bytes(&value);
        self.used += bytes;
        if let Some(old) = self.entries.insert(key.to_vec(), Entry { value, expires_at: None, bytes }) {
            // (Callers remove a key before they replace it: this only keeps the count right.)
            self.uncount(old.bytes);
        }
        self.entries.get_mut(key).expect("inserted above")
    }

    /// Counts what `key` holds growing by `added` bytes and shrinking by `removed`.
    fn resize(&mut self, key: &[u8], added: usize, removed: usize) {
        if let Some(e) = self.entries.get_mut(key) {
            debug_assert!(e.bytes + added >= removed, "{} bytes less {removed}", e.bytes + added);
            e.bytes = (e.bytes + added).saturating_sub(removed);
            self.used += added;
            self.uncount(removed);
        }
    }

    /// Takes `bytes` off the count (never below zero: a miscount shows in debug builds, and
    /// cannot wrap into a count that would evict everything in release ones).
    fn uncount(&mut self, bytes: usize) {
        debug_assert!(self.used >= bytes, "{} bytes counted, {bytes} taken off", self.used);
        self.used = self.used.saturating_sub(bytes);
    }

    fn index(&mut self, at: u64, key: &[u8]) {
        self.used += key.len() + EXPIRY_COST;
        self.expiries.insert((at, key.to_vec()));
        if self.evictable.is_some_and(|evictable| evictable(key)) {
            self.eviction_order.insert((at, key.to_vec()));
        }
    }

    fn unindex(&mut self, at: u64, key: &[u8]) {
        self.uncount(key.len() + EXPIRY_COST);
        let entry = (at, key.to_vec());
        self.expiries.remove(&entry);
        self.eviction_order.remove(&entry);
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
                if a.len() != 2 && a.len() != 3 {
                    return Err(arity_error());
                }
                let ms = int_arg(&a[1])?;
                let Some(current) = self.live(now, &a[0]).map(|e| e.expires_at) else {
                    return Ok(Resp::Int(0));
                };
                let at = now.saturating_add(ms.max(0).unsigned_abs());
                // NX | XX | GT | LT, as Redis 7 reads them: a key without a TTL counts as
                // expiring never, so GT leaves it so and LT gives it one.
                let applies = match a.get(2).map(|c| c.to_ascii_uppercase()).as_deref() {
                    None => true,
                    Some(b"NX") => current.is_none(),
                    Some(b"XX") => current.is_some(),
                    Some(b"GT") => current.is_some_and(|current| at > current),
                    Some(b"LT") => current.is_none_or(|current| at < current),
                    Some(_) => return Err("ERR Unsupported option".into()),
                };
                if !applies {
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
                let (mut added, mut grew, mut shrank) = (0, 0, 0);
                for pair in a[1..].chunks(2) {
                    match h.insert(pair[0].clone(), pair[1].clone()) {
                        None => {
                            added += 1;
                            grew += field_bytes(&pair[0], &pair[1]);
                        }
                        Some(old) => (grew, shrank) = (grew + pair[1].len(), shrank + old.len()),
                    }
                }
                self.resize(&a[0], grew, shrank);
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
                let (grew, shrank) = match h.insert(a[1].clone(), next.to_string().into_bytes()) {
                    Some(old) => (next.to_string().len(), old.len()),
                    None => (field_bytes(&a[1], next.to_string().as_bytes()), 0),
                };
                self.resize(&a[0], grew, shrank);
                Ok(Resp::Int(next))
            }
            "HDEL" => {
                if a.len() < 2 {
                    return Err(arity_error());
                }
                let (n, shrank, empty) = match self.live(now, &a[0]).map(|e| &mut e.value) {
                    None => (0, 0, false),
                    Some(Value::Hash(h)) => {
                        let (mut n, mut shrank) = (0, 0);
                        for f in &a[1..] {
                            if let Some(v) = h.remove(f) {
                                (n, shrank) = (n + 1, shrank + field_bytes(f, &v));
                            }
                        }
                        (n, shrank, h.is_empty())
                    }
                    Some(_) => return Err(wrongtype()),
                };
                self.resize(&a[0], 0, shrank);
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
                let (mut added, mut grew) = (0, 0);
                for (score, member) in pairs {
                    let bytes = member_bytes(&member);
                    if z.add(score, member) == 1 {
                        (added, grew) = (added + 1, grew + bytes);
                    }
                }
                self.resize(&a[0], grew, 0);
                Ok(Resp::Int(added))
            }
            "ZREM" => {
                if a.len() < 2 {
                    return Err(arity_error());
                }
                let (n, shrank, empty) = match self.zset_mut(now, &a[0])? {
                    Some(z) => {
                        let removed: Vec<&Vec<u8>> = a[1..].iter().filter(|m| z.remove(m)).collect();
                        (removed.len(), removed.iter().map(|m| member_bytes(m)).sum(), z.scores.is_empty())
                    }
                    None => (0, 0, false),
                };
                self.resize(&a[0], 0, shrank);
                if empty {
                    self.remove(&a[0]);
                }
                Ok(Resp::Int(n as i64))
            }
            "ZSCORE" => {
                arity(a, 2)?;
                let score = self.zset(now, &a[0])?.and_then(|z| z.scores.get(&a[1]).copied());
                Ok(score.map_or(Resp::Nil, |s| Resp::Bulk(format_number(s.0).into_bytes())))
            }
            "ZRANGE" => self.zrange(now, a),
            "ZRANGEBYSCORE" => self.zrangebyscore(now, a),
            "XADD" => self.xadd(now, a),
            "XTRIM" => self.xtrim(now, a),
            "XLEN" => self.xlen(now, a),
            "XRANGE" => self.xrange(now, a),
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
        self.insert(&a[0], Value::Str(a[1].clone()));
        self.set_expiry(&a[0], expiry);
        Ok(Resp::Status("OK"))
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
            return self.insert(key, new());
        }
        self.entries.get_mut(key).expect("live above")
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
        let Some(entry) = self.entries.get_mut(key) else { return };
        if let Some(old) = std::mem::replace(&mut entry.expires_at, at) {
            self.unindex(old, key);
        }
        if let Some(at) = at {
            self.index(at, key);
        }
    }
}

/// Bytes held by one sorted-set member: kept in the score order and in the score map.
fn member_bytes(member: &[u8]) -> usize {
    2 * (member.len() + FIELD_COST)
}

/// Bytes held by a value as a key is made with it (a new hash, set or stream is empty).
fn value_bytes(value: &Value) -> usize {
    match value {
        Value::Str(v) => v.len(),
        Value::Hash(h) => h.iter().map(|(f, v)| field_bytes(f, v)).sum(),
        Value::ZSet(z) => z.scores.keys().map(|m| member_bytes(m)).sum(),
        Value::Stream(st) => st.bytes(),
    }
}

/// Formats a number the way Redis does when it turns a Lua number or a score into a string.
#[allow(clippy::cast_possible_truncation)] // a whole number under 1e17 fits an i64 exactly
pub fn format_number(n: f64) -> String {
    if n.fract() == 0.0 && n.abs() < 1e17 { format!("{}", n as i64) } else { format!("{n}") }
}

#[cfg(test)]
impl Keyspace {
    /// What the keyspace holds, counted from scratch: what [`Keyspace::used`] must always equal.
    fn recount(&self) -> usize {
        let entries: usize = self
            .entries
            .iter()
            .map(|(k, e)| {
                let value = match &e.value {
                    Value::Stream(st) => st.recount(),
                    v => value_bytes(v),
                };
                k.len() + KEY_COST + value
            })
            .sum();
        entries + self.expiries.iter().map(|(_, k)| k.len() + EXPIRY_COST).sum::<usize>()
    }
}

#[cfg(test)]
mod tests;
