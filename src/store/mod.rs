//! Where the counters live. The protocol itself is the Lua in `lua/`; a store only has to run a
//! script atomically against its keyspace. [`Store`] is that one capability, and [`Protocol`] turns
//! the phases into typed calls over any store, one codec per script ([`phase`]), so the argument
//! and reply layouts exist once. The nouns those calls speak are [`crate::hold`]'s.
//!
//! - [`embedded`]: the same scripts on an in-process Lua 5.1 over an in-memory keyspace (one replica,
//!   no Redis), with an injectable clock.
//! - [`redis`]: Redis or Redis Cluster through fred, scripts loaded at start and called by SHA.
//! - [`observed`]: a store whose every call is timed and shown to an observer (the metrics).
//! - [`backend`]: the store a policy names, opened (the one place that choice is made), Redis
//!   behind a [`breaker`].

// Token arithmetic: no unchecked +, -, * (see Cargo.toml's [lints] for the casts).
#![warn(clippy::arithmetic_side_effects)]

pub mod backend;
pub mod breaker;
pub mod clock;
pub mod embedded;
pub mod keys;
pub mod observed;
pub mod phase;
mod protocol;
pub mod redis;
pub mod scripts;

use std::future::Future;

pub use phase::estimate::EstimateView;
pub use phase::lease::{Earlier, Heard, LeaseCall, LeaseOutcome, LeaseReply, LeaseScope};
pub use phase::pool::{PoolCall, PoolEnd, PoolOutcome, PoolRetry, PoolView, ProviderCall, ThrottleCall};
pub use phase::reserve::{COMPACT_RECORD, FULL_RECORD, KeyCall, ReserveCall, ReserveReply};
pub use phase::settle::{CommitCall, CommitTerms, Learning};
pub use phase::sweep::Swept;
pub use protocol::Protocol;
pub use scripts::Script;

/// A reply from a script, in Redis's reply types (what a Lua return value converts to).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Nil,
    Int(i64),
    Text(String),
    Array(Vec<Reply>),
}

impl Reply {
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Reply::Int(n) => Some(*n),
            Reply::Text(s) => s.parse().ok(),
            _ => None,
        }
    }

    pub fn as_text(&self) -> Option<&str> {
        match self {
            Reply::Text(s) => Some(s),
            _ => None,
        }
    }
}

/// Why a store call failed. Transient errors are worth a retry by the caller; the others are bugs
/// or configuration.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unreachable: {0}")]
    Unavailable(String),
    #[error("script {script} failed: {message}")]
    Script { script: &'static str, message: String },
    #[error("script {script} replied with an unexpected shape: {reply:?}")]
    BadReply { script: &'static str, reply: Reply },
}

impl StoreError {
    /// True when the store could not be reached or timed out: the same call may succeed later.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }
}

/// A keyspace that runs a Lua script atomically: no other script or command interleaves with it.
pub trait Store: Send + Sync + 'static {
    /// Makes `script` ready to run, so that a broken script fails the start, not the first request.
    fn load(&self, script: &Script) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Runs `script` with Redis's `KEYS` and `ARGV`.
    fn eval(
        &self,
        script: &Script,
        keys: Vec<String>,
        args: Vec<String>,
    ) -> impl Future<Output = Result<Reply, StoreError>> + Send;
}
