//! A replica's scripts: `lease.lua` (its slices of a tenant's scopes), `lease_forward.lua` (an
//! operation on its leased hold left by another replica) and `heartbeat.lua` (how many replicas
//! are alive, and which record forms all of them read).

use super::reserve::{COMPACT_RECORD, push_limits};
use super::{Argv, Fields};
use crate::config::LedgerTerms;
use crate::hold::{Amounts, Counted, Detail, Ending, Forwarded, Headroom, Refusal, ScopeLimits};
use crate::store::{Protocol, Reply, Store, StoreError, keys};

/// `lease.lua`'s fixed `ARGV`, in order.
pub(crate) const ARGV: [&str; 10] = [
    "the replica's member in the lease index",
    "record key prefix",
    "lease (ms)",
    "idle TTL",
    "sweep batch",
    "cap on the concurrency Retry-After",
    "end | keep",
    "the call's sequence number",
    "the usage ledger's terms",
    "ledger entries",
];

/// Then these, per scope, in `KEYS` order.
pub(crate) const SCOPE_ARGV: [&str; 28] = [
    "token capacity",
    "tokens per ms",
    "request capacity",
    "requests per ms",
    "max concurrency",
    "input token capacity",
    "input tokens per ms",
    "output token capacity",
    "output tokens per ms",
    "period budgets",
    "tokens returned",
    "cost returned",
    "the day they were drawn on",
    "earlier tokens returned",
    "earlier cost returned",
    "the earlier day",
    "tokens charged today",
    "cost charged today",
    "requests returned",
    "slots held after the return",
    "tokens needed",
    "cost needed",
    "requests needed",
    "slots needed",
    "tokens wanted",
    "cost wanted",
    "requests wanted",
    "slots wanted",
];

/// `lease_forward.lua`'s `ARGV`, in order.
pub(crate) const FORWARD_ARGV: [&str; 3] = ["reservation id", "the operation", "TTL of the forwarded operations"];

/// `heartbeat.lua`'s `ARGV`, in order.
pub(crate) const HEARTBEAT_ARGV: [&str; 4] = [
    "this replica",
    "how long a replica counts",
    "the newest record form this replica reads",
    "how long a replica reading an older form is remembered",
];

/// What a heartbeat learned of the replicas sharing the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heard {
    /// The replicas heard within the heartbeat's TTL, this one included.
    pub replicas: u64,
    /// The newest record form every one of them reads.
    pub record_form: u64,
}

/// One scope of a lease call: what the replica gives back, the slots it keeps, and what it asks for.
#[derive(Debug, Clone)]
pub struct LeaseScope {
    pub key: String,
    pub limits: ScopeLimits,
    /// Tokens given back (negative: debt its holds ran up, charged now).
    pub back_tokens: i64,
    /// Money given back, in nanos (negative: debt, charged now).
    pub back_cost: i64,
    /// The day the tokens and money given back were drawn on (they come off that day's usage
    /// only, and that month's).
    pub back_day: u64,
    /// Refunds of holds drawn on an earlier day than the slice's, one day at a time: back to the
    /// bucket, and to that day's and month's usage while they are the store's current ones.
    pub back_earlier: Option<Earlier>,
    /// Charged to the scope today (its bucket, if any, and today's and this month's usage): what
    /// the replica's holds used of what the scope does not lease, and debt they ran up once the
    /// slice's day had passed.
    pub charge_tokens: u64,
    pub charge_cost: u64,
    pub back_requests: u64,
    /// Slots the replica holds after its return: the slots of its live holds.
    pub held_slots: u64,
    /// At least this, or nothing: what the request that asked needs beyond the slice it has.
    pub need: Amounts,
    /// As much as this, as far as the scope has it.
    pub want: Amounts,
}

/// Refunds of holds drawn on one earlier day.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Earlier {
    pub day: u64,
    pub tokens: u64,
    pub cost: u64,
}

/// One lease call of a replica on one tenant's scopes.
#[derive(Debug, Clone)]
pub struct LeaseCall<'a> {
    pub tenant: &'a str,
    pub replica: &'a str,
    /// How long the lease record lives unrenewed: the tenant's hold lease.
    pub lease_ms: u64,
    pub idle_ttl_ms: u64,
    pub sweep_batch: u32,
    pub concurrency_retry_cap_ms: u64,
    /// The replica leaves the tenant: drop its record if it holds no slot.
    pub ending: bool,
    /// This call's number among the replica's calls. A re-send of a call whose answer was lost
    /// carries the same number (and the same everything), and the store answers it as it did,
    /// forwarded operations included.
    pub seq: u64,
    pub scopes: Vec<LeaseScope>,
    /// The usage ledger's terms (`None`: there is none), and the entries of the leased holds the
    /// replica settled since its last call, each a line as `lua/lease.lua` reads them.
    pub ledger: Option<LedgerTerms>,
    pub entries: Vec<String>,
}

/// The store's answer to a lease call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseReply {
    pub outcome: LeaseOutcome,
    /// The store's day number (UTC days since the epoch) when the grants were drawn: the call's
    /// own run, which a re-send's answer repeats.
    pub day: u64,
    /// The store's clock (ms) when it answered, a re-send included.
    pub store_now: u64,
    pub headroom: Headroom,
    /// Operations other replicas forwarded for this replica's holds, now this replica's to apply.
    pub forwarded: Vec<(String, Forwarded)>,
    /// Ids of expired store holds the sweep settled (their pool legs are still to be released).
    pub swept: Vec<String>,
}

/// What a lease call drew, or why it drew nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseOutcome {
    /// Drawn, per scope in call order.
    Granted(Vec<Amounts>),
    /// Nothing drawn: a scope cannot give what the asking request needs.
    Refused { reason: Refusal, scope: usize, retry_after_ms: u64 },
}

impl<S: Store> Protocol<S> {
    /// A replica's lease call on one tenant (see `lua/lease.lua`).
    pub async fn lease(&self, call: &LeaseCall<'_>) -> Result<LeaseReply, StoreError> {
        let tenant = call.tenant;
        let mut keys = Vec::with_capacity(call.scopes.len().saturating_add(6));
        keys.extend([
            keys::leases(tenant),
            keys::holds(tenant),
            keys::lease_record(tenant, call.replica),
            keys::forwarded(tenant, call.replica),
            keys::ledger(tenant),
            keys::last_lease_call(tenant, call.replica),
        ]);
        let mut a = Argv::grouped("lease", &ARGV, &SCOPE_ARGV, call.scopes.len());
        a.push("the replica's member in the lease index", keys::lease_member(call.replica));
        a.push("record key prefix", keys::record_prefix(tenant));
        a.push("lease (ms)", call.lease_ms.to_string());
        a.push("idle TTL", call.idle_ttl_ms.to_string());
        a.push("sweep batch", call.sweep_batch.to_string());
        a.push("cap on the concurrency Retry-After", call.concurrency_retry_cap_ms.to_string());
        a.push("end | keep", if call.ending { "end" } else { "keep" }.to_string());
        a.push("the call's sequence number", call.seq.to_string());
        a.push(
            "the usage ledger's terms",
            call.ledger.map_or_else(String::new, |l| format!("{} {}", l.max_len, l.retention_ms)),
        );
        a.push("ledger entries", call.entries.join("\n"));
        for s in &call.scopes {
            keys.push(s.key.clone());
            push_limits(&mut a, &s.limits);
            a.push("tokens returned", s.back_tokens.to_string());
            a.push("cost returned", s.back_cost.to_string());
            a.push("the day they were drawn on", s.back_day.to_string());
            let earlier = s.back_earlier.unwrap_or(Earlier { day: s.back_day, tokens: 0, cost: 0 });
            a.push("earlier tokens returned", earlier.tokens.to_string());
            a.push("earlier cost returned", earlier.cost.to_string());
            a.push("the earlier day", earlier.day.to_string());
            a.push("tokens charged today", s.charge_tokens.to_string());
            a.push("cost charged today", s.charge_cost.to_string());
            a.push("requests returned", s.back_requests.to_string());
            a.push("slots held after the return", s.held_slots.to_string());
            for (name, n) in [
                ("tokens needed", s.need.tokens),
                ("cost needed", s.need.cost),
                ("requests needed", s.need.requests),
                ("slots needed", s.need.slots),
                ("tokens wanted", s.want.tokens),
                ("cost wanted", s.want.cost),
                ("requests wanted", s.want.requests),
                ("slots wanted", s.want.slots),
            ] {
                a.push(name, n.to_string());
            }
        }
        let script = &self.scripts.lease;
        let reply = self.store.eval(script, keys, a.finish()).await?;
        let r = Fields::of(script, &reply)?;
        let outcome = match r.uint(0)? {
            1 => {
                let Some(Reply::Array(rows)) = r.get(11) else { return Err(r.bad()) };
                let granted = rows
                    .iter()
                    .map(|row| match row {
                        Reply::Array(n) => {
                            let at = |i: usize| n.get(i).and_then(Reply::as_int).and_then(|v| u64::try_from(v).ok());
                            Some(Amounts { tokens: at(0)?, cost: at(1)?, requests: at(2)?, slots: at(3)? })
                        }
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| r.bad())?;
                if granted.len() != call.scopes.len() {
                    return Err(r.bad());
                }
                LeaseOutcome::Granted(granted)
            }
            0 => LeaseOutcome::Refused { reason: r.refusal(1)?, scope: r.scope(2)?, retry_after_ms: r.uint(3)? },
            _ => return Err(r.bad()),
        };
        let ops = r.texts(12)?;
        let forwarded = ops
            .chunks(2)
            .filter_map(|pair| match pair {
                [id, op] => match decode(op) {
                    Some(f) => Some((id.clone(), f)),
                    None => {
                        tracing::warn!(reservation = %id, op = %op, "a forwarded operation could not be read; dropped");
                        None
                    }
                },
                _ => None,
            })
            .collect();
        Ok(LeaseReply {
            outcome,
            day: r.uint(4)?,
            headroom: Headroom { tokens: r.window([5, 6, 7])?, requests: r.window([8, 9, 10])?, ..Headroom::default() },
            forwarded,
            swept: r.texts(13)?,
            store_now: r.uint(14)?,
        })
    }

    /// Leaves an operation on a leased hold for the replica that holds it. `Ok(false)`: that
    /// replica holds no lease on the tenant any more (it stopped; its holds settle as expired).
    pub async fn forward(
        &self,
        tenant: &str,
        replica: &str,
        id: &str,
        op: Forwarded,
        ttl_ms: u64,
    ) -> Result<bool, StoreError> {
        let script = &self.scripts.lease_forward;
        let keys = vec![keys::forwarded(tenant, replica), keys::lease_record(tenant, replica)];
        let mut a = Argv::new("lease_forward", &FORWARD_ARGV, 0);
        a.push("reservation id", id.to_string());
        a.push("the operation", encode(op));
        a.push("TTL of the forwarded operations", ttl_ms.to_string());
        let reply = self.store.eval(script, keys, a.finish()).await?;
        match reply.as_text() {
            Some("forwarded") => Ok(true),
            Some("gone") => Ok(false),
            _ => Err(StoreError::BadReply { script: script.name, reply }),
        }
    }

    /// Says this replica is alive (for `ttl_ms`) and reads records up to [`COMPACT_RECORD`];
    /// returns how many replicas are, and the newest record form all of them read, a replica
    /// reading an older one remembered for `older_ms` after the last heartbeat that heard it.
    pub async fn heartbeat(&self, replica: &str, ttl_ms: u64, older_ms: u64) -> Result<Heard, StoreError> {
        let script = &self.scripts.heartbeat;
        let mut a = Argv::new("heartbeat", &HEARTBEAT_ARGV, 0);
        a.push("this replica", replica.to_string());
        a.push("how long a replica counts", ttl_ms.to_string());
        a.push("the newest record form this replica reads", COMPACT_RECORD.to_string());
        a.push("how long a replica reading an older form is remembered", older_ms.to_string());
        let keys = vec![keys::replicas(), keys::oldest_record_form()];
        let reply = self.store.eval(script, keys, a.finish()).await?;
        let number = |r: Option<&Reply>| r.and_then(Reply::as_int).and_then(|n| u64::try_from(n).ok());
        let heard = match &reply {
            Reply::Array(v) if v.len() == 2 => number(v.first()).zip(number(v.get(1))),
            _ => None,
        };
        heard
            .map(|(replicas, record_form)| Heard { replicas, record_form })
            .ok_or(StoreError::BadReply { script: script.name, reply })
    }
}

/// A forwarded operation as `lease_forward.lua` keeps it:
/// `commit <prompt|-> <output|-> exact|metered <cache reads|-> <cache writes|-> <reasoning|-> <ending>`,
/// `release <ending>` or `renew <ms>`. An operation that says nothing its short form does not,
/// `commit <prompt|-> <output|-> exact|metered` (ending as its counts say, no cache or reasoning
/// counts) and `release` (released), is written short, as a replica from before the rest was kept
/// reads it: during a rolling update the owner may be one.
fn encode(op: Forwarded) -> String {
    let count = |n: Option<u64>| n.map_or_else(|| "-".to_string(), |n| n.to_string());
    match op {
        Forwarded::Commit(counted, ending) if ending == Ending::of(counted) && plain(counted) => match counted {
            Counted::Exact { prompt, output, .. } => format!("commit {prompt} {output} exact"),
            Counted::Metered { output } => format!("commit - {output} metered"),
            Counted::AsHeld => "commit - - metered".to_string(),
        },
        Forwarded::Release(Ending::Released) => "release".to_string(),
        Forwarded::Commit(counted, ending) => {
            let (prompt, output, measure, detail) = match counted {
                Counted::Exact { prompt, output, detail } => (Some(prompt), Some(output), "exact", detail),
                Counted::Metered { output } => (None, Some(output), "metered", Detail::default()),
                Counted::AsHeld => (None, None, "metered", Detail::default()),
            };
            format!(
                "commit {} {} {measure} {} {} {} {}",
                count(prompt),
                count(output),
                count(detail.cache_read),
                count(detail.cache_write),
                count(detail.reasoning),
                ending.as_str()
            )
        }
        Forwarded::Release(ending) => format!("release {}", ending.as_str()),
        Forwarded::Renew { lease_ms } => format!("renew {lease_ms}"),
    }
}

/// Counts with nothing more said of them.
fn plain(counted: Counted) -> bool {
    !matches!(counted, Counted::Exact { detail, .. } if detail != Detail::default())
}

fn decode(op: &str) -> Option<Forwarded> {
    let words: Vec<&str> = op.split(' ').collect();
    let count = |w: &str| if w == "-" { Some(None) } else { w.parse::<u64>().ok().map(Some) };
    let counted = |prompt: &str, output: &str, measure: &str, detail: Detail| {
        Some(match (count(prompt)?, count(output)?, measure) {
            (Some(prompt), Some(output), "exact") => Counted::Exact { prompt, output, detail },
            (None, Some(output), "metered") if detail == Detail::default() => Counted::Metered { output },
            (None, None, "metered") if detail == Detail::default() => Counted::AsHeld,
            _ => return None,
        })
    };
    Some(match words.as_slice() {
        ["release"] => Forwarded::Release(Ending::Released),
        ["release", ending] => Forwarded::Release(Ending::parse(ending)?),
        ["renew", ms] => Forwarded::Renew { lease_ms: ms.parse().ok()? },
        ["commit", prompt, output, measure] => {
            let counted = counted(prompt, output, measure, Detail::default())?;
            Forwarded::Commit(counted, Ending::of(counted))
        }
        ["commit", prompt, output, measure, read, written, reasoning, ending] => {
            let detail =
                Detail { cache_read: count(read)?, cache_write: count(written)?, reasoning: count(reasoning)? };
            Forwarded::Commit(counted(prompt, output, measure, detail)?, Ending::parse(ending)?)
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarded_operations_read_back_as_written() {
        let said = Detail { cache_read: Some(600), cache_write: None, reasoning: Some(12) };
        for op in [
            Forwarded::Commit(Counted::Exact { prompt: 1000, output: 50, detail: said }, Ending::Completed),
            Forwarded::Commit(Counted::exact(3, 4), Ending::UpstreamError),
            Forwarded::Commit(Counted::Metered { output: 9 }, Ending::ClientLeft),
            Forwarded::Commit(Counted::AsHeld, Ending::AsHeld),
            Forwarded::Release(Ending::UpstreamRefused),
            Forwarded::Renew { lease_ms: 250 },
        ] {
            assert_eq!(decode(&encode(op)), Some(op), "{}", encode(op));
        }
        // As a replica from before cached counts and endings were kept wrote them, and as this one
        // writes what says nothing more, for such a replica to read.
        assert_eq!(decode("commit 3 4 exact"), Some(Forwarded::Commit(Counted::exact(3, 4), Ending::Completed)));
        assert_eq!(encode(Forwarded::Commit(Counted::exact(3, 4), Ending::Completed)), "commit 3 4 exact");
        assert_eq!(encode(Forwarded::Commit(Counted::AsHeld, Ending::AsHeld)), "commit - - metered");
        assert_eq!(encode(Forwarded::Release(Ending::Released)), "release");
        assert_eq!(encode(Forwarded::Release(Ending::UpstreamError)), "release upstream_error");
        assert_eq!(
            decode("commit - 9 metered"),
            Some(Forwarded::Commit(Counted::Metered { output: 9 }, Ending::Metered))
        );
        assert_eq!(decode("release"), Some(Forwarded::Release(Ending::Released)));
        for bad in [
            "commit 3 4 exact x - - completed",
            "commit - 4 exact",
            "commit 3 4 metered",
            "commit - 4 metered 1 - - metered",
            "commit 3 4 exact - - - finished",
            "release later",
            "renew",
        ] {
            assert_eq!(decode(bad), None, "{bad}");
        }
    }
}
