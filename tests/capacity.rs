//! The capacity-admission scenario (interactive chat against a batch flood) through real Envoy and the simulated backend: steady interactive traffic
//! plus a flood of long batch requests. With capacity admission, interactive requests keep their
//! p99 within their deadline and the flood is refused with 503 (queue_full / deadline), not 429.
//! With only tenant quotas, the flood queues in the backend and interactive p99 grows past the
//! deadline. With the pool queueing in tollgate, requests that cannot start wait in the Check
//! for their slot instead of in the backend: interactive requests go first, and the backend is
//! never given more than the pool's slots.

mod support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::procs::{Envoy, TempDir, Tollgate, free_port, tollgate_bin, wait_for_port};
use tollgate::tools::sim::load::{self, Class, ClassReport, LoadPlan};

const DEADLINE_MS: u64 = 600;

/// Capacity admission off, or where its pool queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Capacity {
    Off,
    Backend,
    Tollgate,
}

/// The policy; with capacity admission, model `sim` is in a pool that mirrors the simulated backend.
fn policy(capacity: Capacity) -> String {
    let queue = match capacity {
        Capacity::Off => None,
        Capacity::Backend => Some("backend"),
        Capacity::Tollgate => Some("tollgate"),
    };
    let (pools, served_by) = match queue {
        Some(queue) => (
            format!(
                "pools:\n  gpu:\n    max_sequences: 4\n    prefill_tokens_per_second: 20000\n    decode_tokens_per_second: 1000\n    max_queue_delay_ms: 500\n    queue: {queue}\n    tier_shares: {{ standard: 0.75, sheddable: 0.5 }}\n"
            ),
            ", pool: gpu",
        ),
        None => (String::new(), ""),
    };
    format!(
        "{pools}models:\n  sim: {{ max_output_tokens: 4096, bytes_per_token: 4{served_by} }}\ntenants:\n  \
         chat:\n    limits: {{ tokens_per_minute: 10000000, max_concurrency: 1000 }}\n  \
         batch:\n    default_priority: sheddable\n    max_priority: sheddable\n    limits: {{ tokens_per_minute: 10000000, max_concurrency: 1000 }}\n"
    )
}

/// `tollgate sim-backend`: 4 slots, 20,000 prefill and 1,000 decode tokens/s per sequence. It
/// commits nothing: Envoy's commit from the response closes every hold, as in front of an
/// unmodified backend.
struct SimBackend {
    child: Child,
    port: u16,
    _dir: TempDir,
}

impl SimBackend {
    fn start() -> SimBackend {
        let dir = TempDir::new("sim");
        let port = free_port();
        let log = std::fs::File::create(dir.0.join("sim.log")).unwrap();
        let mut child = Command::new(tollgate_bin())
            .args(["sim-backend", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--slots", "4", "--prefill-tps", "20000", "--decode-tps", "1000"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        wait_for_port(format!("127.0.0.1:{port}").parse().unwrap(), Duration::from_secs(20), "sim-backend", &mut child);
        SimBackend { child, port, _dir: dir }
    }
}

impl Drop for SimBackend {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// 10 interactive requests/s for 3.5 s (100 tokens, 600 ms deadline), and from 0.5 s on a flood of
/// 2,000-token batch requests at 20/s: 60 of them are 120 slot-seconds of work for 4 slots.
async fn scenario(capacity: Capacity) -> (ClassReport, ClassReport) {
    let tollgate = Tollgate::start(&policy(capacity));
    let sim = SimBackend::start();
    let envoy = Envoy::start(tollgate.addr, sim.port);
    let target = format!("http://127.0.0.1:{}", envoy.port);
    let interactive = Class {
        name: "interactive".into(),
        tenant: "chat".into(),
        priority: Some("critical".into()),
        deadline_ms: Some(DEADLINE_MS),
        rate: 10.0,
        max_tokens: 100,
        output_tokens: Some(100),
        prompt_bytes: 400,
        stream: true,
    };
    let batch = Class {
        name: "batch".into(),
        tenant: "batch".into(),
        priority: None,
        deadline_ms: None,
        rate: 20.0,
        max_tokens: 2000,
        output_tokens: Some(2000),
        prompt_bytes: 2000,
        stream: false,
    };
    let steady = LoadPlan {
        target: target.clone(),
        duration: Duration::from_millis(3_500),
        timeout: Duration::from_secs(5),
        classes: vec![interactive],
        retries: 0,
    };
    let flood = LoadPlan {
        target,
        duration: Duration::from_secs(3),
        timeout: Duration::from_secs(5),
        classes: vec![batch],
        retries: 0,
    };
    let flood = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        load::run(&flood).await
    };
    let (mut steady, mut flood) = tokio::join!(load::run(&steady), flood);
    let report = (steady.remove(0), flood.remove(0));
    eprintln!("capacity admission {capacity:?}:\n{}", load::table(&[report.0.clone(), report.1.clone()]));
    report
}

/// Interactive requests kept their deadline (p99), none timed out or failed, and of every `of`
/// sent at least `at_least` were admitted (`served`: (of, at_least)).
fn interactive_served(interactive: &ClassReport, served: (u64, u64)) {
    let p99 = interactive.percentile(990).unwrap();
    assert!(p99 < DEADLINE_MS as f64, "interactive p99 {p99:.0} ms is past its {DEADLINE_MS} ms deadline");
    let (of, at_least) = served;
    assert!(
        interactive.admitted * of >= interactive.sent * at_least,
        "interactive requests are served: {interactive:?}"
    );
    assert_eq!(interactive.timed_out + interactive.failed, 0, "{interactive:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_admission_keeps_interactive_p99_within_its_deadline() {
    let (interactive, batch) = scenario(Capacity::Backend).await;
    // Most: 8 of 10.
    interactive_served(&interactive, (10, 8));
    assert!(batch.denied_total() > batch.sent / 2, "the flood is mostly refused: {batch:?}");
    for reason in batch.denied.keys() {
        assert!(
            reason == "queue_full" || reason == "deadline",
            "the flood is refused as capacity (503), not quota: {reason}"
        );
    }
    assert!(interactive.denied.keys().all(|r| r == "deadline" || r == "queue_full"), "{interactive:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_only_tenant_quotas_the_flood_pushes_interactive_p99_past_its_deadline() {
    let (interactive, batch) = scenario(Capacity::Off).await;
    let p99 = interactive.percentile(990).unwrap();
    assert!(
        p99 > 2.0 * DEADLINE_MS as f64,
        "interactive p99 {p99:.0} ms should be far past the {DEADLINE_MS} ms deadline"
    );
    assert_eq!(batch.denied_total(), 0, "quotas alone admit the whole flood: {batch:?}");
}

/// Queueing in tollgate: interactive requests never wait behind the flood (they take the next slot
/// before any batch request), and a batch request that cannot start waits in the Check, through
/// Envoy (which keeps the Check open: its ext_authz timeout is read from the call), before its
/// 2 s of generation, rather than in the backend's queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queueing_in_tollgate_serves_interactive_first_and_holds_the_flood_in_the_check() {
    let (interactive, batch) = scenario(Capacity::Tollgate).await;
    // All but one in twenty.
    interactive_served(&interactive, (20, 19));
    assert_eq!(batch.timed_out + batch.failed, 0, "no Check outlived Envoy's timeout: {batch:?}");
    assert!(batch.denied.keys().all(|r| r == "queue_full"), "{batch:?}");
    // 2 s of generation at 1,000 tokens/s and 25 ms of prefill; a slot of its own at once would
    // answer in well under 2.1 s.
    let waited = batch.latencies_ms.iter().filter(|&&ms| ms > 2_150.0).count();
    assert!(waited > 0, "some batch requests waited in the Check for a slot: {batch:?}");
}
