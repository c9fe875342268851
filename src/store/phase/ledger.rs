//! `ledger_read.lua` and `ledger_ack.lua`: a tenant's ledger stream read through a consumer group,
//! and what was written out acknowledged. Not protocol phases (they settle nothing), so they are
//! loaded only by the reader that needs them.

use super::Argv;
use crate::store::{Reply, Script, Store, StoreError};

/// `ledger_read.lua`'s `ARGV`, in order.
pub(crate) const READ_ARGV: [&str; 5] =
    ["the consumer group", "this consumer", "most entries to return", "where to read", "entries another consumer left"];

/// `ledger_ack.lua`'s `ARGV`: the group, then the entry ids.
pub(crate) const ACK_ARGV: [&str; 1] = ["the consumer group"];
pub(crate) const ACK_GROUP: [&str; 1] = ["entry ids"];

/// Which entries a read returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFrom {
    /// This consumer's entries read before and not acknowledged (it stopped in between).
    Pending,
    /// Entries nobody in the group has read.
    New,
}

/// One entry read: its stream id and its fields, or `None` for an entry trimmed after it was read
/// and before it was acknowledged.
pub type Entry = (String, Option<Vec<(String, String)>>);

/// The two scripts over a store, loaded.
#[derive(Debug)]
pub struct LedgerStreams<S> {
    store: S,
    read: Script,
    ack: Script,
}

impl<S: Store> LedgerStreams<S> {
    /// Loads both scripts into `store`.
    pub async fn new(store: S) -> Result<Self, StoreError> {
        let read = Script::new("ledger_read", include_str!("../../../lua/ledger_read.lua").to_string());
        let ack = Script::new("ledger_ack", include_str!("../../../lua/ledger_ack.lua").to_string());
        store.load(&read).await?;
        store.load(&ack).await?;
        Ok(LedgerStreams { store, read, ack })
    }

    /// The store read (to look for streams on it).
    pub fn store(&self) -> &S {
        &self.store
    }

    /// At most `batch` entries of `stream` for `consumer` of `group`; with [`ReadFrom::Pending`],
    /// entries another consumer left unacknowledged for `claim_idle_ms` become this one's first
    /// (0: never).
    pub async fn read(
        &self,
        stream: &str,
        group: &str,
        consumer: &str,
        batch: u32,
        from: ReadFrom,
        claim_idle_ms: u64,
    ) -> Result<Vec<Entry>, StoreError> {
        let mut a = Argv::new("ledger_read", &READ_ARGV, 0);
        a.push("the consumer group", group.to_string());
        a.push("this consumer", consumer.to_string());
        a.push("most entries to return", batch.to_string());
        a.push("where to read", if from == ReadFrom::Pending { "0" } else { ">" }.to_string());
        a.push("entries another consumer left", claim_idle_ms.to_string());
        let reply = self.store.eval(&self.read, vec![stream.to_string()], a.finish()).await?;
        let bad = || StoreError::BadReply { script: self.read.name, reply: reply.clone() };
        let Reply::Array(items) = &reply else { return Err(bad()) };
        let mut entries = Vec::with_capacity(items.len() / 2);
        for pair in items.chunks(2) {
            let [Reply::Text(id), fields] = pair else { return Err(bad()) };
            let fields = match fields {
                Reply::Array(f) => f,
                Reply::Nil => &Vec::new(),
                _ => return Err(bad()),
            };
            if fields.is_empty() {
                entries.push((id.clone(), None));
                continue;
            }
            let mut flat = Vec::with_capacity(fields.len() / 2);
            for pair in fields.chunks(2) {
                let [Reply::Text(field), Reply::Text(value)] = pair else { return Err(bad()) };
                flat.push((field.clone(), value.clone()));
            }
            entries.push((id.clone(), Some(flat)));
        }
        Ok(entries)
    }

    /// Acknowledges `entries` of `stream` for `group`.
    pub async fn ack(
        &self,
        stream: &str,
        group: &str,
        entries: impl Iterator<Item = String>,
    ) -> Result<(), StoreError> {
        let (low, _) = entries.size_hint();
        let mut a = Argv::grouped("ledger_ack", &ACK_ARGV, &ACK_GROUP, low);
        a.push("the consumer group", group.to_string());
        for id in entries {
            a.push("entry ids", id);
        }
        self.store.eval(&self.ack, vec![stream.to_string()], a.finish()).await?;
        Ok(())
    }
}
