//! The `tollgate` binary: parse the command line, start telemetry and the runtime, dispatch:
//! `serve` to [`tollgate::app`], every tool to [`tollgate::tools::run`].

#![forbid(unsafe_code)]
#![warn(clippy::unwrap_used)]

use std::process::ExitCode;

use clap::Parser;

use tollgate::cli::{Cli, Command};
use tollgate::config::{LogFormat, Policy};
use tollgate::tools::run;

/// mimalloc: a decision allocates (gRPC frames, headers, protobuf messages, Lua values) and glibc's
/// malloc was a sixth of tollgate's CPU behind Envoy (docs/BENCHMARKS.md). Built without
/// transparent huge pages (`no_thp`): with them an idle sidecar kept 20 MB of 2 MB pages it had
/// barely touched.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::CheckConfig { file } = &cli.command {
        return match tollgate::app::check_config(file) {
            Ok(summary) => {
                print!("{summary}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("tollgate: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    // A sidecar's runtime: one worker unless told otherwise (docs/BENCHMARKS.md, "One worker, by default").
    // The tools keep tokio's default, a worker per core.
    match &cli.command {
        Command::Serve(args) => {
            let policy = || Policy::server_setting_in::<u16>(&args.config, "worker_threads");
            builder.worker_threads(usize::from(args.worker_threads.or_else(policy).unwrap_or(1)).clamp(1, 64));
        }
        Command::BenchFloor { worker_threads, .. } => {
            builder.worker_threads(usize::from(*worker_threads));
        }
        _ => {}
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tollgate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let log_format = cli.log_format;
    runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => {
                let format =
                    log_format.or_else(|| Policy::server_setting_in(&args.config, "log_format")).unwrap_or_default();
                let _telemetry = match tollgate::telemetry::init(&args.log, format, args.otlp_endpoint.as_deref()) {
                    Ok(t) => t,
                    Err(e) => {
                        eprintln!("tollgate: {e}");
                        return ExitCode::FAILURE;
                    }
                };
                match tollgate::app::run(args.options()).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        tracing::error!("{e}");
                        // (A JSON log stays JSON to its last line: the error is in it.)
                        if format == LogFormat::Text {
                            eprintln!("tollgate: {e}");
                        }
                        ExitCode::FAILURE
                    }
                }
            }
            Command::Bench(args) => run::bench(*args).await,
            Command::SimBackend(args) => {
                let _telemetry = tollgate::telemetry::init("info", log_format.unwrap_or_default(), None);
                run::sim_backend(args).await
            }
            Command::SimLoad(args) => run::sim_load(args).await,
            Command::BenchFloor { listen, .. } => run::bench_floor(listen).await,
            Command::Inject(args) => {
                let _telemetry = tollgate::telemetry::init("info", log_format.unwrap_or_default(), None);
                run::inject(args).await
            }
            Command::Ledger(args) => {
                let _telemetry = tollgate::telemetry::init("warn", log_format.unwrap_or_default(), None);
                run::ledger(args).await
            }
            // Answered above, without a runtime.
            Command::CheckConfig { .. } => ExitCode::SUCCESS,
        }
    })
}
