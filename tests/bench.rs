//! The benchmark tools measure what they claim, on the real gateway: the open-loop cycle
//! generator sends its whole schedule, and the burst experiment's worst case admits exactly what
//! the budget holds while the learned reservation admits far more.

mod support;

use std::path::Path;
use std::time::Duration;

use support::procs::Tollgate;
use tollgate::bench::burst::{self, BurstOptions};
use tollgate::bench::{self, BenchOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cycle_benchmark_sends_its_whole_schedule() {
    let t = Tollgate::start("models:\n  m: { max_output_tokens: 4096 }\ndefault_tenant: {}\n");
    let options = BenchOptions {
        target: t.endpoint(),
        http: false,
        rate: 200,
        duration: Duration::from_secs(1),
        warmup: Duration::from_millis(200),
        tenants: vec!["a".into(), "b".into()],
        model: "m".into(),
        connections: 2,
    };
    let report = bench::run(&options).await.unwrap();
    assert_eq!((report.cycles, report.admitted, report.errors), (200, 200, 0), "{report}");
    assert!(report.p50 <= report.p99 && report.p99 <= report.max);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learned_reservation_admits_more_of_a_burst_than_the_worst_case() {
    let policy =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/burst-policy.yaml")).unwrap();
    let t = Tollgate::start(&policy);
    let options = BurstOptions {
        target: t.endpoint(),
        worst_tenant: "worst".into(),
        adaptive_tenant: "adaptive".into(),
        model: "m".into(),
        requests: 400,
        learn: 400,
        prompt_tokens: 200,
        max_tokens: 4096,
        median: 200.0,
        sigma: 0.8,
        seed: 7,
    };
    let r = burst::run(&options).await.unwrap();
    // 320,000 tokens of budget hold floor(320000 / (200 + 4096)) = 74 worst-case requests.
    assert_eq!(r.worst.admitted, 74, "{r}");
    assert_eq!(r.worst.overrun_tokens, 0, "a worst-case hold never overruns");
    assert!(r.adaptive.admitted > 2 * r.worst.admitted, "{r}");
    assert!(r.adaptive.overrun_share() < 0.10, "{r}");
}
