//! The background sweeper: a tenant that goes quiet (holds it never commits, and no call ever
//! again) still has every expired hold settled within the stated bound, on every store: charged
//! as held, its slots back, entered in the ledger, and the tenant gone from the sweeper's index.
//! (The periods are driven by hand here: `sweep_tick` is one period of the sweeper.)

mod support;

use support::{Harness, TOP_SEPARATOR, admitted};
use tollgate::admission::SWEEP_MS;
use tollgate::store::{Store, keys};

const LEASE_MS: u64 = 300;

fn body(top: &str) -> String {
    format!(
        "{top}{TOP_SEPARATOR}lease_ttl_ms: {LEASE_MS}\nlimits: {{ max_concurrency: 4, tokens_per_minute: 60, burst_tokens: 10000 }}\n"
    )
}

async fn a_quiet_tenants_holds_are_settled_by_the_sweeper<S: Store + Clone>(h: &Harness<S>) {
    for _ in 0..3 {
        admitted(&h.reserve(10, 90).await);
    }
    assert_eq!(h.in_flight().await, 3.0);
    // The replica writes its notes and looks at every shard once: nothing is due yet, and
    // nothing live is touched.
    for _ in 0..keys::SWEEP_SHARDS {
        h.admission.sweep_tick().await.unwrap();
    }
    assert_eq!(h.in_flight().await, 3.0, "live holds are left alone");
    // Due two periods after the lease; then settled at the first look at its shard (each period
    // looks at the next shard: within `SWEEP_SHARDS` periods).
    h.advance(LEASE_MS + 2 * SWEEP_MS + 100).await;
    for _ in 0..keys::SWEEP_SHARDS {
        h.admission.sweep_tick().await.unwrap();
    }
    assert_eq!(h.in_flight().await, 0.0, "every slot back, with no call of the tenant's");
    let scope = h.tenant_scope().await;
    assert_eq!(scope.num("du"), 300.0, "charged as held: missing usage is not zero usage: {scope:?}");
    // Nothing left: the tenant has left the index.
    let shard = h.scope(&keys::sweep_shard(keys::sweep_shard_of(&h.tenant))).await;
    assert!(
        shard.as_ref().is_none_or(|s| !s.fields.contains_key(&h.tenant)),
        "the tenant is still in the sweeper's index: {shard:?}"
    );
}

const LEDGER: &str = "ledger:\n  max_len: 1000\n";

#[tokio::test]
async fn embedded_a_quiet_tenants_holds_are_settled_by_the_sweeper() {
    let h = support::embedded(&body(LEDGER)).await;
    a_quiet_tenants_holds_are_settled_by_the_sweeper(&h).await;
    let file = h.ledger_file.as_ref().expect("the embedded store's ledger file");
    let ledger = std::fs::read_to_string(file).unwrap();
    let expired = ledger.lines().filter(|l| l.contains("\"outcome\":\"expired\"")).count();
    assert_eq!(expired, 3, "each expired hold entered once:\n{ledger}");
}

#[tokio::test]
async fn redis_a_quiet_tenants_holds_are_settled_by_the_sweeper() {
    a_quiet_tenants_holds_are_settled_by_the_sweeper(&support::redis(&body(LEDGER)).await).await;
}

#[tokio::test]
async fn cluster_a_quiet_tenants_holds_are_settled_by_the_sweeper() {
    a_quiet_tenants_holds_are_settled_by_the_sweeper(&support::cluster(&body(LEDGER)).await).await;
}
