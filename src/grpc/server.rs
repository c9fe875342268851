//! One port, every service: Envoy's `Authorization` and `ExternalProcessor`, tollgate's `Admission`, `grpc.health.v1`, and
//! server reflection v1 and v1alpha (grpcurl 1.8 speaks only v1alpha). The stack is built here and
//! nowhere else.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::auth::v3::authorization_server::AuthorizationServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

use super::admission::AdmissionService;
use super::authz::AuthzService;
use super::budgets::BudgetsService;
use super::ext_proc::ExtProcService;
use crate::admission::Admission;
use crate::proto::{REFLECTION_DESCRIPTOR_SET, admission_server::AdmissionServer, budgets_server::BudgetsServer};
use crate::store::Store;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("reflection descriptors are broken: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// The connections `serve` accepts, each with TCP_NODELAY set. A decision is a few hundred bytes
/// and an ext_proc stream many small messages: under Nagle's algorithm each reply would wait for
/// the peer's next ACK. (The builder's own `tcp_nodelay` applies only to listeners tonic binds
/// itself, not to an incoming stream handed to it, so it is set here, on every accepted socket.)
pub fn incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Serves until `shutdown` is cancelled, then stops accepting, lets in-flight calls finish for at
/// most `drain`, and returns. With `tls`, the main port speaks TLS only (the health port stays
/// plaintext, for probes). Tests call this with a listener on port 0.
pub async fn serve<S: Store>(
    listener: TcpListener,
    tls: Option<Arc<super::tls::LiveTls>>,
    health_listener: Option<TcpListener>,
    admission: Arc<Admission<S>>,
    shutdown: CancellationToken,
    drain: Duration,
) -> Result<(), ServeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    // Every service says SERVING before a probe can ask (its listener already accepts: a probe
    // that came first was answered "service not registered").
    health.set_serving::<AuthorizationServer<AuthzService<S>>>().await;
    health.set_serving::<AdmissionServer<AdmissionService<S>>>().await;
    health.set_serving::<ExternalProcessorServer<ExtProcService<S>>>().await;
    // Health alone, on its own address: probes reach it, nothing else does.
    let health_only = health_listener.map(|listener| {
        let server = Server::builder()
            .add_service(health_service.clone())
            .serve_with_incoming_shutdown(incoming(listener), shutdown.clone().cancelled_owned());
        tokio::spawn(server)
    });

    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(REFLECTION_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
    };
    // Settlements that could not reach the store (the commit from the response, the clean-up of
    // a reserve nobody received), retried until the store takes them.
    let stop_retrying = CancellationToken::new();
    let retrying = admission.run_retries(stop_retrying.clone());
    let reflection_v1 = reflection().build_v1()?;
    let reflection_v1alpha = reflection().build_v1alpha()?;

    let router = Server::builder()
        // Envoy keeps HTTP/2 connections open; pings find dead peers.
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        // A call stuck behind a dead store gives up instead of holding a stream forever; the
        // store's own command timeout is far shorter, so this is a backstop.
        .timeout(Duration::from_secs(5))
        // Past this many in-flight calls on one connection, refuse at once (RESOURCE_EXHAUSTED,
        // Envoy then answers status_on_error) rather than queue: a queue only adds latency.
        .concurrency_limit_per_connection(4096)
        .load_shed(true)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(AuthorizationServer::new(AuthzService::new(admission.clone())))
        .add_service(ExternalProcessorServer::new(ExtProcService::new(admission.clone())))
        .add_service(AdmissionServer::new(AdmissionService::new(Arc::clone(&admission))))
        .add_service(BudgetsServer::new(BudgetsService::new(Arc::clone(&admission))));
    let stopped = shutdown.clone().cancelled_owned();
    let server: std::pin::Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>> = match tls {
        None => Box::pin(router.serve_with_incoming_shutdown(incoming(listener), stopped)),
        Some(config) => {
            let accepted = super::tls::incoming(listener, config, shutdown.clone());
            Box::pin(router.serve_with_incoming_shutdown(accepted, stopped))
        }
    };

    tokio::select! {
        result = server => result?,
        () = async { shutdown.cancelled().await; tokio::time::sleep(drain).await } => {
            tracing::warn!(?drain, "drain period over with calls still in flight; stopping anyway");
        }
    }
    if let Some(health) = health_only
        && let Ok(Err(e)) = health.await
    {
        tracing::warn!(error = %e, "the health listener failed");
    }
    // Reserves whose callers left finish (and hand what they could not give back to the retry
    // queue); then, once nothing is left to settle anything, the queue's last try.
    admission.finish_tasks().await;
    stop_retrying.cancel();
    if let Some(retrying) = retrying {
        let _ = retrying.await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    use super::*;

    #[tokio::test]
    async fn every_accepted_connection_has_nodelay_set() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut accepted = incoming(listener);
        for _ in 0..3 {
            let client = tokio::net::TcpStream::connect(addr).await.unwrap();
            let server_side = accepted.next().await.unwrap().unwrap();
            assert!(server_side.nodelay().unwrap(), "TCP_NODELAY read back from the accepted socket");
            drop(client);
        }
    }
}
