//! What each tool subcommand does, from its parsed arguments to its exit code.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admission::{Admission, AdmissionError};
use crate::app::cancel_on_signal;
use crate::cli::{
    BenchArgs, BenchKind, BurstArgs, CycleArgs, DecisionArgs, InjectArgs, LedgerArgs, OverloadArgs, SimBackendArgs,
    SimLoadArgs, SimText,
};
use crate::config::{ConfigError, Policy, TlsSettings};
use crate::store::backend::Backend;
use crate::store::clock::SystemClock;
use crate::store::redis::{RedisOptions, RedisStore, RedisTarget};
use crate::store::{Protocol, StoreError};
use crate::tools::bench::burst::{self, BurstOptions};
use crate::tools::bench::overload::{self, OverloadOptions};
use crate::tools::bench::sweep::{self, SweepOptions};
use crate::tools::bench::{BenchOptions, Control};
use crate::tools::sim::backend::{self, SimConfig};
use crate::tools::sim::lengths::OutputLengths;
use crate::tools::sim::load;

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
    match text.and_then(|t| crate::tools::inject::inject(&t, &options).map_err(|e| e.to_string())) {
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

fn inject_options(args: &InjectArgs) -> crate::tools::inject::Options {
    crate::tools::inject::Options {
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
    crate::tools::webhook::serve(listener, live, Arc::new(inject_options(&args)), shutdown).await;
    Ok(())
}

impl From<OverloadArgs> for OverloadOptions {
    fn from(a: OverloadArgs) -> Self {
        OverloadOptions {
            envoy: a.envoy,
            tollgate: a.tollgate,
            pool: a.pool,
            sim_listen: a.sim_listen,
            slots: a.slots,
            prefill_tokens_per_second: a.prefill_tps,
            decode_tokens_per_second: a.decode_tps,
            median: a.output_median,
            sigma: a.output_sigma,
            loads: a.loads,
            seconds: a.seconds,
            rounds: a.rounds,
            calibrate: a.calibrate,
            retries: a.retries,
        }
    }
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
                SimText::Tok => crate::tools::sim::formats::Text::Tok,
                SimText::Words => crate::tools::sim::formats::Text::Words,
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
                prompt_bytes: self.prompt_bytes,
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
    if let Some(BenchKind::Overload(o)) = args.kind {
        return match overload::run(&OverloadOptions::from(o)).await {
            Ok(report) => {
                print!("{report}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("tollgate: bench overload: {e}");
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
pub async fn bench_floor(listen: SocketAddr, redis: Option<String>) -> ExitCode {
    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone());
    let redis = match redis {
        None => None,
        Some(url) => match crate::tools::bench::floor::connect_redis(&url).await {
            Ok(connected) => Some(connected),
            Err(e) => {
                eprintln!("tollgate: bench-floor: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let listener = match TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("tollgate: bench-floor cannot listen on {listen}: {e}");
            return ExitCode::FAILURE;
        }
    };
    match crate::tools::bench::floor::serve(listener, redis, shutdown).await {
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
        retries: args.retries,
    };
    let before = match &args.sim {
        Some(sim) => load::fleet_busy(sim).await.map(|b| (b, std::time::Instant::now())),
        None => None,
    };
    let reports = load::run(&plan).await;
    print!("{}", load::table(&reports));
    if let (Some(sim), Some((before, at))) = (&args.sim, before) {
        match load::fleet_busy(sim).await {
            Some(after) => println!(
                "\nbackend utilisation: {:.1}% of its slots busy over the load (generations that ended)",
                100.0 * load::utilisation(before, after, at.elapsed())
            ),
            None => println!("\nbackend utilisation: the simulated fleet at {sim} did not answer"),
        }
    }
    ExitCode::SUCCESS
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
    Ledger(#[from] crate::tools::ledger::LedgerError),
}

async fn ledger_run(args: LedgerArgs) -> Result<crate::tools::ledger::Drained, LedgerRunError> {
    let (target, options) = match (&args.config, args.redis_url, args.redis_cluster) {
        (Some(file), _, _) => {
            let policy = Policy::load(file)?;
            let Some(target) = RedisTarget::of(&policy.store.choice) else {
                let file = policy.ledger.and_then(|l| l.file).map(|f| format!(" ({})", f.display()));
                return Err(LedgerRunError::Embedded(file.unwrap_or_default()));
            };
            (target, RedisOptions::from(&policy.store))
        }
        (None, Some(url), _) => (RedisTarget::Single(url), RedisOptions::default()),
        (None, None, Some(nodes)) => (RedisTarget::Cluster(nodes), RedisOptions::default()),
        (None, None, None) => return Err(LedgerRunError::NoStore),
    };
    let consumer = args.consumer.unwrap_or_else(host_name);
    let settings = crate::tools::ledger::ReaderSettings {
        group: args.group,
        consumer,
        batch: args.batch,
        claim_idle_ms: args.claim_idle_ms,
    };
    let store = RedisStore::connect(&target, options).await?;
    let reader = crate::tools::ledger::Reader::new(store.clone(), settings).await?;
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

/// Why `bench decision` could not run.
#[derive(Debug, thiserror::Error)]
enum DecisionError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("heartbeat: {0}")]
    Heartbeat(#[from] AdmissionError),
}

async fn bench_decision(args: DecisionArgs) -> Result<crate::tools::bench::decision::DecisionTimes, DecisionError> {
    let policy = Arc::new(Policy::load(&args.config)?);
    let store = Backend::open(&policy, Arc::new(SystemClock)).await?;
    let admission = Arc::new(Admission::new(policy, Protocol::new(store).await?));
    // As a server at its start: heard by the others, and writing the records they all read.
    admission.heartbeat().await?;
    let done = CancellationToken::new();
    let leasing = tokio::spawn(Arc::clone(&admission).run_leases(done.clone()));
    let times =
        crate::tools::bench::decision::run(admission, &args.tenants, &args.model, args.warmup, args.calls).await;
    done.cancel();
    let _ = leasing.await;
    Ok(times)
}
