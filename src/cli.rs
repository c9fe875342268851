//! The command line: its arguments, and what each subcommand does (the binary's `main` only
//! parses, starts the runtime and dispatches).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use clap::{Parser, Subcommand};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admission::Admission;
use crate::bench::burst::{self, BurstOptions};
use crate::bench::sweep::{self, SweepOptions};
use crate::bench::{BenchOptions, Control};
use crate::config::{ConfigError, Policy, StoreChoice, TlsSettings};
use crate::grpc::server::{ServeError, serve as serve_grpc};
use crate::metrics::Metrics;
use crate::metrics::exposition::Registry;
use crate::metrics::store::Measured;
use crate::sim::backend::{self, SimConfig};
use crate::sim::lengths::OutputLengths;
use crate::sim::load;
use crate::store::breaker::{Breaker, BreakerSettings};
use crate::store::embedded::EmbeddedStore;
use crate::store::redis::{RedisOptions, RedisStore, RedisTarget};
use crate::store::{Protocol, Store, StoreError};

#[derive(Debug, Parser)]
#[command(name = "tollgate", version, about = "Token-based admission for LLM inference, as an Envoy ext_authz sidecar")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve Envoy's Authorization, tollgate's Admission, health and reflection on one port.
    Serve {
        /// The policy file (YAML).
        #[arg(long, short)]
        config: PathBuf,
        /// Overrides server.listen from the policy.
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Overrides server.health_listen from the policy (health alone, for the kubelet's probes).
        #[arg(long)]
        health_listen: Option<SocketAddr>,
        #[command(flatten)]
        tls: TlsFlags,
        /// Export traces over OTLP/gRPC to this endpoint (e.g. http://127.0.0.1:4317).
        #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
        otlp_endpoint: Option<String>,
        /// Log filter, as for RUST_LOG.
        #[arg(long, default_value = "info")]
        log: String,
    },
    /// Validate a policy file and print what it enforces.
    CheckConfig {
        /// The policy file (YAML).
        file: PathBuf,
    },
    /// Open-loop load: full Check + Commit cycles at a fixed rate against a running tollgate;
    /// latency counted from each cycle's scheduled send time. `bench burst` runs seed 000's
    /// worst-case versus adaptive reservation experiment instead.
    Bench(Box<BenchArgs>),
    /// A simulated OpenAI-compatible inference backend: slots, a FIFO queue, prefill and decode
    /// speeds, log-normal output lengths; commits its usage to tollgate.
    SimBackend(SimBackendArgs),
    /// Open-loop HTTP load of interactive, standard and batch requests through Envoy; prints
    /// admitted, denied by reason, and p50/p99 per class.
    SimLoad(SimLoadArgs),
    /// The floor of this machine for `bench`: a gRPC server on tollgate's stack that answers every
    /// Check and Commit with OK and does no work.
    BenchFloor {
        #[arg(long, default_value = "127.0.0.1:50052")]
        listen: SocketAddr,
    },
    /// Add tollgate and its Envoy to the pods of Kubernetes workloads (Deployment, StatefulSet,
    /// DaemonSet, ReplicaSet, Job, Pod) read from a file or stdin; write the YAML to stdout.
    Inject(InjectArgs),
    /// Write the usage ledger out as JSON lines on stdout: every tenant's ledger stream on Redis
    /// or a Redis Cluster, read through a consumer group, each entry acknowledged once written
    /// (at least once; keep the last line per reservation id).
    Ledger(LedgerArgs),
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

/// `tollgate inject`: the YAML, injected, on stdout; nothing on stdout when a document is refused.
/// With `--serve`, the webhook until SIGTERM.
pub async fn inject(args: InjectArgs) -> ExitCode {
    if args.serve {
        return match inject_webhook(args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tollgate inject --serve: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let text = match args.file.as_deref().filter(|f| f.as_os_str() != "-") {
        Some(file) => std::fs::read_to_string(file).map_err(|e| format!("cannot read {}: {e}", file.display())),
        None => std::io::read_to_string(std::io::stdin()).map_err(|e| format!("cannot read stdin: {e}")),
    };
    let options = inject_options(&args);
    match text.and_then(|t| crate::inject::inject(&t, &options).map_err(|e| e.to_string())) {
        Ok(out) => {
            use std::io::Write;
            let mut stdout = std::io::stdout().lock();
            match stdout.write_all(out.as_bytes()).and_then(|()| stdout.flush()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("tollgate inject: cannot write: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Err(e) => {
            eprintln!("tollgate inject: {e}");
            ExitCode::FAILURE
        }
    }
}

fn inject_options(args: &InjectArgs) -> crate::inject::Options {
    crate::inject::Options {
        image: args.image.clone(),
        envoy_image: args.envoy_image.clone(),
        policy_config_map: args.policy_config_map.clone(),
        app_port: args.app_port,
        proxy_port: args.proxy_port,
    }
}

async fn inject_webhook(args: InjectArgs) -> Result<(), String> {
    let tls = TlsSettings::from_flags(args.tls_cert.as_deref(), args.tls_key.as_deref(), None, &[])
        .map_err(|e| e.to_string())?
        .ok_or("--serve needs --tls-cert and --tls-key")?;
    let live = crate::grpc::tls::LiveTls::load_for(&tls, crate::grpc::tls::Alpn::Http1).map_err(|e| e.to_string())?;
    let listener =
        TcpListener::bind(args.listen).await.map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    // On stderr as a plain line, so that whoever started it (on port 0, say) can read where.
    eprintln!("tollgate inject: serving the webhook on https://{bound}");
    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone());
    crate::webhook::serve(listener, live, Arc::new(inject_options(&args)), shutdown).await;
    Ok(())
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

/// Why `serve` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Tls(#[from] crate::grpc::tls::TlsError),
    #[error(transparent)]
    Metrics(#[from] crate::metrics::exposition::ExporterError),
    #[error(transparent)]
    Serve(#[from] ServeError),
}

/// The ports `serve` answers on, and the TLS the main one speaks.
pub struct Listeners {
    pub main: TcpListener,
    pub tls: Option<Arc<crate::grpc::tls::LiveTls>>,
    pub health: Option<TcpListener>,
    /// `/metrics`, with `server.admin_listen`.
    pub admin: Option<TcpListener>,
}

/// Reads the TLS files, then binds the policy's (or the override's) address, and the health and
/// admin addresses if there are any. All are bound before anything is served, so a client (or a
/// probe, or a scraper) that finds the main port open finds every port open.
pub async fn bind(policy: &Policy, listen: Option<SocketAddr>) -> Result<Listeners, RunError> {
    let tls = policy.server.tls.as_ref().map(crate::grpc::tls::LiveTls::load).transpose()?;
    let addr = listen.unwrap_or(policy.server.listen);
    if policy.server.unauthenticated_beyond_loopback(addr) {
        tracing::warn!(
            %addr,
            "Admission (Commit, Release, Renew, Reserve) is open to every client that reaches this address: \
             bind to loopback beside Envoy, or set server.tls with client_ca and allowed_clients"
        );
    }
    let bind = |addr: SocketAddr| async move {
        TcpListener::bind(addr).await.map_err(|source| RunError::Bind { addr, source })
    };
    let health = match policy.server.health_listen {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    let admin = match policy.server.admin_listen {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    Ok(Listeners { main: bind(addr).await?, tls, health, admin })
}

/// Connects the policy's store, loads the scripts, and serves on `listeners` until `shutdown`,
/// recording into `registry`. Redis is called through a circuit breaker: a Redis that keeps
/// failing is not waited on. Every store call is timed.
pub async fn serve(
    policy: Arc<Policy>,
    listeners: Listeners,
    shutdown: CancellationToken,
    registry: Arc<Registry>,
    watched: Option<Watched>,
) -> Result<(), RunError> {
    let options = RedisOptions::from(&policy.store);
    let b = policy.store.breaker;
    let breaker = BreakerSettings { failures: b.failures, open_for: b.open, max_open: b.max_open };
    let metrics = registry.metrics(&policy);
    let meter = registry.meter();
    let served = Served { listeners, shutdown, registry, metrics: metrics.clone(), watched };
    match policy.store.choice.clone() {
        StoreChoice::Embedded => {
            let clock = Arc::new(crate::store::clock::SystemClock);
            let store = match policy.ledger.as_ref().and_then(|l| l.file.as_deref()) {
                Some(file) => EmbeddedStore::with_ledger_file(clock, file)?,
                None => EmbeddedStore::with_clock(clock)?,
            };
            run_on(Measured::new(store, metrics, &meter), policy, served).await
        }
        StoreChoice::Redis { url } => {
            let store = RedisStore::connect(&RedisTarget::Single(url), options).await?;
            run_on(Measured::new(Breaker::new(store, breaker), metrics, &meter), policy, served).await
        }
        StoreChoice::Cluster { nodes } => {
            let store = RedisStore::connect(&RedisTarget::Cluster(nodes), options).await?;
            run_on(Measured::new(Breaker::new(store, breaker), metrics, &meter), policy, served).await
        }
    }
}

/// The policy file `serve` reloads, and what it does to each policy it loads.
pub struct Watched {
    pub path: PathBuf,
    pub adjust: crate::reload::Adjust,
}

/// What `serve` serves on, records into, and reloads.
struct Served {
    listeners: Listeners,
    shutdown: CancellationToken,
    registry: Arc<Registry>,
    metrics: Metrics,
    watched: Option<Watched>,
}

async fn bench_decision(args: DecisionArgs) -> Result<crate::bench::decision::DecisionTimes, RunError> {
    let policy = Arc::new(Policy::load(&args.config)?);
    let options = RedisOptions::from(&policy.store);
    match policy.store.choice.clone() {
        StoreChoice::Embedded => decide_on(EmbeddedStore::new()?, policy, args).await,
        StoreChoice::Redis { url } => {
            decide_on(RedisStore::connect(&RedisTarget::Single(url), options).await?, policy, args).await
        }
        StoreChoice::Cluster { nodes } => {
            decide_on(RedisStore::connect(&RedisTarget::Cluster(nodes), options).await?, policy, args).await
        }
    }
}

async fn decide_on<S: Store>(
    store: S,
    policy: Arc<Policy>,
    args: DecisionArgs,
) -> Result<crate::bench::decision::DecisionTimes, RunError> {
    let admission = Arc::new(Admission::new(policy, Protocol::new(store).await?));
    let done = CancellationToken::new();
    let leasing = tokio::spawn(Arc::clone(&admission).run_leases(done.clone()));
    let times = crate::bench::decision::run(admission, &args.tenants, &args.model, args.warmup, args.calls).await;
    done.cancel();
    let _ = leasing.await;
    Ok(times)
}

async fn run_on<S: Store>(store: S, policy: Arc<Policy>, served: Served) -> Result<(), RunError> {
    let Served { listeners, shutdown, registry, metrics, watched } = served;
    let poll = policy.server.policy_poll;
    let protocol = Protocol::new(store).await?;
    let drain = policy.server.drain_timeout;
    let addr = listeners.main.local_addr().ok();
    let health = listeners.health.as_ref().and_then(|l| l.local_addr().ok());
    let admin_addr = listeners.admin.as_ref().and_then(|l| l.local_addr().ok());
    let tls = policy.server.tls.as_ref().map_or_else(|| "plaintext".to_string(), |t| t.describe());
    tracing::info!(?addr, ?health, admin = ?admin_addr, %tls, store = ?policy.store.choice, "tollgate serving");
    let admission = Arc::new(Admission::new(policy, protocol).with_metrics(metrics));
    // Lease windows, heartbeats and the admin port run until the server has drained.
    let drained = CancellationToken::new();
    // The registry lives as long as the server: its last reference going flushes OTLP.
    let admin = listeners.admin.map(|l| tokio::spawn(crate::admin::serve(l, Arc::clone(&registry), drained.clone())));
    // The policy file is watched until shutdown: no reload while draining.
    let watching = watched
        .map(|w| tokio::spawn(crate::reload::watch(w.path, poll, Arc::clone(&admission), w.adjust, shutdown.clone())));
    let leasing = tokio::spawn(Arc::clone(&admission).run_leases(drained.clone()));
    // The replica count that on_store_error: local shares limits by.
    let heartbeat = {
        let admission = Arc::clone(&admission);
        let done = drained.clone();
        tokio::spawn(async move { admission.run_heartbeat(done).await })
    };
    let served = serve_grpc(listeners.main, listeners.tls, listeners.health, admission, shutdown, drain).await;
    drained.cancel();
    let _ = heartbeat.await;
    if let Some(admin) = admin {
        let _ = admin.await;
    }
    if let Some(watching) = watching {
        let _ = watching.await;
    }
    if leasing.await.is_err() {
        tracing::warn!("the lease task ended abnormally; unreturned slices stay charged until their lease");
    }
    drop(registry);
    served?;
    tracing::info!("tollgate stopped");
    Ok(())
}

impl From<BurstArgs> for BurstOptions {
    fn from(a: BurstArgs) -> Self {
        BurstOptions {
            target: a.target,
            worst_tenant: a.worst_tenant,
            adaptive_tenant: a.adaptive_tenant,
            model: a.model,
            requests: a.requests,
            learn: a.learn,
            prompt_tokens: a.prompt_tokens,
            max_tokens: a.max_tokens,
            median: a.median,
            sigma: a.sigma,
            seed: a.seed,
        }
    }
}

impl From<&SimBackendArgs> for SimConfig {
    fn from(a: &SimBackendArgs) -> Self {
        SimConfig {
            slots: a.slots,
            prefill_tokens_per_second: a.prefill_tps,
            decode_tokens_per_second: a.decode_tps,
            lengths: match a.output_fixed {
                Some(n) => OutputLengths::Fixed(n),
                None => OutputLengths::LogNormal { median: a.output_median, sigma: a.output_sigma },
            },
            seed: a.seed,
            tollgate: a.tollgate.clone(),
            renew_every: Duration::from_millis(a.renew_every_ms),
            text: match a.text {
                SimText::Tok => crate::sim::formats::Text::Tok,
                SimText::Words => crate::sim::formats::Text::Words,
            },
            ..SimConfig::default()
        }
    }
}

impl CycleArgs {
    fn sweep_options(self) -> SweepOptions {
        SweepOptions {
            base: BenchOptions {
                target: self.target,
                http: self.http,
                stream: self.stream,
                last_byte: self.last_byte,
                rate: 0,
                duration: Duration::from_secs(self.seconds),
                warmup: Duration::from_secs(self.warmup_seconds),
                tenants: self.tenants,
                model: self.model,
                connections: self.connections,
                store_stats: self.store_stats,
                quota: self.quota,
            },
            rates: self.rates,
            runs: self.runs,
            p99_target: Duration::from_secs_f64(self.p99_target_ms.max(0.0) / 1000.0),
            spread_bound: self.spread_bound,
        }
    }
}

/// `tollgate bench` and `tollgate bench burst`.
pub async fn bench(args: BenchArgs) -> ExitCode {
    if let Some(BenchKind::Decision(d)) = args.kind {
        return match bench_decision(d).await {
            Ok(times) => {
                println!("{times}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("tollgate: bench decision: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if let Some(BenchKind::Burst(burst)) = args.kind {
        let options = BurstOptions::from(burst);
        return match burst::run(&options).await {
            Ok(report) => {
                println!(
                    "burst of {} requests, prompt {} tokens, max_tokens {}; output lengths log-normal (median {}, sigma {}) capped at max_tokens; {} learning cycles first\n",
                    options.requests,
                    options.prompt_tokens,
                    options.max_tokens,
                    options.median,
                    options.sigma,
                    options.learn
                );
                print!("{report}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("tollgate: bench burst: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let json = args.cycle.json.clone();
    let options = args.cycle.sweep_options();
    let control = Arc::new(Control::default());
    let stopper = control.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("\nCtrl-C: finishing the cycles in flight, then reporting what ran");
            stopper.stop.store(true, Ordering::Relaxed);
        }
    });
    let report = match sweep::sweep(&options, control).await {
        Ok(report) => report,
        Err(e) => {
            eprintln!("tollgate: bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    print!("{}", report.markdown());
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report).unwrap_or_default();
        if let Err(e) = std::fs::write(&path, text) {
            eprintln!("tollgate: bench: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

/// `tollgate sim-backend`: serves until SIGTERM or SIGINT.
pub async fn sim_backend(args: SimBackendArgs) -> ExitCode {
    let config = SimConfig::from(&args);
    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone());
    let listener = match TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("tollgate: sim-backend cannot listen on {}: {e}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    match backend::serve(listener, config, shutdown, Default::default()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tollgate: sim-backend: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `tollgate bench-floor`: serves until a signal.
pub async fn bench_floor(listen: SocketAddr) -> ExitCode {
    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone());
    let listener = match TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("tollgate: bench-floor cannot listen on {listen}: {e}");
            return ExitCode::FAILURE;
        }
    };
    match crate::bench::floor::serve(listener, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tollgate: bench-floor: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `tollgate sim-load`: the mixed load, then its table.
pub async fn sim_load(args: SimLoadArgs) -> ExitCode {
    let plan = load::LoadPlan {
        target: args.target,
        duration: Duration::from_secs(args.seconds),
        timeout: Duration::from_millis(args.timeout_ms),
        classes: load::mixed(args.interactive_rate, args.standard_rate, args.batch_rate),
    };
    let reports = load::run(&plan).await;
    print!("{}", load::table(&reports));
    ExitCode::SUCCESS
}

/// Kubernetes sends SIGTERM to stop a pod; a terminal sends SIGINT. Either cancels `shutdown`.
/// The handlers are installed before this returns, so call it before the port opens: a signal
/// that arrives once the process is seen to listen is always a drain, never the default kill.
pub fn cancel_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let listen = |kind: SignalKind, name: &'static str| match signal(kind) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!("cannot listen for {name}: {e}");
            None
        }
    };
    let (mut interrupt, mut terminate) =
        (listen(SignalKind::interrupt(), "SIGINT"), listen(SignalKind::terminate(), "SIGTERM"));
    // SIGHUP reloads the policy (crate::reload). Its default action ends the process, so it is
    // taken over from the start: one that arrives before the watcher listens is only missed.
    let _ = listen(SignalKind::hangup(), "SIGHUP");
    tokio::spawn(async move {
        // A signal that cannot be listened for (or whose stream ends) never fires.
        let received = |s: Option<tokio::signal::unix::Signal>| async move {
            if let Some(mut s) = s
                && s.recv().await.is_some()
            {
                return;
            }
            std::future::pending::<()>().await
        };
        tokio::select! {
            () = received(interrupt.take()) => tracing::info!("SIGINT: draining"),
            () = received(terminate.take()) => tracing::info!("SIGTERM: draining"),
        }
        shutdown.cancel();
    });
}

/// `tollgate ledger`: drains the ledger streams to stdout.
pub async fn ledger(args: LedgerArgs) -> ExitCode {
    match ledger_run(args).await {
        Ok(d) => {
            eprintln!("tollgate ledger: {} entries written, {} lost to trimming", d.written, d.lost);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tollgate ledger: {e}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum LedgerRunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("name a store: --config, --redis-url or --redis-cluster")]
    NoStore,
    #[error("the embedded store writes its ledger to ledger.file{0}: there is no stream to read")]
    Embedded(String),
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Ledger(#[from] crate::ledger::LedgerError),
}

async fn ledger_run(args: LedgerArgs) -> Result<crate::ledger::Drained, LedgerRunError> {
    let (target, options) = match (&args.config, args.redis_url, args.redis_cluster) {
        (Some(file), _, _) => {
            let policy = Policy::load(file)?;
            let options = RedisOptions::from(&policy.store);
            match policy.store.choice {
                StoreChoice::Redis { url } => (RedisTarget::Single(url), options),
                StoreChoice::Cluster { nodes } => (RedisTarget::Cluster(nodes), options),
                StoreChoice::Embedded => {
                    let file = policy.ledger.and_then(|l| l.file).map(|f| format!(" ({})", f.display()));
                    return Err(LedgerRunError::Embedded(file.unwrap_or_default()));
                }
            }
        }
        (None, Some(url), _) => (RedisTarget::Single(url), RedisOptions::default()),
        (None, None, Some(nodes)) => (RedisTarget::Cluster(nodes), RedisOptions::default()),
        (None, None, None) => return Err(LedgerRunError::NoStore),
    };
    let consumer = args.consumer.unwrap_or_else(host_name);
    let settings = crate::ledger::ReaderSettings {
        group: args.group,
        consumer,
        batch: args.batch,
        claim_idle_ms: args.claim_idle_ms,
    };
    let store = RedisStore::connect(&target, options).await?;
    let reader = crate::ledger::Reader::new(store.clone(), settings).await?;
    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone());
    let mut out = std::io::stdout().lock();
    let (poll, rescan) = (Duration::from_millis(args.poll_ms), Duration::from_millis(args.rescan_ms));
    let drained = reader.follow(&mut out, args.once, poll, rescan, shutdown).await;
    store.close().await;
    Ok(drained?)
}

/// This host's name, for a consumer name that survives restarts (a pod's name in Kubernetes).
fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "tollgate-ledger".to_string())
}
