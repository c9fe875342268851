//! 100,000 distinct tenants under `default_tenant`, each with its own user, through a real Redis:
//! every key they leave behind carries a TTL, so Redis's memory cannot grow without bound (the
//! keys go after the tenant's idle TTL, a record after its retention). tollgate's own per-tenant
//! memory is bounded by construction: the estimates the pool leg remembers and the local buckets
//! of `on_store_error: local` at 100,000 tenants each (then forgotten), and leased tenants are left
//! after four idle windows.

mod support;

use std::sync::Arc;

use futures_util::StreamExt;
use tollgate::admission::{Admission, Attributes, Decision};
use tollgate::config::Policy;
use tollgate::estimate::PromptSize;
use tollgate::store::redis::{RedisOptions, RedisStore, RedisTarget};
use tollgate::store::{Protocol, Reply, Script, Store};

const TENANTS: usize = 100_000;

/// Keys under `pattern` and how many of them have no TTL, by SCAN inside Redis.
fn census() -> Script {
    Script::new(
        "census",
        "local cursor, keys, forever = '0', 0, 0\n\
         repeat\n\
           local page = redis.call('SCAN', cursor, 'MATCH', ARGV[1], 'COUNT', 5000)\n\
           cursor = page[1]\n\
           for _, key in ipairs(page[2]) do\n\
             keys = keys + 1\n\
             if redis.call('PTTL', key) == -1 then forever = forever + 1 end\n\
           end\n\
         until cursor == '0'\n\
         return {keys, forever}"
            .to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_tenants_leave_no_key_without_a_ttl() {
    let run = format!("{:08x}", fastrand::u32(..));
    let policy = format!(
        "store:\n  redis_url: {}\nmodels:\n  m: {{ max_output_tokens: 100 }}\n\
         default_tenant:\n  limits: {{ tokens_per_minute: 60000 }}\n  default_user: {{ tokens_per_minute: 6000 }}\n",
        support::redis_url()
    );
    let policy = Arc::new(Policy::parse("many.yaml", &policy).unwrap());
    let store = RedisStore::connect(&RedisTarget::Single(support::redis_url()), RedisOptions::default()).await.unwrap();
    let admission = Arc::new(Admission::new(policy, Protocol::new(store).await.unwrap()));
    let attributes = |i: usize| Attributes {
        plan: None,
        tenant: Some(format!("many{run}-{i}")),
        user: Some(format!("u{i}")),
        model: Some("m".into()),
        priority: None,
        deadline_ms: None,
        wait_ms: None,
        idempotency: None,
        prompt: PromptSize::Tokens(10),
        max_tokens: Some(10),
        stream: false,
        input_only: false,
        outputs: 1,
    };
    // Reserve and commit, 32 tenants at a time.
    let settled = futures_util::stream::iter(0..TENANTS)
        .map(|i| {
            let admission = Arc::clone(&admission);
            let a = attributes(i);
            async move {
                let Decision::Admitted(ok) = admission.reserve(&a).await else { return false };
                admission.commit(&ok.reservation_id, 10, 5).await.is_ok()
            }
        })
        .buffer_unordered(32)
        .filter(|ok| std::future::ready(*ok))
        .count()
        .await;
    assert_eq!(settled, TENANTS, "every tenant was admitted and committed");

    // The census walks the whole keyspace in one script: give it time.
    let options = RedisOptions { command_timeout: std::time::Duration::from_secs(120), ..RedisOptions::default() };
    let patient = RedisStore::connect(&RedisTarget::Single(support::redis_url()), options).await.unwrap();
    let pattern = format!("tg:{{many{run}-*");
    let reply = patient.eval(&census(), vec![], vec![pattern]).await.unwrap();
    let Reply::Array(counts) = reply else { panic!("{reply:?}") };
    let (keys, forever) = (counts[0].as_int().unwrap(), counts[1].as_int().unwrap());
    eprintln!("{TENANTS} tenants left {keys} keys, {forever} without a TTL");
    assert!(keys >= TENANTS as i64 * 2, "tenant and user scopes at least: {keys}");
    assert_eq!(forever, 0, "every key a tenant leaves expires");
}
