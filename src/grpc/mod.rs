//! The gRPC edge. Protobuf types stop here: each service converts to the plain types of
//! [`crate::admission`] and back.

pub mod admission;
pub mod authz;
pub mod ext_proc;
pub mod response;
pub mod server;
pub mod tls;
