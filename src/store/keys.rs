//! Every Redis key tollgate uses is built here, and nowhere else.
//!
//! The rule: every key of one tenant carries the hash tag `{<tenant>}`. Redis Cluster hashes only
//! the part between the first `{` and the next `}`, so all of a tenant's scopes, holds and indexes
//! land on one slot and one script can touch them atomically. That is why a tenant id may not
//! contain `{`, `}` (it would move or break the tag), `:` (the separator below) or `@` (it ends a
//! leased hold's id and starts a replica's entry in the lease index); see [`crate::hold::id`].
//!
//! ```text
//! tg:{acme}:s:t              tenant scope (token bucket, request bucket, in flight, day usage)
//! tg:{acme}:s:u:<user>       user scope within the tenant
//! tg:{acme}:s:m:<model>      model scope within the tenant
//! tg:{acme}:leases           sorted set: reservation id by lease expiry, for the expiry sweep
//! tg:{acme}:holds            hash: reservation id → what settling it takes, while it is live
//! tg:{acme}:r:<id>           reservation record
//! tg:{acme}:settled:<n>      hash: what a repeat of each hold settled in period n is answered with
//! tg:{acme}:settled:<n>e     hash: how those holds' requests ended, where their entry does not imply it
//! tg:{acme}:i:<key>          idempotency key: its request's fingerprint, attempts, latest hold
//! tg:{acme}:adj:<request>    a budget adjustment: what its request id did, for a repeat
//! tg:{acme}:o:<model>        output-length estimate of the tenant's requests to the model
//! tg:{acme}:ledger           stream: one entry per settled hold (the usage ledger)
//! tg:{acme}:r:@<replica>     a replica's lease on the tenant (leasing): the slots it holds
//! tg:{acme}:f:<replica>      operations on that replica's holds forwarded by other replicas
//! ```
//!
//! Backend pools are shared by every tenant, so their keys carry the pool's own tag and live on
//! their own slot; capacity admission touches them in a separate script (see
//! admission's reserve phase for the ordering that keeps the two key spaces consistent):
//!
//! ```text
//! tg:pool:{gpu-a}:s          pool state: holds outstanding, their work (slot-ms), their KV tokens
//! tg:pool:{gpu-a}:h          hash: reservation id → "work kv …" of each outstanding hold, and
//!                            "<id>+" → what it charged the provider's limits (common.lua)
//! tg:pool:{gpu-a}:leases     sorted set: reservation id by lease expiry
//! tg:pool:{gpu-a}:p          hash: the provider's limits, a scope shared by every tenant (buckets,
//!                            period counters), where the pool sets `provider_limits`
//! ```
//!
//! The replicas that share one store count themselves (for `on_store_error: local`) in a key of its
//! own, outside every tenant's and pool's:
//!
//! ```text
//! tg:replicas:{replicas}     sorted set: replica id by when it was last heard
//! ```
//!
//! The sweep in `reserve.lua` finds expired ids in the lease index and builds their record keys as
//! `record_prefix(tenant) .. id`; that prefix is passed in from here, so Lua formats no key itself.

/// Shards of the sweeper's index (tenants that may hold something, by when): each its own hash
/// tag, so a Cluster spreads them, and no one key takes every tenant's notes. Few, since every
/// replica looks at one each sweeper period.
pub const SWEEP_SHARDS: u32 = 4;

/// A shard of the sweeper's index.
pub fn sweep_shard(shard: u32) -> String {
    format!("tg:{{sweep-{shard}}}:tenants")
}

/// The shard that indexes `tenant`: FNV-1a of its name, so every replica picks the same one.
pub fn sweep_shard_of(tenant: &str) -> u32 {
    let hash = tenant.bytes().fold(0x811c_9dc5_u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
    hash % SWEEP_SHARDS
}

/// The replicas sharing this store, by last heartbeat, each as `<replica>#<the newest record
/// form it reads>`.
pub fn replicas() -> String {
    "tg:replicas:{replicas}".to_string()
}

/// The oldest record form a replica heard lately reads, when older than the newest (beside
/// [`replicas`], on its slot; see `heartbeat.lua`).
pub fn oldest_record_form() -> String {
    "tg:replicas:oldest-form:{replicas}".to_string()
}

/// The scope hash of the tenant as a whole.
pub fn tenant_scope(tenant: &str) -> String {
    format!("tg:{{{tenant}}}:s:t")
}

/// The scope hash of one user within a tenant.
pub fn user_scope(tenant: &str, user: &str) -> String {
    format!("tg:{{{tenant}}}:s:u:{user}")
}

/// The scope hash of one model within a tenant.
pub fn model_scope(tenant: &str, model: &str) -> String {
    format!("tg:{{{tenant}}}:s:m:{model}")
}

/// The tenant's lease index.
pub fn leases(tenant: &str) -> String {
    format!("tg:{{{tenant}}}:leases")
}

/// The tenant's live holds: what the sweep needs to settle each, should its record be gone.
pub fn holds(tenant: &str) -> String {
    format!("tg:{{{tenant}}}:holds")
}

/// The tenant's usage ledger: a stream of its settled holds.
pub fn ledger(tenant: &str) -> String {
    format!("tg:{{{tenant}}}:ledger")
}

/// The pattern that matches every tenant's ledger (for `SCAN`).
pub const LEDGER_PATTERN: &str = "tg:{*}:ledger";

/// The tenant a ledger key belongs to.
pub fn ledger_tenant(key: &str) -> Option<&str> {
    key.strip_prefix("tg:{")?.strip_suffix("}:ledger")
}

/// The prefix that, followed by a reservation id, names its record.
pub fn record_prefix(tenant: &str) -> String {
    format!("tg:{{{tenant}}}:r:")
}

/// The prefix that, followed by a period number, names one of the tenant's settled buckets (see
/// `lua/common.lua`): the period is the settled-record retention, the number the store's clock
/// over it, so the script builds the name.
pub fn settled_prefix(tenant: &str) -> String {
    format!("tg:{{{tenant}}}:settled:")
}

/// Whether `key` is one of a tenant's settled buckets: what the embedded store's memory cap may
/// evict (a repeat of a hold it held is then answered `not_found`, changing nothing).
/// The shape is exact (`tg:{<tenant>}:settled:<digits>`; a tenant holds no `}`): a user, model or
/// idempotency key named to look like a bucket is inside another key's name, never this shape.
pub fn is_settled_bucket(key: &[u8]) -> bool {
    let Some(rest) = key.strip_prefix(b"tg:{") else { return false };
    let Some(close) = rest.iter().position(|&b| b == b'}') else { return false };
    match rest.get(close.saturating_add(1)..).and_then(|after| after.strip_prefix(b":settled:")) {
        Some(period) => !period.is_empty() && period.iter().all(u8::is_ascii_digit),
        None => false,
    }
}

/// A reservation's record.
pub fn record(tenant: &str, id: &str) -> String {
    format!("tg:{{{tenant}}}:r:{id}")
}

/// An idempotency key's pointer to its reservation.
pub fn idempotency(tenant: &str, key: &str) -> String {
    format!("tg:{{{tenant}}}:i:{key}")
}

pub fn adjustment(tenant: &str, request_id: &str) -> String {
    format!("tg:{{{tenant}}}:adj:{request_id}")
}

/// The output-length estimate a tenant's commits teach, per model.
pub fn output_estimate(tenant: &str, model: &str) -> String {
    format!("tg:{{{tenant}}}:o:{model}")
}

/// A replica's member in the tenant's lease index: `@<replica>`, which no reservation id starts with.
pub fn lease_member(replica: &str) -> String {
    format!("@{replica}")
}

/// A replica's lease record on a tenant: under the record prefix, so the sweep finds it from the
/// lease index as it finds hold records.
pub fn lease_record(tenant: &str, replica: &str) -> String {
    format!("tg:{{{tenant}}}:r:@{replica}")
}

/// What a replica's last lease call on a tenant answered, for a re-send of it (`lease.lua`).
pub fn last_lease_call(tenant: &str, replica: &str) -> String {
    format!("tg:{{{tenant}}}:lc:{replica}")
}

/// Operations on a replica's leased holds that reached another replica.
pub fn forwarded(tenant: &str, replica: &str) -> String {
    format!("tg:{{{tenant}}}:f:{replica}")
}

/// A pool's state hash.
pub fn pool_state(pool: &str) -> String {
    format!("tg:pool:{{{pool}}}:s")
}

/// A pool's outstanding holds.
pub fn pool_holds(pool: &str) -> String {
    format!("tg:pool:{{{pool}}}:h")
}

/// A pool's lease index.
pub fn pool_leases(pool: &str) -> String {
    format!("tg:pool:{{{pool}}}:leases")
}

/// The requests waiting in tollgate for a slot of a pool that queues here.
pub fn pool_waiting(pool: &str) -> String {
    format!("tg:pool:{{{pool}}}:q")
}

/// The tenants' finish tags at one tier of a pool that queues in tollgate (fair queueing).
pub fn pool_tags(pool: &str, tier: crate::config::Priority) -> String {
    format!("tg:pool:{{{pool}}}:v:{}", tier.as_str())
}

/// A pool's provider scope: the limits of the account behind it, shared by every tenant.
pub fn pool_provider(pool: &str) -> String {
    format!("tg:pool:{{{pool}}}:p")
}

/// A pool hold's charge of its provider's limits: its field beside the hold's own in the pool's
/// holds hash.
pub fn pool_charge(id: &str) -> String {
    format!("{id}+")
}

/// Whether a field of a pool's holds hash is a hold's charge ([`pool_charge`]), not a hold.
pub fn is_pool_charge(field: &str) -> bool {
    field.ends_with('+')
}

/// KEYS of the pool scripts that touch holds, in this order: the state hash, the holds hash, the
/// lease index, the waiting hash, the finish tags of the critical, standard and sheddable tiers,
/// and the provider scope.
pub fn pool_keys(pool: &str) -> Vec<String> {
    use crate::config::Priority;
    vec![
        pool_state(pool),
        pool_holds(pool),
        pool_leases(pool),
        pool_waiting(pool),
        pool_tags(pool, Priority::Critical),
        pool_tags(pool, Priority::Standard),
        pool_tags(pool, Priority::Sheddable),
        pool_provider(pool),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Redis Cluster's hash tag: the substring between the first `{` and the next `}`.
    fn hash_tag(key: &str) -> &str {
        let (_, rest) = key.split_once('{').expect("tagged");
        rest.split_once('}').expect("closed").0
    }

    #[test]
    fn every_key_of_a_tenant_shares_its_hash_tag() {
        let keys = [
            tenant_scope("acme"),
            user_scope("acme", "alice"),
            model_scope("acme", "gpt-4o"),
            leases("acme"),
            holds("acme"),
            ledger("acme"),
            record("acme", "acme:0f"),
            format!("{}acme:0f", record_prefix("acme")),
            idempotency("acme", "k{e}y:1"),
            output_estimate("acme", "gpt-4o"),
            lease_record("acme", "0a1b2c3d4e5f"),
            forwarded("acme", "0a1b2c3d4e5f"),
            last_lease_call("acme", "0a1b2c3d4e5f"),
            format!("{}29932", settled_prefix("acme")),
        ];
        for key in &keys {
            assert_eq!(hash_tag(key), "acme", "{key}");
        }
        assert_eq!(record("acme", "x"), format!("{}x", record_prefix("acme")));
        assert_eq!(ledger_tenant(&ledger("acme")), Some("acme"));
        assert_eq!(lease_record("acme", "r1"), format!("{}{}", record_prefix("acme"), lease_member("r1")));
        for key in [pool_state("gpu-a"), pool_holds("gpu-a"), pool_leases("gpu-a"), pool_provider("gpu-a")] {
            assert_eq!(hash_tag(&key), "gpu-a", "{key}");
        }
    }

    /// Only a settled bucket is evictable: never a key whose name a client chose to look like one.
    #[test]
    fn a_settled_bucket_is_told_by_its_whole_shape() {
        assert!(is_settled_bucket(format!("{}29932", settled_prefix("acme")).as_bytes()));
        for key in [
            user_scope("acme", "x}:settled:1"),
            model_scope("acme", "m}:settled:1"),
            idempotency("acme", "k}:settled:1"),
            idempotency("acme", "}:settled:1"),
            format!("{}29932x", settled_prefix("acme")),
            settled_prefix("acme"),
            tenant_scope("acme"),
            record("acme", "acme:0f"),
        ] {
            assert!(!is_settled_bucket(key.as_bytes()), "{key}");
        }
    }
}
