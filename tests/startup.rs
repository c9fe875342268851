//! Starting and stopping: an unreachable Redis is a clear error and a non-zero exit; SIGTERM
//! drains and exits cleanly.

mod support;

use std::time::Duration;

use support::procs::{TempDir, Tollgate, free_port, tollgate_cmd};
use tollgate::proto::ReserveRequest;
use tollgate::proto::admission_client::AdmissionClient;

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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_and_exits_cleanly() {
    let mut t = Tollgate::start(MODELS);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    let reply = client
        .reserve(ReserveRequest { tenant: "acme".into(), model: "m".into(), prompt_tokens: 1, ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert!(reply.admitted, "{reply:?}");
    let status = t.terminate(Duration::from_secs(10)).expect("tollgate did not exit within 10 s of SIGTERM");
    assert!(status.success(), "exit status {status}\n{}", t.log());
    assert!(t.log().contains("SIGTERM: draining"), "{}", t.log());
}
