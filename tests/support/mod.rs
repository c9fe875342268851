//! Shared test harness: policies with a fresh tenant per test, stores of every kind, and a look
//! at the raw counters through a script (so the same inspection works on every store).
//!
//! Redis and the Redis Cluster are started by `scripts/test` on free loopback ports and named in
//! `TOLLGATE_TEST_REDIS_URL` and `TOLLGATE_TEST_REDIS_CLUSTER`; a test that needs one and finds
//! the variable unset fails and says how to run it.

// A harness: an unwrap that fails is a test that fails, and its casts are of small test numbers.
#![allow(dead_code, clippy::unwrap_used, clippy::cast_possible_truncation, clippy::cast_sign_loss)]

pub mod certs;
pub mod checks;
pub mod faults;
pub mod kube;
pub mod model;
pub mod procs;
pub mod proxy;
pub mod rng;
pub mod stack;
pub mod upstream;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tollgate::admission::{Admission, Attributes, Decision, IdempotencyKey, KeyRepeat};
use tollgate::config::Policy;
use tollgate::estimate::PromptSize;
use tollgate::store::clock::ManualClock;
use tollgate::store::embedded::EmbeddedStore;
use tollgate::store::redis::{RedisOptions, RedisStore, RedisTarget};
use tollgate::store::{Protocol, Reply, Script, Store, keys};

/// The simulated backend on a free loopback port, committing nothing itself (Envoy commits from
/// its responses): four slots, an instant prefill, `decode_tokens_per_second` per sequence, 40
/// output tokens in `text`. Its port, and the token that stops it.
pub async fn sim_backend(
    decode_tokens_per_second: f64,
    text: tollgate::tools::sim::formats::Text,
) -> (u16, tokio_util::sync::CancellationToken) {
    let (port, shutdown, _) = sim_backend_counted(decode_tokens_per_second, text).await;
    (port, shutdown)
}

/// The same, with the count of what it answered.
pub async fn sim_backend_counted(
    decode_tokens_per_second: f64,
    text: tollgate::tools::sim::formats::Text,
) -> (u16, tokio_util::sync::CancellationToken, Arc<tollgate::tools::sim::backend::SimStats>) {
    use tollgate::tools::sim::backend::SimConfig;
    sim_backend_with(SimConfig {
        slots: 4,
        prefill_tokens_per_second: 1_000_000.0,
        decode_tokens_per_second,
        lengths: tollgate::tools::sim::lengths::OutputLengths::Fixed(40),
        tollgate: None,
        text,
        ..SimConfig::default()
    })
    .await
}

/// The simulated backend as `config` says, on a free port, with the count of what it answered.
pub async fn sim_backend_with(
    config: tollgate::tools::sim::backend::SimConfig,
) -> (u16, tokio_util::sync::CancellationToken, Arc<tollgate::tools::sim::backend::SimStats>) {
    use tollgate::tools::sim::backend::{self, SimStats};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let stats = Arc::new(SimStats::default());
    tokio::spawn(backend::serve(listener, config, shutdown.clone(), Arc::clone(&stats)));
    (port, shutdown, stats)
}

pub fn redis_url() -> String {
    std::env::var("TOLLGATE_TEST_REDIS_URL")
        .expect("TOLLGATE_TEST_REDIS_URL is not set: run the suite with `bash scripts/test`, which starts Redis")
}

pub fn redis_cluster_nodes() -> Vec<String> {
    std::env::var("TOLLGATE_TEST_REDIS_CLUSTER")
        .expect(
            "TOLLGATE_TEST_REDIS_CLUSTER is not set: run the suite with `bash scripts/test`, which starts a cluster",
        )
        .split(',')
        .map(str::to_string)
        .collect()
}

/// A tenant name no other test uses, so tests share a Redis without interfering.
pub fn unique_tenant(prefix: &str) -> String {
    format!("{prefix}-{:016x}", fastrand::u64(..))
}

/// Separates a scenario's tenant body from its pool body: `"<tenant>\n---pool---\n<pool>"`.
pub const POOL_SEPARATOR: &str = "---pool---";

/// Separates extra `defaults:` lines from the rest: `"<defaults>\n---defaults---\n<body>"`.
pub const DEFAULTS_SEPARATOR: &str = "---defaults---";

/// A whole policy around one tenant's YAML body (model `m` priced at 1 and 3 per million input and
/// output tokens, `other` at 2 and 6) (as under `tenants.<t>:`) and, when the body
/// carries a [`POOL_SEPARATOR`], one pool (as under `pools.<p>:`) that serves model `m`. Lines
/// before a [`DEFAULTS_SEPARATOR`] go under `defaults:`.
pub fn policy_yaml(tenant: &str, pool: &str, body: &str, store: &str) -> String {
    let indent = |text: &str| text.lines().map(|l| format!("    {l}\n")).collect::<String>();
    let (defaults, body) = match body.split_once(DEFAULTS_SEPARATOR) {
        Some((d, b)) => (d.lines().map(|l| format!("  {l}\n")).collect::<String>(), b),
        None => (String::new(), body),
    };
    let (tenant_body, pool_body) = match body.split_once(POOL_SEPARATOR) {
        Some((t, p)) => (t, Some(p)),
        None => (body, None),
    };
    let (pools, served_by) = match pool_body {
        Some(p) => (format!("pools:\n  {pool}:\n{}", indent(p)), format!("    pool: {pool}\n")),
        None => (String::new(), String::new()),
    };
    format!(
        "{store}\ndefaults:\n  lease_ttl_ms: 120000\n  concurrency_retry_ms: 1000\n{defaults}{pools}\
         models:\n  m:\n    max_output_tokens: 100000\n    bytes_per_token: 4\n    price: {{ input_per_million: 1, output_per_million: 3 }}\n\
         {served_by}  other:\n    max_output_tokens: 100000\n    price: {{ input_per_million: 2, output_per_million: 6 }}\n\
         \x20 cached:\n    max_output_tokens: 100000\n    cache_read_weight: 0.1\n    cache_write_weight: 1.25\n    reasoning_weight: 0.5\n\
         \x20   price: {{ input_per_million: 3, output_per_million: 15, cache_read_per_million: 0.3, cache_write_per_million: 3.75 }}\n\
         tenants:\n  {tenant}:\n{}",
        indent(tenant_body)
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Embedded,
    Redis,
    Cluster,
}

impl Backend {
    /// The policy's `store:` section for this backend.
    pub fn store_yaml(self) -> String {
        match self {
            Backend::Embedded => String::new(),
            Backend::Redis => format!("store:\n  redis_url: {}", redis_url()),
            Backend::Cluster => {
                let nodes = redis_cluster_nodes().iter().map(|n| format!("\"{n}\"")).collect::<Vec<_>>().join(", ");
                format!("store:\n  redis_cluster: [{nodes}]")
            }
        }
    }
}

/// Reads keys raw: type, PTTL and contents, for assertions on what a call changed.
const INSPECT: &str = r#"
local out = {}
for _, k in ipairs(KEYS) do
  local t = redis.call('TYPE', k)['ok']
  local items = {}
  if t == 'hash' then items = redis.call('HGETALL', k)
  elseif t == 'zset' then items = redis.call('ZRANGE', k, 0, -1, 'WITHSCORES')
  elseif t == 'string' then items = { redis.call('GET', k) } end
  out[#out + 1] = { k, t, redis.call('PTTL', k), items }
end
return out
"#;

/// Reads a tenant's settled buckets, the previous period's and the current one's (`ARGV`: the
/// bucket prefix, the retention), as {field, value, the bucket's PTTL} each settled hold (not the
/// bucket's `ttl` mark). `KEYS[1]` is
/// any key of the tenant, for a Cluster to route the call.
const SETTLED: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local period = math.floor(now / tonumber(ARGV[2]))
local out = {}
for _, n in ipairs({ period - 1, period }) do
  local k = ARGV[1] .. n
  local flat = redis.call('HGETALL', k)
  for i = 1, #flat, 2 do
    if flat[i] ~= 'ttl' then
      out[#out + 1] = { flat[i], flat[i + 1], redis.call('PTTL', k) }
    end
  end
end
return out
"#;

/// One key as [`Harness::inspect`] sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyView {
    pub kind: String,
    pub pttl: i64,
    pub fields: BTreeMap<String, String>,
}

impl KeyView {
    pub fn num(&self, field: &str) -> f64 {
        self.fields.get(field).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("no number {field} in {self:?}"))
    }
}

/// An admission service over one store, with one tenant of its own.
pub struct Harness<S> {
    pub admission: Arc<Admission<S>>,
    pub tenant: String,
    /// The pool serving model `m`, when the scenario has one.
    pub pool: String,
    pub clock: Option<ManualClock>,
    /// The embedded store's ledger file, when the policy has a ledger.
    pub ledger_file: Option<std::path::PathBuf>,
    inspect: Script,
    settled: Script,
    ledger: Script,
}

/// 2026-11-29T12:00:00Z: a fixed start for the manual clock, mid-day so budgets do not roll over.
pub const CLOCK_START_MS: u64 = 1_795_953_600_000;

pub async fn embedded(body: &str) -> Harness<EmbeddedStore> {
    let (tenant, pool) = (unique_tenant("t"), unique_tenant("p"));
    let (top, body) = body.split_once(TOP_SEPARATOR).unwrap_or(("", body));
    let (store, body) = store_section("", body);
    // A ledger on the embedded store is a file: the scenario's `ledger:` section gets one.
    let ledger_file = top
        .contains("ledger:")
        .then(|| std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ledger-{tenant}.jsonl")));
    let top = match &ledger_file {
        Some(f) => top.replace("ledger:\n", &format!("ledger:\n  file: {}\n", f.display())),
        None => top.to_string(),
    };
    let policy = Policy::parse("test.yaml", &policy_yaml(&tenant, &pool, body, &format!("{top}\n{store}")))
        .expect("test policy");
    let clock = ManualClock::new(CLOCK_START_MS);
    let store = match &ledger_file {
        Some(f) => EmbeddedStore::with_ledger_file(Arc::new(clock.clone()), f),
        None => EmbeddedStore::with_clock(Arc::new(clock.clone())),
    }
    .expect("embedded store");
    let mut h = Harness::build(store, policy, tenant, pool, Some(clock)).await;
    h.ledger_file = ledger_file;
    h
}

/// Every period a test's budgets or counters belong to (an hour; a day, week or month in UTC or in
/// a whole- or half-hour zone) turns on a UTC half hour.
const TURN_MS: u64 = 30 * 60_000;

/// How long a test on the real clock spends from its store's start to its last assertion, unless
/// it says otherwise ([`clear_of_a_turn`]).
pub const REAL_CLOCK_SPAN: Duration = Duration::from_secs(10);

/// How long to wait so that no UTC half hour turns within `span` from now: nothing, unless one is
/// about to, and then until it has.
pub fn wait_for_a_turn(span: Duration) -> Duration {
    use tollgate::store::clock::Clock;
    let now = tollgate::store::clock::SystemClock.now_ms();
    let left = TURN_MS - now % TURN_MS;
    if u128::from(left) <= span.as_millis() { Duration::from_millis(left + 50) } else { Duration::ZERO }
}

/// Waits, when a UTC half hour turns within `span`, until it has turned: a test on the real clock
/// (Redis reads this machine's) then counts inside one period of every budget it uses, as its
/// assertions expect. Waits at most `span` and 50 ms, and only in the `span` before a turn.
pub async fn clear_of_a_turn(span: Duration) {
    tokio::time::sleep(wait_for_a_turn(span)).await;
}

/// A policy section placed before `store:` (e.g. `leasing:`): `"<top>\n---top---\n<body>"`.
pub const TOP_SEPARATOR: &str = "---top---";

/// Settings of the policy's `store:` section beside the backend's own (indented as under it):
/// `"<settings>\n---store---\n<body>"`, outside any `---top---` part.
pub const STORE_SEPARATOR: &str = "---store---";

/// The policy's `store:` section: the backend's (`backend`, which may be empty) with the settings
/// a body gives before a [`STORE_SEPARATOR`]; and the rest of the body.
fn store_section<'a>(backend: &str, body: &'a str) -> (String, &'a str) {
    match body.split_once(STORE_SEPARATOR) {
        None => (backend.to_string(), body),
        Some((settings, body)) => {
            let settings: String =
                settings.lines().filter(|l| !l.trim().is_empty()).map(|l| format!("\n  {l}")).collect();
            let section = if backend.is_empty() { format!("store:{settings}") } else { format!("{backend}{settings}") };
            (section, body)
        }
    }
}

pub async fn redis(tenant_body: &str) -> Harness<RedisStore> {
    redis_backend(Backend::Redis, tenant_body).await
}

pub async fn cluster(tenant_body: &str) -> Harness<RedisStore> {
    redis_backend(Backend::Cluster, tenant_body).await
}

/// A harness on the single Redis reached at `url` (a fault proxy in front of it), whose calls time
/// out after `command_timeout`.
pub async fn redis_at(url: &str, body: &str, command_timeout: Duration) -> Harness<RedisStore> {
    let (tenant, pool) = (unique_tenant("t"), unique_tenant("p"));
    let (top, body) = body.split_once(TOP_SEPARATOR).unwrap_or(("", body));
    let (store, body) = store_section(&format!("store:\n  redis_url: {url}"), body);
    let yaml = policy_yaml(&tenant, &pool, body, &format!("{top}\n{store}"));
    let policy = Policy::parse("test.yaml", &yaml).expect("test policy");
    let options = RedisOptions { command_timeout, ..RedisOptions::default() };
    let store = RedisStore::connect(&RedisTarget::Single(url.to_string()), options).await.expect("redis");
    clear_of_a_turn(REAL_CLOCK_SPAN).await;
    Harness::build(store, policy, tenant, pool, None).await
}

async fn redis_backend(backend: Backend, body: &str) -> Harness<RedisStore> {
    let (tenant, pool) = (unique_tenant("t"), unique_tenant("p"));
    let (top, body) = body.split_once(TOP_SEPARATOR).unwrap_or(("", body));
    let (store, body) = store_section(&backend.store_yaml(), body);
    let yaml = policy_yaml(&tenant, &pool, body, &format!("{top}\n{store}"));
    let policy = Policy::parse("test.yaml", &yaml).expect("test policy");
    let target = match backend {
        Backend::Cluster => RedisTarget::Cluster(redis_cluster_nodes()),
        _ => RedisTarget::Single(redis_url()),
    };
    let store = RedisStore::connect(&target, RedisOptions::default()).await.expect("redis");
    clear_of_a_turn(REAL_CLOCK_SPAN).await;
    Harness::build(store, policy, tenant, pool, None).await
}

impl<S: Store> Harness<S> {
    /// A harness over a store and a policy made elsewhere; `tenant` and `pool` name the ones the
    /// helpers look at.
    pub async fn from_parts(
        store: S,
        policy: Policy,
        tenant: String,
        pool: String,
        clock: Option<ManualClock>,
    ) -> Self {
        Harness::build(store, policy, tenant, pool, clock).await
    }

    async fn build(store: S, policy: Policy, tenant: String, pool: String, clock: Option<ManualClock>) -> Self {
        Harness::built(store, policy, tenant, pool, clock, true).await
    }

    /// A harness, `announced` by a heartbeat at its start, as a server's, on the manual clock
    /// only: it writes records as the replicas heard read them, and counts them (itself alone
    /// on its own embedded store). On Redis the replicas heard would be the harnesses of every
    /// test beside it, and its local share would change from run to run; there, as for a
    /// second replica on the same store ([`Harness::wrapped`]), it has heard no replica yet:
    /// it writes full records and counts one.
    async fn built(
        store: S,
        policy: Policy,
        tenant: String,
        pool: String,
        clock: Option<ManualClock>,
        announced: bool,
    ) -> Self {
        let protocol = Protocol::new(store).await.expect("scripts load");
        let admission = match &clock {
            Some(c) => Admission::with_clock(Arc::new(policy), protocol, Arc::new(c.clone())),
            None => Admission::new(Arc::new(policy), protocol),
        };
        if announced && clock.is_some() {
            admission.heartbeat().await.expect("the harness's heartbeat");
        }
        Harness {
            admission: Arc::new(admission),
            tenant,
            pool,
            clock,
            ledger_file: None,
            inspect: Script::new("inspect", INSPECT.to_string()),
            settled: Script::new("settled", SETTLED.to_string()),
            ledger: Script::new("ledger", "return redis.call('XRANGE', KEYS[1], '-', '+')".to_string()),
        }
    }

    /// The same tenant, policy and keyspace seen through a wrapper around the store, as a second
    /// replica on the same store would see them.
    pub async fn wrapped<T: Store>(&self, wrap: impl FnOnce(S) -> T) -> Harness<T>
    where
        S: Clone,
    {
        let store = wrap(self.admission.protocol().store().clone());
        let policy = Policy::clone(&self.admission.policy());
        Harness::built(store, policy, self.tenant.clone(), self.pool.clone(), self.clock.clone(), false).await
    }

    /// Waits (in real time, at most `limit`) until `done` holds of the harness; false if it never did.
    pub async fn eventually<F, Fut>(&self, limit: Duration, mut done: F) -> bool
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if done().await {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A scope hash by key, or `None` when it does not exist.
    pub async fn scope(&self, key: &str) -> Option<KeyView> {
        self.inspect(vec![key.to_string()]).await.remove(key).filter(|v| v.kind != "none")
    }

    /// Holds in flight in the tenant scope (0 when the scope hash does not exist).
    pub async fn in_flight(&self) -> f64 {
        self.scope(&keys::tenant_scope(&self.tenant))
            .await
            .map_or(0.0, |v| v.fields.get("c").map_or(0.0, |c| c.parse().unwrap()))
    }

    /// Moves time: the manual clock on the embedded store, real time on Redis (whose clock is
    /// the server's own `TIME`).
    pub async fn advance(&self, ms: u64) {
        match &self.clock {
            Some(c) => c.advance_ms(ms),
            None => tokio::time::sleep(Duration::from_millis(ms)).await,
        }
    }

    /// The time the store reads: the manual clock's, or the real clock's (a Redis server's own
    /// is this machine's).
    pub fn now_ms(&self) -> u64 {
        use tollgate::store::clock::Clock;
        match &self.clock {
            Some(c) => c.now_ms(),
            None => tollgate::store::clock::SystemClock.now_ms(),
        }
    }

    /// True when time moves only when the test moves it, so exact timing can be asserted.
    pub fn exact_time(&self) -> bool {
        self.clock.is_some()
    }

    pub fn attributes(&self, prompt: u64, max_tokens: u64) -> Attributes {
        Attributes {
            plan: None,
            tenant: Some(self.tenant.clone()),
            user: None,
            model: Some("m".into()),
            priority: None,
            deadline_ms: None,
            wait_ms: None,
            idempotency: None,
            prompt: PromptSize::Tokens(prompt),
            max_tokens: Some(max_tokens),
            stream: false,
            input_only: false,
            outputs: 1,
        }
    }

    /// `attributes` under an idempotency key that means `repeat` when repeated.
    pub fn keyed(&self, prompt: u64, max_tokens: u64, key: &str, repeat: KeyRepeat) -> Attributes {
        Attributes {
            idempotency: Some(IdempotencyKey { key: key.into(), repeat }),
            ..self.attributes(prompt, max_tokens)
        }
    }

    pub async fn reserve(&self, prompt: u64, max_tokens: u64) -> Decision {
        self.admission.reserve(&self.attributes(prompt, max_tokens)).await
    }

    pub async fn inspect(&self, keys: Vec<String>) -> BTreeMap<String, KeyView> {
        let reply = self.admission.protocol().store().eval(&self.inspect, keys, vec![]).await.expect("inspect");
        let Reply::Array(items) = reply else { panic!("inspect reply {reply:?}") };
        let mut out = BTreeMap::new();
        for item in items {
            let Reply::Array(parts) = item else { panic!() };
            let key = parts[0].as_text().unwrap().to_string();
            let kind = parts[1].as_text().unwrap().to_string();
            let pttl = parts[2].as_int().unwrap();
            let mut fields = BTreeMap::new();
            if let Reply::Array(flat) = &parts[3] {
                if kind == "string" {
                    fields.insert("value".into(), flat[0].as_text().unwrap_or_default().to_string());
                } else {
                    for pair in flat.chunks(2) {
                        fields.insert(pair[0].as_text().unwrap().to_string(), pair[1].as_text().unwrap().to_string());
                    }
                }
            }
            out.insert(key, KeyView { kind, pttl, fields });
        }
        out
    }

    /// What the tenant's settled buckets hold: each settled hold's field, and its value with the
    /// PTTL of the bucket it is in.
    pub async fn settled(&self) -> BTreeMap<String, (String, i64)> {
        let args = vec![keys::settled_prefix(&self.tenant), self.admission.policy().record_retention_ms.to_string()];
        let store = self.admission.protocol().store();
        let reply = store.eval(&self.settled, vec![keys::holds(&self.tenant)], args).await.expect("settled");
        let Reply::Array(entries) = reply else { panic!("settled reply {reply:?}") };
        entries
            .into_iter()
            .map(|e| {
                let Reply::Array(p) = e else { panic!("entry {e:?}") };
                (p[0].as_text().unwrap().to_string(), (p[1].as_text().unwrap().to_string(), p[2].as_int().unwrap()))
            })
            .collect()
    }

    /// The tenant's ledger stream, oldest entry first: each entry's fields.
    pub async fn ledger(&self) -> Vec<BTreeMap<String, String>> {
        self.ledger_of(&self.tenant).await
    }

    /// Any tenant's ledger stream, oldest entry first.
    pub async fn ledger_of(&self, tenant: &str) -> Vec<BTreeMap<String, String>> {
        let key = keys::ledger(tenant);
        let reply = self.admission.protocol().store().eval(&self.ledger, vec![key], vec![]).await.expect("ledger");
        let Reply::Array(entries) = reply else { panic!("XRANGE reply {reply:?}") };
        entries
            .into_iter()
            .map(|e| {
                let Reply::Array(parts) = e else { panic!("entry {e:?}") };
                let Reply::Array(flat) = &parts[1] else { panic!("fields {parts:?}") };
                flat.chunks(2)
                    .map(|p| (p[0].as_text().unwrap().to_string(), p[1].as_text().unwrap_or_default().to_string()))
                    .collect()
            })
            .collect()
    }

    /// The tenant scope's tokens charged today (`du`; 0 when nothing was charged).
    pub async fn day_usage(&self) -> u64 {
        self.scope(&keys::tenant_scope(&self.tenant))
            .await
            .and_then(|v| v.fields.get("du").map(|d| d.parse::<f64>().unwrap() as u64))
            .unwrap_or(0)
    }

    /// The tenant's scope hash.
    pub async fn tenant_scope(&self) -> KeyView {
        let key = keys::tenant_scope(&self.tenant);
        self.inspect(vec![key.clone()]).await.remove(&key).unwrap()
    }

    /// The pool's state (`n`, `w`, `kv`) and how many holds its hash and lease index list.
    pub async fn pool_view(&self) -> (KeyView, usize, usize) {
        let keys = vec![keys::pool_state(&self.pool), keys::pool_holds(&self.pool), keys::pool_leases(&self.pool)];
        let mut views = self.inspect(keys.clone()).await;
        let state = views.remove(&keys[0]).unwrap();
        // (A hold's charge of the provider's limits sits beside it, at `<id>+`.)
        let holds = views.remove(&keys[1]).unwrap().fields.keys().filter(|f| !keys::is_pool_charge(f)).count();
        let leases = views.remove(&keys[2]).unwrap().fields.len();
        (state, holds, leases)
    }

    /// The requests waiting in tollgate for a slot of the pool (a pool that queues here).
    pub async fn pool_waiting(&self) -> usize {
        self.scope(&keys::pool_waiting(&self.pool)).await.map_or(0, |v| v.fields.len())
    }

    /// The reservation ids the pool holds work for.
    pub async fn pool_holds(&self) -> Vec<String> {
        let key = keys::pool_holds(&self.pool);
        let mut views = self.inspect(vec![key.clone()]).await;
        views.remove(&key).unwrap().fields.into_keys().filter(|f| !keys::is_pool_charge(f)).collect()
    }

    /// Outstanding holds and work of the pool: (n, w).
    pub async fn pool_load(&self) -> (u64, u64) {
        let (state, holds, leases) = self.pool_view().await;
        let get = |f: &str| state.fields.get(f).map_or(0, |v| v.parse::<u64>().unwrap());
        let (n, w) = (get("n"), get("w"));
        assert_eq!((holds as u64, leases as u64), (n, n), "the holds hash and lease index agree with n");
        (n, w)
    }

    /// Every key a tenant-level scenario touches: scope, lease index, the given records, and the
    /// entries of the settled buckets.
    pub async fn snapshot(&self, ids: &[&str]) -> BTreeMap<String, KeyView> {
        let mut keys = vec![keys::tenant_scope(&self.tenant), keys::leases(&self.tenant)];
        keys.extend(ids.iter().map(|id| keys::record(&self.tenant, id)));
        let mut snap = self.inspect(keys).await;
        for (field, (value, pttl)) in self.settled().await {
            let fields = BTreeMap::from([("value".to_string(), value)]);
            snap.insert(format!("settled {field}"), KeyView { kind: "settled".into(), pttl, fields });
        }
        // PTTL counts down on Redis between two looks; contents are what must not change.
        for view in snap.values_mut() {
            view.pttl = view.pttl.signum();
        }
        snap
    }
}

/// The admitted reservation id, or a panic that shows the decision.
pub fn admitted(d: &Decision) -> &tollgate::admission::Admitted {
    match d {
        Decision::Admitted(a) => a,
        other => panic!("expected admission with a hold, got {other:?}"),
    }
}

pub fn denied(d: &Decision) -> &tollgate::admission::Denial {
    match d {
        Decision::Denied(d) => d,
        other => panic!("expected denial, got {other:?}"),
    }
}
