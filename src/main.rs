//! The `tollgate` binary: parse the command line, start telemetry, serve until SIGTERM or SIGINT.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use tollgate::bench::burst::{self, BurstOptions};
use tollgate::bench::sweep::{self, SweepOptions};
use tollgate::bench::{BenchOptions, Control};
use tollgate::cli::{self, BenchArgs, BenchKind, Cli, Command, CycleArgs};
use tollgate::config::Policy;
use tollgate::sim::backend::{self, SimConfig};
use tollgate::sim::lengths::OutputLengths;
use tollgate::sim::load;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { file } => match Policy::load(&file) {
            Ok(policy) => {
                print!("{}", policy.summary());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("tollgate: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Bench(BenchArgs {
            kind:
                Some(BenchKind::Burst {
                    target,
                    worst_tenant,
                    adaptive_tenant,
                    model,
                    requests,
                    learn,
                    prompt_tokens,
                    max_tokens,
                    median,
                    sigma,
                    seed,
                }),
            ..
        }) => {
            let Some(runtime) = runtime() else { return ExitCode::FAILURE };
            let options = BurstOptions {
                target,
                worst_tenant,
                adaptive_tenant,
                model,
                requests,
                learn,
                prompt_tokens,
                max_tokens,
                median,
                sigma,
                seed,
            };
            runtime.block_on(async move {
                match burst::run(&options).await {
                    Ok(report) => {
                        println!(
                            "burst of {requests} requests, prompt {prompt_tokens} tokens, max_tokens {max_tokens}; output lengths log-normal (median {median}, sigma {sigma}) capped at max_tokens; {learn} learning cycles first\n"
                        );
                        print!("{report}");
                        ExitCode::SUCCESS
                    }
                    Err(e) => {
                        eprintln!("tollgate: bench burst: {e}");
                        ExitCode::FAILURE
                    }
                }
            })
        }
        Command::Bench(BenchArgs { kind: None, cycle }) => {
            let Some(runtime) = runtime() else { return ExitCode::FAILURE };
            let CycleArgs {
                target,
                http,
                rates,
                seconds,
                warmup_seconds,
                tenants,
                model,
                connections,
                runs,
                p99_target_ms,
                spread_bound,
                json,
            } = cycle;
            let options = SweepOptions {
                base: BenchOptions {
                    target,
                    http,
                    rate: 0,
                    duration: Duration::from_secs(seconds),
                    warmup: Duration::from_secs(warmup_seconds),
                    tenants,
                    model,
                    connections,
                },
                rates,
                runs,
                p99_target: Duration::from_secs_f64(p99_target_ms.max(0.0) / 1000.0),
                spread_bound,
            };
            runtime.block_on(async move {
                let control = Arc::new(Control::default());
                let stopper = control.clone();
                tokio::spawn(async move {
                    if tokio::signal::ctrl_c().await.is_ok() {
                        eprintln!("\nCtrl-C: finishing the cycles in flight, then reporting what ran");
                        stopper.stop.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                });
                match sweep::sweep(&options, control).await {
                    Ok(report) => {
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
                    Err(e) => {
                        eprintln!("tollgate: bench: {e}");
                        ExitCode::FAILURE
                    }
                }
            })
        }
        Command::SimBackend {
            listen,
            tollgate,
            slots,
            prefill_tps,
            decode_tps,
            output_median,
            output_sigma,
            output_fixed,
            seed,
            renew_every_ms,
        } => {
            let Some(runtime) = runtime() else { return ExitCode::FAILURE };
            let lengths = match output_fixed {
                Some(n) => OutputLengths::Fixed(n),
                None => OutputLengths::LogNormal { median: output_median, sigma: output_sigma },
            };
            let config = SimConfig {
                slots,
                prefill_tokens_per_second: prefill_tps,
                decode_tokens_per_second: decode_tps,
                lengths,
                seed,
                tollgate,
                renew_every: Duration::from_millis(renew_every_ms),
                ..SimConfig::default()
            };
            runtime.block_on(async move {
                let _telemetry = tollgate::telemetry::init("info", None);
                let listener = match tokio::net::TcpListener::bind(listen).await {
                    Ok(l) => l,
                    Err(e) => {
                        eprintln!("tollgate: sim-backend cannot listen on {listen}: {e}");
                        return ExitCode::FAILURE;
                    }
                };
                let shutdown = CancellationToken::new();
                tokio::spawn(cancel_on_signal(shutdown.clone()));
                match backend::serve(listener, config, shutdown, Default::default()).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("tollgate: sim-backend: {e}");
                        ExitCode::FAILURE
                    }
                }
            })
        }
        Command::SimLoad { target, seconds, timeout_ms, interactive_rate, standard_rate, batch_rate } => {
            let Some(runtime) = runtime() else { return ExitCode::FAILURE };
            let plan = load::LoadPlan {
                target,
                duration: Duration::from_secs(seconds),
                timeout: Duration::from_millis(timeout_ms),
                classes: load::mixed(interactive_rate, standard_rate, batch_rate),
            };
            runtime.block_on(async move {
                let reports = load::run(&plan).await;
                print!("{}", load::table(&reports));
                ExitCode::SUCCESS
            })
        }
        Command::Serve { config, listen, otlp_endpoint, log } => {
            let Some(runtime) = runtime() else { return ExitCode::FAILURE };
            runtime.block_on(async move {
                let _telemetry = match tollgate::telemetry::init(&log, otlp_endpoint.as_deref()) {
                    Ok(t) => t,
                    Err(e) => {
                        eprintln!("tollgate: {e}");
                        return ExitCode::FAILURE;
                    }
                };
                let result = async {
                    let policy = Arc::new(Policy::load(&config)?);
                    let listener = cli::bind(&policy, listen).await?;
                    let shutdown = CancellationToken::new();
                    tokio::spawn(cancel_on_signal(shutdown.clone()));
                    cli::serve(policy, listener, shutdown).await
                }
                .await;
                match result {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        tracing::error!("{e}");
                        eprintln!("tollgate: {e}");
                        ExitCode::FAILURE
                    }
                }
            })
        }
    }
}

fn runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => Some(rt),
        Err(e) => {
            eprintln!("tollgate: cannot start the runtime: {e}");
            None
        }
    }
}

/// Kubernetes sends SIGTERM to stop a pod; a terminal sends SIGINT. Either starts the drain.
async fn cancel_on_signal(shutdown: CancellationToken) {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: draining"),
        () = terminate => tracing::info!("SIGTERM: draining"),
    }
    shutdown.cancel();
}
