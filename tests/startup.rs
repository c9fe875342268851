//! Starting and stopping: an unreachable Redis is a clear error and a non-zero exit; SIGTERM
//! drains and exits cleanly.

mod support;

use std::time::Duration;

use support::procs::{TempDir, Tollgate, free_port, tollgate_cmd};
use tollgate::proto::ReserveRequest;
use tollgate::proto::admission_client::AdmissionClient;

/// One small reserve for acme; panics unless it is admitted.
async fn reserve_one(client: &mut AdmissionClient<tonic::transport::Channel>) {
    let request = ReserveRequest { tenant: "acme".into(), model: "m".into(), prompt_tokens: 1, ..Default::default() };
    let reply = client.reserve(request).await.unwrap().into_inner();
    assert!(reply.admitted, "{reply:?}");
}

const MODELS: &str = "models:\n  m:\n    max_output_tokens: 100\ntenants:\n  acme: {}\n";

#[test]
fn an_unreachable_redis_fails_the_start() {
    let dir = TempDir::new("startup");
    let port = free_port();
    let policy = dir.write(
        "policy.yaml",
        &format!("store:\n  redis_url: redis://127.0.0.1:{port}\n  connect_timeout_ms: 1000\n{MODELS}"),
    );
    let out = tollgate_cmd(
        &["serve", "--config", policy.to_str().unwrap(), "--listen", "127.0.0.1:0"],
        Duration::from_secs(20),
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("cannot connect to Redis at redis://127.0.0.1:{port}")), "{stderr}");

    // A password in the URL never reaches the log, in either format.
    let policy = dir.write(
        "secret.yaml",
        &format!("store:\n  redis_url: redis://app:s3cret@127.0.0.1:{port}\n  connect_timeout_ms: 1000\n{MODELS}"),
    );
    for format in ["text", "json"] {
        let args = ["serve", "--config", policy.to_str().unwrap(), "--listen", "127.0.0.1:0", "--log-format", format];
        let out = tollgate_cmd(&args, Duration::from_secs(20));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains("redis://app:***@127.0.0.1"), "{stderr}");
        assert!(!stderr.contains("s3cret"), "{stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_and_exits_cleanly() {
    let mut t = Tollgate::start(MODELS);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    reserve_one(&mut client).await;
    let status = t.terminate(Duration::from_secs(10)).expect("tollgate did not exit within 10 s of SIGTERM");
    assert!(status.success(), "exit status {status}\n{}", t.log());
    assert!(t.log().contains("SIGTERM: draining"), "{}", t.log());
}

#[test]
fn sigint_exits_cleanly_too() {
    let mut t = Tollgate::start(MODELS);
    let status = t.signal("INT", Duration::from_secs(10)).expect("no exit within 10 s of SIGINT");
    assert!(status.success(), "{status}\n{}", t.log());
    assert!(t.log().contains("SIGINT: draining"), "{}", t.log());
}

/// The runtime's worker threads of a running tollgate, as its start line states them.
fn workers(t: &Tollgate) -> usize {
    for _ in 0..250 {
        if let Some(line) = t.log().lines().find(|l| l.contains("tollgate serving")) {
            let (_, after) = line.split_once("worker_threads=").unwrap_or_else(|| panic!("{line}"));
            return after.split_whitespace().next().unwrap().parse().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("no start line:\n{}", t.log());
}

/// One worker by default (a sidecar beside Envoy); the policy's server.worker_threads, and the
/// flag over it; a count outside 1..=64 stops the start naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runtime_has_one_worker_unless_told_otherwise() {
    let t = Tollgate::start(MODELS);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    reserve_one(&mut client).await;
    assert_eq!(workers(&t), 1);
    let policy = format!("server:\n  worker_threads: 3\n{MODELS}");
    assert_eq!(workers(&Tollgate::start(&policy)), 3);
    assert_eq!(workers(&Tollgate::start_with(&policy, &["--worker-threads", "2"])), 2);

    let dir = TempDir::new("startup");
    let config = dir.write("policy.yaml", &format!("server:\n  worker_threads: 0\n{MODELS}"));
    let out = tollgate_cmd(&["check-config", config.to_str().unwrap()], Duration::from_secs(10));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("server.worker_threads"), "{stderr}");
    let out = tollgate_cmd(
        &["serve", "--config", config.to_str().unwrap(), "--worker-threads", "65"],
        Duration::from_secs(10),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("--worker-threads"), "{stderr}");
}

/// Traces are exported only when an endpoint is configured; a collector that is not there does
/// not stop admission or shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_otlp_endpoint_with_no_collector_does_not_stop_admission() {
    let endpoint = format!("http://127.0.0.1:{}", free_port());
    let mut t = Tollgate::start_with(MODELS, &["--otlp-endpoint", &endpoint]);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    for _ in 0..3 {
        reserve_one(&mut client).await;
    }
    let status = t.terminate(Duration::from_secs(20)).expect("no exit within 20 s of SIGTERM");
    assert!(status.success(), "{status}\n{}", t.log());
}

/// A stand-in OTLP collector (tollgate does not own the collector): it records span names, and
/// the names of the metrics it is sent.
mod collector {
    use std::sync::{Arc, Mutex};

    use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
        MetricsService, MetricsServiceServer,
    };
    use opentelemetry_proto::tonic::collector::metrics::v1::{
        ExportMetricsServiceRequest, ExportMetricsServiceResponse,
    };
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
    use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
    use tokio_stream::wrappers::TcpListenerStream;

    #[derive(Clone, Default)]
    pub struct Spans(pub Arc<Mutex<Vec<String>>>);

    #[derive(Clone, Default)]
    pub struct Metrics(pub Arc<Mutex<Vec<String>>>);

    #[tonic::async_trait]
    impl MetricsService for Metrics {
        async fn export(
            &self,
            request: tonic::Request<ExportMetricsServiceRequest>,
        ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
            let mut names = self.0.lock().unwrap();
            for resource in request.into_inner().resource_metrics {
                for scope in resource.scope_metrics {
                    names.extend(scope.metrics.into_iter().map(|m| m.name));
                }
            }
            Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
        }
    }

    #[tonic::async_trait]
    impl TraceService for Spans {
        async fn export(
            &self,
            request: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            let mut names = self.0.lock().unwrap();
            for resource in request.into_inner().resource_spans {
                for scope in resource.scope_spans {
                    names.extend(scope.spans.into_iter().map(|s| s.name));
                }
            }
            Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
        }
    }

    pub async fn start() -> (Spans, Metrics, u16) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (spans, metrics) = (Spans::default(), Metrics::default());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(spans.clone()))
                .add_service(MetricsServiceServer::new(metrics.clone()))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        (spans, metrics, port)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_otlp_collector_when_one_is_configured() {
    let (spans, _, port) = collector::start().await;
    let mut t = Tollgate::start_with(MODELS, &["--otlp-endpoint", &format!("http://127.0.0.1:{port}")]);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    reserve_one(&mut client).await;
    // Shutdown flushes the batch exporter.
    let status = t.terminate(Duration::from_secs(20)).expect("no exit within 20 s of SIGTERM");
    assert!(status.success(), "{status}\n{}", t.log());
    let names = spans.0.lock().unwrap().clone();
    assert!(names.iter().any(|n| n == "reserve"), "spans received: {names:?}\n{}", t.log());
}

/// The instruments the Prometheus endpoint shows go over OTLP too (flushed at shutdown at the
/// latest), under their OpenTelemetry names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_reach_an_otlp_collector_when_one_is_configured() {
    let (_, metrics, port) = collector::start().await;
    let mut t = Tollgate::start_with(MODELS, &["--otlp-endpoint", &format!("http://127.0.0.1:{port}")]);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    reserve_one(&mut client).await;
    let status = t.terminate(Duration::from_secs(20)).expect("no exit within 20 s of SIGTERM");
    assert!(status.success(), "{status}\n{}", t.log());
    let names = metrics.0.lock().unwrap().clone();
    for name in ["tollgate.decisions", "tollgate.decision.duration", "tollgate.tokens", "tollgate.store.duration"] {
        assert!(names.iter().any(|n| n == name), "{name} missing from {names:?}\n{}", t.log());
    }
}
