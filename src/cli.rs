//! The command line, and nothing else: every subcommand's arguments as clap reads them. `main`
//! parses them and dispatches, `serve` to [`crate::app`], the rest to the tools' runners.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Parser, Subcommand};

use crate::app::ServeOptions;
use crate::config::{ConfigError, LogFormat, Policy, TlsSettings};

#[derive(Debug, Parser)]
#[command(name = "tollgate", version, about = "Token-based admission for LLM inference, as an Envoy ext_authz sidecar")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// How log lines are written: text (coloured only on a terminal, never with NO_COLOR set) or
    /// json (one object a line). For `serve`, the policy's server.log_format when not given here.
    #[arg(long, global = true, env = "TOLLGATE_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve Envoy's Authorization, tollgate's Admission, health and reflection on one port.
    Serve(ServeArgs),
    /// Validate a policy file and print what it enforces.
    CheckConfig {
        /// The policy file (YAML).
        file: PathBuf,
    },
    /// Open-loop load: full Check + Commit cycles at a fixed rate against a running tollgate;
    /// latency counted from each cycle's scheduled send time. `bench burst` runs the burst experiment
    /// instead: worst-case versus adaptive output reservation.
    Bench(Box<BenchArgs>),
    /// A simulated OpenAI-compatible inference backend: slots, a FIFO queue, prefill and decode
    /// speeds, log-normal output lengths; commits its usage to tollgate.
    SimBackend(SimBackendArgs),
    /// Open-loop HTTP load of interactive, standard and batch requests through Envoy; prints
    /// admitted, denied by reason, and p50/p99 per class.
    SimLoad(SimLoadArgs),
    /// The floor of this machine for `bench` and `scripts/bench-envoy`: a gRPC server on tollgate's
    /// stack that answers every Check and Commit with OK, reads ext_proc streams to their end, and
    /// does no work.
    BenchFloor {
        #[arg(long, default_value = "127.0.0.1:50052")]
        listen: SocketAddr,
        /// A Redis every Check calls once before it answers (a script that does nothing, on one
        /// key): the floor of a decision that takes one round trip to Redis.
        #[arg(long, value_name = "URL")]
        redis: Option<String>,
        /// The runtime's worker threads, as `serve --worker-threads`.
        #[arg(long, env = "TOLLGATE_WORKER_THREADS", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
        worker_threads: u16,
    },
    /// Add tollgate and its Envoy to the pods of Kubernetes workloads (Deployment, StatefulSet,
    /// DaemonSet, ReplicaSet, Job, Pod) read from a file or stdin; write the YAML to stdout.
    Inject(InjectArgs),
    /// Write the usage ledger out as JSON lines on stdout: every tenant's ledger stream on Redis
    /// or a Redis Cluster, read through a consumer group, each entry acknowledged once written
    /// (at least once; keep the last line per reservation id).
    Ledger(LedgerArgs),
}

/// `tollgate serve`'s arguments.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The policy file (YAML).
    #[arg(long, short)]
    pub config: PathBuf,
    /// Overrides server.listen from the policy.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Overrides server.health_listen from the policy (health alone, for the kubelet's probes).
    #[arg(long)]
    pub health_listen: Option<SocketAddr>,
    #[command(flatten)]
    pub tls: TlsFlags,
    /// Export traces over OTLP/gRPC to this endpoint (e.g. http://127.0.0.1:4317).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Log filter, as for RUST_LOG.
    #[arg(long, default_value = "info")]
    pub log: String,
    /// The runtime's worker threads (1-64); without it the policy's server.worker_threads, else 1.
    #[arg(long, env = "TOLLGATE_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub worker_threads: Option<u16>,
}

impl ServeArgs {
    /// What `serve` runs with, given its policy file as read at start: the flags that override
    /// the policy become a function applied to every policy loaded, the first and each one
    /// reloaded.
    pub fn options(self, loaded: Result<Policy, ConfigError>) -> ServeOptions {
        let ServeArgs { config, listen, health_listen, tls, otlp_endpoint, log: _, worker_threads: _ } = self;
        let adjust: crate::reload::Adjust = Arc::new(move |p: &mut Policy| {
            if health_listen.is_some() {
                p.server.health_listen = health_listen;
            }
            tls.apply(p)
        });
        ServeOptions { config, loaded, listen, adjust, otlp_endpoint }
    }
}

/// What `tollgate inject` reads and adds.
#[derive(Debug, clap::Args)]
pub struct InjectArgs {
    /// Kubernetes YAML, one or more documents; `-` or nothing: stdin.
    pub file: Option<PathBuf>,
    /// tollgate's image.
    #[arg(long, default_value = concat!("tollgate:", env!("CARGO_PKG_VERSION")))]
    pub image: String,
    /// Envoy's image.
    #[arg(long, default_value = "envoyproxy/envoy:v1.40.0")]
    pub envoy_image: String,
    /// The ConfigMap that holds policy.yaml.
    #[arg(long, default_value = "tollgate-policy")]
    pub policy_config_map: String,
    /// The application's port, for pods that neither annotate it (tollgate.io/app-port) nor
    /// declare one (the first container's first port).
    #[arg(long)]
    pub app_port: Option<u16>,
    /// Envoy's port on the pod's network: point the Service here.
    #[arg(long, default_value_t = 8080)]
    pub proxy_port: u16,
    /// Serve the same injection as a mutating admission webhook (AdmissionReview v1, HTTPS)
    /// instead of reading YAML.
    #[arg(long, requires_all = ["tls_cert", "tls_key"], conflicts_with = "file")]
    pub serve: bool,
    /// With --serve: where the webhook listens.
    #[arg(long, default_value = "0.0.0.0:8443")]
    pub listen: SocketAddr,
    /// With --serve: the webhook's certificate (PEM), reread when it changes.
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// With --serve: its private key (PEM).
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
}

/// Where `tollgate ledger` reads, and as whom.
#[derive(Debug, clap::Args)]
pub struct LedgerArgs {
    /// Take the store from this policy file.
    #[arg(long, short, conflicts_with_all = ["redis_url", "redis_cluster"])]
    pub config: Option<PathBuf>,
    /// A single Redis, as redis://host:port.
    #[arg(long, conflicts_with = "redis_cluster")]
    pub redis_url: Option<String>,
    /// Redis Cluster seed nodes, host:port, comma separated.
    #[arg(long, value_delimiter = ',')]
    pub redis_cluster: Option<Vec<String>>,
    /// The consumer group: readers in one group share the entries.
    #[arg(long, default_value = "tollgate-ledger")]
    pub group: String,
    /// This reader's name in the group (default: the host name).
    #[arg(long)]
    pub consumer: Option<String>,
    /// Entries per read.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub batch: u32,
    /// Take over entries another reader of the group left unacknowledged this long (ms; 0: never).
    #[arg(long, default_value_t = 60_000)]
    pub claim_idle_ms: u64,
    /// Drain every stream once and exit; otherwise keep reading until SIGTERM.
    #[arg(long)]
    pub once: bool,
    /// How often to look again when not --once (ms).
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(10..))]
    pub poll_ms: u64,
    /// How often to look for new tenants' streams when not --once (ms; a SCAN of every primary).
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(10..))]
    pub rescan_ms: u64,
}

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub kind: Option<BenchKind>,
    #[command(flatten)]
    pub cycle: CycleArgs,
}

/// The open-loop cycle benchmark's settings.
#[derive(Debug, clap::Args)]
pub struct CycleArgs {
    /// tollgate's gRPC endpoint; with --http, Envoy's HTTP address. Several, comma separated, are
    /// replicas: each cycle goes to one of them, round robin.
    #[arg(long, alias = "targets", default_value = "http://127.0.0.1:50051")]
    pub target: String,
    /// Drive chat completions through Envoy to the simulated backend instead of gRPC cycles.
    #[arg(long)]
    pub http: bool,
    /// With --http: stream the responses and measure to the first byte of the body (time to first
    /// token) instead of the last.
    #[arg(long, requires = "http")]
    pub stream: bool,
    /// With --stream: time each stream to its last byte instead (every chunk of it).
    #[arg(long, requires = "stream")]
    pub last_byte: bool,
    /// Offered rates to sweep, cycles per second (comma separated).
    #[arg(long, default_value = "1000", value_delimiter = ',')]
    pub rates: Vec<u32>,
    /// Measured seconds.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// Seconds of load before measuring.
    #[arg(long, default_value_t = 2)]
    pub warmup_seconds: u64,
    /// Tenants to spread the load over (comma separated).
    #[arg(long, default_value = "bench", value_delimiter = ',')]
    pub tenants: Vec<String>,
    /// The model the requests name.
    #[arg(long, default_value = "m")]
    pub model: String,
    /// gRPC connections.
    #[arg(long, default_value_t = 2)]
    pub connections: usize,
    /// Runs per rate.
    #[arg(long, default_value_t = 5)]
    pub runs: u32,
    /// A defended rate's p99, in every run, stays under this.
    #[arg(long, default_value_t = 1.0)]
    pub p99_target_ms: f64,
    /// A defended rate's p99 spread (max/min over the runs) stays under this.
    #[arg(long, default_value_t = 1.3)]
    pub spread_bound: f64,
    /// Also write the sweep as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Count the script calls this Redis serves in each run (`redis://host:port`), and report the
    /// share of decisions that made none (lease hits).
    #[arg(long)]
    pub store_stats: Option<String>,
    /// The tenants' token quota as `TOKENS_PER_MINUTE,BURST`: report tokens admitted over each run
    /// against what it allows.
    #[arg(long, value_parser = parse_quota)]
    pub quota: Option<(u64, u64)>,
    /// Every prompt this many bytes, instead of a realistic spread around 1,200 (what a body's size
    /// costs; with --http, what Envoy's max_request_bytes costs).
    #[arg(long)]
    pub prompt_bytes: Option<usize>,
}

fn parse_quota(s: &str) -> Result<(u64, u64), String> {
    let (rate, burst) = s.split_once(',').ok_or("give TOKENS_PER_MINUTE,BURST")?;
    let n = |v: &str| v.trim().parse::<u64>().map_err(|_| format!("{v:?} is not a whole number"));
    Ok((n(rate)?, n(burst)?))
}

#[derive(Debug, Subcommand)]
pub enum BenchKind {
    /// A burst of requests against one budget: worst-case reservation versus adaptive.
    Burst(BurstArgs),
    /// Capacity admission under overload, through Envoy, against the simulated fleet (started
    /// here): calibration, then offered load at multiples of the pool's capacity (see
    /// `scripts/bench-overload`, which starts tollgate and Envoy for it).
    Overload(OverloadArgs),
    /// The decision itself, in process: Check requests handed straight to tollgate's
    /// Authorization service on a policy's store, timed one by one (no network, no load
    /// generator); each admitted hold is committed at once, untimed.
    Decision(DecisionArgs),
}

#[derive(Debug, clap::Args)]
pub struct DecisionArgs {
    /// The policy file (YAML): its store, and `leasing:` for lease hits.
    #[arg(long, short)]
    pub config: PathBuf,
    /// Timed decisions.
    #[arg(long, default_value_t = 100_000)]
    pub calls: usize,
    /// Untimed decisions first (slices drawn, caches warm).
    #[arg(long, default_value_t = 10_000)]
    pub warmup: usize,
    #[arg(long, default_value = "bench-0,bench-1,bench-2,bench-3", value_delimiter = ',')]
    pub tenants: Vec<String>,
    #[arg(long, default_value = "m")]
    pub model: String,
}

/// What the simulated backend's tokens read as.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum SimText {
    Tok,
    Words,
}

/// `sim-backend`'s settings.
#[derive(Debug, clap::Args)]
pub struct SimBackendArgs {
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// tollgate's gRPC endpoint, for Commit and Renew.
    #[arg(long)]
    pub tollgate: Option<String>,
    /// Sequences generated at once; the rest wait in a FIFO queue.
    #[arg(long, default_value_t = 4)]
    pub slots: usize,
    #[arg(long, default_value_t = 5000.0)]
    pub prefill_tps: f64,
    /// Decode speed of one sequence, tokens per second.
    #[arg(long, default_value_t = 50.0)]
    pub decode_tps: f64,
    /// Median of the log-normal output length.
    #[arg(long, default_value_t = 200.0)]
    pub output_median: f64,
    /// Shape of the log-normal output length.
    #[arg(long, default_value_t = 0.8)]
    pub output_sigma: f64,
    /// Every output this long instead (capped by max_tokens).
    #[arg(long)]
    pub output_fixed: Option<u64>,
    /// What generated tokens read as: `tok` (4 bytes each) or `words` (an English-like
    /// vocabulary, 4.375 bytes per token on average).
    #[arg(long, value_enum, default_value = "tok")]
    pub text: SimText,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long, default_value_t = 30_000)]
    pub renew_every_ms: u64,
}

/// `sim-load`'s settings.
#[derive(Debug, clap::Args)]
pub struct SimLoadArgs {
    /// Envoy's HTTP address.
    #[arg(long, default_value = "http://127.0.0.1:10000")]
    pub target: String,
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    #[arg(long, default_value_t = 15_000)]
    pub timeout_ms: u64,
    /// Interactive requests per second (tenant acme, critical, 2 s deadline, 64 tokens).
    #[arg(long, default_value_t = 4.0)]
    pub interactive_rate: f64,
    /// Standard requests per second (tenant acme, 256 tokens).
    #[arg(long, default_value_t = 2.0)]
    pub standard_rate: f64,
    /// Batch requests per second (tenant batchco, sheddable, 1024 tokens).
    #[arg(long, default_value_t = 8.0)]
    pub batch_rate: f64,
    /// The simulated fleet's base URL (`tollgate sim-backend`): the printout adds its utilisation.
    #[arg(long)]
    pub sim: Option<String>,
    /// A refused request waits exactly its hint and is sent again, up to this many times (as the
    /// OpenAI SDK does, 2); the printout then says how many its first retry got in.
    #[arg(long, default_value_t = 0)]
    pub retries: u32,
}

/// The overload matrix's settings.
#[derive(Debug, clap::Args)]
pub struct OverloadArgs {
    /// Envoy's HTTP address, whose upstream is --sim-listen.
    #[arg(long, default_value = "http://127.0.0.1:10000")]
    pub envoy: String,
    /// tollgate's gRPC address (for the pool's status).
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub tollgate: String,
    #[arg(long, default_value = "gpu")]
    pub pool: String,
    /// Where the simulated fleet listens.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub sim_listen: std::net::SocketAddr,
    #[arg(long, default_value_t = 4)]
    pub slots: usize,
    #[arg(long, default_value_t = 5000.0)]
    pub prefill_tps: f64,
    /// Decode speed of one sequence (the policy's pool says the same).
    #[arg(long, default_value_t = 100.0)]
    pub decode_tps: f64,
    #[arg(long, default_value_t = 120.0)]
    pub output_median: f64,
    #[arg(long, default_value_t = 0.8)]
    pub output_sigma: f64,
    /// Multiples of the pool's capacity offered, one cell each.
    #[arg(long, default_value = "1,2,3,5", value_delimiter = ',')]
    pub loads: Vec<f64>,
    /// Seconds of load per cell.
    #[arg(long, default_value_t = 30)]
    pub seconds: u64,
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Seconds of calibration at capacity before the speed halves (0: none).
    #[arg(long, default_value_t = 60)]
    pub calibrate: u64,
    /// A refused request waits exactly its hint and is sent again, up to this many times (as the
    /// OpenAI SDK does, 2): the matrix then shows how many its first retry got in.
    #[arg(long, default_value_t = 0)]
    pub retries: u32,
}

/// The burst experiment's settings.
#[derive(Debug, clap::Args)]
pub struct BurstArgs {
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub target: String,
    /// The tenant that reserves max_tokens (no adaptive_output).
    #[arg(long, default_value = "worst")]
    pub worst_tenant: String,
    /// The tenant with adaptive_output.
    #[arg(long, default_value = "adaptive")]
    pub adaptive_tenant: String,
    #[arg(long, default_value = "m")]
    pub model: String,
    /// Requests in the burst.
    #[arg(long, default_value_t = 400)]
    pub requests: usize,
    /// Reserve + commit cycles that teach the estimate first.
    #[arg(long, default_value_t = 4000)]
    pub learn: usize,
    #[arg(long, default_value_t = 200)]
    pub prompt_tokens: u64,
    /// The ceiling every request names.
    #[arg(long, default_value_t = 4096)]
    pub max_tokens: u64,
    /// Median of the log-normal output length.
    #[arg(long, default_value_t = 200.0)]
    pub median: f64,
    /// Shape of the log-normal output length.
    #[arg(long, default_value_t = 0.8)]
    pub sigma: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// `serve`'s TLS flags. Given, they replace `server.tls` from the policy as a whole.
#[derive(Debug, Clone, clap::Args)]
pub struct TlsFlags {
    /// TLS on the main port: tollgate's certificate chain (PEM). Replaces server.tls.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Mutual TLS: the CA (PEM) that client certificates must chain to.
    #[arg(long, requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// An identity a client certificate may carry (a DNS or URI SAN; * for any); repeatable.
    #[arg(long = "tls-allow-client", requires = "tls_client_ca")]
    tls_allow_clients: Vec<String>,
}

impl TlsFlags {
    /// Puts the flags' TLS, if any, in place of the policy's.
    pub fn apply(&self, policy: &mut Policy) -> Result<(), ConfigError> {
        let flags = TlsSettings::from_flags(
            self.tls_cert.as_deref(),
            self.tls_key.as_deref(),
            self.tls_client_ca.as_deref(),
            &self.tls_allow_clients,
        )?;
        if flags.is_some() {
            policy.server.tls = flags;
        }
        Ok(())
    }
}
