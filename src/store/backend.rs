//! The store a policy names, opened: the one place the choice between the embedded store, a Redis
//! and a Redis Cluster is made, for `serve` and for the tools alike.

use std::sync::Arc;

use super::breaker::{Breaker, BreakerSettings};
use super::clock::Clock;
use super::embedded::EmbeddedStore;
use super::redis::{RedisOptions, RedisStore, RedisTarget};
use super::{Reply, Script, Store, StoreError};
use crate::config::{Policy, StoreChoice};

/// The policy's store. Redis is called through a circuit breaker: a Redis that keeps failing is
/// not waited on (the embedded store cannot fail that way).
#[derive(Debug)]
pub enum Backend {
    Embedded(EmbeddedStore),
    Redis(Breaker<RedisStore>),
}

impl Backend {
    /// Opens the store `policy` names: the embedded one on `clock` (with the ledger file when the
    /// policy keeps one), or connects to Redis.
    pub async fn open(policy: &Policy, clock: Arc<dyn Clock>) -> Result<Backend, StoreError> {
        let redis = match RedisTarget::of(&policy.store.choice) {
            Some(target) => RedisStore::connect(&target, RedisOptions::from(&policy.store)).await?,
            None => {
                let store = match policy.ledger.as_ref().and_then(|l| l.file.as_deref()) {
                    Some(file) => EmbeddedStore::with_ledger_file(clock, file)?,
                    None => EmbeddedStore::with_clock(clock)?,
                };
                store.cap_memory(policy.store.max_memory_bytes)?;
                return Ok(Backend::Embedded(store));
            }
        };
        Ok(Backend::Redis(Breaker::new(redis, BreakerSettings::from(&policy.store.breaker))))
    }
}

impl RedisTarget {
    /// The Redis a store choice names; `None` for the embedded store.
    pub fn of(choice: &StoreChoice) -> Option<RedisTarget> {
        match choice {
            StoreChoice::Embedded => None,
            StoreChoice::Redis { url } => Some(RedisTarget::Single(url.clone())),
            StoreChoice::Cluster { nodes } => Some(RedisTarget::Cluster(nodes.clone())),
        }
    }
}

impl Store for Backend {
    async fn load(&self, script: &Script) -> Result<(), StoreError> {
        match self {
            Backend::Embedded(s) => s.load(script).await,
            Backend::Redis(s) => s.load(script).await,
        }
    }

    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        match self {
            Backend::Embedded(s) => s.eval(script, keys, args).await,
            // Boxed: a call into fred is a future of several KB, and every future that may call
            // the store holds one inline, whether it calls or not. Boxed, a leased commit's (no
            // store call) stays small: the ext_proc stream's task 9.7 -> 4.1 KB (docs/
            // BENCHMARKS.md, the twenty-fifth session). (The embedded store's call is a send to
            // its thread and a wait for the answer: small already.)
            Backend::Redis(s) => Box::pin(s.eval(script, keys, args)).await,
        }
    }
}
