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
    // `serve` reads its policy before the runtime and the log exist, since the policy may set
    // both; a policy that does not load is reported once the log is set up.
    let loaded = match &cli.command {
        Command::Serve(args) => Some(Policy::load(&args.config)),
        _ => None,
    };
    let server = loaded.as_ref().and_then(|l| l.as_ref().ok()).map(|p| &p.server);
    let log_format = cli.log_format.or(server.map(|s| s.log_format)).unwrap_or_default();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    // A sidecar's runtime: one worker unless told otherwise (docs/BENCHMARKS.md, "One worker, by default").
    // The tools keep tokio's default, a worker per core.
    match &cli.command {
        Command::Serve(args) => {
            let policy = server.map_or(1, |s| s.worker_threads);
            builder.worker_threads(args.worker_threads.map_or(policy, usize::from));
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
    runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => {
                let _telemetry = match tollgate::telemetry::init(&args.log, log_format, args.otlp_endpoint.as_deref()) {
                    Ok(t) => t,
                    Err(e) => {
                        eprintln!("tollgate: {e}");
                        return ExitCode::FAILURE;
                    }
                };
                let loaded = loaded.unwrap_or_else(|| Policy::load(&args.config));
                match tollgate::app::run(args.options(loaded)).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        tracing::error!("{e}");
                        // (A JSON log stays JSON to its last line: the error is in it.)
                        if log_format == LogFormat::Text {
                            eprintln!("tollgate: {e}");
                        }
                        ExitCode::FAILURE
                    }
                }
            }
            Command::Bench(args) => run::bench(*args).await,
            Command::SimBackend(args) => {
                let _telemetry = tollgate::telemetry::init("info", log_format, None);
                run::sim_backend(args).await
            }
            Command::SimLoad(args) => run::sim_load(args).await,
            Command::BenchFloor { listen, redis, .. } => run::bench_floor(listen, redis).await,
            Command::Inject(args) => {
                let _telemetry = tollgate::telemetry::init("info", log_format, None);
                run::inject(args).await
            }
            Command::Ledger(args) => {
                let _telemetry = tollgate::telemetry::init("warn", log_format, None);
                run::ledger(args).await
            }
            // Answered above, without a runtime.
            Command::CheckConfig { .. } => ExitCode::SUCCESS,
        }
    })
}
