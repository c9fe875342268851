//! The policy file exactly as written. Every struct denies unknown fields.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{ExpiredUsage, OnStoreError, Priority};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub defaults: RawDefaults,
    #[serde(default)]
    pub models: BTreeMap<String, RawModel>,
    #[serde(default)]
    pub pools: BTreeMap<String, RawPool>,
    #[serde(default)]
    pub tenants: BTreeMap<String, RawTenant>,
    pub default_tenant: Option<RawTenant>,
    pub anonymous_tenant: Option<String>,
    pub leasing: Option<RawLeasing>,
    #[serde(default)]
    pub metrics: RawMetrics,
    pub ledger: Option<RawLedger>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLedger {
    pub max_len: Option<u64>,
    pub retention_ms: Option<u64>,
    pub file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLeasing {
    pub window_ms: Option<u64>,
    pub max_share: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMetrics {
    pub tenants: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub listen: Option<String>,
    pub health_listen: Option<String>,
    pub admin_listen: Option<String>,
    pub policy_poll_ms: Option<u64>,
    pub tenant_header: Option<String>,
    pub drain_timeout_ms: Option<u64>,
    pub tls: Option<RawTls>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub cert: Option<String>,
    pub key: Option<String>,
    pub client_ca: Option<String>,
    #[serde(default)]
    pub allowed_clients: Vec<String>,
    pub reload_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    pub redis_url: Option<String>,
    pub redis_cluster: Option<Vec<String>>,
    pub connect_timeout_ms: Option<u64>,
    pub command_timeout_ms: Option<u64>,
    pub breaker: Option<RawBreaker>,
    pub local_factor: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBreaker {
    pub failures: Option<u32>,
    pub open_ms: Option<u64>,
    pub max_open_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDefaults {
    pub lease_ttl_ms: Option<u64>,
    pub expired_usage: Option<ExpiredUsage>,
    pub record_retention_ms: Option<u64>,
    pub sweep_batch: Option<u32>,
    pub max_attempts: Option<u32>,
    pub concurrency_retry_ms: Option<u64>,
    pub adaptive_output: Option<RawAdaptive>,
    pub on_store_error: Option<OnStoreError>,
    pub shadow: Option<bool>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdaptive {
    pub quantile: f64,
    #[serde(default = "default_min_samples")]
    pub min_samples: u64,
    #[serde(default = "default_window")]
    pub window: u64,
}

fn default_min_samples() -> u64 {
    100
}

fn default_window() -> u64 {
    2000
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawModel {
    pub max_output_tokens: u64,
    /// The backend pool that serves this model, if capacity admission applies to it.
    pub pool: Option<String>,
    #[serde(default = "default_bytes_per_token")]
    pub bytes_per_token: f64,
    #[serde(default = "default_max_prompt_tokens")]
    pub max_prompt_tokens: u64,
}

/// 128 Ki tokens: the context of most current models, so a prompt of unknown size is held in full.
fn default_max_prompt_tokens() -> u64 {
    131_072
}

fn default_bytes_per_token() -> f64 {
    4.0
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPool {
    pub max_sequences: u64,
    pub prefill_tokens_per_second: f64,
    pub decode_tokens_per_second: f64,
    pub max_queue_delay_ms: u64,
    pub kv_cache_tokens: Option<u64>,
    #[serde(default)]
    pub tier_shares: RawShares,
    #[serde(default)]
    pub upstream_throttle: RawThrottle,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawThrottle {
    #[serde(default = "yes")]
    pub enabled: bool,
    pub decrease: Option<f64>,
    pub min_share: Option<f64>,
    pub recover_per_second: Option<f64>,
    pub cooldown_ms: Option<u64>,
    pub max_retry_after_ms: Option<u64>,
}

impl Default for RawThrottle {
    fn default() -> Self {
        RawThrottle {
            enabled: true,
            decrease: None,
            min_share: None,
            recover_per_second: None,
            cooldown_ms: None,
            max_retry_after_ms: None,
        }
    }
}

fn yes() -> bool {
    true
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawShares {
    pub standard: Option<f64>,
    pub sheddable: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTenant {
    #[serde(default)]
    pub limits: Limits,
    pub lease_ttl_ms: Option<u64>,
    pub expired_usage: Option<ExpiredUsage>,
    pub default_priority: Option<Priority>,
    pub max_priority: Option<Priority>,
    pub default_deadline_ms: Option<u64>,
    pub adaptive_output: Option<RawAdaptive>,
    pub on_store_error: Option<OnStoreError>,
    pub shadow: Option<bool>,
    #[serde(default)]
    pub strict: bool,
    pub default_user: Option<Limits>,
    #[serde(default)]
    pub users: BTreeMap<String, Limits>,
    #[serde(default)]
    pub models: BTreeMap<String, Limits>,
}

/// The limits of one scope (tenant, user or model). Every field is optional; an absent one does
/// not limit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Refill rate of the token bucket.
    pub tokens_per_minute: Option<u64>,
    /// Capacity of the token bucket; defaults to one minute of refill.
    pub burst_tokens: Option<u64>,
    pub requests_per_minute: Option<u64>,
    pub max_concurrency: Option<u64>,
    /// Token budget per UTC day.
    pub tokens_per_day: Option<u64>,
}
