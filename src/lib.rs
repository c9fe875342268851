//! tollgate: token-based admission for LLM inference, as an Envoy ext_authz sidecar.
//!
//! Every admission is three phases, each one atomic Lua script on the store: **reserve** budget at
//! admission (Envoy's `Check`, or `Admission/Reserve`), **commit** the actual usage when generation
//! ends (`Admission/Commit`), and **expire** holds whose owner never came back (swept inside
//! reserve, in bounded batches).
//!
//! # Layout
//!
//! From the bottom up: a module imports only from those above it in this list, so the imports
//! draw no circle (`tests/layers.rs` holds the code to this list).
//!
//! - [`config`]: YAML policy → validated, typed policy; strict, with errors that name the field.
//!   Imports nothing else from the crate.
//! - [`hold`]: the protocol's nouns, no I/O: the reservation id, limits and headroom, refusals,
//!   how each phase answered, a ledger entry's JSON line.
//! - [`proto`]: tollgate's own API, generated (with the descriptors reflection serves).
//! - [`store`]: the store trait; `keys` (the one module that builds keys); the scripts and one
//!   codec per script (`phase`); the embedded and Redis stores, the breaker, the one store choice
//!   (`backend`) and the observer that times every call.
//! - [`llm`]: what tollgate reads of LLM traffic, no I/O: request bodies, a response's usage (or
//!   a meter of what it generated), and how a response ended → the hold's settlement.
//! - [`estimate`]: how many tokens to hold: the prompt estimate and the output reservation.
//! - [`metrics`]: the instruments (decisions, latency, the books, the store), their Prometheus
//!   exposition for the admin port, and the store observer that times every script call.
//! - [`admission`]: attributes + policy + store → [`admission::Decision`], by phase (plan,
//!   reserve, leasing, store down, settle). Knows nothing of gRPC.
//! - [`reload`]: live policy: the file watched (and SIGHUP), validated, swapped whole.
//! - [`grpc`]: the edge. `authz` (Envoy `Check` → attributes), `ext_proc` (commit from the
//!   response), `admission` (the Admission service), `response` (decision → `CheckResponse`: the
//!   one place for status, headers, body), `headers` (every header name once), `server` (the
//!   tower stack, health, reflection, graceful shutdown), `tls`.
//! - [`admin`]: the admin HTTP port (`/metrics`).
//! - [`telemetry`]: tracing, and OpenTelemetry export when an endpoint is configured.
//! - [`app`]: `serve` assembled once: policy and overrides, the store, Admission, the background
//!   tasks under one tracker, the server, the drain.
//! - [`cli`]: the command line (clap only).
//! - [`tools`]: beside the sidecar, never imported by it: the load generator and benchmarks, the
//!   simulated backend and load, `inject` and its webhook, the ledger reader, and each tool
//!   subcommand's runner.
//!
//! The protocol itself lives in `lua/` and exists once: both stores run those scripts.

#![forbid(unsafe_code)]
#![warn(clippy::unwrap_used)]

pub mod admin;
pub mod admission;
pub mod app;
pub mod cli;
pub mod config;
pub mod estimate;
pub mod grpc;
pub mod hold;
pub mod llm;
pub mod metrics;
pub mod reload;
pub mod store;
pub mod telemetry;
pub mod tools;

/// Generated protobuf types of tollgate's own API.
pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("tollgate.v1");

    /// Descriptors for server reflection: tollgate's API and Envoy's ext_authz closure.
    pub const REFLECTION_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/reflection_descriptor.bin"));
}
