//! `tollgate ledger`: the usage ledger, read out. The scripts that settle holds append one entry
//! per settled hold to the tenant's ledger stream (`lua/common.lua` lists the fields), so billing
//! reads what the counters charged, in the same atomic step. This reads those streams from Redis
//! through a consumer group and writes each entry as a JSON line ([`crate::hold::ledger`], the
//! line the embedded store's ledger file writes too).
//!
//! Delivery is at least once: an entry is acknowledged only after its line is written and flushed,
//! so a reader that stops in between writes it again next time. A consumer keeps one row per
//! reservation id (`id`), the last one it saw winning: that makes a repeat harmless, and lets a
//! `late_committed` entry replace the `expired` entry of the same hold.

use std::io::Write;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::hold::ledger::entry_json;
use crate::store::phase::ledger::{LedgerStreams, ReadFrom};
use crate::store::redis::RedisStore;
use crate::store::{StoreError, keys};

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
    streams: LedgerStreams<RedisStore>,
    settings: ReaderSettings,
}

impl Reader {
    pub async fn new(store: RedisStore, settings: ReaderSettings) -> Result<Self, StoreError> {
        Ok(Reader { streams: LedgerStreams::new(store).await?, settings })
    }

    /// Every tenant's ledger stream: a `SCAN` of every primary for stream keys of the ledger's
    /// pattern.
    pub async fn streams(&self) -> Result<Vec<String>, StoreError> {
        let mut streams = self.streams.store().scan_streams(keys::LEDGER_PATTERN).await?;
        streams.retain(|key| keys::ledger_tenant(key).is_some());
        streams.sort();
        streams.dedup();
        Ok(streams)
    }

    /// Writes out, as JSON lines, every entry of `stream` this consumer has not acknowledged:
    /// first those it read before and did not acknowledge (it stopped in between), then those
    /// nobody has read. Each batch is flushed before it is acknowledged.
    pub async fn drain(&self, stream: &str, out: &mut impl Write) -> Result<Drained, LedgerError> {
        let mut drained = Drained::default();
        for from in [ReadFrom::Pending, ReadFrom::New] {
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
                let group = &self.settings.group;
                self.streams.ack(stream, group, batch.iter().map(|(id, _)| id.clone())).await?;
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
    async fn read_batch(&self, stream: &str, from: ReadFrom) -> Result<(Vec<(String, String)>, u64), StoreError> {
        let s = &self.settings;
        let entries = self.streams.read(stream, &s.group, &s.consumer, s.batch, from, s.claim_idle_ms).await?;
        let mut lost = 0_u64;
        let batch = entries
            .into_iter()
            .map(|(id, fields)| match fields {
                Some(fields) => {
                    let line = entry_json(&id, fields.iter().map(|(f, v)| (f.as_str(), v.as_str())));
                    (id, line)
                }
                None => {
                    lost = lost.saturating_add(1);
                    (id, String::new())
                }
            })
            .collect();
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
