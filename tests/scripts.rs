//! Scripts are loaded at start, so a broken one fails there, on every store; and a Redis that lost
//! its script cache or its functions (a restart, a failover, a flush) has them loaded again without
//! the caller noticing.

mod support;

use fred::interfaces::{FunctionInterface, LuaInterface};
use tollgate::store::embedded::EmbeddedStore;
use tollgate::store::redis::{RedisOptions, RedisStore, RedisTarget};
use tollgate::store::{Protocol, Reply, Script, Store};

fn broken() -> Script {
    Script::new("broken", "return (".to_string())
}

#[tokio::test]
async fn a_broken_script_fails_to_load_on_every_store() {
    assert!(EmbeddedStore::new().unwrap().load(&broken()).await.is_err());
    for target in [RedisTarget::Single(support::redis_url()), RedisTarget::Cluster(support::redis_cluster_nodes())] {
        let store = RedisStore::connect(&target, RedisOptions::default()).await.unwrap();
        assert!(store.load(&broken()).await.is_err(), "{target:?}");
    }
}

#[tokio::test]
async fn a_flushed_script_cache_is_reloaded_on_noscript() {
    for target in [RedisTarget::Single(support::redis_url()), RedisTarget::Cluster(support::redis_cluster_nodes())] {
        let store = RedisStore::connect(&target, RedisOptions::default()).await.unwrap();
        let script = Script::new("probe", format!("return '{:016x}'", fastrand::u64(..)));
        store.load(&script).await.unwrap();
        store.client().script_flush_cluster(false).await.unwrap();
        let key = format!("probe-{:x}", fastrand::u64(..));
        let reply = store.eval(&script, vec![key], vec![]).await.unwrap();
        assert!(matches!(reply, Reply::Text(_)), "{target:?}: {reply:?}");
        // And the protocol's own scripts load on a freshly flushed cache.
        store.client().script_flush_cluster(false).await.unwrap();
        Protocol::new(store.clone()).await.unwrap();
    }
}

/// The phases run as functions of one library, which a node that lost it (`FUNCTION FLUSH`) is
/// given again on the next call: here, the commit of a hold made before the flush.
#[tokio::test]
async fn the_phases_are_functions_loaded_again_where_a_node_lost_them() {
    use tollgate::admission::Decision;
    for h in [support::redis("limits: {}\n").await, support::cluster("limits: {}\n").await] {
        let store = h.admission.protocol().store();
        let library = &h.admission.protocol().scripts().reserve.function.as_ref().unwrap().library.name;
        let listed: fred::types::Value = store.client().function_list(Some(library.as_str()), false).await.unwrap();
        assert!(format!("{listed:?}").contains(library.as_str()), "{listed:?}");
        let Decision::Admitted(a) = h.reserve(10, 10).await else { panic!("not admitted") };
        store.client().function_flush_cluster(false).await.unwrap();
        let outcome = h.admission.commit(&a.reservation_id, 5, 5).await.unwrap();
        assert!(format!("{outcome:?}").contains("Committed"), "{outcome:?}");
    }
}
