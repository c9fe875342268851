//! What tollgate reads of LLM traffic, with no I/O: the few fields of a request body admission
//! needs, the usage a response reports (or a meter of what it generated), and how the way a
//! response ended settles its hold.
//!
//! - [`api`]: which API a request came by, from its path: its body's shape, its model, what it
//!   asks for, whose error shape a refusal takes.
//! - [`body`]: `model`, the output ceiling and `stream`, from a body Envoy may have cut short.
//! - [`usage`]: a response's usage as it streams past, or the meter where it reports none.
//! - [`settlement`]: how a response ended → commit (with what counts) or release.

pub mod api;
pub mod body;
pub mod settlement;
pub mod usage;
