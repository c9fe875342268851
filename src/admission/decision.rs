//! What admission answers. The reason table lives here, once: each reason's HTTP status and
//! whether retrying can ever help. `grpc::response` turns a [`Decision`] into headers and a body.

use crate::hold::Headroom;

/// Why a request was refused. Distinct reasons, because one 429 for everything tells a client to
/// retry when retrying is hopeless, and tells a proxy that a saturated backend is a quota problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The token bucket of the limiting scope is empty.
    TokenRate,
    RequestRate,
    /// Every concurrency slot is held.
    Concurrency,
    /// The day's token budget is spent.
    Budget,
    /// Backend capacity, not client quota.
    QueueFull,
    /// A rate of the provider account behind the pool, shared by every tenant: not the
    /// client's quota.
    ProviderRate,
    /// A period budget of the provider account behind the pool is spent.
    ProviderBudget,
    /// The predicted wait already exceeds the caller's deadline.
    Deadline,
    /// Larger than the scope's whole capacity: retrying can never work.
    Unsatisfiable,
    /// No tenant identity.
    Unauthenticated,
    InvalidRequest,
    /// The store is down and the tenant fails closed.
    StoreUnavailable,
}

impl Reason {
    /// The code in `x-tollgate-reason` and in the error body.
    pub fn code(self) -> &'static str {
        match self {
            Reason::TokenRate => "token_rate",
            Reason::RequestRate => "request_rate",
            Reason::Concurrency => "concurrency",
            Reason::Budget => "budget",
            Reason::QueueFull => "queue_full",
            Reason::ProviderRate => "provider_rate",
            Reason::ProviderBudget => "provider_budget",
            Reason::Deadline => "deadline",
            Reason::Unsatisfiable => "unsatisfiable",
            Reason::Unauthenticated => "unauthenticated",
            Reason::InvalidRequest => "invalid_request",
            Reason::StoreUnavailable => "store_unavailable",
        }
    }

    pub fn http_status(self) -> u16 {
        match self {
            Reason::TokenRate | Reason::RequestRate | Reason::Concurrency | Reason::Budget => 429,
            Reason::QueueFull
            | Reason::ProviderRate
            | Reason::ProviderBudget
            | Reason::Deadline
            | Reason::StoreUnavailable => 503,
            Reason::Unsatisfiable | Reason::InvalidRequest => 400,
            Reason::Unauthenticated => 401,
        }
    }

    /// Whether the wait a refusal gives is only an upper bound: concurrency's, the oldest lease's
    /// end, where a commit usually frees a slot sooner.
    pub fn waits_at_most(self) -> bool {
        self == Reason::Concurrency
    }

    /// Whether waiting and retrying the same request can succeed: whether a refusal computes a
    /// wait (`retry-after`), and the first half of [`Denial::should_retry`].
    pub fn retryable(self) -> bool {
        matches!(
            self,
            Reason::TokenRate
                | Reason::RequestRate
                | Reason::Concurrency
                | Reason::Budget
                | Reason::QueueFull
                | Reason::ProviderRate
                | Reason::ProviderBudget
                | Reason::StoreUnavailable
        )
    }

    /// The OpenAI-style error `type` for the body.
    pub fn error_type(self) -> &'static str {
        match self {
            Reason::TokenRate | Reason::RequestRate | Reason::Concurrency | Reason::Budget => "rate_limit_error",
            Reason::QueueFull
            | Reason::ProviderRate
            | Reason::ProviderBudget
            | Reason::Deadline
            | Reason::StoreUnavailable => "overloaded_error",
            Reason::Unsatisfiable | Reason::InvalidRequest => "invalid_request_error",
            Reason::Unauthenticated => "authentication_error",
        }
    }

    /// Every reason, in table order.
    pub const ALL: [Reason; 12] = [
        Reason::TokenRate,
        Reason::RequestRate,
        Reason::Concurrency,
        Reason::Budget,
        Reason::QueueFull,
        Reason::ProviderRate,
        Reason::ProviderBudget,
        Reason::Deadline,
        Reason::Unsatisfiable,
        Reason::Unauthenticated,
        Reason::InvalidRequest,
        Reason::StoreUnavailable,
    ];
}

/// A request admitted: its hold is live until committed, released or expired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    pub reservation_id: String,
    /// The model the hold was made for (goes upstream, so the commit from the response meters it).
    pub model: String,
    pub reserved_tokens: u64,
    /// The reserves its idempotency key has made, this one included (1 without a key).
    pub attempts: u32,
    /// The idempotency key gave back its earlier live hold (`Admission/Reserve` only): the same
    /// reservation, nothing new charged.
    pub replayed: bool,
    pub headroom: Headroom,
    /// The tenant is in shadow and its limits would have refused this request, for this reason:
    /// admitted (and held) anyway, and marked so.
    pub shadow: Option<Reason>,
    /// The tenant's soft budget this request is past: admitted, marked, and (from this replica's
    /// next request on, until the period turns) one tier lower in its pool.
    pub soft_limit: Option<crate::hold::BudgetKey>,
    /// The tier its pool leg was decided at.
    pub tier: crate::config::Priority,
    /// What capacity admission predicted, when the request holds pool work.
    pub forecast: Option<Forecast>,
    /// The most output the request itself allows (its `max_tokens`, times its outputs), when it
    /// named a limit: the commit from the response holds a metered count to it. (Without one, the
    /// backend's own default applies, and a metered count stands.)
    pub output_ceiling: Option<u64>,
}

/// What capacity admission predicted for a request it admitted into a pool: it goes upstream with
/// the request, so the commit from the response can time the pool by it (a request predicted to
/// start at once shows the pool's prefill in its first token) and count the stream's remaining
/// work down from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forecast {
    /// When the pool was predicted to start it (ms after admission).
    pub start_delay_ms: u64,
    /// The output its pool work was predicted for.
    pub output_tokens: u64,
}

/// A request refused. Nothing was charged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    pub reason: Reason,
    pub message: String,
    /// When retrying can help, how long to wait; computed from the limiting scope.
    pub retry_after_ms: Option<u64>,
    pub headroom: Headroom,
}

/// A wait past which a refusal tells clients not to retry by themselves (`x-should-retry: false`):
/// the OpenAI SDK's own limit, past which it gives up; Anthropic's would sleep through any wait,
/// a budget spent until midnight included.
pub const LONG_WAIT_MS: u64 = 120_000;

impl Denial {
    /// A refusal decided before the store was asked: no wait, no headroom.
    pub fn now(reason: Reason, message: impl Into<String>) -> Self {
        Denial { reason, message: message.into(), retry_after_ms: None, headroom: Headroom::default() }
    }

    /// Whether a client should retry by itself: the reason allows it, and its wait is one an SDK
    /// may sleep through (at most [`LONG_WAIT_MS`]). A concurrency wait is only an upper bound (a
    /// commit usually frees a slot sooner), so it never says not to.
    pub fn should_retry(&self) -> bool {
        self.reason.retryable()
            && (self.reason.waits_at_most() || self.retry_after_ms.is_none_or(|ms| ms <= LONG_WAIT_MS))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Admitted(Admitted),
    /// Admitted without a hold, so with nothing to commit.
    Unmetered(Unmetered),
    Denied(Denial),
}

/// Why a request was admitted without a hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unmetered {
    /// The store could not be reached and the tenant fails open (or stays within its local share).
    StoreUnavailable,
    /// It costs nothing: a token count (Gemini's `countTokens`, Anthropic's `count_tokens`).
    Free,
}

impl Unmetered {
    /// As the `x-tollgate-unmetered` header says it.
    pub fn code(self) -> &'static str {
        match self {
            Unmetered::StoreUnavailable => "store_unavailable",
            Unmetered::Free => "free",
        }
    }
}
