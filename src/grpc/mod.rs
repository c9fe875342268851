//! The gRPC edge. Protobuf types stop here: each service converts to the plain types of
//! [`crate::admission`] and back.
//!
//! - [`authz`]: Envoy's `Check` → attributes → a reserve.
//! - [`ext_proc`]: the response as it streams back through Envoy: usage read, the hold settled.
//! - [`admission`]: tollgate's own `Admission` service (Reserve, Commit, Renew, Release, ...).
//! - [`response`]: a decision → `CheckResponse`, the one place for status, headers and body;
//!   [`refusal`], a refusal's body and status in the shape of the API the request came by.
//! - [`headers`]: every header name, once.
//! - [`server`]: the tower stack, health, reflection, the drain; [`tls`], the main port's TLS.

pub mod admission;
pub mod authz;
pub mod budgets;
pub mod ext_proc;
pub mod headers;
pub mod refusal;
pub mod response;
pub mod server;
pub mod tls;
