//! The four phases as typed calls over any [`Store`]: this is the only Rust that knows the
//! `KEYS`/`ARGV` layout and the reply shape each script documents in its header.

use serde::Deserialize;

use super::{Reply, Script, Store, StoreError, keys, scripts::Scripts};

/// What happens to the tokens of a hold whose owner never came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ExpiredUsage {
    /// Missing usage is not zero usage: the slot is freed, the held tokens stay charged.
    #[default]
    ChargeReserved,
    /// The held tokens come back as if the request had never run.
    Refund,
}

impl ExpiredUsage {
    fn as_lua(self) -> &'static str {
        match self {
            ExpiredUsage::ChargeReserved => "charge",
            ExpiredUsage::Refund => "refund",
        }
    }
}

/// The limits of one scope as the reserve script takes them; zero means "no such limit".
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ScopeLimits {
    pub token_capacity: u64,
    pub tokens_per_ms: f64,
    pub request_capacity: u64,
    pub requests_per_ms: f64,
    pub max_concurrency: u64,
    pub daily_budget: u64,
}

/// Everything one reserve needs. Scope keys come from [`keys`]; the tenant's scope is first.
#[derive(Debug, Clone)]
pub struct ReserveCall<'a> {
    pub tenant: &'a str,
    pub model: &'a str,
    pub id: &'a str,
    pub prompt_tokens: u64,
    /// The output held unless the estimate says less: the request's max_tokens or the model's.
    pub output_ceiling: u64,
    /// Learn and reserve the output estimate: (samples needed, quantile); `None` holds the ceiling.
    pub adaptive: Option<(u64, f64)>,
    pub lease_ms: u64,
    pub idle_ttl_ms: u64,
    pub retention_ms: u64,
    pub expired_usage: ExpiredUsage,
    pub sweep_batch: u32,
    pub idempotency_key: Option<&'a str>,
    pub max_attempts: u32,
    pub concurrency_retry_cap_ms: u64,
    pub scopes: Vec<(String, ScopeLimits)>,
}

/// Remaining / limit / reset of the tightest scope, for the `x-ratelimit-*` headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub remaining: i64,
    pub limit: u64,
    pub reset_ms: u64,
}

/// The tightest token and request windows after a decision; `None` where no scope limits them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Headroom {
    pub tokens: Option<Window>,
    pub requests: Option<Window>,
}

/// Which limit a reserve script refused on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    TokenRate,
    RequestRate,
    Concurrency,
    Budget,
    /// The idempotency key has made its most attempts.
    Attempts,
    /// The hold is larger than a scope's whole capacity.
    Unsatisfiable,
}

impl Refusal {
    fn parse(s: &str) -> Option<Refusal> {
        Some(match s {
            "token_rate" => Refusal::TokenRate,
            "request_rate" => Refusal::RequestRate,
            "concurrency" => Refusal::Concurrency,
            "budget" => Refusal::Budget,
            "attempts" => Refusal::Attempts,
            "unsatisfiable" => Refusal::Unsatisfiable,
            _ => return None,
        })
    }
}

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
    },
    Denied {
        reason: Refusal,
        /// Index into [`ReserveCall::scopes`] of the scope that refused.
        scope: usize,
        retry_after_ms: u64,
        headroom: Headroom,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitOutcome {
    /// `committed`, `late_committed`, `released` or `not_found`.
    pub state: String,
    pub duplicate: bool,
    pub used: u64,
    pub held: u64,
    pub refunded: u64,
    pub overrun: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenewOutcome {
    /// `reserved` when renewed; otherwise the record's state or `not_found`.
    pub state: String,
    pub lease_remaining_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseOutcome {
    /// `released` when this call released it; otherwise the record's state or `not_found`.
    pub state: String,
    pub refunded: u64,
}

/// A tenant's learned output length for one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EstimateView {
    pub samples: u64,
    /// The tracked quantile, in tokens (0 before the first sample).
    pub quantile_tokens: u64,
    pub used_tokens: u64,
    /// Tokens used beyond their hold: the estimator's error, as overrun / used.
    pub overrun_tokens: u64,
}

/// Everything one pool reserve needs.
#[derive(Debug, Clone)]
pub struct PoolCall<'a> {
    pub pool: &'a str,
    pub id: &'a str,
    /// Predicted slot time of the request (ms).
    pub work_ms: u64,
    pub kv_tokens: u64,
    pub lease_ms: u64,
    pub idle_ttl_ms: u64,
    pub sweep_batch: u32,
    pub slots: u64,
    pub tier_slots: u64,
    pub max_queue_delay_ms: u64,
    /// `None` when the pool sets no KV limit.
    pub tier_kv_tokens: Option<u64>,
    pub deadline_ms: Option<u64>,
}

/// Why a pool refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolRefusal {
    /// The predicted finish is past the caller's deadline.
    Deadline,
    /// The tier's share of the pool is full: its predicted queue delay is past the max.
    QueueFull,
}

/// The pool's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolOutcome {
    Admitted { start_delay_ms: u64, holds: u64, work_ms: u64 },
    Denied { reason: PoolRefusal, retry_after_ms: u64, start_delay_ms: u64 },
}

/// The protocol over a store.
#[derive(Debug)]
pub struct Protocol<S> {
    store: S,
    scripts: Scripts,
}

impl<S: Store> Protocol<S> {
    /// Loads every phase script into the store: a script the store cannot compile fails here.
    pub async fn new(store: S) -> Result<Self, StoreError> {
        let scripts = Scripts::new();
        for script in scripts.all() {
            store.load(script).await?;
        }
        Ok(Protocol { store, scripts })
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    pub async fn reserve(&self, call: &ReserveCall<'_>) -> Result<ReserveOutcome, StoreError> {
        let tenant = call.tenant;
        let mut keys = Vec::with_capacity(4 + call.scopes.len());
        keys.push(keys::leases(tenant));
        keys.push(keys::record(tenant, call.id));
        keys.push(keys::idempotency(tenant, call.idempotency_key.unwrap_or("")));
        keys.push(keys::output_estimate(tenant, call.model));
        let (min_samples, quantile) = call.adaptive.unwrap_or((0, 0.0));
        let mut args = Vec::with_capacity(14 + 6 * call.scopes.len());
        args.extend([
            call.id.to_string(),
            keys::record_prefix(tenant),
            call.prompt_tokens.to_string(),
            call.lease_ms.to_string(),
            call.idle_ttl_ms.to_string(),
            call.retention_ms.to_string(),
            call.expired_usage.as_lua().to_string(),
            call.sweep_batch.to_string(),
            if call.idempotency_key.is_some() { "1" } else { "0" }.to_string(),
            call.max_attempts.to_string(),
            call.concurrency_retry_cap_ms.to_string(),
            call.output_ceiling.to_string(),
            min_samples.to_string(),
            quantile.to_string(),
        ]);
        for (key, limits) in &call.scopes {
            keys.push(key.clone());
            args.extend([
                limits.token_capacity.to_string(),
                limits.tokens_per_ms.to_string(),
                limits.request_capacity.to_string(),
                limits.requests_per_ms.to_string(),
                limits.max_concurrency.to_string(),
                limits.daily_budget.to_string(),
            ]);
        }
        let script = &self.scripts.reserve;
        let reply = self.store.eval(script, keys, args).await?;
        let bad = || StoreError::BadReply { script: script.name, reply: reply.clone() };
        let items = array(&reply).ok_or_else(bad)?;
        let int = |i: usize| items.get(i).and_then(Reply::as_int).ok_or_else(bad);
        match int(0)? {
            1 => Ok(ReserveOutcome::Admitted {
                id: text(items, 1).ok_or_else(bad)?,
                held: int(2)?.max(0) as u64,
                attempts: int(3)?.max(0) as u32,
                headroom: Headroom {
                    tokens: window(int(4)?, int(5)?, int(6)?),
                    requests: window(int(7)?, int(8)?, int(9)?),
                },
                estimated_output: (int(11)? == 1).then_some(int(10)?.max(0) as u64),
            }),
            0 => Ok(ReserveOutcome::Denied {
                reason: text(items, 1).as_deref().and_then(Refusal::parse).ok_or_else(bad)?,
                scope: (int(2)?.max(1) - 1) as usize,
                retry_after_ms: int(3)?.max(0) as u64,
                headroom: Headroom { tokens: window(int(4)?, int(5)?, int(6)?), requests: None },
            }),
            _ => Err(bad()),
        }
    }

    /// `learning` is the output estimate's (TTL ms, window) for a hold that teaches one.
    pub async fn commit(
        &self,
        tenant: &str,
        id: &str,
        prompt_tokens: u64,
        output_tokens: u64,
        learning: (u64, u64),
    ) -> Result<CommitOutcome, StoreError> {
        let script = &self.scripts.commit;
        let keys = vec![keys::record(tenant, id), keys::leases(tenant)];
        let args = vec![
            id.to_string(),
            prompt_tokens.to_string(),
            output_tokens.to_string(),
            learning.0.to_string(),
            learning.1.to_string(),
        ];
        let reply = self.store.eval(script, keys, args).await?;
        let bad = || StoreError::BadReply { script: script.name, reply: reply.clone() };
        let items = array(&reply).ok_or_else(bad)?;
        let uint = |i: usize| items.get(i).and_then(Reply::as_int).map(|n| n.max(0) as u64).ok_or_else(bad);
        Ok(CommitOutcome {
            state: text(items, 0).ok_or_else(bad)?,
            duplicate: uint(1)? == 1,
            used: uint(2)?,
            held: uint(3)?,
            refunded: uint(4)?,
            overrun: uint(5)?,
        })
    }

    pub async fn renew(
        &self,
        tenant: &str,
        id: &str,
        lease_ms: u64,
        idle_ttl_ms: u64,
    ) -> Result<RenewOutcome, StoreError> {
        let (state, n) = self
            .state_and_number(
                &self.scripts.renew,
                tenant,
                id,
                vec![id.to_string(), lease_ms.to_string(), idle_ttl_ms.to_string()],
            )
            .await?;
        Ok(RenewOutcome { state, lease_remaining_ms: n })
    }

    pub async fn release(&self, tenant: &str, id: &str) -> Result<ReleaseOutcome, StoreError> {
        let (state, n) = self.state_and_number(&self.scripts.release, tenant, id, vec![id.to_string()]).await?;
        Ok(ReleaseOutcome { state, refunded: n })
    }

    /// A tenant's output estimate for a model, and its error so far.
    pub async fn output_estimate(&self, tenant: &str, model: &str) -> Result<EstimateView, StoreError> {
        let script = &self.scripts.estimate;
        let reply = self.store.eval(script, vec![keys::output_estimate(tenant, model)], vec![]).await?;
        let bad = || StoreError::BadReply { script: script.name, reply: reply.clone() };
        let items = array(&reply).ok_or_else(bad)?;
        let uint = |i: usize| items.get(i).and_then(Reply::as_int).map(|n| n.max(0) as u64).ok_or_else(bad);
        Ok(EstimateView {
            samples: uint(0)?,
            quantile_tokens: uint(1)?,
            used_tokens: uint(2)?,
            overrun_tokens: uint(3)?,
        })
    }

    pub async fn pool_reserve(&self, call: &PoolCall<'_>) -> Result<PoolOutcome, StoreError> {
        let script = &self.scripts.pool_reserve;
        let args = vec![
            call.id.to_string(),
            call.work_ms.to_string(),
            call.kv_tokens.to_string(),
            call.lease_ms.to_string(),
            call.idle_ttl_ms.to_string(),
            call.sweep_batch.to_string(),
            call.slots.to_string(),
            call.tier_slots.to_string(),
            call.max_queue_delay_ms.to_string(),
            call.tier_kv_tokens.unwrap_or(0).to_string(),
            call.deadline_ms.unwrap_or(0).to_string(),
        ];
        let reply = self.store.eval(script, pool_keys(call.pool), args).await?;
        let bad = || StoreError::BadReply { script: script.name, reply: reply.clone() };
        let items = array(&reply).ok_or_else(bad)?;
        let uint = |i: usize| items.get(i).and_then(Reply::as_int).map(|n| n.max(0) as u64).ok_or_else(bad);
        match uint(0)? {
            1 => Ok(PoolOutcome::Admitted { start_delay_ms: uint(1)?, holds: uint(2)?, work_ms: uint(3)? }),
            0 => {
                let reason = match text(items, 1).as_deref() {
                    Some("deadline") => PoolRefusal::Deadline,
                    Some("queue_full") => PoolRefusal::QueueFull,
                    _ => return Err(bad()),
                };
                Ok(PoolOutcome::Denied { reason, retry_after_ms: uint(2)?, start_delay_ms: uint(3)? })
            }
            _ => Err(bad()),
        }
    }

    /// Takes a hold off its pool; `false` when the pool did not hold it. Idempotent.
    pub async fn pool_release(&self, pool: &str, id: &str) -> Result<bool, StoreError> {
        let script = &self.scripts.pool_release;
        let reply = self.store.eval(script, pool_keys(pool), vec![id.to_string()]).await?;
        let bad = || StoreError::BadReply { script: script.name, reply: reply.clone() };
        let items = array(&reply).ok_or_else(bad)?;
        Ok(items.first().and_then(Reply::as_int).ok_or_else(bad)? == 1)
    }

    /// Extends a pool hold's lease; `false` when the pool does not hold it.
    pub async fn pool_renew(&self, pool: &str, id: &str, lease_ms: u64, idle_ttl_ms: u64) -> Result<bool, StoreError> {
        let script = &self.scripts.pool_renew;
        let args = vec![id.to_string(), lease_ms.to_string(), idle_ttl_ms.to_string()];
        let reply = self.store.eval(script, pool_keys(pool), args).await?;
        Ok(reply.as_int().ok_or_else(|| StoreError::BadReply { script: script.name, reply: reply.clone() })? == 1)
    }

    /// Renew and release share a call shape: KEYS = record, index; reply = {state, number}.
    async fn state_and_number(
        &self,
        script: &Script,
        tenant: &str,
        id: &str,
        args: Vec<String>,
    ) -> Result<(String, u64), StoreError> {
        let keys = vec![keys::record(tenant, id), keys::leases(tenant)];
        let reply = self.store.eval(script, keys, args).await?;
        let bad = || StoreError::BadReply { script: script.name, reply: reply.clone() };
        let items = array(&reply).ok_or_else(bad)?;
        let state = text(items, 0).ok_or_else(bad)?;
        let n = items.get(1).and_then(Reply::as_int).ok_or_else(bad)?;
        Ok((state, n.max(0) as u64))
    }
}

fn pool_keys(pool: &str) -> Vec<String> {
    vec![keys::pool_state(pool), keys::pool_holds(pool), keys::pool_leases(pool)]
}

fn array(reply: &Reply) -> Option<&[Reply]> {
    match reply {
        Reply::Array(items) => Some(items),
        _ => None,
    }
}

fn text(items: &[Reply], i: usize) -> Option<String> {
    items.get(i).and_then(Reply::as_text).map(str::to_string)
}

/// The scripts send -1 for "no scope limits this".
fn window(remaining: i64, limit: i64, reset_ms: i64) -> Option<Window> {
    (limit >= 0).then(|| Window { remaining, limit: limit as u64, reset_ms: reset_ms.max(0) as u64 })
}
