//! Scripts are loaded at start, so a broken one fails there, on every store; and a Redis that lost
//! its script cache (a restart, a failover) is reloaded on NOSCRIPT without the caller noticing.

mod support;

use fred::interfaces::LuaInterface;
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
