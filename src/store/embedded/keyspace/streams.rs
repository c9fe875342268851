//! Streams, the usage ledger: XADD (MAXLEN, `*` ids), XTRIM (MINID), XLEN, XRANGE. Every entry
//! XADD appends is also handed to the keyspace's [`super::LedgerSink`] when it has one.

use super::{
    CmdResult, FIELD_COST, Keyspace, Resp, Value, arity, arity_error, field_bytes, int_arg, positive, wrongtype,
};

/// A stream entry's id: milliseconds and a sequence within them.
pub(super) type StreamId = (u64, u64);

/// A stream entry's fields and values, in order.
type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// A stream: entries in id order, and the last id given (ids only grow, even past trimming).
#[derive(Debug, Default)]
pub(super) struct Stream {
    entries: std::collections::BTreeMap<StreamId, Fields>,
    last: StreamId,
    /// What its entries hold, as the keyspace counts it.
    bytes: usize,
}

impl Stream {
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    #[cfg(test)]
    pub(super) fn recount(&self) -> usize {
        self.entries.values().map(entry_bytes).sum()
    }
}

/// Bytes held by one stream entry: its id and its fields.
fn entry_bytes(fields: &Fields) -> usize {
    FIELD_COST + fields.iter().map(|(f, v)| field_bytes(f, v)).sum::<usize>()
}

impl Keyspace {
    /// `XADD key [MAXLEN [~|=] n] * field value ...`: the id is the clock's millisecond, and a
    /// sequence within it.
    pub(super) fn xadd(&mut self, now: u64, a: &[Vec<u8>]) -> CmdResult {
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
        let grew = entry_bytes(&fields);
        st.entries.insert(id, fields.clone());
        let mut shrank = 0;
        if let Some(max) = max_len {
            while st.entries.len() as u64 > max {
                shrank += st.entries.pop_first().map_or(0, |(_, f)| entry_bytes(&f));
            }
        }
        st.bytes = st.bytes + grew - shrank;
        self.resize(&a[0], grew, shrank);
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

    pub(super) fn xtrim(&mut self, now: u64, a: &[Vec<u8>]) -> CmdResult {
        arity(a, 4)?;
        if !a[1].eq_ignore_ascii_case(b"MINID") || &a[2][..] != b"~" && &a[2][..] != b"=" {
            return Err("ERR syntax error (embedded XTRIM takes only MINID ~|= id)".into());
        }
        let min = stream_id(&a[3])?;
        let (trimmed, shrank) = match self.stream_mut(now, &a[0])? {
            Some(st) => {
                let keep = st.entries.split_off(&min);
                let trimmed = std::mem::replace(&mut st.entries, keep);
                let shrank = trimmed.values().map(entry_bytes).sum();
                st.bytes -= shrank;
                (trimmed.len(), shrank)
            }
            None => (0, 0),
        };
        self.resize(&a[0], 0, shrank);
        Ok(Resp::Int(trimmed as i64))
    }

    pub(super) fn xlen(&mut self, now: u64, a: &[Vec<u8>]) -> CmdResult {
        arity(a, 1)?;
        Ok(Resp::Int(self.stream_mut(now, &a[0])?.map_or(0, |st| st.entries.len() as i64)))
    }

    pub(super) fn xrange(&mut self, now: u64, a: &[Vec<u8>]) -> CmdResult {
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
                out.push(Resp::Array(vec![Resp::Bulk(format_id(*id).into_bytes()), Resp::Array(flat.collect())]));
            }
        }
        Ok(Resp::Array(out))
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
