//! The policy: YAML in, a validated [`Policy`] out. Parsing is strict (an unknown field is an
//! error, so a typo cannot silently drop a limit) and validation names the field and the reason,
//! so a bad file stops the start with a message a person can act on.

pub mod budget;
mod models;
pub mod names;
mod raw;
mod summary;
mod validate;
mod window;
mod zone;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use models::{
    DEFAULT_BYTES_PER_TOKEN, MAX_CACHE_WEIGHT_MILLI, MAX_PRICE_NANOS, ModelPolicy, PoolPolicy, PoolQueue, Price,
    ProviderLimits, TokenWeights, UpstreamThrottle,
};
pub use raw::{Limits, MAX_MONEY, Money, NANOS};
pub use summary::without_password;
pub use validate::MAX_TOKEN_COUNT;
pub use window::{CommitWindow, DEFAULT_COMMIT_WINDOW, SHORT_COMMIT_WINDOW};
pub use zone::Zone;

/// Request priority tier (`x-priority`, or the tenant's default). As a pool fills, `sheddable` is
/// refused first, then `standard`; `critical` only when the pool truly cannot serve it. Ordered
/// from lowest to highest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    Sheddable,
    #[default]
    Standard,
    Critical,
}

impl Priority {
    /// One tier lower (the lowest stays): where a request past its tenant's soft budget goes.
    pub fn demoted(self) -> Priority {
        match self {
            Priority::Critical => Priority::Standard,
            Priority::Standard | Priority::Sheddable => Priority::Sheddable,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Critical => "critical",
            Priority::Standard => "standard",
            Priority::Sheddable => "sheddable",
        }
    }
}

impl std::str::FromStr for Priority {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "critical" => Ok(Priority::Critical),
            "standard" => Ok(Priority::Standard),
            "sheddable" => Ok(Priority::Sheddable),
            other => Err(format!("priority {other:?} is not one of critical, standard, sheddable")),
        }
    }
}

/// What happens to the tokens of a hold whose owner never came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ExpiredUsage {
    /// Missing usage is not zero usage: the slot is freed, the held tokens stay charged.
    #[default]
    ChargeReserved,
    /// The held tokens come back as if the request had never run.
    Refund,
}

/// A configuration the process refuses to start with.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: {message}")]
    Parse { file: String, message: String },
    #[error("{file}: {field}: {why}")]
    Invalid { file: String, field: String, why: String },
}

/// Where the counters live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreChoice {
    /// In-process; for a single replica.
    Embedded,
    Redis {
        url: String,
    },
    Cluster {
        nodes: Vec<String>,
    },
}

/// Store selection, connection timeouts, and the circuit breaker in front of Redis.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreSettings {
    pub choice: StoreChoice,
    pub connect_timeout: Duration,
    /// Every Redis call's limit; well under Envoy's ext_authz timeout (0.5 s), so a decision
    /// against a dead or stalled Redis answers before Envoy gives up on it.
    pub command_timeout: Duration,
    pub breaker: BreakerPolicy,
    /// The share of each limit the replicas admit, together, while the store cannot be reached
    /// (`on_store_error: local`): each admits `limit × local_factor ÷ replicas`.
    pub local_factor: f64,
    /// The embedded store's memory cap (bytes): past it the oldest settled records are evicted,
    /// and when none is left no new hold is made until some settle. (Redis has its own
    /// `maxmemory`.)
    pub max_memory_bytes: usize,
    /// How long a commit from a response waits for more of its tenant's to go in one store call
    /// (`store.commit_window_ms`): see [`CommitWindow`] and `admission::batch`.
    pub commit_window: CommitWindow,
}

/// When calls to Redis stop (see `store::breaker`): after `failures` transient errors in a row,
/// for `open` and then doubling up to `max_open` while probes fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerPolicy {
    pub failures: u32,
    pub open: Duration,
    pub max_open: Duration,
}

/// The serving side of the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSettings {
    pub listen: SocketAddr,
    /// A second address that serves only `grpc.health.v1`: for probes from outside the pod while
    /// `listen` stays on loopback, reachable by the Envoy beside tollgate alone.
    pub health_listen: Option<SocketAddr>,
    /// The admin HTTP port: `/metrics` for Prometheus. Off unless set; keep it off the network
    /// Envoy's clients reach.
    pub admin_listen: Option<SocketAddr>,
    /// How often the policy file is looked at for changes (`server.policy_poll_ms`, 1 s by
    /// default); `None` (0): only SIGHUP reloads it.
    pub policy_poll: Option<Duration>,
    /// The header that carries the verified tenant id (Envoy sets it from identity, e.g. a JWT).
    pub tenant_header: String,
    /// The header that carries the plan a tenant the policy does not list is admitted under
    /// (Envoy sets it from a verified claim, and strips what clients send); none: not read.
    pub plan_header: Option<String>,
    /// The tier of a request that names no `x-priority` but an objective of the Gateway API
    /// Inference Extension (`x-gateway-inference-objective`) listed here; empty: not read.
    pub objectives: HashMap<String, Priority>,
    /// Most tenants admitted under a plan header this replica remembers the plan of (see
    /// `admission::claims`).
    pub claimed_tenants: usize,
    /// Who may call `Budgets/Adjust`: client certificate identities (a DNS name or URI, as
    /// `tls.allowed_clients`), or `loopback` for a caller on this host's loopback addresses.
    pub budget_admins: Vec<String>,
    /// How long in-flight calls may take to finish after SIGTERM.
    pub drain_timeout: Duration,
    /// TLS on `listen` (not on `health_listen`, which probes reach in plaintext).
    pub tls: Option<TlsSettings>,
    /// How log lines are written (`server.log_format`; `serve --log-format` wins). Read at start.
    pub log_format: LogFormat,
    /// The runtime's worker threads (`server.worker_threads`; `serve --worker-threads` wins):
    /// one by default, as a sidecar beside Envoy (docs/BENCHMARKS.md: a second worker costs more
    /// in wake-ups than it adds). Read at start.
    pub worker_threads: usize,
}

/// How tollgate writes its log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// One line of text per event, coloured only on a terminal and never with `NO_COLOR` set.
    #[default]
    Text,
    /// One JSON object per line, the event's fields at its top level, for a log pipeline to index.
    Json,
}

impl ServerSettings {
    /// True when clients beyond this host could reach `listen` without proving who they are: a
    /// non-loopback address without mutual TLS. Admission moves budget, so serving that way is
    /// warned about at start.
    pub fn unauthenticated_beyond_loopback(&self, listen: SocketAddr) -> bool {
        !listen.ip().is_loopback() && self.tls.as_ref().is_none_or(|t| t.client_ca.is_none())
    }
}

/// TLS on the main port, and with `client_ca`, mutual TLS: only a client whose certificate that
/// CA signed, naming an allowed identity, completes the handshake. The files are read at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// tollgate's certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA(s) client certificates must chain to (PEM); none means clients are not asked for one.
    pub client_ca: Option<PathBuf>,
    /// The identities a client certificate must carry one of, as a subject alternative name: a DNS
    /// name (`envoy.llm.svc`) or a URI (`spiffe://cluster.local/ns/llm/sa/envoy`); `*` is any
    /// certificate the CA signed.
    pub allowed_clients: Vec<String>,
    /// How often the files are looked at for a rotation (`reload_ms`, 10 s by default); `None`
    /// (0): read at start only.
    pub reload: Option<Duration>,
}

impl TlsSettings {
    /// TLS from the `serve` flags, which replace `server.tls` as a whole; checked as the policy's
    /// would be, with each problem named by its flag.
    pub fn from_flags(
        cert: Option<&Path>,
        key: Option<&Path>,
        client_ca: Option<&Path>,
        allowed_clients: &[String],
    ) -> Result<Option<TlsSettings>, ConfigError> {
        let text = |p: Option<&Path>| p.map(|p| p.display().to_string());
        let raw = raw::RawTls {
            cert: text(cert),
            key: text(key),
            client_ca: text(client_ca),
            allowed_clients: allowed_clients.to_vec(),
            reload_ms: None,
        };
        if raw.cert.is_none() && raw.key.is_none() && raw.client_ca.is_none() && raw.allowed_clients.is_empty() {
            return Ok(None);
        }
        validate::tls(raw).map(Some).map_err(|(field, why)| ConfigError::Invalid {
            file: "command line".into(),
            field: validate::tls_flag(&field).to_string(),
            why,
        })
    }

    /// One line for `check-config`.
    pub fn describe(&self) -> String {
        match &self.client_ca {
            None => format!("TLS ({}), clients not authenticated", self.cert.display()),
            Some(ca) => format!(
                "mutual TLS ({}), clients signed by {} naming {}",
                self.cert.display(),
                ca.display(),
                self.allowed_clients.join(", ")
            ),
        }
    }
}

/// What a tenant's requests get when the store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    /// Admit within this replica's share of each rate limit (`store.local_factor` of the limit,
    /// divided among the replicas last counted), unmetered (the default of the distributed rate-limiting design tollgate follows).
    #[default]
    Local,
    /// Refuse with 503 `store_unavailable` (cost wins).
    FailClosed,
    /// Admit without a hold, unmetered (availability wins); the request goes upstream with
    /// `x-tollgate-unmetered: store_unavailable` and no reservation to commit.
    FailOpen,
}

impl OnStoreError {
    /// As the policy spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            OnStoreError::Local => "local",
            OnStoreError::FailClosed => "fail_closed",
            OnStoreError::FailOpen => "fail_open",
        }
    }
}

/// Reserve a learned quantile of the output instead of the ceiling. The estimate is per tenant and
/// model, lives in the store (every replica shares it) and is taught by commits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveOutput {
    /// The quantile of past output lengths to reserve, e.g. 0.99.
    pub quantile: f64,
    /// Samples needed before the estimate is used; until then the ceiling is reserved.
    pub min_samples: u64,
    /// Samples kept: past this many, every count is halved, so the estimate follows drift.
    pub window: u64,
}

/// One tenant's limits and accounting rules.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantPolicy {
    pub limits: Limits,
    pub users: HashMap<String, Limits>,
    /// Limits for every user the policy does not name; none means unnamed users share the tenant's.
    pub default_user: Option<Limits>,
    pub models: HashMap<String, Limits>,
    pub lease_ttl_ms: u64,
    pub expired_usage: ExpiredUsage,
    /// The tier of a request that names none.
    pub default_priority: Priority,
    /// The highest tier this tenant's requests may claim; a higher claim is lowered to it.
    pub max_priority: Priority,
    /// The deadline of a request that names none; none means no deadline.
    pub default_deadline_ms: Option<u64>,
    /// Its weight among the tenants of its tier contending for a pool, in thousandths (1,000 = 1):
    /// a contended tier's work is shared in proportion.
    pub weight_milli: u64,
    /// Learned output reservation; none means the ceiling is always reserved.
    pub adaptive_output: Option<AdaptiveOutput>,
    pub on_store_error: OnStoreError,
    /// The tenant's limits are measured, not enforced: a request they would refuse is admitted
    /// (and held and charged, as any), marked `x-tollgate-shadow: <reason>`, and counted. Its
    /// decisions go to the store (no leasing).
    pub shadow: bool,
    /// Every decision goes to the store, even when the policy leases (`leasing`).
    pub strict: bool,
    /// The time zone its budgets' hours, days, weeks and months turn in.
    pub zone: Zone,
    /// Soft budgets of the tenant's scope, by [`budget::BudgetKey::index`] (`0`: none): past
    /// one, a request is still admitted, one tier lower and marked.
    pub soft: budget::BudgetLimits,
    /// How long the tenant's keys outlive their last write: long enough for every bucket to refill,
    /// every lease to run out and a day's budget to roll over, so expiry never forgets state that
    /// still matters.
    pub idle_ttl_ms: u64,
}

impl TenantPolicy {
    /// Whether the tenant has a soft budget.
    pub fn has_soft(&self) -> bool {
        self.soft.iter().any(|&n| n > 0)
    }

    /// Whether its soft budgets mark and demote its requests: a tenant in shadow only measures
    /// its limits, so its soft budgets count and do nothing more.
    pub fn acts_on_soft(&self) -> bool {
        self.has_soft() && !self.shadow
    }

    /// The user's limits, if any apply.
    pub fn user_limits(&self, user: &str) -> Option<&Limits> {
        self.users.get(user).or(self.default_user.as_ref())
    }
}

/// The validated policy the server runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Names this policy's text (16 hex digits of its FNV-1a hash): the same file, the same
    /// version, on every replica. Shown by `check-config` and in the metrics.
    pub version: String,
    pub server: ServerSettings,
    pub store: StoreSettings,
    pub models: HashMap<String, ModelPolicy>,
    /// Other names of models (`models.<name>.aliases`) → the model's name.
    pub aliases: HashMap<String, String>,
    pub pools: HashMap<String, Arc<PoolPolicy>>,
    pub tenants: HashMap<String, Arc<TenantPolicy>>,
    /// Named plans (`plans:`), each as the policy of a tenant that takes it whole: a tenant the
    /// policy does not list is admitted under the plan its trusted plan header names.
    pub plans: HashMap<String, Arc<TenantPolicy>>,
    /// Applied to a tenant the policy does not name (each such tenant gets its own buckets); none
    /// means unknown tenants are refused as `unauthenticated`.
    pub default_tenant: Option<Arc<TenantPolicy>>,
    /// The tenant a request without tenant identity is charged to; none means such requests are
    /// refused as `unauthenticated`.
    pub anonymous_tenant: Option<String>,
    pub record_retention_ms: u64,
    pub sweep_batch: u32,
    pub max_attempts: u32,
    pub concurrency_retry_ms: u64,
    /// Decide from slices of the store's buckets leased to this replica; `None`: every decision
    /// goes to the store.
    pub leasing: Option<Leasing>,
    pub metrics: MetricsSettings,
    /// How long a commit from a response waits for more of its tenant's: see
    /// [`Policy::commit_window`].
    commit_wait: Option<Duration>,
    /// The usage ledger: every settled hold entered by the script that settles it; `None`: off.
    pub ledger: Option<LedgerSettings>,
}

/// The usage ledger (see `lua/common.lua` and `ledger`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerSettings {
    pub terms: LedgerTerms,
    /// The embedded store's ledger file (JSON lines); Redis keeps the ledger in streams.
    pub file: Option<PathBuf>,
}

/// How much of the ledger the store keeps: each tenant's stream is trimmed to about `max_len`
/// entries and to `retention_ms` of age. A hold carries the terms it was made under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LedgerTerms {
    pub max_len: u64,
    pub retention_ms: u64,
}

/// What the metrics label.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetricsSettings {
    /// The tenants with series of their own; `None`: every tenant the policy names. Any other
    /// tenant is counted as `other`, so series stay bounded however many tenants arrive.
    pub tenants: Option<Vec<String>>,
    /// Of the tenants not among them (unlisted tenants, admitted under a plan or
    /// `default_tenant`), the first this many seen have series of their own; the rest are `other`.
    pub unlisted_tenants: usize,
    /// How often the labelled tenants' period budgets are read into the remaining-budget gauges
    /// (`metrics.budget_poll_ms`, 30 s by default); `None` (0): never.
    pub budget_poll: Option<Duration>,
}

/// Leasing: each replica draws slices of a scope's tokens, request permits and concurrency slots
/// from the store and decides from them in memory (see `admission::lease`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Leasing {
    /// How often a replica gives back what it did not use and draws again, per tenant.
    pub window_ms: u64,
    /// The most of a scope's capacity one replica's unused slice may hold.
    pub max_share: f64,
}

/// A policy text's version: FNV-1a, 64 bits, in hex. Not a security measure, a name.
pub fn version_of(text: &str) -> String {
    let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("{hash:016x}")
}

impl Policy {
    /// A model by its name or one of its aliases: its name, and its policy.
    pub fn model(&self, name: &str) -> Option<(&str, &ModelPolicy)> {
        let name = self.aliases.get(name).map_or(name, String::as_str);
        self.models.get_key_value(name).map(|(k, m)| (k.as_str(), m))
    }

    /// Reads and validates a policy file.
    pub fn load(path: &Path) -> Result<Policy, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { file: file.clone(), source })?;
        Policy::parse(&file, &text)
    }

    /// Parses and validates policy text; `file` names it in errors.
    pub fn parse(file: &str, text: &str) -> Result<Policy, ConfigError> {
        let raw: raw::RawPolicy = serde_yaml::from_str(text)
            .map_err(|e| ConfigError::Parse { file: file.to_string(), message: e.to_string() })?;
        let mut policy = validate::validate(raw).map_err(|(field, why)| ConfigError::Invalid {
            file: file.to_string(),
            field,
            why,
        })?;
        policy.version = version_of(text);
        Ok(policy)
    }

    /// Refuses a policy whose shortest lease is shorter than ten times `window`, the commit window
    /// in force where the policy in force set one (a reload keeps the store's settings until a
    /// restart, so this policy's own window is not the one its holds will see; a default window
    /// fits itself to the leases, see [`Policy::commit_window`]).
    pub fn check_window_in_force(&self, file: &str, window: CommitWindow) -> Result<(), ConfigError> {
        validate::commit_window_fits(window, self.shortest_lease_ms(), " (in force until a restart)")
            .map_err(|(field, why)| ConfigError::Invalid { file: file.to_string(), field, why })
    }

    /// The shortest lease any hold of this policy is made with (its tenants', plans' and
    /// `default_tenant`'s); `u64::MAX` when it has none of them.
    pub fn shortest_lease_ms(&self) -> u64 {
        self.tenants
            .values()
            .chain(self.default_tenant.iter())
            .chain(self.plans.values())
            .map(|t| t.lease_ttl_ms)
            .min()
            .unwrap_or(u64::MAX)
    }

    /// The settings a running tollgate cannot change (its ports, TLS, store, leasing) that differ
    /// in `new`: a reload applies the rest and keeps these until a restart.
    pub fn restart_only_changes(&self, new: &Policy) -> Vec<&'static str> {
        let mut changed = Vec::new();
        if self.server != new.server {
            changed.push("server");
        }
        if self.store != new.store {
            changed.push("store");
        }
        if self.leasing != new.leasing {
            changed.push("leasing");
        }
        if self.ledger != new.ledger {
            changed.push("ledger");
        }
        changed
    }

    /// The pool serving a model, with its name.
    pub fn pool_of(&self, model: &ModelPolicy) -> Option<(&str, &Arc<PoolPolicy>)> {
        let name = model.pool.as_deref()?;
        self.pools.get_key_value(name).map(|(n, p)| (n.as_str(), p))
    }

    /// The tenant's policy, or the default tenant's.
    pub fn tenant(&self, tenant: &str) -> Option<&Arc<TenantPolicy>> {
        self.tenants.get(tenant).or(self.default_tenant.as_ref())
    }
}

impl Limits {
    /// The token bucket's capacity: `burst_tokens`, or one minute of refill; `None` without a bucket.
    pub fn token_capacity(&self) -> Option<u64> {
        self.tokens_per_minute.map(|tpm| self.burst_tokens.unwrap_or(tpm))
    }

    /// The token bucket's refill per millisecond (0 without a bucket).
    pub fn tokens_per_ms(&self) -> f64 {
        per_ms(self.tokens_per_minute)
    }

    /// The request bucket's refill per millisecond (0 without one); its capacity is one minute's.
    pub fn requests_per_ms(&self) -> f64 {
        per_ms(self.requests_per_minute)
    }

    /// The largest request these limits can ever admit, in tokens; `None` when unbounded.
    pub fn largest_admissible(&self) -> Option<u64> {
        let budgets = [self.tokens_per_hour, self.tokens_per_day, self.tokens_per_week, self.tokens_per_month];
        std::iter::once(self.token_capacity()).chain(budgets).flatten().min()
    }
}

/// A per-minute rate per millisecond. Limits are at most 10^12 (validated), well inside f64's
/// exact integers.
#[allow(clippy::cast_precision_loss)]
pub fn per_ms(per_minute: Option<u64>) -> f64 {
    per_minute.unwrap_or(0) as f64 / 60_000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shadow_is_inherited_from_defaults_unless_a_tenant_says_otherwise() {
        let text = "defaults:\n  shadow: true\nmodels:\n  m: { max_output_tokens: 1 }\n\
                    tenants:\n  a: {}\n  b: { shadow: false }\ndefault_tenant: {}\n";
        let policy = Policy::parse("t", text).unwrap();
        assert!(policy.tenants["a"].shadow);
        assert!(!policy.tenants["b"].shadow);
        assert!(policy.default_tenant.as_ref().unwrap().shadow);
        let plain = Policy::parse("t", "models:\n  m: { max_output_tokens: 1 }\ntenants:\n  a: {}\n").unwrap();
        assert!(!plain.tenants["a"].shadow, "off unless asked for");
    }

    #[test]
    fn only_mutual_tls_makes_a_network_address_safe_to_serve() {
        let policy = Policy::parse("t", "models:\n  m: { max_output_tokens: 1 }\n").unwrap();
        let mut server = policy.server.clone();
        let loopback: SocketAddr = "127.0.0.1:50051".parse().unwrap();
        let v6_loopback: SocketAddr = "[::1]:50051".parse().unwrap();
        let anywhere: SocketAddr = "0.0.0.0:50051".parse().unwrap();
        assert!(!server.unauthenticated_beyond_loopback(loopback));
        assert!(!server.unauthenticated_beyond_loopback(v6_loopback));
        assert!(server.unauthenticated_beyond_loopback(anywhere));
        let tls = |client_ca: Option<&str>| TlsSettings {
            cert: "c".into(),
            key: "k".into(),
            client_ca: client_ca.map(PathBuf::from),
            allowed_clients: client_ca.map(|_| vec!["*".to_string()]).unwrap_or_default(),
            reload: None,
        };
        server.tls = Some(tls(None));
        assert!(server.unauthenticated_beyond_loopback(anywhere), "TLS without client certificates");
        server.tls = Some(tls(Some("ca")));
        assert!(!server.unauthenticated_beyond_loopback(anywhere));
    }
}
