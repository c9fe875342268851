//! tollgate: token-based admission for LLM inference, as an Envoy ext_authz sidecar.
//!
//! Every admission is three phases, each one atomic Lua script on the store: **reserve** budget at
//! admission (Envoy's `Check`, or `Admission/Reserve`), **commit** the actual usage when generation
//! ends (`Admission/Commit`), and **expire** holds whose owner never came back (swept inside
//! reserve, in bounded batches).
//!
//! # Layout
//!
//! - [`admin`]: the admin HTTP port (`/metrics`).
//! - [`cli`]: the command line (`serve`, `check-config`, `bench`).
//! - [`bench`]: the open-loop load generator for full Check + Commit cycles.
//! - [`config`]: YAML policy → validated, typed policy; strict, with errors that name the field.
//! - [`admission`]: attributes + policy + store → [`admission::Decision`]. Knows nothing of gRPC.
//! - [`estimate`]: how many tokens to hold: the prompt estimate and the output reservation.
//! - [`store`]: the store trait, the one module that builds keys, the scripts, and the embedded
//!   and Redis stores.
//! - [`grpc`]: the edge. `authz` (Envoy `Check` → attributes), `admission` (the Admission
//!   service), `response` (decision → `CheckResponse`: the one place for status, headers, body),
//!   `server` (the tower stack, health, reflection, graceful shutdown).
//! - [`metrics`]: the instruments (decisions, latency, the books, the store), their Prometheus
//!   exposition for the admin port, and the store wrapper that times every script call.
//! - [`reload`]: live policy: the file watched (and SIGHUP), validated, swapped whole.
//! - [`sim`]: a simulated inference backend (`sim-backend`) and an HTTP load of request classes
//!   (`sim-load`), for tests, the demo and the benchmark.
//! - [`telemetry`]: tracing, and OpenTelemetry export when an endpoint is configured.
//!
//! The protocol itself lives in `lua/` and exists once: both stores run those scripts.

#![forbid(unsafe_code)]
#![warn(clippy::unwrap_used)]

pub mod admin;
pub mod admission;
pub mod bench;
pub mod cli;
pub mod config;
pub mod estimate;
pub mod grpc;
pub mod inject;
pub mod ledger;
pub mod metrics;
pub mod reload;
pub mod sim;
pub mod store;
pub mod telemetry;
pub mod webhook;

/// Generated protobuf types of tollgate's own API.
pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("tollgate.v1");

    /// Descriptors for server reflection: tollgate's API and Envoy's ext_authz closure.
    pub const REFLECTION_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/reflection_descriptor.bin"));
}
