//! The usage ledger, read out. The scripts that settle holds append one entry per settled hold to
//! the tenant's ledger stream (`lua/common.lua` lists the fields), so billing reads what the
//! counters charged, in the same atomic step. This module turns entries into JSON lines: as the
//! embedded store appends them (its ledger file), and as `tollgate ledger` reads them from Redis
//! through a consumer group.
//!
//! Delivery is at least once: an entry is acknowledged only after its line is written and flushed,
//! so a reader that stops in between writes it again next time. A consumer keeps one row per
//! reservation id (`id`), the last one it saw winning: that makes a repeat harmless, and lets a
//! `late_committed` entry replace the `expired` entry of the same hold.

use std::borrow::Cow;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use fred::prelude::ClientLike;
use fred::types::scan::ScanType;
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::store::embedded::LedgerSink;
use crate::store::redis::RedisStore;
use crate::store::{Reply, Script, Store, StoreError, keys};

/// Fields whose values are whole numbers, written as JSON numbers.
const NUMBERS: [&str; 8] = [
    "prompt_tokens",
    "output_tokens",
    "reserved_tokens",
    "charged_tokens",
    "cost_nanos",
    "reserved_cost_nanos",
    "reserved_at_ms",
    "settled_at_ms",
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

/// The embedded store's ledger: every entry appended to `path` as a JSON line, in one write, as the
/// script that settles the hold runs. A write that fails is logged; the entry stays in the store's
/// stream (and its counters are charged all the same).
pub fn file_sink(path: &Path) -> std::io::Result<LedgerSink> {
    let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    let shown = path.display().to_string();
    Ok(Box::new(move |_key, id, fields| {
        let fields: Vec<(Cow<'_, str>, Cow<'_, str>)> =
            fields.iter().map(|(f, v)| (String::from_utf8_lossy(f), String::from_utf8_lossy(v))).collect();
        let mut line = entry_json(id, fields.iter().map(|(f, v)| (f.as_ref(), v.as_ref())));
        line.push('\n');
        if let Err(e) = file.write_all(line.as_bytes()) {
            tracing::error!(file = %shown, error = %e, entry = %line.trim_end(), "cannot append to the ledger file");
        }
    }))
}

/// How `tollgate ledger` reads.
#[derive(Debug, Clone)]
pub struct ReaderSettings {
    /// The consumer group: readers in one group share the entries; each group gets them all.
    pub group: String,
    /// This reader's name within the group.
    pub consumer: String,
    /// Entries per read.
    pub batch: u32,
    /// Entries another consumer of the group read and left unacknowledged this long become this
    /// one's (it stopped); 0: never.
    pub claim_idle_ms: u64,
}

/// What one pass wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Drained {
    /// Entries written out (and then acknowledged).
    pub written: u64,
    /// Entries read once but trimmed before they were acknowledged: gone from the store.
    pub lost: u64,
}

impl std::ops::AddAssign for Drained {
    fn add_assign(&mut self, other: Drained) {
        self.written = self.written.saturating_add(other.written);
        self.lost = self.lost.saturating_add(other.lost);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("cannot write the ledger out: {0}")]
    Write(#[from] std::io::Error),
}

/// Reads every tenant's ledger stream on a Redis or a Redis Cluster.
pub struct Reader {
    store: RedisStore,
    read: Script,
    ack: Script,
    settings: ReaderSettings,
}

impl Reader {
    pub async fn new(store: RedisStore, settings: ReaderSettings) -> Result<Self, StoreError> {
        let read = Script::new("ledger_read", include_str!("../lua/ledger_read.lua").to_string());
        let ack = Script::new("ledger_ack", include_str!("../lua/ledger_ack.lua").to_string());
        store.load(&read).await?;
        store.load(&ack).await?;
        Ok(Reader { store, read, ack, settings })
    }

    /// Every tenant's ledger stream: a `SCAN` of every primary for stream keys of the ledger's
    /// pattern.
    pub async fn streams(&self) -> Result<Vec<String>, StoreError> {
        let client = self.store.client();
        let pattern = keys::LEDGER_PATTERN;
        let found: Vec<_> = if client.is_clustered() {
            client.scan_cluster_buffered(pattern, Some(1000), Some(ScanType::Stream)).collect().await
        } else {
            client.scan_buffered(pattern, Some(1000), Some(ScanType::Stream)).collect().await
        };
        let mut streams = Vec::with_capacity(found.len());
        for key in found {
            let key = key.map_err(|e| StoreError::Unavailable(format!("cannot scan for ledger streams: {e}")))?;
            let key = key.as_str_lossy().into_owned();
            if keys::ledger_tenant(&key).is_some() {
                streams.push(key);
            }
        }
        streams.sort();
        streams.dedup();
        Ok(streams)
    }

    /// Writes out, as JSON lines, every entry of `stream` this consumer has not acknowledged:
    /// first those it read before and did not acknowledge (it stopped in between), then those
    /// nobody has read. Each batch is flushed before it is acknowledged.
    pub async fn drain(&self, stream: &str, out: &mut impl Write) -> Result<Drained, LedgerError> {
        let mut drained = Drained::default();
        for from in ["0", ">"] {
            loop {
                let (batch, lost) = self.read_batch(stream, from).await?;
                if batch.is_empty() {
                    break;
                }
                for (_, line) in batch.iter().filter(|(_, line)| !line.is_empty()) {
                    out.write_all(line.as_bytes())?;
                    out.write_all(b"\n")?;
                }
                out.flush()?;
                let mut args = vec![self.settings.group.clone()];
                args.extend(batch.iter().map(|(id, _)| id.clone()));
                self.store.eval(&self.ack, vec![stream.to_string()], args).await?;
                let n = u64::try_from(batch.len()).unwrap_or(u64::MAX);
                drained += Drained { written: n.saturating_sub(lost), lost };
                if n < u64::from(self.settings.batch) {
                    break;
                }
            }
        }
        if drained.lost > 0 {
            tracing::warn!(stream, lost = drained.lost, "ledger entries were trimmed before they were acknowledged");
        }
        Ok(drained)
    }

    /// One read: (entry id, JSON line, or empty for an entry trimmed meanwhile), and how many of
    /// those were trimmed.
    async fn read_batch(&self, stream: &str, from: &str) -> Result<(Vec<(String, String)>, u64), StoreError> {
        let s = &self.settings;
        let args = vec![
            s.group.clone(),
            s.consumer.clone(),
            s.batch.to_string(),
            from.to_string(),
            s.claim_idle_ms.to_string(),
        ];
        let reply = self.store.eval(&self.read, vec![stream.to_string()], args).await?;
        let bad = || StoreError::BadReply { script: self.read.name, reply: reply.clone() };
        let Reply::Array(items) = &reply else { return Err(bad()) };
        let mut batch = Vec::with_capacity(items.len() / 2);
        let mut lost = 0_u64;
        for pair in items.chunks(2) {
            let [Reply::Text(id), fields] = pair else { return Err(bad()) };
            let fields = match fields {
                Reply::Array(f) => f,
                Reply::Nil => &Vec::new(),
                _ => return Err(bad()),
            };
            if fields.is_empty() {
                lost = lost.saturating_add(1);
                batch.push((id.clone(), String::new()));
                continue;
            }
            let mut flat = Vec::with_capacity(fields.len());
            for f in fields {
                flat.push(f.as_text().ok_or_else(bad)?);
            }
            let line = entry_json(id, flat.chunks(2).filter_map(|p| Some((*p.first()?, *p.get(1)?))));
            batch.push((id.clone(), line));
        }
        Ok((batch, lost))
    }

    /// Drains every ledger stream once.
    pub async fn pass(&self, out: &mut impl Write) -> Result<Drained, LedgerError> {
        let streams = self.streams().await?;
        self.drain_all(&streams, out).await
    }

    async fn drain_all(&self, streams: &[String], out: &mut impl Write) -> Result<Drained, LedgerError> {
        let mut drained = Drained::default();
        for stream in streams {
            drained += self.drain(stream, out).await?;
        }
        Ok(drained)
    }

    /// Drains every stream, then again every `poll`, until `shutdown` (after the pass in
    /// progress) or, with `once`, after the first pass. The streams are looked for again (a
    /// `SCAN` of every primary) every `rescan`, so new tenants are picked up without scanning the
    /// keyspace at every poll. A pass that fails is logged and retried at the next poll unless
    /// `once`.
    pub async fn follow(
        &self,
        out: &mut impl Write,
        once: bool,
        poll: Duration,
        rescan: Duration,
        shutdown: CancellationToken,
    ) -> Result<Drained, LedgerError> {
        let mut total = Drained::default();
        let mut known: Option<(Vec<String>, tokio::time::Instant)> = None;
        loop {
            let streams = match known.take() {
                Some((streams, at)) if at.elapsed() < rescan => Ok((streams, at)),
                _ => self.streams().await.map(|s| (s, tokio::time::Instant::now())),
            };
            let pass = match streams {
                Ok((streams, at)) => {
                    let drained = self.drain_all(&streams, out).await;
                    known = Some((streams, at));
                    drained
                }
                Err(e) => Err(e.into()),
            };
            match pass {
                Ok(d) => total += d,
                Err(e) if once => return Err(e),
                Err(LedgerError::Write(e)) => return Err(LedgerError::Write(e)),
                Err(e) => tracing::warn!(error = %e, "a ledger pass failed; trying again"),
            }
            if once {
                return Ok(total);
            }
            tokio::select! {
                () = tokio::time::sleep(poll) => {}
                () = shutdown.cancelled() => return Ok(total),
            }
        }
    }
}
