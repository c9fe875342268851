//! The output estimate's quantile is recomputed from every bucket only when a sample moves it
//! (`learn` in lua/common.lua). Property: after every sample, on the embedded store and on real
//! Redis, the bucket it stands on and the samples at or below it are exactly what a full
//! recomputation from the hash's own buckets gives.

mod support;

use std::collections::BTreeMap;

use proptest::prelude::*;
use tollgate::store::embedded::EmbeddedStore;
use tollgate::store::redis::{RedisOptions, RedisStore, RedisTarget};
use tollgate::store::{Reply, Script, Store};

/// Teaches one sample (ARGV: output, quantile, window) and answers the whole hash.
fn probe() -> Script {
    Script::new(
        "learn_probe",
        format!(
            "{}\nbind()\nlearn(KEYS[1], tonumber(ARGV[1]), 0, 0, tonumber(ARGV[2]), tonumber(ARGV[3]), 600000)\n\
             return redis.call('HGETALL', KEYS[1])",
            include_str!("../lua/common.lua")
        ),
    )
}

fn fields(reply: &Reply) -> BTreeMap<String, String> {
    let Reply::Array(items) = reply else { panic!("not a hash: {reply:?}") };
    let text = |r: &Reply| match r {
        Reply::Text(t) => t.clone(),
        Reply::Int(n) => n.to_string(),
        other => panic!("{other:?}"),
    };
    items.chunks(2).map(|kv| (text(&kv[0]), text(&kv[1]))).collect()
}

/// The first bucket, in order, at which the samples reach quantile x n, and the samples up to it.
fn recomputed(hash: &BTreeMap<String, String>, quantile: f64) -> (i64, u64) {
    let mut buckets: Vec<(i64, u64)> =
        hash.iter().filter_map(|(k, v)| Some((k.strip_prefix('b')?.parse().ok()?, v.parse().ok()?))).collect();
    buckets.sort_unstable();
    let n: u64 = hash["n"].parse().unwrap();
    assert_eq!(buckets.iter().map(|b| b.1).sum::<u64>(), n, "n counts every bucket's samples: {hash:?}");
    let need = quantile * n as f64;
    let mut seen = 0;
    for (bucket, count) in &buckets {
        seen += count;
        if seen as f64 >= need {
            return (*bucket, seen);
        }
    }
    panic!("the samples never reach the quantile: {hash:?}")
}

/// Outputs that cluster (repeats, near neighbours) and wander, as real ones do.
fn outputs() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(prop_oneof![0u64..4, 90u64..110, 1u64..5000, Just(400)], 1..160)
}

async fn run<S: Store>(store: &S, outputs: &[u64], quantile: f64, window: u64) -> Result<(), TestCaseError> {
    let script = probe();
    store.load(&script).await.unwrap();
    let key = format!("tg:{{estimate-model}}:o:{:016x}", fastrand::u64(..));
    for (i, output) in outputs.iter().enumerate() {
        let args = vec![output.to_string(), quantile.to_string(), window.to_string()];
        let hash = fields(&store.eval(&script, vec![key.clone()], args).await.unwrap());
        let n: u64 = hash["n"].parse().unwrap();
        prop_assert!(n <= window, "sample {i}: n {n} past the window {window}");
        if n == 0 {
            continue; // halved to nothing: no estimate is read until samples return
        }
        let stands: (i64, u64) = (hash["qb"].parse().unwrap(), hash["qc"].parse().unwrap());
        prop_assert_eq!(stands, recomputed(&hash, quantile), "sample {} ({}): {:?}", i, output, hash);
    }
    Ok(())
}

fn cases() -> impl Strategy<Value = (Vec<u64>, f64, u64)> {
    (outputs(), prop_oneof![Just(0.5), Just(0.9), Just(0.99), 0.01f64..0.999], 1u64..80)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn the_quantile_stands_where_a_recomputation_puts_it_embedded((outputs, quantile, window) in cases()) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let store = EmbeddedStore::new().unwrap();
        rt.block_on(run(&store, &outputs, quantile, window))?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 60, ..ProptestConfig::default() })]

    #[test]
    fn the_quantile_stands_where_a_recomputation_puts_it_on_redis((outputs, quantile, window) in cases()) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let target = RedisTarget::Single(support::redis_url());
            let store = RedisStore::connect(&target, RedisOptions::default()).await.unwrap();
            run(&store, &outputs, quantile, window).await
        })?;
    }
}
