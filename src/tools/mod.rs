//! The tools beside the sidecar: nothing `serve` runs imports them.
//!
//! - [`bench`]: the open-loop load generator for full Check + Commit cycles, the decision
//!   benchmark, the burst experiment and the gRPC floor.
//! - [`sim`]: a simulated inference backend (`sim-backend`) and an HTTP load of request classes
//!   (`sim-load`), for tests, the demo and the benchmarks.
//! - [`inject`]: `tollgate inject`, the Kubernetes sidecar injector; [`webhook`], its mutating
//!   admission webhook.
//! - [`ledger`]: `tollgate ledger`, the usage ledger read out of Redis as JSON lines.
//! - [`run`]: each tool subcommand, from its parsed arguments to its exit code.

pub mod bench;
pub mod inject;
pub mod ledger;
pub mod run;
pub mod sim;
pub mod webhook;
