//! Live policy: a running tollgate picks up a changed policy file (polled, including the symlink
//! swap a Kubernetes ConfigMap volume makes, or at once on SIGHUP) without a failed or
//! inconsistent decision; holds taken under the old policy settle under their own terms; a broken
//! file is refused and the policy in force stays; the version in force is in the metrics.

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use support::procs::{TempDir, Tollgate, free_port, http_get, tollgate_cmd};
use tollgate::config::version_of;
use tollgate::proto::admission_client::AdmissionClient;
use tollgate::proto::{CommitRequest, ReserveRequest, ReserveResponse};

/// A policy: model `m`'s output ceiling, tenant acme's lease, and extra server lines.
fn policy(admin: SocketAddr, ceiling: u64, lease_ms: u64, server: &str) -> String {
    format!(
        "server:\n  admin_listen: {admin}\n{server}models:\n  m: {{ max_output_tokens: {ceiling} }}\n\
         tenants:\n  acme:\n    lease_ttl_ms: {lease_ms}\n    limits: {{ tokens_per_minute: 60000000 }}\n"
    )
}

/// A directory laid out as Kubernetes lays out a ConfigMap volume: `policy.yaml` is a symlink to
/// `..data/policy.yaml`, `..data` a symlink to the current version's directory, swapped atomically.
struct ConfigMap {
    dir: TempDir,
    versions: u32,
}

impl ConfigMap {
    fn new(text: &str) -> ConfigMap {
        let mut map = ConfigMap { dir: TempDir::new("configmap"), versions: 0 };
        map.publish(text);
        std::os::unix::fs::symlink("..data/policy.yaml", map.dir.0.join("policy.yaml")).unwrap();
        map
    }

    fn path(&self) -> PathBuf {
        self.dir.0.join("policy.yaml")
    }

    /// Writes a new version and points `..data` at it, as the kubelet does.
    fn publish(&mut self, text: &str) {
        self.versions += 1;
        let version = format!("..v{}", self.versions);
        std::fs::create_dir(self.dir.0.join(&version)).unwrap();
        std::fs::write(self.dir.0.join(&version).join("policy.yaml"), text).unwrap();
        let tmp = self.dir.0.join("..data_tmp");
        std::os::unix::fs::symlink(&version, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.0.join("..data")).unwrap();
    }
}

/// Replaces a plain file's contents atomically (write beside, rename over).
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn scrape(admin: SocketAddr) -> String {
    http_get(admin, "/metrics").1
}

fn ask(max_tokens: u64) -> ReserveRequest {
    ReserveRequest { tenant: "acme".into(), model: "m".into(), prompt_tokens: 1, max_tokens, ..Default::default() }
}

/// Waits (at most 10 s) until `line` is in the log.
fn wait_for_log(t: &Tollgate, line: &str) {
    let start = Instant::now();
    while !t.log().contains(line) {
        assert!(start.elapsed() < Duration::from_secs(10), "never logged {line:?}:\n{}", t.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[derive(Debug)]
struct Seen {
    at: Duration,
    answered: Duration,
    answer: Result<ReserveResponse, tonic::Code>,
}

/// Reserves of 150 output tokens (beyond the old ceiling of 100, within the new 200), committed
/// when admitted, until `stop` (at most 3,000).
async fn load(endpoint: String, start: Instant, stop: Duration) -> Vec<Seen> {
    let mut client = AdmissionClient::connect(endpoint).await.unwrap();
    let mut seen = Vec::new();
    for _ in 0..3_000 {
        if start.elapsed() >= stop {
            break;
        }
        let at = start.elapsed();
        let answer = client.reserve(ask(150)).await.map(tonic::Response::into_inner).map_err(|s| s.code());
        let answered = start.elapsed();
        if let Ok(r) = &answer
            && r.admitted
        {
            let commit = CommitRequest {
                reservation_id: r.reservation_id.clone(),
                prompt_tokens: 1,
                completion_tokens: 1,
                ..Default::default()
            };
            client.commit(commit).await.unwrap();
        }
        seen.push(Seen { at, answered, answer });
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_swap_applies_under_load_without_an_inconsistent_decision() {
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let poll = "  policy_poll_ms: 200\n";
    let (v1, v2) = (policy(admin, 100, 300, poll), policy(admin, 200, 60_000, poll));
    let mut map = ConfigMap::new(&v1);
    let t = Tollgate::start_in(TempDir::new("tollgate"), &map.path(), &[]);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    // A hold taken under the old policy: its lease is 300 ms.
    let old = client.reserve(ask(10)).await.unwrap().into_inner();
    assert!(old.admitted, "{old:?}");

    let start = Instant::now();
    let stop = Duration::from_secs(3);
    let loads: Vec<_> = (0..2).map(|_| tokio::spawn(load(t.endpoint(), start, stop))).collect();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let swapped = start.elapsed();
    map.publish(&v2);
    let mut seen = Vec::new();
    for l in loads {
        seen.extend(l.await.unwrap());
    }
    seen.sort_by_key(|s| s.at);

    // Every call answered with a decision: the old policy's refusal or the new one's admission,
    // never the old after the new was seen, and the new within a second of the swap.
    let first_new = seen
        .iter()
        .find(|s| s.answer.as_ref().is_ok_and(|r| r.admitted))
        .unwrap_or_else(|| panic!("the new policy never applied\n{}", t.log()));
    eprintln!(
        "{} decisions in {stop:?}; swapped at {swapped:?}; the first under the new policy answered at {:?}",
        seen.len(),
        first_new.answered
    );
    assert!(first_new.answered > swapped, "admitted before the swap: {first_new:?}");
    assert!(first_new.answered < swapped + Duration::from_secs(1), "applied late: {first_new:?}\n{}", t.log());
    for s in &seen {
        let r = s.answer.as_ref().unwrap_or_else(|code| panic!("a failed decision: {code:?} {s:?}"));
        assert!(r.admitted || r.reason == "invalid_request", "{s:?}");
        if s.at > first_new.answered {
            assert!(r.admitted, "the old policy after the new one was in force: {s:?}");
        }
    }
    assert!(seen.iter().filter(|s| s.at < swapped).count() > 20, "the load ran before the swap");

    // Holds settle under their own terms: the old one's 300 ms lease has passed (the new policy's
    // 60 s does not extend it), a new one's has not.
    let new = client.reserve(ask(10)).await.unwrap().into_inner();
    tokio::time::sleep(Duration::from_millis(400)).await;
    for (hold, state) in [(old, "late_committed"), (new, "committed")] {
        let commit = CommitRequest {
            reservation_id: hold.reservation_id,
            prompt_tokens: 1,
            completion_tokens: 1,
            ..Default::default()
        };
        assert_eq!(client.commit(commit).await.unwrap().into_inner().state, state);
    }

    let metrics = scrape(admin);
    assert!(metrics.contains(&format!("tollgate_policy_info{{version=\"{}\"}} 1", version_of(&v2))), "{metrics}");
    assert!(metrics.contains("tollgate_policy_reloads_total{result=\"ok\"} 1"), "{metrics}");
    let check = tollgate_cmd(&["check-config", map.path().to_str().unwrap()], Duration::from_secs(10));
    assert!(String::from_utf8_lossy(&check.stdout).contains(&version_of(&v2)), "{check:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_policy_is_refused_and_the_one_in_force_stays() {
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let poll = "  policy_poll_ms: 100\n";
    let dir = TempDir::new("tollgate");
    let path = dir.write("policy.yaml", &policy(admin, 100, 60_000, poll));
    let t = Tollgate::start_in(dir, &path.clone(), &[]);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();

    replace(&path, &policy(admin, 0, 60_000, poll));
    wait_for_log(&t, "policy reload refused");
    assert!(t.log().contains("models.m.max_output_tokens"), "the reason names the field:\n{}", t.log());
    // Still the old policy: 150 is beyond its ceiling, 10 within it.
    assert_eq!(client.reserve(ask(150)).await.unwrap().into_inner().reason, "invalid_request");
    assert!(client.reserve(ask(10)).await.unwrap().into_inner().admitted);
    assert!(scrape(admin).contains("tollgate_policy_reloads_total{result=\"error\"} 1"));

    // Mended: in force at the next look.
    replace(&path, &policy(admin, 200, 60_000, poll));
    wait_for_log(&t, "policy reloaded");
    assert!(client.reserve(ask(150)).await.unwrap().into_inner().admitted, "{}", t.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_at_once_and_restart_only_settings_wait() {
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let dir = TempDir::new("tollgate");
    let path = dir.write("policy.yaml", &policy(admin, 100, 60_000, "  policy_poll_ms: 0\n"));
    let t = Tollgate::start_in(dir, &path.clone(), &[]);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();

    // Polling off: a changed file waits for SIGHUP. The new one also moves the drain timeout,
    // which a running tollgate keeps until a restart.
    replace(&path, &policy(admin, 200, 60_000, "  policy_poll_ms: 0\n  drain_timeout_ms: 1000\n"));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(client.reserve(ask(150)).await.unwrap().into_inner().reason, "invalid_request", "reloaded unasked");
    let hup = std::process::Command::new("kill").args(["-HUP", &t.child.id().to_string()]).status().unwrap();
    assert!(hup.success());
    wait_for_log(&t, "policy reloaded");
    assert!(client.reserve(ask(150)).await.unwrap().into_inner().admitted, "{}", t.log());
    assert!(t.log().contains("apply on restart only") && t.log().contains("\"server\""), "{}", t.log());
}

/// A leasing replica follows a tightened limit at once: the slices it drew under the old limit
/// (a tenth of a million tokens) are not spent under the new one (500 tokens): the next decision
/// after the reload draws again, and what it holds beyond the new share goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leasing_replica_follows_a_tightened_limit() {
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let leased = |burst: u64| {
        format!(
            "server:\n  admin_listen: {admin}\n  policy_poll_ms: 100\nleasing: {{ window_ms: 250, max_share: 0.1 }}\n\
             models:\n  m: {{ max_output_tokens: 100 }}\n\
             tenants:\n  acme:\n    limits: {{ tokens_per_minute: 60, burst_tokens: {burst} }}\n"
        )
    };
    let dir = TempDir::new("tollgate");
    let path = dir.write("policy.yaml", &leased(1_000_000));
    let t = Tollgate::start_in(dir, &path.clone(), &[]);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    let hold = |client: &mut AdmissionClient<tonic::transport::Channel>| {
        let mut client = client.clone();
        async move { client.reserve(ask(49)).await.unwrap().into_inner() }
    };
    // Stocked: a few decisions under the loose limit, from leased slices.
    for _ in 0..5 {
        let r = hold(&mut client).await;
        assert!(r.admitted, "{r:?}");
        let c = CommitRequest {
            reservation_id: r.reservation_id,
            prompt_tokens: 1,
            completion_tokens: 49,
            ..Default::default()
        };
        client.commit(c).await.unwrap();
    }

    replace(&path, &leased(500));
    wait_for_log(&t, "policy reloaded");
    // Each hold is 50 tokens: the new limit admits at most 500 tokens' worth (plus a token a
    // second of refill), however much the replica had drawn before.
    let mut admitted = 0;
    for _ in 0..40 {
        if hold(&mut client).await.admitted {
            admitted += 1;
        }
    }
    assert!(admitted <= 11, "{admitted} holds of 50 admitted under a 500-token limit\n{}", t.log());
    assert!(admitted > 0, "the tightened limit still admits its 500 tokens");
}
