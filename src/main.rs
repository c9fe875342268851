//! The `tollgate` binary: parse the command line, start telemetry and the runtime, dispatch.

#![forbid(unsafe_code)]
#![warn(clippy::unwrap_used)]

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use tollgate::cli::{self, Cli, Command};

/// mimalloc: a decision allocates (gRPC frames, headers, protobuf messages, Lua values) and glibc's
/// malloc was a sixth of tollgate's CPU behind Envoy (docs/BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use tollgate::config::Policy;
use tollgate::metrics::exposition::Registry;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::CheckConfig { file } = &cli.command {
        // The TLS files are read too: what would stop `serve` stops the check.
        let checked = Policy::load(file).map_err(|e| e.to_string()).and_then(|policy| {
            match policy.server.tls.as_ref().map(tollgate::grpc::tls::server_config).transpose() {
                Ok(_) => Ok(policy),
                Err(e) => Err(format!("{}: {e}", file.display())),
            }
        });
        return match checked {
            Ok(policy) => {
                print!("{}", policy.summary());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("tollgate: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tollgate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        match cli.command {
            Command::Serve { config, listen, health_listen, tls, otlp_endpoint, log } => {
                let _telemetry = match tollgate::telemetry::init(&log, otlp_endpoint.as_deref()) {
                    Ok(t) => t,
                    Err(e) => {
                        eprintln!("tollgate: {e}");
                        return ExitCode::FAILURE;
                    }
                };
                let result = async {
                    let adjust: tollgate::reload::Adjust = Arc::new(move |p: &mut Policy| {
                        if health_listen.is_some() {
                            p.server.health_listen = health_listen;
                        }
                        tls.apply(p)
                    });
                    let mut policy = Policy::load(&config)?;
                    adjust(&mut policy)?;
                    let policy = Arc::new(policy);
                    let shutdown = CancellationToken::new();
                    cli::cancel_on_signal(shutdown.clone());
                    let registry = Arc::new(Registry::new(otlp_endpoint.as_deref())?);
                    let listeners = cli::bind(&policy, listen).await?;
                    let watched = cli::Watched { path: config, adjust };
                    cli::serve(policy, listeners, shutdown, registry, Some(watched)).await
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
            }
            Command::Bench(args) => cli::bench(*args).await,
            Command::SimBackend(args) => {
                let _telemetry = tollgate::telemetry::init("info", None);
                cli::sim_backend(args).await
            }
            Command::SimLoad(args) => cli::sim_load(args).await,
            Command::BenchFloor { listen } => cli::bench_floor(listen).await,
            Command::Inject(args) => {
                let _telemetry = tollgate::telemetry::init("info", None);
                cli::inject(args).await
            }
            Command::Ledger(args) => {
                let _telemetry = tollgate::telemetry::init("warn", None);
                cli::ledger(args).await
            }
            // Answered above, without a runtime.
            Command::CheckConfig { .. } => ExitCode::SUCCESS,
        }
    })
}
