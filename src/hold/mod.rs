//! The protocol's nouns, with no I/O: what a hold is called, what it holds, how a phase answers.
//! The store's codecs (`store::phase`) turn these into a script's `KEYS`/`ARGV` and back;
//! admission and the edge speak only these.
//!
//! - [`id`]: the reservation id, which carries every leg of a hold.
//! - [`limits`]: a scope's limits as a decision applies them, and the headroom left after it.
//! - [`refusal`]: why a script refused.
//! - [`outcome`]: how each phase answered, what a commit was told and what it charged.
//! - [`ledger`]: a settled hold's ledger entry as a JSON line.

pub mod id;
pub mod ledger;
pub mod limits;
pub mod outcome;
pub mod refusal;

pub use crate::config::MAX_TOKEN_COUNT;
pub use id::{ReservationRef, parse_reservation_id};
pub use limits::{Amounts, Bucket, Headroom, ScopeLimits, Window};
pub use outcome::{CommitOutcome, Counted, Forwarded, ReleaseOutcome, RenewOutcome, ReserveOutcome, Settled, Usage};
pub use refusal::{Budget, KeyRepeat, PoolRefusal, Refusal, WouldRefuse};

/// One UTC day in milliseconds: budgets reset on the store's day number, `now / DAY_MS`.
pub const DAY_MS: u64 = 86_400_000;
