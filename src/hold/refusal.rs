//! Why a script refused: the tenant's limits, an idempotency key, or a backend pool.

use super::BudgetKey;

/// What a second reserve under the same idempotency key means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyRepeat {
    /// The caller lost the answer (`Admission/Reserve`): give back the key's live hold, charging
    /// nothing new.
    ReturnHold,
    /// A retried request (Envoy's `Check`): it will reach the backend too, so it is a new attempt
    /// with a hold of its own.
    NewAttempt,
}

/// What the limits would have said of a hold made in shadow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WouldRefuse {
    pub reason: Refusal,
    /// Index into the scopes the reserve was called with.
    pub scope: usize,
    pub retry_after_ms: u64,
}

/// Which limit a reserve script refused on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    TokenRate,
    /// The bucket of prompt tokens alone (`input_tokens_per_minute`).
    InputRate,
    /// The bucket of output tokens alone (`output_tokens_per_minute`).
    OutputRate,
    RequestRate,
    Concurrency,
    Budget(BudgetKey),
    /// The idempotency key has made its most reserves.
    Attempts,
    /// The idempotency key was first used for a different request.
    Conflict,
    /// The hold is larger than a scope's whole capacity.
    Unsatisfiable,
}

/// Why a pool refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolRefusal {
    /// The predicted finish is past the caller's deadline.
    Deadline,
    /// The tier's share of the pool is full: its predicted queue delay is past the max.
    QueueFull,
    /// The provider behind the pool refused with a Retry-After that has not passed.
    Throttled,
    /// The tier is contended and the tenant already holds its weight's share of it.
    FairShare,
    /// The provider's limits on the pool (`provider_limits`), as the request's tier may use them,
    /// cannot take it: a rate (token, input, output or request), a period budget, or larger than
    /// the tier's share of one could ever be (`Unsatisfiable`).
    Provider(Refusal),
}
