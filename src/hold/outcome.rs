//! How each phase answered: a reserve's verdict, what a commit was told and what it charged, how a
//! renew or release found the hold, and the operations one replica leaves for another.

use super::BudgetKey;
use super::limits::Headroom;
use super::refusal::{Refusal, WouldRefuse};

/// The store's verdict on a reserve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveOutcome {
    Admitted {
        id: String,
        held: u64,
        attempts: u32,
        headroom: Headroom,
        /// The output part of the hold when it came from the estimate.
        estimated_output: Option<u64>,
        /// An idempotency key gave back its earlier live hold: nothing new was charged.
        replayed: bool,
        /// In shadow, the refusal the limits would have made.
        shadowed: Option<WouldRefuse>,
        /// The soft budget the hold left past, and the ms until its period ends.
        soft: Option<(BudgetKey, u64)>,
        /// The fewest concurrency slots a scope of the hold has left with it (`None`: no scope
        /// caps them).
        slots_left: Option<u64>,
    },
    Denied {
        reason: Refusal,
        /// Index into the scopes the reserve was called with of the scope that refused.
        scope: usize,
        retry_after_ms: u64,
        headroom: Headroom,
    },
}

/// A state a hold has been settled in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    Committed,
    LateCommitted,
    Released,
    Expired,
}

impl Settled {
    /// The state as the API and the ledger name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Settled::Committed => "committed",
            Settled::LateCommitted => "late_committed",
            Settled::Released => "released",
            Settled::Expired => "expired",
        }
    }
}

/// What a commit is told was used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// Counts the response (or the caller) reported, with what it said more of them (cached
    /// prompt tokens are charged at their weight and price).
    Exact { prompt: u64, output: u64, detail: super::Detail },
    /// Counted by tollgate from the text that passed; the prompt is the one held at admission.
    Metered { output: u64 },
    /// Not countable (a compressed body, a format tollgate does not read): the hold is charged as
    /// it was made, prompt and output.
    AsHeld,
}

impl Counted {
    /// Reported counts, with nothing more said of them.
    pub fn exact(prompt: u64, output: u64) -> Counted {
        Counted::Exact { prompt, output, detail: super::Detail::default() }
    }
}

/// How a hold's request ended, as whoever settled it saw it: kept with the settled hold, entered
/// in the ledger, counted as a metric label, and given in the answer to a repeated commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ending {
    /// The response completed and reported its counts (or the caller committed its own).
    Completed,
    /// The response completed without counts: its output was counted by tollgate.
    Metered,
    /// As `Metered`, and the count was held to the most output the request allowed (its
    /// `max_tokens`): the bytes passed read as more.
    MeteredCapped,
    /// The response completed in a form tollgate cannot count: charged as held.
    AsHeld,
    /// The client went away (or Envoy reset the stream) before the response ended: charged what
    /// passed.
    ClientLeft,
    /// The backend refused the request (a 4xx, a 429).
    UpstreamRefused,
    /// The backend failed (a 5xx).
    UpstreamError,
    /// Its caller gave it back.
    Released,
    /// Nobody came back before its lease ran out.
    Expired,
}

impl Ending {
    pub const ALL: [Ending; 9] = [
        Ending::Completed,
        Ending::Metered,
        Ending::MeteredCapped,
        Ending::AsHeld,
        Ending::ClientLeft,
        Ending::UpstreamRefused,
        Ending::UpstreamError,
        Ending::Released,
        Ending::Expired,
    ];

    /// The name the API, the ledger and the metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            Ending::Completed => "completed",
            Ending::Metered => "metered",
            Ending::MeteredCapped => "metered_capped",
            Ending::AsHeld => "as_held",
            Ending::ClientLeft => "client_left",
            Ending::UpstreamRefused => "upstream_refused",
            Ending::UpstreamError => "upstream_error",
            Ending::Released => "released",
            Ending::Expired => "expired",
        }
    }

    pub fn parse(name: &str) -> Option<Ending> {
        Ending::ALL.into_iter().find(|e| e.as_str() == name)
    }

    /// A commit's ending when nothing more is known: what its counts say.
    pub fn of(counted: Counted) -> Ending {
        match counted {
            Counted::Exact { .. } => Ending::Completed,
            Counted::Metered { .. } => Ending::Metered,
            Counted::AsHeld => Ending::AsHeld,
        }
    }
}

/// What a commit charged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    /// The hold had expired before its usage arrived.
    pub late: bool,
    /// An earlier commit of this id charged it; this is that commit's result.
    pub duplicate: bool,
    /// The counts charged were metered by tollgate, not reported.
    pub metered: bool,
    pub used: u64,
    pub held: u64,
    pub refunded: u64,
    pub overrun: u64,
    /// The model the request named (none for a hold whose record predates it).
    pub model: Option<String>,
    /// The output part of what was held (the rest was the prompt estimate), when known.
    pub output_held: Option<u64>,
    /// What the usage cost at the model's price when the hold was made (nanos; 0 unpriced).
    pub cost_nanos: u64,
    /// How the request ended, as the commit that settled it said (for a hold settled before
    /// endings were kept, what its entry implies: completed, or metered).
    pub ending: Option<Ending>,
}

/// The store's answer to a commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitOutcome {
    Committed(Usage),
    /// The hold was released; it cannot be committed, and nothing was charged.
    Released,
    NotFound,
    /// A leased hold of another replica: the commit was left for it, which applies it within one
    /// lease window.
    Forwarded,
}

impl CommitOutcome {
    /// `committed`, `late_committed`, `released` or `not_found`, as the API names them.
    pub fn state(&self) -> &'static str {
        match self {
            CommitOutcome::Committed(u) if u.late => "late_committed",
            CommitOutcome::Committed(_) => "committed",
            CommitOutcome::Released => "released",
            CommitOutcome::NotFound => "not_found",
            CommitOutcome::Forwarded => "forwarded",
        }
    }

    /// What the commit charged, when it charged.
    pub fn usage(&self) -> Option<&Usage> {
        match self {
            CommitOutcome::Committed(u) => Some(u),
            _ => None,
        }
    }
}

/// The store's answer to a renew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenewOutcome {
    Renewed {
        lease_remaining_ms: u64,
    },
    /// Too late: the hold was already settled (or expired as this call found it).
    Settled(Settled),
    NotFound,
    /// Left for the replica that holds the leased hold.
    Forwarded,
}

impl RenewOutcome {
    /// The hold's state as the API names it.
    pub fn state(&self) -> &'static str {
        match self {
            RenewOutcome::Renewed { .. } => "reserved",
            RenewOutcome::Settled(s) => s.as_str(),
            RenewOutcome::NotFound => "not_found",
            RenewOutcome::Forwarded => "forwarded",
        }
    }
}

/// The store's answer to a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// Released; `repeated` when an earlier call did it (the refund is that call's, given once).
    Released {
        refunded: u64,
        repeated: bool,
    },
    /// Settled otherwise before this call (or expired as this call found it).
    Settled(Settled),
    NotFound,
    /// Left for the replica that holds the leased hold.
    Forwarded,
}

impl ReleaseOutcome {
    /// The hold's state as the API names it.
    pub fn state(&self) -> &'static str {
        match self {
            ReleaseOutcome::Released { .. } => "released",
            ReleaseOutcome::Settled(s) => s.as_str(),
            ReleaseOutcome::NotFound => "not_found",
            ReleaseOutcome::Forwarded => "forwarded",
        }
    }
}

/// An operation on a leased hold that reached another replica, handed to the one that holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forwarded {
    Commit(Counted, Ending),
    Release(Ending),
    Renew { lease_ms: u64 },
}
