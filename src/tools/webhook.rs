//! `tollgate inject --serve`: the same injection as `tollgate inject`, as a Kubernetes mutating
//! admission webhook (as Istio and Linkerd inject theirs). The API server posts an
//! `admission.k8s.io/v1` AdmissionReview for each pod being created in an opted-in namespace or
//! with an opted-in pod (the selectors of deploy/webhook/'s MutatingWebhookConfiguration); the
//! answer admits it with a JSON patch that adds the sidecars, the policy volume and the
//! `tollgate.io/injected` annotation.
//!
//! A pod annotated or labelled `tollgate.io/inject: disabled`, or already injected, is admitted
//! unchanged. A pod inject refuses (it has a container called `tollgate`, say) is admitted
//! unchanged with a warning that says why: a webhook that blocked pods would take a namespace's
//! workloads down with it. A body that is not an AdmissionReview is answered 400.
//!
//! HTTPS only (the API server calls nothing else), HTTP/1.1, the certificate reread when its
//! files change (cert-manager rotates them).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::admin::serve_http1;
use crate::grpc::tls::{HANDSHAKE_TIMEOUT, LiveTls};
use crate::tools::inject::{self, Options};

/// The opt-in and opt-out annotation or label.
pub const INJECT: &str = "tollgate.io/inject";
/// The largest AdmissionReview accepted (a pod with its spec is a few KiB; the API server's own
/// limit on objects is 1.5 MiB).
const MAX_BODY: usize = 3 * 1024 * 1024;

/// The answer to one AdmissionReview body, or why it is not one.
pub fn review(body: &[u8], options: &Options) -> Result<Value, String> {
    let review: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    if review["apiVersion"] != "admission.k8s.io/v1" || review["kind"] != "AdmissionReview" {
        return Err("not an admission.k8s.io/v1 AdmissionReview".into());
    }
    let request = &review["request"];
    let uid = request["uid"].as_str().filter(|u| !u.is_empty()).ok_or("the AdmissionReview has no request.uid")?;
    let object = &request["object"];
    if !object.is_object() {
        return Err("the AdmissionReview's request has no object".into());
    }
    let mut response = json!({ "uid": uid, "allowed": true });
    if request["kind"]["kind"].as_str().is_some_and(|k| k != "Pod") {
        response["warnings"] = json!([format!("tollgate inject: a {} is not a pod", request["kind"]["kind"])]);
    } else if opted_out(object) {
        // Admitted as it is.
    } else {
        match patch(object, options) {
            Ok(Some(ops)) => {
                response["patchType"] = "JSONPatch".into();
                let ops = serde_json::to_vec(&ops).map_err(|e| e.to_string())?;
                response["patch"] = base64::engine::general_purpose::STANDARD.encode(ops).into();
            }
            Ok(None) => {}
            Err(why) => response["warnings"] = json!([format!("tollgate inject: not injected: {why}")]),
        }
    }
    Ok(json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response }))
}

fn opted_out(pod: &Value) -> bool {
    let says = |field: &str| pod["metadata"][field][INJECT].as_str() == Some("disabled");
    says("annotations") || says("labels")
}

/// The JSON patch that injects this pod, or `None` when it needs none (already injected). Each
/// field inject changes is set whole (`add` replaces a member that exists).
fn patch(pod: &Value, options: &Options) -> Result<Option<Vec<Value>>, String> {
    let as_yaml: serde_yaml::Value = serde_yaml::to_value(pod).map_err(|e| e.to_string())?;
    let Some(after) = inject::inject_pod(as_yaml, options)? else { return Ok(None) };
    let after = serde_json::to_value(&after).map_err(|e| e.to_string())?;
    let ops = [
        ("/spec/initContainers", &after["spec"]["initContainers"]),
        ("/spec/volumes", &after["spec"]["volumes"]),
        ("/metadata/annotations", &after["metadata"]["annotations"]),
    ]
    .into_iter()
    .map(|(path, value)| json!({ "op": "add", "path": path, "value": value }))
    .collect();
    Ok(Some(ops))
}

fn reply(status: StatusCode, content_type: &'static str, body: Vec<u8>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
    response
}

async fn answer(req: Request<Incoming>, options: &Options) -> Response<Full<Bytes>> {
    if req.method() != Method::POST {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", b"POST an AdmissionReview\n".to_vec());
    }
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(e) => return reply(StatusCode::BAD_REQUEST, "text/plain", format!("cannot read the body: {e}\n").into()),
    };
    match review(&body, options) {
        Ok(answer) => reply(StatusCode::OK, "application/json", answer.to_string().into_bytes()),
        Err(why) => {
            tracing::info!(%why, "a request that is not an AdmissionReview");
            reply(StatusCode::BAD_REQUEST, "text/plain", format!("{why}\n").into_bytes())
        }
    }
}

/// Serves the webhook on `listener` until `shutdown`.
pub async fn serve(listener: TcpListener, tls: Arc<LiveTls>, options: Arc<Options>, shutdown: CancellationToken) {
    let reload = tls.watch(Duration::from_secs(10), shutdown.clone());
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "webhook: accept failed");
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let acceptor = TlsAcceptor::from(tls.current());
        let (options, done) = (Arc::clone(&options), shutdown.clone());
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => return tracing::info!(%peer, error = %e, "webhook: TLS handshake failed"),
                Err(_) => return tracing::info!(%peer, "webhook: TLS handshake not completed in time"),
            };
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let options = Arc::clone(&options);
                async move { Ok::<_, Infallible>(answer(req, &options).await) }
            });
            serve_http1(TokioIo::new(stream), service, done).await;
        });
    }
    reload.abort();
}
