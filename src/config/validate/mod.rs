//! Raw policy → [`Policy`], or the first problem as (field path, why). The tenants and the
//! whole are checked here; the other sections in `sections`.

mod limits;
mod sections;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::budget::Period;
use super::names as ids;
use super::raw::{RawAdaptive, RawPolicy, RawPool, RawTenant, RawTls};
use super::{
    AdaptiveOutput, CommitWindow, Leasing, LedgerSettings, LedgerTerms, Limits, MAX_CACHE_WEIGHT_MILLI,
    MAX_PRICE_NANOS, MetricsSettings, ModelPolicy, Policy, PoolPolicy, Price, ServerSettings, StoreChoice,
    StoreSettings, TenantPolicy, TlsSettings, TokenWeights, Zone,
};

use limits::{check_limits, check_within, children, money_needs_prices, soft_budgets};
use sections::{adaptive, breaker, leasing, ledger, metrics, pool_policy, price, token_weight};
pub(super) use sections::{tls, tls_flag};

type Problem = (String, String);

const MIN_LEASE_MS: u64 = 50;
const MAX_LEASE_MS: u64 = 86_400_000;
const DAY_MS: u64 = 86_400_000;
/// The embedded store's memory cap unless `store.max_memory_mb` says otherwise.
const DEFAULT_MAX_MEMORY_MB: u64 = 128;
/// The longest a commit from a response waits for its batch (`store.commit_window_ms`).
const MAX_COMMIT_WINDOW_MS: u64 = 100;
/// Windows a lease is at least as long as, so a batched commit lands well inside its hold's lease.
pub(super) const COMMIT_WINDOWS_IN_A_LEASE: u64 = 10;
// (A default window, which fits itself to the leases, is never shorter than the short one; and it
// is a window a policy may set.)
const _: () = assert!((MIN_LEASE_MS / COMMIT_WINDOWS_IN_A_LEASE) as u128 >= super::SHORT_COMMIT_WINDOW.as_millis());
const _: () = assert!(super::DEFAULT_COMMIT_WINDOW.as_millis() <= MAX_COMMIT_WINDOW_MS as u128);
/// The most entries a tenant's ledger stream may be configured to keep.
const MAX_LEDGER_LEN: u64 = 100_000_000;
/// Tenants `metrics.tenants` may list: each adds a few dozen series.
const MAX_LABELLED_TENANTS: usize = 1_000;
/// The largest output ceiling a model may declare: far above any model today, low enough that
/// token arithmetic never nears overflow.
const MAX_OUTPUT_CEILING: u64 = 10_000_000;
/// The largest token count tollgate accepts anywhere: a prompt, an output, a commit's counts. Far
/// above any model's context, and small enough that no sum of them nears 2^53, the largest integer
/// Lua's numbers hold exactly. Stated once, here (config imports nothing from the crate);
/// the protocol's nouns (`hold`) re-export it for everything else.
pub const MAX_TOKEN_COUNT: u64 = 1_000_000_000;

/// A commit window the policy sets, of at most a tenth of the shortest lease (`shortest_lease_ms`);
/// `said` is what the error adds about where the window comes from. (A default one fits itself to
/// the leases: see `Policy::commit_window`.)
pub(super) fn commit_window_fits(window: CommitWindow, shortest_lease_ms: u64, said: &str) -> Result<(), Problem> {
    let CommitWindow::Set(window) = window else { return Ok(()) };
    let window = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
    if window.saturating_mul(COMMIT_WINDOWS_IN_A_LEASE) > shortest_lease_ms {
        return Err(problem(
            "store.commit_window_ms",
            format!(
                "{window}{said} is more than a tenth of the shortest lease ({shortest_lease_ms} ms): \
                 a batched commit must land well inside its hold's lease"
            ),
        ));
    }
    Ok(())
}

fn problem(field: impl Into<String>, why: impl Into<String>) -> Problem {
    (field.into(), why.into())
}

/// An optional listen address; `example` shows the form in the error.
fn optional_address(field: &str, value: Option<&str>, example: &str) -> Result<Option<SocketAddr>, Problem> {
    value
        .map(|addr| addr.parse().map_err(|_| problem(field, format!("{addr:?} is not an address like {example}"))))
        .transpose()
}

pub(super) fn validate(raw: RawPolicy) -> Result<Policy, Problem> {
    let listen = raw.server.listen.as_deref().unwrap_or("127.0.0.1:50051");
    let listen: SocketAddr = listen
        .parse()
        .map_err(|_| problem("server.listen", format!("{listen:?} is not an address like 127.0.0.1:50051")))?;
    let header_name = |field: &str, name: String| {
        let name = name.to_ascii_lowercase();
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(problem(field, format!("{name:?} is not a header name")));
        }
        Ok(name)
    };
    let tenant_header =
        header_name("server.tenant_header", raw.server.tenant_header.unwrap_or_else(|| "x-tenant-id".into()))?;
    let plan_header = raw.server.plan_header.map(|h| header_name("server.plan_header", h)).transpose()?;
    if plan_header.as_ref().is_some_and(|h| *h == tenant_header) {
        return Err(problem("server.plan_header", "must be another header than server.tenant_header"));
    }
    let budget_admins = raw.server.budget_admins;
    if let Some((i, _)) =
        budget_admins.iter().enumerate().find(|(_, a)| a.trim().is_empty() || a.contains(char::is_whitespace))
    {
        return Err(problem(
            format!("server.budget_admins[{i}]"),
            "is not an identity (a DNS name, a URI, or loopback)",
        ));
    }
    let claimed_tenants = match raw.server.claimed_tenants {
        None => 100_000,
        Some(n @ 1..=10_000_000) => usize::try_from(n).unwrap_or(usize::MAX),
        Some(n) => return Err(problem("server.claimed_tenants", format!("{n} is outside 1..=10000000"))),
    };
    let health_listen = optional_address("server.health_listen", raw.server.health_listen.as_deref(), "0.0.0.0:50052")?;
    if health_listen.is_some_and(|h| h.port() == listen.port() && h.port() != 0) {
        return Err(problem("server.health_listen", "must be another port than server.listen"));
    }
    let admin_listen = optional_address("server.admin_listen", raw.server.admin_listen.as_deref(), "127.0.0.1:9090")?;
    if let Some(admin) = admin_listen
        && admin.port() != 0
        && (admin.port() == listen.port() || health_listen.is_some_and(|h| h.port() == admin.port()))
    {
        return Err(problem("server.admin_listen", "must be another port than server.listen and server.health_listen"));
    }
    let policy_poll = match raw.server.policy_poll_ms.unwrap_or(1_000) {
        0 => None,
        ms @ 100..=3_600_000 => Some(Duration::from_millis(ms)),
        ms => {
            return Err(problem("server.policy_poll_ms", format!("{ms} is outside 100..=3600000 (or 0: SIGHUP only)")));
        }
    };
    let server = ServerSettings {
        listen,
        health_listen,
        admin_listen,
        policy_poll,
        tenant_header,
        plan_header,
        objectives: raw.server.objectives.into_iter().collect(),
        claimed_tenants,
        budget_admins,
        drain_timeout: Duration::from_millis(raw.server.drain_timeout_ms.unwrap_or(5_000)),
        tls: raw.server.tls.map(tls).transpose()?,
        log_format: raw.server.log_format.unwrap_or_default(),
        worker_threads: match raw.server.worker_threads.unwrap_or(1) {
            n @ 1..=64 => usize::try_from(n).unwrap_or(1),
            n => return Err(problem("server.worker_threads", format!("{n} is outside 1..=64"))),
        },
    };

    let choice = match (raw.store.redis_url, raw.store.redis_cluster) {
        (Some(_), Some(_)) => {
            return Err(problem("store", "set redis_url or redis_cluster, not both"));
        }
        (Some(url), None) => {
            if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
                let shown = super::without_password(&url);
                return Err(problem("store.redis_url", format!("{shown:?} is not a redis:// URL")));
            }
            StoreChoice::Redis { url }
        }
        (None, Some(nodes)) => {
            if nodes.is_empty() {
                return Err(problem("store.redis_cluster", "name at least one node as host:port"));
            }
            for (i, node) in nodes.iter().enumerate() {
                let port = node.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok());
                if port.is_none() {
                    return Err(problem(format!("store.redis_cluster[{i}]"), format!("{node:?} is not host:port")));
                }
            }
            StoreChoice::Cluster { nodes }
        }
        (None, None) => StoreChoice::Embedded,
    };
    let max_memory_bytes = match (raw.store.max_memory_mb, &choice) {
        (Some(_), StoreChoice::Redis { .. } | StoreChoice::Cluster { .. }) => {
            return Err(problem(
                "store.max_memory_mb",
                "caps the embedded store only; Redis's memory is its own maxmemory setting",
            ));
        }
        (mb, _) => usize::try_from(positive("store.max_memory_mb", mb, DEFAULT_MAX_MEMORY_MB)?)
            .ok()
            .and_then(|mb| mb.checked_mul(1 << 20))
            .ok_or_else(|| problem("store.max_memory_mb", "is more memory than this machine can address"))?,
    };
    let commit_window = match (raw.store.commit_window_ms, &choice) {
        (None, StoreChoice::Embedded) | (Some(0), _) => CommitWindow::Off,
        (None, StoreChoice::Redis { .. } | StoreChoice::Cluster { .. }) => CommitWindow::Default,
        (Some(ms), _) if ms <= MAX_COMMIT_WINDOW_MS => CommitWindow::Set(Duration::from_millis(ms)),
        (Some(ms), _) => {
            return Err(problem(
                "store.commit_window_ms",
                format!("{ms} is more than {MAX_COMMIT_WINDOW_MS}: a commit may wait that long at most"),
            ));
        }
    };
    let store = StoreSettings {
        choice,
        connect_timeout: Duration::from_millis(positive(
            "store.connect_timeout_ms",
            raw.store.connect_timeout_ms,
            3_000,
        )?),
        command_timeout: Duration::from_millis(positive(
            "store.command_timeout_ms",
            raw.store.command_timeout_ms,
            250,
        )?),
        breaker: breaker(raw.store.breaker.unwrap_or_default())?,
        local_factor: match raw.store.local_factor {
            None => 0.8,
            Some(f) if f > 0.0 && f <= 1.0 => f,
            Some(f) => return Err(problem("store.local_factor", format!("{f} is outside (0, 1]"))),
        },
        max_memory_bytes,
        commit_window,
    };

    let d = raw.defaults;
    let lease_ttl_ms = lease("defaults.lease_ttl_ms", d.lease_ttl_ms.unwrap_or(120_000))?;
    let expired_usage = d.expired_usage.unwrap_or_default();
    let record_retention_ms = positive("defaults.record_retention_ms", d.record_retention_ms, 60_000)?;
    let sweep_batch = positive_u32("defaults.sweep_batch", d.sweep_batch, 16)?;
    let max_attempts = positive_u32("defaults.max_attempts", d.max_attempts, 3)?;
    let concurrency_retry_ms = positive("defaults.concurrency_retry_ms", d.concurrency_retry_ms, 1_000)?;
    let adaptive_output = d.adaptive_output.map(|a| adaptive("defaults.adaptive_output", a)).transpose()?;

    let mut pools = HashMap::new();
    for (name, p) in &raw.pools {
        let field = format!("pools.{name}");
        ids::check_tenant(name).map_err(|why| problem(field.clone(), why.to_string()))?;
        pools.insert(name.clone(), pool_policy(&field, p)?);
    }

    if raw.models.is_empty() {
        return Err(problem("models", "name at least one model: a request for an unknown model is refused"));
    }
    let mut models = HashMap::new();
    let mut aliases = HashMap::new();
    for (name, m) in &raw.models {
        for alias in &m.aliases {
            let field = format!("models.{name}.aliases");
            if ids::check_model(alias).is_err() {
                return Err(problem(field, format!("{alias:?}: a model name is 1-128 visible ASCII characters")));
            }
            if raw.models.contains_key(alias) {
                return Err(problem(field, format!("{alias:?} is the name of a model")));
            }
            if let Some(other) = aliases.insert(alias.clone(), name.clone()) {
                return Err(problem(field, format!("{alias:?} is also an alias of {other}")));
            }
        }
    }
    for (name, m) in raw.models {
        let field = format!("models.{name}");
        if ids::check_model(&name).is_err() {
            return Err(problem(field, "a model name is 1-128 visible ASCII characters"));
        }
        if m.max_output_tokens == 0 || m.max_output_tokens > MAX_OUTPUT_CEILING {
            return Err(problem(
                format!("{field}.max_output_tokens"),
                format!("{} is outside 1..={MAX_OUTPUT_CEILING}", m.max_output_tokens),
            ));
        }
        if !(m.bytes_per_token.is_finite() && m.bytes_per_token > 0.0) {
            return Err(problem(format!("{field}.bytes_per_token"), "must be a positive number"));
        }
        if m.max_prompt_tokens == 0 || m.max_prompt_tokens > MAX_TOKEN_COUNT {
            return Err(problem(
                format!("{field}.max_prompt_tokens"),
                format!("{} is outside 1..={MAX_TOKEN_COUNT}", m.max_prompt_tokens),
            ));
        }
        if let Some(pool) = &m.pool
            && !pools.contains_key(pool)
        {
            return Err(problem(
                format!("{field}.pool"),
                format!("{pool:?} is not one of the pools this policy names"),
            ));
        }
        let price = m.price.as_ref().map(|p| price(&format!("{field}.price"), p)).transpose()?;
        let token_weights = TokenWeights {
            read_milli: token_weight(&format!("{field}.cache_read_weight"), m.cache_read_weight)?,
            write_milli: token_weight(&format!("{field}.cache_write_weight"), m.cache_write_weight)?,
            reasoning_milli: token_weight(&format!("{field}.reasoning_weight"), m.reasoning_weight)?,
        };
        models.insert(
            name,
            ModelPolicy {
                max_output_tokens: m.max_output_tokens,
                bytes_per_token: m.bytes_per_token,
                learn_bytes_per_token: m.learn_bytes_per_token,
                max_prompt_tokens: m.max_prompt_tokens,
                pool: m.pool,
                price,
                token_weights,
            },
        );
    }
    for (name, pool) in &pools {
        if let Some(provider) = &pool.provider {
            let served = models.iter().filter(|(_, m)| m.pool.as_deref() == Some(name.as_str()));
            money_needs_prices(&format!("pools.{name}.provider_limits"), &provider.limits, served)?;
        }
    }

    let tenant = |field: String, t: RawTenant| {
        let defaults = TenantDefaults {
            lease_ttl_ms,
            expired_usage,
            retention_ms: record_retention_ms,
            adaptive_output,
            on_store_error: d.on_store_error.unwrap_or_default(),
            shadow: d.shadow.unwrap_or(false),
        };
        tenant_policy(&field, t, &defaults, &models)
    };
    // A plan is validated as a tenant of its own (a tenant admitted under it by a trusted header
    // is one), then each tenant that names it takes its settings under its own.
    let mut plans = HashMap::new();
    for (name, p) in &raw.plans {
        let field = format!("plans.{name}");
        ids::check_tenant(name).map_err(|why| problem(field.clone(), why.to_string()))?;
        if p.plan.is_some() {
            return Err(problem(format!("{field}.plan"), "a plan cannot name another plan"));
        }
        plans.insert(name.clone(), Arc::new(tenant(field, p.clone())?));
    }
    let planned = |field: &str, t: RawTenant| match &t.plan {
        None => Ok(t),
        Some(name) => match raw.plans.get(name) {
            Some(plan) => Ok(t.over(plan)),
            None => {
                Err(problem(format!("{field}.plan"), format!("{name:?} is not one of the plans this policy names")))
            }
        },
    };
    let mut tenants = HashMap::new();
    for (name, t) in raw.tenants {
        let field = format!("tenants.{name}");
        ids::check_tenant(&name).map_err(|why| problem(field.clone(), why.to_string()))?;
        let t = planned(&field, t)?;
        tenants.insert(name, Arc::new(tenant(field, t)?));
    }
    let default_tenant = match raw.default_tenant {
        Some(t) => Some(Arc::new(tenant("default_tenant".into(), planned("default_tenant", t)?)?)),
        None => None,
    };

    if let Some(name) = &raw.anonymous_tenant {
        ids::check_tenant(name).map_err(|why| problem("anonymous_tenant", why.to_string()))?;
        if !tenants.contains_key(name) && default_tenant.is_none() {
            return Err(problem(
                "anonymous_tenant",
                format!("{name:?} is neither a tenant of this policy nor covered by default_tenant"),
            ));
        }
    }

    let longest_lease = tenants
        .values()
        .chain(default_tenant.iter())
        .chain(plans.values())
        .map(|t| t.lease_ttl_ms)
        .max()
        .unwrap_or(lease_ttl_ms);
    let pools = pools
        .into_iter()
        .map(|(name, mut p)| {
            p.idle_ttl_ms = 2 * longest_lease.max(lease_ttl_ms) + 60_000;
            (name, Arc::new(p))
        })
        .collect();

    let ledger = raw.ledger.map(|l| ledger(l, &store.choice)).transpose()?;
    let mut policy = Policy {
        version: String::new(),
        server,
        store,
        models,
        aliases,
        pools,
        tenants,
        plans,
        default_tenant,
        anonymous_tenant: raw.anonymous_tenant,
        record_retention_ms,
        sweep_batch,
        max_attempts,
        concurrency_retry_ms,
        ledger,
        leasing: raw.leasing.map(leasing).transpose()?,
        metrics: metrics(raw.metrics)?,
        commit_wait: None,
    };
    commit_window_fits(policy.store.commit_window, policy.shortest_lease_ms(), "")?;
    policy.fit_commit_window();
    Ok(policy)
}

/// What a tenant inherits from `defaults`.
struct TenantDefaults {
    lease_ttl_ms: u64,
    expired_usage: super::ExpiredUsage,
    retention_ms: u64,
    adaptive_output: Option<AdaptiveOutput>,
    on_store_error: super::OnStoreError,
    shadow: bool,
}

fn tenant_policy(
    field: &str,
    t: RawTenant,
    defaults: &TenantDefaults,
    models: &HashMap<String, ModelPolicy>,
) -> Result<TenantPolicy, Problem> {
    let (default_lease, default_expired, retention_ms) =
        (defaults.lease_ttl_ms, defaults.expired_usage, defaults.retention_ms);
    check_limits(&format!("{field}.limits"), &t.limits)?;
    let lease_ttl_ms = lease(&format!("{field}.lease_ttl_ms"), t.lease_ttl_ms.unwrap_or(default_lease))?;
    let adaptive_output = match t.adaptive_output {
        Some(a) => Some(adaptive(&format!("{field}.adaptive_output"), a)?),
        None => defaults.adaptive_output,
    };
    if let Some(user) = &t.default_user {
        let f = format!("{field}.default_user");
        check_limits(&f, user)?;
        check_within(&f, user, &t.limits)?;
    }
    let users =
        children(field, "users", t.users, &t.limits, |name| ids::check_user(name).map_err(|why| why.to_string()))?;
    let tenant_models = children(field, "models", t.models, &t.limits, |name| {
        if models.contains_key(name) { Ok(()) } else { Err("is not one of the models this policy names".into()) }
    })?;

    // A budget in money counts every model's tokens at its price: an unpriced model would be free.
    let scoped = [(format!("{field}.limits"), &t.limits)]
        .into_iter()
        .chain(t.default_user.iter().map(|l| (format!("{field}.default_user"), l)))
        .chain(users.iter().map(|(n, l)| (format!("{field}.users.{n}"), l)))
        .chain(tenant_models.iter().map(|(n, l)| (format!("{field}.models.{n}"), l)));
    for (f, l) in scoped {
        money_needs_prices(&f, l, models)?;
    }

    let soft = soft_budgets(field, t.soft_limits.as_ref(), &t.limits, models)?;

    // Keys must outlive everything they remember: a full refill, two leases, a day's budget.
    let mut idle = 2 * lease_ttl_ms + retention_ms.min(lease_ttl_ms);
    let all = std::iter::once(&t.limits)
        .chain(t.soft_limits.iter())
        .chain(t.default_user.iter())
        .chain(users.values())
        .chain(tenant_models.values());
    for limits in all {
        idle = idle.max(remembered_for(limits));
    }

    let default_priority = t.default_priority.unwrap_or_default();
    let max_priority = t.max_priority.unwrap_or(super::Priority::Critical);
    if default_priority > max_priority {
        return Err(problem(
            format!("{field}.default_priority"),
            format!("{} is above max_priority {}", default_priority.as_str(), max_priority.as_str()),
        ));
    }
    if t.default_deadline_ms == Some(0) {
        return Err(problem(format!("{field}.default_deadline_ms"), "must be at least 1 (leave it out for none)"));
    }
    let weight = t.weight.unwrap_or(1.0);
    if !(0.001..=1000.0).contains(&weight) {
        return Err(problem(format!("{field}.weight"), format!("{weight} is outside 0.001..=1000")));
    }

    Ok(TenantPolicy {
        limits: t.limits,
        default_priority,
        max_priority,
        default_deadline_ms: t.default_deadline_ms,
        // In 0.001..=1000: the product is a whole number of thousandths from 1 to 10^6.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        weight_milli: (weight * 1000.0).round() as u64,
        adaptive_output,
        on_store_error: t.on_store_error.unwrap_or(defaults.on_store_error),
        shadow: t.shadow.unwrap_or(defaults.shadow),
        strict: t.strict.unwrap_or(false),
        soft,
        zone: match &t.time_zone {
            Some(text) => Zone::parse(text).map_err(|why| problem(format!("{field}.time_zone"), why))?,
            None => Zone::utc(),
        },
        users,
        default_user: t.default_user,
        models: tenant_models,
        lease_ttl_ms,
        expired_usage: t.expired_usage.unwrap_or(default_expired),
        idle_ttl_ms: idle + 60_000,
    })
}

fn lease(field: &str, ms: u64) -> Result<u64, Problem> {
    if (MIN_LEASE_MS..=MAX_LEASE_MS).contains(&ms) {
        Ok(ms)
    } else {
        Err(problem(field, format!("{ms} is outside {MIN_LEASE_MS}..={MAX_LEASE_MS} ms")))
    }
}

fn positive_u32(field: &str, value: Option<u32>, default: u32) -> Result<u32, Problem> {
    match value {
        Some(0) => Err(problem(field, "must be at least 1")),
        Some(n) => Ok(n),
        None => Ok(default),
    }
}

fn positive(field: &str, value: Option<u64>, default: u64) -> Result<u64, Problem> {
    match value {
        Some(0) => Err(problem(field, "must be at least 1")),
        Some(n) => Ok(n),
        None => Ok(default),
    }
}

/// How long a scope's hash must outlive its last write to remember what `limits` count: a full
/// refill of its buckets, and the longest period of its budgets and a day besides (a time zone
/// moves the turn by at most 14 hours).
fn remembered_for(limits: &Limits) -> u64 {
    let mut ms = 0;
    // A full refill takes capacity / rate; a bucket refills one minute's worth per minute.
    if let (Some(capacity), Some(tpm)) = (limits.token_capacity(), limits.tokens_per_minute) {
        ms = capacity.saturating_mul(60_000).div_ceil(tpm);
    }
    if limits.requests_per_minute.is_some()
        || limits.input_tokens_per_minute.is_some()
        || limits.output_tokens_per_minute.is_some()
    {
        ms = ms.max(60_000);
    }
    for (key, _) in limits.budgets() {
        let longest = match key.period {
            Period::Hour => DAY_MS,
            Period::Day => 2 * DAY_MS,
            Period::Week => 8 * DAY_MS,
            Period::Month => 32 * DAY_MS,
        };
        ms = ms.max(longest);
    }
    ms
}
