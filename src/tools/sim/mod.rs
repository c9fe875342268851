//! A simulated inference fleet, for tests, the demo and the benchmark: tollgate does not own the
//! backend, so a faithful stand-in is the right part here.
//!
//! - [`backend`]: `tollgate sim-backend`, an OpenAI-compatible server with a fixed number of slots,
//!   a real FIFO queue in front of them, prefill and decode speeds, and an output-length
//!   distribution. It commits its real usage to tollgate (and renews long streams).
//! - [`load`]: `tollgate sim-load`, an open-loop HTTP load of several request classes (tiers),
//!   reporting admitted, denied by reason, and latency percentiles per class.

// Measurement arithmetic (rates, percentiles, simulated lengths), not token accounting: float
// casts here round a figure for display or a schedule, and saturate where they must.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

pub mod backend;
pub mod formats;
pub mod lengths;
pub mod load;
