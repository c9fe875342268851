//! Redis and Redis Cluster through fred. The protocol's phases are a function library, loaded at
//! start (`FUNCTION LOAD` on every primary, so a broken one fails the start) and called by
//! `FCALL`; other scripts are loaded by `SCRIPT LOAD` and called by SHA. Either is loaded again
//! when a node says it has neither (a restarted node without persistence, a new primary, a flush).

use std::time::Duration;

use std::sync::Arc;

use fred::prelude::{
    ClientLike, Config, ConnectionConfig, EventInterface, FunctionInterface, LuaInterface, Options, PerformanceConfig,
    ReconnectPolicy, ServerConfig,
};
use fred::types::Value;
use fred::types::scan::ScanType;
use futures_util::StreamExt;

use super::{Reply, Script, Store, StoreError};

/// Where the Redis store connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// One node, as a `redis://host:port[/db]` URL.
    Single(String),
    /// Cluster seed nodes as `host:port`; the rest of the cluster is discovered.
    Cluster(Vec<String>),
}

/// Connection knobs; the defaults suit a sidecar next to a nearby Redis.
#[derive(Debug, Clone, Copy)]
pub struct RedisOptions {
    /// How long the start may wait for the first connection.
    pub connect_timeout: Duration,
    /// A script call that takes longer fails as `store_unavailable`.
    pub command_timeout: Duration,
}

impl From<&crate::config::StoreSettings> for RedisOptions {
    fn from(store: &crate::config::StoreSettings) -> Self {
        RedisOptions { connect_timeout: store.connect_timeout, command_timeout: store.command_timeout }
    }
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions { connect_timeout: Duration::from_secs(3), command_timeout: Duration::from_millis(500) }
    }
}

/// A connected Redis store.
#[derive(Clone)]
pub struct RedisStore {
    client: fred::prelude::Client,
    /// Every script call fails at once while the connection is down or being made again, and a
    /// call whose connection drops fails then rather than waiting for the reconnect: a dead Redis
    /// costs no decision its command timeout. A call that may have run is the caller's to repeat
    /// (every write script notices a call it has already run).
    calls: Options,
    /// Told whenever a connection ends: a call still waiting then (written to it, or queued while
    /// the client noticed) fails at once rather than waiting out the reconnect.
    lost: Arc<tokio::sync::Notify>,
    /// The function libraries this store has loaded: every phase names the same library, which
    /// the start loads once, not once per phase (a node that lost it is given it again by `eval`).
    libraries: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects, and fails if the first connection does not succeed within the connect timeout:
    /// an unreachable Redis at start is an error, not a silent retry loop.
    pub async fn connect(target: &RedisTarget, options: RedisOptions) -> Result<Self, StoreError> {
        let config = match target {
            RedisTarget::Single(url) => Config::from_url(url).map_err(|e| {
                StoreError::Unavailable(format!("bad Redis URL {:?}: {e}", crate::config::without_password(url)))
            })?,
            RedisTarget::Cluster(nodes) => {
                let mut hosts = Vec::with_capacity(nodes.len());
                for node in nodes {
                    hosts.push(parse_host_port(node)?);
                }
                Config { server: ServerConfig::new_clustered(hosts), ..Config::default() }
            }
        };
        let perf = PerformanceConfig { default_command_timeout: options.command_timeout, ..Default::default() };
        let connection = ConnectionConfig {
            connection_timeout: options.connect_timeout,
            internal_command_timeout: options.connect_timeout,
            max_command_attempts: 2,
            ..Default::default()
        };
        // Reconnect at most half a second apart: a Redis that comes back is in use within about a
        // second (this, then the circuit breaker's next probe).
        let policy = ReconnectPolicy::new_exponential(0, 50, 500, 2);
        let client = fred::prelude::Client::new(config, Some(perf), Some(connection), Some(policy));
        let connected = tokio::time::timeout(options.connect_timeout, client.init()).await;
        match connected {
            Ok(Ok(_task)) => {
                let lost = Arc::new(tokio::sync::Notify::new());
                let notify = Arc::clone(&lost);
                client.on_error(move |_| {
                    notify.notify_waiters();
                    async { Ok(()) }
                });
                Ok(RedisStore {
                    client,
                    calls: Options { fail_fast: true, ..Options::default() },
                    lost,
                    libraries: Arc::default(),
                })
            }
            Ok(Err(e)) => {
                let _ = client.quit().await;
                Err(StoreError::Unavailable(format!("cannot connect to Redis at {}: {e}", describe(target))))
            }
            Err(_) => {
                let _ = client.quit().await;
                Err(StoreError::Unavailable(format!(
                    "cannot connect to Redis at {}: no connection within {:?}",
                    describe(target),
                    options.connect_timeout
                )))
            }
        }
    }

    /// The underlying client, for tests that inspect keys directly.
    pub fn client(&self) -> &fred::prelude::Client {
        &self.client
    }

    /// Every stream key matching `pattern`, on every primary: a `SCAN` (of each Cluster node).
    pub async fn scan_streams(&self, pattern: &str) -> Result<Vec<String>, StoreError> {
        let client = &self.client;
        let found: Vec<_> = if client.is_clustered() {
            client.scan_cluster_buffered(pattern, Some(1000), Some(ScanType::Stream)).collect().await
        } else {
            client.scan_buffered(pattern, Some(1000), Some(ScanType::Stream)).collect().await
        };
        let mut streams = Vec::with_capacity(found.len());
        for key in found {
            let key =
                key.map_err(|e| StoreError::Unavailable(format!("cannot scan for streams matching {pattern}: {e}")))?;
            streams.push(key.as_str_lossy().into_owned());
        }
        Ok(streams)
    }

    /// Closes the connections.
    pub async fn close(&self) {
        let _ = self.client.quit().await;
    }
}

impl Store for RedisStore {
    async fn load(&self, script: &Script) -> Result<(), StoreError> {
        if let Some(f) = &script.function
            && self.libraries.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains(&f.library.name)
        {
            return Ok(());
        }
        self.load_again(script).await?;
        if let Some(f) = &script.function {
            self.libraries.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(f.library.name.clone());
        }
        Ok(())
    }

    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        let lost = self.lost.notified();
        let call = async {
            let client = self.client.with_options(&self.calls);
            let run = |keys, args| async {
                match &script.function {
                    Some(f) => client.fcall::<Value, _, _, _>(&*f.name, keys, args).await,
                    None => client.evalsha::<Value, _, _, _>(&*script.sha1, keys, args).await,
                }
            };
            match run(keys.clone(), args.clone()).await {
                Err(e) if not_loaded(&e) => {
                    self.load_again(script).await?;
                    run(keys, args).await
                }
                other => other,
            }
            .map_err(|e| store_error(script, e))
        };
        tokio::select! {
            value = call => Ok(to_reply(value?)),
            () = lost => Err(StoreError::Unavailable(format!("{}: the connection to Redis was lost", script.name))),
        }
    }
}

impl RedisStore {
    /// Loads `script` (its library, for a phase) on every primary, whether or not it was before.
    async fn load_again(&self, script: &Script) -> Result<(), StoreError> {
        match &script.function {
            // (Its code names the library with its hash: loading it again replaces it with itself.)
            Some(f) => self.client.function_load_cluster::<Value, _>(true, f.library.code.as_str()).await,
            None => self.client.script_load_cluster::<Value, _>(&*script.source).await,
        }
        .map(|_| ())
        .map_err(|e| match e.details() {
            // A setting, not a passing fault: the start fails, saying why.
            d if d.contains("unknown command") => StoreError::Script {
                script: script.name,
                message: format!("Redis 7.0 or later is needed (FUNCTION LOAD): {d}"),
            },
            _ => store_error(script, e),
        })
    }
}

/// The node has not got the script (`NOSCRIPT`) or the function (`Function not found`).
fn not_loaded(e: &fred::error::Error) -> bool {
    let d = e.details();
    d.starts_with("NOSCRIPT") || d.contains("Function not found")
}

fn describe(target: &RedisTarget) -> String {
    match target {
        RedisTarget::Single(url) => crate::config::without_password(url),
        RedisTarget::Cluster(nodes) => {
            let nodes: Vec<_> = nodes.iter().map(|n| crate::config::without_password(n)).collect();
            format!("cluster {}", nodes.join(","))
        }
    }
}

fn parse_host_port(node: &str) -> Result<(String, u16), StoreError> {
    let bad = || StoreError::Unavailable(format!("cluster node {node:?} is not host:port"));
    let (host, port) = node.rsplit_once(':').ok_or_else(bad)?;
    let port = port.parse().map_err(|_| bad())?;
    Ok((host.trim_matches(['[', ']']).to_string(), port))
}

fn store_error(script: &Script, e: fred::error::Error) -> StoreError {
    use fred::error::ErrorKind;
    match e.kind() {
        ErrorKind::IO
        | ErrorKind::Timeout
        | ErrorKind::Canceled
        | ErrorKind::Cluster
        | ErrorKind::Backpressure
        | ErrorKind::Routing => StoreError::Unavailable(e.to_string()),
        _ => StoreError::Script { script: script.name, message: e.to_string() },
    }
}

fn to_reply(value: Value) -> Reply {
    match value {
        Value::Null | Value::Boolean(false) => Reply::Nil,
        Value::Boolean(true) => Reply::Int(1),
        Value::Integer(n) => Reply::Int(n),
        // As Redis itself turns a Lua number into an integer reply: truncated (`as` saturates).
        #[allow(clippy::cast_possible_truncation)]
        Value::Double(f) => Reply::Int(f.trunc() as i64),
        Value::String(s) => Reply::Text(s.to_string()),
        Value::Bytes(b) => Reply::Text(String::from_utf8_lossy(&b).into_owned()),
        Value::Array(items) => Reply::Array(items.into_iter().map(to_reply).collect()),
        Value::Map(map) => Reply::Array(
            map.inner()
                .into_iter()
                .flat_map(|(k, v)| [Reply::Text(k.as_str_lossy().into_owned()), to_reply(v)])
                .collect(),
        ),
        Value::Queued => Reply::Nil,
    }
}
