//! The benchmark tools measure what they claim, on the real gateway: the open-loop cycle
//! generator sends its whole schedule, and the burst experiment's worst case admits exactly what
//! the budget holds while the learned reservation admits far more.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use support::procs::Tollgate;
use tollgate::proto::OutputEstimateRequest;
use tollgate::proto::admission_client::AdmissionClient;
use tollgate::tools::bench::burst::{self, BurstOptions};
use tollgate::tools::bench::{self, BenchOptions};
use tollgate::tools::sim::backend::{self as sim, SimConfig, SimStats};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cycle_benchmark_sends_its_whole_schedule() {
    let t = Tollgate::start("models:\n  m: { max_output_tokens: 4096 }\ndefault_tenant: {}\n");
    let options = BenchOptions {
        target: t.endpoint(),
        http: false,
        stream: false,
        last_byte: false,
        rate: 200,
        duration: Duration::from_secs(1),
        warmup: Duration::from_millis(200),
        tenants: vec!["a".into(), "b".into()],
        model: "m".into(),
        connections: 2,
        store_stats: None,
        quota: None,
        prompt_bytes: None,
    };
    let report = bench::run(&options).await.unwrap();
    assert_eq!((report.cycles, report.admitted, report.errors), (200, 200, 0), "{report}");
    assert!(report.p50 <= report.p99 && report.p99 <= report.max);
}

/// Two leasing replicas on one Redis: `--targets` spreads the cycles over both, `--store-stats`
/// counts every script call Redis served against the decisions, and `--quota` measures what was
/// admitted against what the tenant's quota allows. Offered at many times the quota, leasing
/// admits no more than it allows; unlimited, most decisions make no store call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cycle_benchmark_drives_replicas_and_measures_hits_and_quota() {
    let url = support::redis_url();
    let tenant = support::unique_tenant("q");
    let policy = format!(
        "store: {{ redis_url: {url} }}\nleasing: {{ window_ms: 250, max_share: 0.1 }}\n\
         models:\n  m: {{ max_output_tokens: 4096, bytes_per_token: 4 }}\n\
         tenants:\n  {tenant}:\n    limits: {{ tokens_per_minute: 600000, burst_tokens: 20000 }}\n\
         default_tenant: {{}}\n"
    );
    let (a, b) = (Tollgate::start(&policy), Tollgate::start(&policy));
    let options = |tenant: &str, quota| BenchOptions {
        target: format!("{},{}", a.endpoint(), b.endpoint()),
        http: false,
        stream: false,
        last_byte: false,
        rate: 200,
        duration: Duration::from_secs(2),
        warmup: Duration::from_millis(200),
        tenants: vec![tenant.to_string()],
        model: "m".into(),
        connections: 1,
        store_stats: Some(url.clone()),
        quota,
        prompt_bytes: None,
    };
    // About 450 tokens a cycle at 200/s: 90,000 tokens/s against a quota of 10,000/s.
    let limited = bench::run(&options(&tenant, Some((600_000, 20_000)))).await.unwrap();
    assert!(limited.admitted > 0 && limited.denied > 0, "{limited}");
    let overshoot = limited.quota.unwrap().overshoot();
    assert!(overshoot <= 0.02, "admitted {:.1}% over the quota: {limited}", overshoot * 100.0);
    assert!(overshoot >= -0.5, "the quota is offered 9x over; at least half of it is used: {limited}");
    let open = bench::run(&options(&support::unique_tenant("open"), None)).await.unwrap();
    assert_eq!((open.admitted, open.errors), (400, 0), "{open}");
    let hits = bench::Report::hits(open.store_calls_per_cycle.unwrap());
    assert!(hits >= 0.8, "{:.1}% of decisions made no store call: {open}", hits * 100.0);
}

/// tollgate, the simulated backend (built from `config`, told tollgate's endpoint) and Envoy in
/// front; and a bench through that Envoy at `rate` for a second.
async fn through_envoy(
    config: impl FnOnce(String) -> SimConfig,
    stream: bool,
    rate: u32,
    warmup: Duration,
) -> (bench::Report, Arc<SimStats>) {
    let t = Tollgate::start("models:\n  m: { max_output_tokens: 4096 }\ndefault_tenant: {}\n");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let sim_port = listener.local_addr().unwrap().port();
    let stats = Arc::new(SimStats::default());
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn(sim::serve(listener, config(t.endpoint()), shutdown.clone(), stats.clone()));
    let envoy = support::procs::Envoy::start(t.addr, sim_port);
    let options = BenchOptions {
        target: format!("http://127.0.0.1:{}", envoy.port),
        http: true,
        stream,
        last_byte: false,
        rate,
        duration: Duration::from_secs(1),
        warmup,
        tenants: vec!["a".into()],
        model: "m".into(),
        connections: 1,
        store_stats: None,
        quota: None,
        prompt_bytes: None,
    };
    let report = bench::run(&options).await.unwrap();
    shutdown.cancel();
    (report, stats)
}

/// HTTP mode: chat completions through real Envoy to the simulated backend, which commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_mode_drives_envoy_and_the_simulated_backend() {
    let config =
        |tollgate| SimConfig { decode_tokens_per_second: 20_000.0, tollgate: Some(tollgate), ..SimConfig::default() };
    let (report, stats) = through_envoy(config, false, 50, Duration::from_millis(200)).await;
    assert_eq!((report.cycles, report.admitted, report.errors), (50, 50, 0), "{report}");
    assert!(stats.commits.load(std::sync::atomic::Ordering::Relaxed) >= 50, "the backend committed every request");
}

/// `--stream` measures to the first byte of the body: streams of 200 tokens at 500 tokens/s take
/// 400 ms to finish, but their first chunk (10 tokens) comes after 20 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_mode_measures_the_time_to_the_first_byte() {
    let config = |_| SimConfig {
        slots: 64,
        prefill_tokens_per_second: 1e9,
        decode_tokens_per_second: 500.0,
        lengths: tollgate::tools::sim::lengths::OutputLengths::Fixed(200),
        ..SimConfig::default()
    };
    let (report, _) = through_envoy(config, true, 20, Duration::from_millis(100)).await;
    assert_eq!((report.cycles, report.errors), (20, 0), "{report}");
    assert!(report.p99 < Duration::from_millis(200), "to the first byte, not the 400 ms stream: {report}");
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
    // 320,000 tokens of budget hold floor(320000 / (200 + 4096)) = 74 worst-case requests; the
    // bucket refills 5,333 tokens a second, so a burst slower than 0.41 s (a busy machine) fits a
    // 75th, and one slower than 1.2 s a 76th.
    assert!((74..=75).contains(&r.worst.admitted), "{r}");
    assert_eq!(r.worst.overrun_tokens, 0, "a worst-case hold never overruns");
    assert!(r.adaptive.admitted > 2 * r.worst.admitted, "{r}");
    assert!(r.adaptive.overrun_share() < 0.10, "{r}");

    // The estimator's error, as the Admission service reports it.
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    let request = OutputEstimateRequest { tenant: "adaptive".into(), model: "m".into() };
    let e = client.output_estimate(request).await.unwrap().into_inner();
    assert!(e.in_use && e.samples >= 400, "{e:?}");
    assert_eq!(e.quantile, 0.985);
    assert!(e.reserved_output_tokens > 200 && e.reserved_output_tokens < 4096, "{e:?}");
    assert!(e.used_tokens > 0 && e.overrun_ratio == e.overrun_tokens as f64 / e.used_tokens as f64, "{e:?}");
    let worst =
        client.output_estimate(OutputEstimateRequest { tenant: "worst".into(), model: "m".into() }).await.unwrap();
    assert!(!worst.into_inner().in_use, "a tenant without adaptive_output never uses an estimate");
    let bad = client.output_estimate(OutputEstimateRequest { tenant: "a{b".into(), model: "m".into() }).await;
    assert_eq!(bad.unwrap_err().code(), tonic::Code::InvalidArgument);
}

/// Ctrl-C stops a sweep cleanly: the cycles in flight finish, and what ran is reported.
#[test]
fn ctrl_c_stops_the_sweep_and_reports_what_ran() {
    use std::process::{Command, Stdio};
    let t = Tollgate::start("models:\n  m: { max_output_tokens: 4096 }\ndefault_tenant: {}\n");
    let child = Command::new(support::procs::tollgate_bin())
        .args(["bench", "--target", &t.endpoint(), "--rates", "100,200", "--seconds", "30", "--runs", "5"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(2_500));
    Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    let started = std::time::Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(started.elapsed() < Duration::from_secs(15), "no prompt stop");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("| 100 |"), "the partial run is reported:\n{stdout}");
    assert!(!stdout.contains("| 200 |"), "no rate after the stop:\n{stdout}");
    assert!(stdout.contains("stopped early"), "{stdout}");
}

/// `bench decision` hands Checks straight to the Authorization service and times each; on a
/// leasing policy the holds are leased (committed at once), so the slices keep serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decision_benchmark_times_every_call_in_process() {
    use tollgate::admission::Admission;
    use tollgate::config::Policy;
    use tollgate::store::Protocol;
    use tollgate::store::embedded::EmbeddedStore;
    let policy = Policy::parse(
        "decision.yaml",
        "leasing: { window_ms: 250 }\nmodels:\n  m: { max_output_tokens: 4096, bytes_per_token: 4 }\n\
         default_tenant:\n  limits: { tokens_per_minute: 1000000000, burst_tokens: 1000000000 }\n",
    )
    .unwrap();
    let admission =
        Arc::new(Admission::new(Arc::new(policy), Protocol::new(EmbeddedStore::new().unwrap()).await.unwrap()));
    let tenants = vec!["a".to_string(), "b".to_string()];
    let t = tollgate::tools::bench::decision::run(admission.clone(), &tenants, "m", 100, 1_000).await;
    assert_eq!((t.calls, t.admitted), (1_000, 1_000), "{t}");
    assert!(t.p50 <= t.p99 && t.p99 <= t.p999 && t.p999 <= t.max, "{t}");
    assert_eq!(admission.leased_holds("a").0, 0, "every hold was committed");
    assert!(admission.leased_holds("a").1 > 0, "and they were leased holds");
}

/// The overload matrix runs through real Envoy against the fleet it starts, and reports every
/// cell it ran: one load and the weighted cell, one round of three seconds each (the figures
/// themselves are the benchmark's, scripts/bench-overload).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overload_matrix_drives_envoy_and_the_fleet_it_starts() {
    use tollgate::tools::bench::overload::{self, OverloadOptions};
    let policy =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/overload-policy.yaml")).unwrap();
    let t = Tollgate::start(&policy);
    let sim_port = support::procs::free_port();
    let envoy = support::procs::Envoy::start(t.addr, sim_port);
    let options = OverloadOptions {
        envoy: format!("http://127.0.0.1:{}", envoy.port),
        tollgate: t.endpoint(),
        pool: "gpu".into(),
        sim_listen: format!("127.0.0.1:{sim_port}").parse().unwrap(),
        slots: 4,
        prefill_tokens_per_second: 5000.0,
        decode_tokens_per_second: 100.0,
        median: 120.0,
        sigma: 0.8,
        loads: vec![2.0],
        seconds: 3,
        rounds: 1,
        calibrate: 0,
        retries: 2,
    };
    let report = overload::run(&options).await.unwrap();
    assert!((2.0..4.0).contains(&report.capacity_rps), "{report}");
    assert_eq!((report.cells.len(), report.cells[0].1.len(), report.weighted.len()), (1, 1, 1), "{report}");
    let cell = report.cells[0].1[0];
    assert!(cell.sent >= 10, "{report}");
    assert!(cell.utilisation > 0.0 && cell.utilisation <= 1.0, "{report}");
    // A cold fleet (no output length learned yet) holds every request at its ceiling, and a short
    // cell may refuse every interactive request `deadline`; the figures are shares all the same.
    assert!((0.0..=1.0).contains(&cell.interactive_admitted) && (0.0..=1.0).contains(&cell.deadline_hits), "{report}");
    assert!((0.0..=1.0).contains(&cell.wasted) && (0.0..=1.0).contains(&cell.jain), "{report}");
    assert!(report.to_string().contains("| 2x |"), "{report}");
    // At twice the capacity some are refused and follow their hints: the shares of them admitted
    // at the first retry and later are shares, and the table says so.
    assert!(cell.retried > 0, "{report}");
    assert!((0.0..=1.0).contains(&(cell.first_retry + cell.later)), "{report}");
    assert!(report.to_string().contains("admitted at the first retry"), "{report}");
    assert!(report.to_string().contains("at most (with the admissions each class got)"), "{report}");
}
