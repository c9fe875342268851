//! The admin HTTP port (`server.admin_listen`): `GET /metrics` in Prometheus text. Plain HTTP/1.1
//! on a port of its own, off the gRPC port, so a scrape never shares a connection (or a
//! concurrency limit) with Envoy's calls. Keep it where only the scraper reaches it.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::exposition::Registry;

/// The content type of Prometheus's text format.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

fn answer(req: &Request<Incoming>, registry: &Registry) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, content_type: &str, body: String| {
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
            response.headers_mut().insert(hyper::header::CONTENT_TYPE, value);
        }
        response
    };
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => reply(StatusCode::OK, PROMETHEUS_TEXT, registry.render()),
        (_, "/metrics") => reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n".into()),
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "tollgate's admin port serves /metrics\n".into()),
    }
}

/// Serves the admin port until `shutdown`.
pub async fn serve(listener: TcpListener, registry: Arc<Registry>, shutdown: CancellationToken) {
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "admin port: accept failed");
                    continue;
                }
            },
            () = shutdown.cancelled() => return,
        };
        let registry = Arc::clone(&registry);
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let response = answer(&req, &registry);
            async move { Ok::<_, Infallible>(response) }
        });
        tokio::spawn(serve_http1(TokioIo::new(stream), service, shutdown.clone()));
    }
}

/// Serves one HTTP/1.1 connection until the client closes it, or until `done`, after which the
/// request in progress is answered and the connection closed.
pub(crate) async fn serve_http1<I, S>(io: I, service: S, done: CancellationToken)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = Response<Full<Bytes>>, Error = Infallible>,
    S::Future: Send + 'static,
{
    let connection = hyper::server::conn::http1::Builder::new().serve_connection(io, service);
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => return,
        () = done.cancelled() => connection.as_mut().graceful_shutdown(),
    }
    let _ = connection.await;
}
