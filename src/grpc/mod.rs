//! The gRPC edge. Protobuf types stop here: each service converts to the plain types of
//! [`crate::admission`] and back.
//!
//! - [`authz`]: Envoy's `Check` → attributes → a reserve.
//! - [`ext_proc`]: the response as it streams back through Envoy: usage read, the hold settled.
//! - [`admission`]: tollgate's own `Admission` service (Reserve, Commit, Renew, Release, ...).
//! - [`response`]: a decision → `CheckResponse`, the one place for status, headers and body.
//! - [`headers`]: every header name, once.
//! - [`server`]: the tower stack, health, reflection, the drain; [`tls`], the main port's TLS.

pub mod admission;
pub mod authz;
pub mod ext_proc;
pub mod headers;
pub mod response;
pub mod server;
pub mod tls;
