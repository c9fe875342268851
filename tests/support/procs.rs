//! Processes started by tests: redis-server, tollgate, Envoy, grpcurl; each stopped on drop.
