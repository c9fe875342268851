//! `tollgate bench-floor`: the floor of this machine. A gRPC server on the same stack as tollgate's
//! (tonic, the same server settings, TCP_NODELAY) that answers every Check with OK and a
//! reservation id, and every Commit with OK, and reads every ext_proc stream to its end answering
//! nothing (Envoy's shipped filter observes: it waits for no answer), doing no work at all.
//! `tollgate bench` against it measures what the load generator, the kernel and the gRPC stack cost
//! here, and `scripts/bench-envoy` what Envoy's two filters cost with nothing behind them, so that
//! tollgate's own share of a figure is measured, not guessed. Given a Redis, every Check first
//! calls it once (a script that does nothing, on one key): the floor of a decision that takes
//! one round trip to Redis, what any limiter on Redis pays it a request before its script does
//! anything.

use std::pin::Pin;
use std::time::Duration;

use envoy_types::pb::envoy::service::auth::v3::authorization_server::{Authorization, AuthorizationServer};
use envoy_types::pb::envoy::service::auth::v3::{CheckRequest, CheckResponse};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Phase;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::net::TcpListener;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tonic::{Request, Response, Status, Streaming};

use crate::admission::{Admitted, Decision};
use crate::grpc::response::check_response;
use crate::hold::Headroom;
use crate::proto::admission_server::{Admission, AdmissionServer};
use crate::proto::{
    CommitRequest, CommitResponse, OutputEstimateRequest, OutputEstimateResponse, PoolStatusRequest,
    PoolStatusResponse, ReleaseRequest, ReleaseResponse, RenewRequest, RenewResponse, ReserveRequest, ReserveResponse,
};
use crate::store::redis::{RedisOptions, RedisStore, RedisTarget};
use crate::store::{Script, Store, StoreError};

/// Answers without work (but one call to Redis a Check, given one).
#[derive(Clone, Default)]
pub struct Floor {
    redis: Option<(RedisStore, Script)>,
}

/// The script a Check calls: it does nothing. KEYS[1] only routes the call (on a Cluster, to the
/// node that has it); the reply is 1.
const NOTHING: &str = "return 1";

/// The key the floor's calls name: a tool's, outside the protocol's key space (`store::keys`).
const FLOOR_KEY: &str = "tg:{floor}:x";

/// Connects to the Redis at `url` as tollgate does (the same reconnects and timeouts), for
/// [`serve`].
pub async fn connect_redis(url: &str) -> Result<(RedisStore, Script), StoreError> {
    let store = RedisStore::connect(&RedisTarget::Single(url.to_string()), RedisOptions::default()).await?;
    Ok((store, Script::new("floor", NOTHING.to_string())))
}

#[tonic::async_trait]
impl Authorization for Floor {
    async fn check(&self, _: Request<CheckRequest>) -> Result<Response<CheckResponse>, Status> {
        if let Some((store, nothing)) = &self.redis {
            store
                .eval(nothing, vec![FLOOR_KEY.to_string()], Vec::new())
                .await
                .map_err(|e| Status::unavailable(e.to_string()))?;
        }
        let admitted = Decision::Admitted(Admitted {
            reservation_id: "floor:00000000000000000000000000000000".into(),
            model: "m".into(),
            reserved_tokens: 0,
            attempts: 1,
            replayed: false,
            headroom: Headroom::default(),
            shadow: None,
            soft_limit: None,
            tier: crate::config::Priority::Standard,
            forecast: None,
            output_ceiling: None,
        });
        Ok(Response::new(check_response(&admitted, &[], crate::llm::api::Family::OpenAi)))
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Floor {
    type ProcessStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

    /// Reads the stream until the response ends and answers nothing, as an observer is answered,
    /// then closes it as tollgate does: a stream left for Envoy to close waits out the filter's
    /// `deferred_close_timeout`, which costs Envoy a timer and a tenth of a second of open stream.
    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let drained = futures_util::stream::unfold(request.into_inner(), |mut inbound| async move {
            while let Ok(Some(message)) = inbound.message().await {
                if response_ended(&message) {
                    break;
                }
            }
            None
        });
        Ok(Response::new(Box::pin(drained)))
    }
}

/// The message that ends the response: its headers or a body chunk with `end_of_stream`, or its
/// trailers.
fn response_ended(message: &ProcessingRequest) -> bool {
    match &message.request {
        Some(Phase::ResponseHeaders(h)) => h.end_of_stream,
        Some(Phase::ResponseBody(b)) => b.end_of_stream,
        Some(Phase::ResponseTrailers(_)) => true,
        _ => false,
    }
}

#[tonic::async_trait]
impl Admission for Floor {
    async fn reserve(&self, _: Request<ReserveRequest>) -> Result<Response<ReserveResponse>, Status> {
        Ok(Response::new(ReserveResponse::default()))
    }

    async fn commit(&self, _: Request<CommitRequest>) -> Result<Response<CommitResponse>, Status> {
        Ok(Response::new(CommitResponse { state: "committed".into(), ..Default::default() }))
    }

    async fn renew(&self, _: Request<RenewRequest>) -> Result<Response<RenewResponse>, Status> {
        Ok(Response::new(RenewResponse::default()))
    }

    async fn release(&self, _: Request<ReleaseRequest>) -> Result<Response<ReleaseResponse>, Status> {
        Ok(Response::new(ReleaseResponse::default()))
    }

    async fn output_estimate(
        &self,
        _: Request<OutputEstimateRequest>,
    ) -> Result<Response<OutputEstimateResponse>, Status> {
        Ok(Response::new(OutputEstimateResponse::default()))
    }

    async fn pool_status(&self, _: Request<PoolStatusRequest>) -> Result<Response<PoolStatusResponse>, Status> {
        Ok(Response::new(PoolStatusResponse::default()))
    }
}

/// Serves the floor until `shutdown`, with tollgate's server settings; each Check calls `redis`
/// once, given one.
pub async fn serve(
    listener: TcpListener,
    redis: Option<(RedisStore, Script)>,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let floor = Floor { redis };
    Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .timeout(Duration::from_secs(5))
        .concurrency_limit_per_connection(4096)
        .load_shed(true)
        .add_service(AuthorizationServer::new(floor.clone()))
        .add_service(AdmissionServer::new(floor.clone()))
        .add_service(ExternalProcessorServer::new(floor))
        .serve_with_incoming_shutdown(crate::grpc::server::incoming(listener), shutdown.cancelled_owned())
        .await
}
