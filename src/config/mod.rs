//! The policy: YAML in, a validated [`Policy`] out. Parsing is strict (an unknown field is an
//! error, so a typo cannot silently drop a limit) and validation names the field and the reason,
//! so a bad file stops the start with a message a person can act on.

mod raw;
mod validate;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub use raw::Limits;

use crate::store::{ExpiredUsage, ScopeLimits};

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

/// Store selection and connection timeouts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreSettings {
    pub choice: StoreChoice,
    pub connect_timeout: Duration,
    pub command_timeout: Duration,
}

/// The serving side of the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSettings {
    pub listen: SocketAddr,
    /// The header that carries the verified tenant id (Envoy sets it from identity, e.g. a JWT).
    pub tenant_header: String,
    /// How long in-flight calls may take to finish after SIGTERM.
    pub drain_timeout: Duration,
}

/// What a model costs to admit.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelPolicy {
    /// The output reserved when a request names no `max_tokens`; also the largest it may name.
    pub max_output_tokens: u64,
    /// Body bytes per prompt token, for the prompt estimate.
    pub bytes_per_token: f64,
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
    /// How long the tenant's keys outlive their last write: long enough for every bucket to refill,
    /// every lease to run out and a day's budget to roll over, so expiry never forgets state that
    /// still matters.
    pub idle_ttl_ms: u64,
}

impl TenantPolicy {
    /// The user's limits, if any apply.
    pub fn user_limits(&self, user: &str) -> Option<&Limits> {
        self.users.get(user).or(self.default_user.as_ref())
    }
}

/// The validated policy the server runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub server: ServerSettings,
    pub store: StoreSettings,
    pub models: HashMap<String, ModelPolicy>,
    pub tenants: HashMap<String, Arc<TenantPolicy>>,
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
}

impl Policy {
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
        validate::validate(raw).map_err(|(field, why)| ConfigError::Invalid { file: file.to_string(), field, why })
    }

    /// The tenant's policy, or the default tenant's.
    pub fn tenant(&self, tenant: &str) -> Option<&Arc<TenantPolicy>> {
        self.tenants.get(tenant).or(self.default_tenant.as_ref())
    }

    /// A few lines saying what the policy enforces, for `check-config`.
    pub fn summary(&self) -> String {
        let store = match &self.store.choice {
            StoreChoice::Embedded => "embedded (single replica)".to_string(),
            StoreChoice::Redis { url } => format!("redis {url}"),
            StoreChoice::Cluster { nodes } => format!("redis cluster {}", nodes.join(",")),
        };
        let mut names: Vec<_> = self.tenants.keys().cloned().collect();
        names.sort();
        let mut models: Vec<_> = self.models.keys().cloned().collect();
        models.sort();
        let mut out = format!(
            "policy OK\n  listen: {}\n  store: {store}\n  models: {} ({})\n  tenants: {} ({})\n  default tenant: {}\n",
            self.server.listen,
            models.len(),
            models.join(", "),
            names.len(),
            names.join(", "),
            if self.default_tenant.is_some() { "yes" } else { "no (unknown tenants are refused)" },
        );
        for name in &names {
            let t = &self.tenants[name];
            out.push_str(&format!(
                "  tenant {name}: {}; lease {} ms; expired usage {:?}; {} user(s), {} model override(s)\n",
                t.limits.describe(),
                t.lease_ttl_ms,
                t.expired_usage,
                t.users.len(),
                t.models.len()
            ));
        }
        out
    }
}

impl Limits {
    /// These limits as the reserve script takes them.
    pub fn scope_limits(&self) -> ScopeLimits {
        let tpm = self.tokens_per_minute.unwrap_or(0);
        let rpm = self.requests_per_minute.unwrap_or(0);
        ScopeLimits {
            token_capacity: if tpm > 0 { self.burst_tokens.unwrap_or(tpm) } else { 0 },
            tokens_per_ms: tpm as f64 / 60_000.0,
            request_capacity: rpm,
            requests_per_ms: rpm as f64 / 60_000.0,
            max_concurrency: self.max_concurrency.unwrap_or(0),
            daily_budget: self.tokens_per_day.unwrap_or(0),
        }
    }

    /// The largest request these limits can ever admit, in tokens; `None` when unbounded.
    pub fn largest_admissible(&self) -> Option<u64> {
        let s = self.scope_limits();
        [s.token_capacity, s.daily_budget].into_iter().filter(|&n| n > 0).min()
    }

    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(n) = self.tokens_per_minute {
            parts.push(format!("{n} tokens/min (burst {})", self.burst_tokens.unwrap_or(n)));
        }
        if let Some(n) = self.requests_per_minute {
            parts.push(format!("{n} requests/min"));
        }
        if let Some(n) = self.max_concurrency {
            parts.push(format!("{n} concurrent"));
        }
        if let Some(n) = self.tokens_per_day {
            parts.push(format!("{n} tokens/day"));
        }
        if parts.is_empty() { "no limits".into() } else { parts.join(", ") }
    }
}
