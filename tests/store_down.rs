//! When Redis goes away under a running tollgate, admission fails closed with 503
//! `store_unavailable` and a Retry-After (or admits unmetered, for a fail_open tenant), stops
//! waiting on it once it keeps failing, and comes back when Redis does.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::procs::{OwnRedis, Tollgate, free_port};
use tollgate::proto::admission_client::AdmissionClient;
use tollgate::proto::{CommitRequest, ReserveRequest};

fn reserve() -> ReserveRequest {
    ReserveRequest { tenant: "acme".into(), model: "m".into(), prompt_tokens: 1, max_tokens: 1, ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_redis_fails_closed_with_503_and_recovers() {
    let port = free_port();
    let redis = OwnRedis::start(port);
    let policy = format!(
        "store:\n  redis_url: redis://127.0.0.1:{}\n  command_timeout_ms: 200\nmodels:\n  m: {{ max_output_tokens: 10 }}\ntenants:\n  acme: {{ on_store_error: fail_closed }}\n  open: {{ on_store_error: fail_open }}\n",
        redis.port
    );
    let t = Tollgate::start_with(&policy, &["--log-format", "json", "--log", "info,decision=debug"]);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    assert!(client.reserve(reserve()).await.unwrap().into_inner().admitted);

    drop(redis);
    let down = client.reserve(reserve()).await.unwrap().into_inner();
    assert!(!down.admitted);
    assert_eq!(
        (down.reason.as_str(), down.http_status, down.retry_after_ms),
        ("store_unavailable", 503, 1000),
        "{down:?}"
    );
    let open = client.reserve(ReserveRequest { tenant: "open".into(), ..reserve() }).await.unwrap().into_inner();
    assert!(open.admitted && open.unmetered, "a fail_open tenant is admitted unmetered: {open:?}");
    assert_eq!(open.reservation_id, "", "with nothing to commit");
    // Each decision's log line says which store-down mode made it.
    let decided = |tenant: &str, mode: &str, outcome: &str| {
        t.log().lines().any(|l| {
            let line: serde_json::Value = serde_json::from_str(l).unwrap();
            line["target"] == "decision"
                && line["tenant"] == tenant
                && line["store_mode"] == mode
                && line["outcome"] == outcome
        })
    };
    assert!(decided("acme", "store", "admitted"), "{}", t.log());
    assert!(decided("acme", "fail_closed", "denied"), "{}", t.log());
    assert!(decided("open", "fail_open", "unmetered"), "{}", t.log());

    let _back = OwnRedis::start(port);
    admitted_again(&mut client, &t, Duration::from_secs(15), Duration::from_millis(100)).await;
}

/// Reserves until one is admitted (within `limit`, every `every`), and says how long it took.
async fn admitted_again(
    client: &mut AdmissionClient<tonic::transport::Channel>,
    t: &Tollgate,
    limit: Duration,
    every: Duration,
) -> Duration {
    let start = Instant::now();
    loop {
        let r = client.reserve(reserve()).await.unwrap().into_inner();
        if r.admitted {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "no recovery after Redis came back: {r:?}\n{}", t.log());
        tokio::time::sleep(every).await;
    }
}

/// A dead Redis is not waited on: once a few calls have failed (each within the command timeout),
/// the circuit breaker answers every decision at once, by the tenant's mode, without calling Redis;
/// when Redis is back, a probe finds it and decisions resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_is_not_waited_on_and_is_found_again() {
    let port = free_port();
    let redis = OwnRedis::start(port);
    // A long command timeout, so a call that waited on Redis cannot pass for one that did not.
    let policy = format!(
        "store:\n  redis_url: redis://127.0.0.1:{}\n  command_timeout_ms: 3000\n  breaker: {{ failures: 2, open_ms: 1500, max_open_ms: 1500 }}\n\
         models:\n  m: {{ max_output_tokens: 10 }}\ntenants:\n  acme: {{ on_store_error: fail_closed }}\n  open: {{ on_store_error: fail_open }}\n",
        redis.port
    );
    let t = Tollgate::start(&policy);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    assert!(client.reserve(reserve()).await.unwrap().into_inner().admitted);

    drop(redis);
    for _ in 0..2 {
        let started = Instant::now();
        let r = client.reserve(reserve()).await.unwrap().into_inner();
        assert_eq!(r.reason, "store_unavailable", "{r:?}");
        assert!(started.elapsed() < Duration::from_secs(5), "bounded by the command timeout: {:?}", started.elapsed());
    }
    // The breaker is open for 1.5 s: 20 decisions of both modes, none of which waits on Redis (one
    // that did would take the 3 s command timeout).
    let started = Instant::now();
    for i in 0..20 {
        let tenant = if i % 2 == 0 { "acme" } else { "open" };
        let r = client.reserve(ReserveRequest { tenant: tenant.into(), ..reserve() }).await.unwrap().into_inner();
        match tenant {
            "acme" => assert_eq!((r.admitted, r.reason.as_str(), r.http_status), (false, "store_unavailable", 503)),
            _ => assert!(r.admitted && r.unmetered, "fail_open admits unmetered: {r:?}"),
        }
    }
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "20 decisions took {:?}: one of them waited on the dead Redis\n{}",
        started.elapsed(),
        t.log()
    );
    assert!(t.log().contains("circuit open"), "the breaker says it opened:\n{}", t.log());

    let _back = OwnRedis::start(port);
    // The next probe (at most max_open_ms, 1.5 s, away) after a reconnect (at most 0.5 s apart),
    // with room for a slow machine.
    let resumed = admitted_again(&mut client, &t, Duration::from_secs(4), Duration::from_millis(20)).await;
    eprintln!("decisions resumed {resumed:?} after Redis accepted connections");
}

/// A dead Redis (connections refused) costs no decision its command timeout, even with a breaker
/// that never opens: while the client has no connection, or is making one again, every call fails
/// at once instead of queueing for the reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_costs_no_decision_its_command_timeout() {
    let port = free_port();
    let redis = OwnRedis::start(port);
    let policy = format!(
        "store:\n  redis_url: redis://127.0.0.1:{}\n  command_timeout_ms: 3000\n  breaker: {{ failures: 1000 }}\n\
         models:\n  m: {{ max_output_tokens: 10 }}\ntenants:\n  acme: {{ on_store_error: fail_closed }}\n",
        redis.port
    );
    let t = Tollgate::start(&policy);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    assert!(client.reserve(reserve()).await.unwrap().into_inner().admitted);

    drop(redis);
    for i in 0..12 {
        let started = Instant::now();
        let r = client.reserve(reserve()).await.unwrap().into_inner();
        let took = started.elapsed();
        assert_eq!((r.admitted, r.reason.as_str()), (false, "store_unavailable"), "{r:?}");
        // One that queued for the reconnect would take the 3 s command timeout.
        assert!(took < Duration::from_millis(1000), "decision {i} waited {took:?} on a dead Redis\n{}", t.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A stalled Redis (accepting, not answering: `DEBUG SLEEP`) costs at most the breaker's first
/// failures their command timeout: once it opens, its probes are its own, so no decision asked
/// while it probes a store that still hangs waits on one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_redis_costs_only_the_first_decisions_their_timeout() {
    let redis = OwnRedis::start_with(free_port(), &["--enable-debug-command", "yes"]);
    let policy = format!(
        "store:\n  redis_url: redis://127.0.0.1:{}\n  command_timeout_ms: 300\n  breaker: {{ failures: 3, open_ms: 100, max_open_ms: 200 }}\n\
         models:\n  m: {{ max_output_tokens: 10 }}\ntenants:\n  acme: {{ on_store_error: fail_closed }}\n",
        redis.port
    );
    let t = Tollgate::start(&policy);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    assert!(client.reserve(reserve()).await.unwrap().into_inner().admitted);

    let mut stall = std::net::TcpStream::connect(("127.0.0.1", redis.port)).unwrap();
    let stalled = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        stall.write_all(b"DEBUG SLEEP 3\r\n").unwrap();
        let mut reply = [0u8; 5];
        stall.read_exact(&mut reply).unwrap();
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Decisions one after another for 2.4 s of the 3 s stall: the breaker probes about ten times.
    let start = Instant::now();
    let mut slow = Vec::new();
    let mut decisions = 0;
    while start.elapsed() < Duration::from_millis(2400) && decisions < 500 {
        let asked = Instant::now();
        let r = client.reserve(reserve()).await.unwrap().into_inner();
        assert_eq!(r.reason, "store_unavailable", "Redis is stalled: {r:?}");
        if asked.elapsed() >= Duration::from_millis(250) {
            slow.push(asked.duration_since(start));
        }
        decisions += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        slow.len() <= 3,
        "{} of {decisions} decisions waited out the command timeout (at {slow:?}): a probe was a decision\n{}",
        slow.len(),
        t.log()
    );
    stalled.await.unwrap();
    admitted_again(&mut client, &t, Duration::from_secs(4), Duration::from_millis(20)).await;
}

/// One decision of the load below: when it was asked (since the start), how long it took, its answer.
#[derive(Debug)]
struct Seen {
    at: Duration,
    took: Duration,
    tenant: &'static str,
    answer: Result<tollgate::proto::ReserveResponse, tonic::Code>,
}

/// Reserve-and-commit cycles of one tenant, about 150 a second, for `length` (at most 2,000).
async fn load(endpoint: String, tenant: &'static str, start: Instant, length: Duration) -> Vec<Seen> {
    let mut client = AdmissionClient::connect(endpoint).await.unwrap();
    let mut seen = Vec::new();
    for _ in 0..2_000 {
        if start.elapsed() >= length {
            break;
        }
        let asked = Instant::now();
        let answer = client
            .reserve(ReserveRequest { tenant: tenant.into(), ..reserve() })
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| s.code());
        let took = asked.elapsed();
        if let Ok(r) = &answer
            && r.admitted
            && !r.unmetered
        {
            // Committed at once; UNAVAILABLE when Redis is gone in between, which a caller retries.
            let commit = CommitRequest {
                reservation_id: r.reservation_id.clone(),
                prompt_tokens: 1,
                completion_tokens: 1,
                ..Default::default()
            };
            if let Err(status) = client.commit(commit).await {
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
            }
        }
        seen.push(Seen { at: asked.duration_since(start), took, tenant, answer });
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    seen
}

/// The load tests' policy: acme fails closed, open fails open.
fn both_modes_policy(redis_port: u16) -> String {
    format!(
        "store:\n  redis_url: redis://127.0.0.1:{redis_port}\nmodels:\n  m: {{ max_output_tokens: 10 }}\n\
         tenants:\n  acme: {{ on_store_error: fail_closed }}\n  open: {{ on_store_error: fail_open }}\n"
    )
}

type Load = tokio::task::JoinHandle<Vec<Seen>>;

/// The load of both tenants, from `start` for `length`.
fn both_modes(t: &Tollgate, start: Instant, length: Duration) -> (Load, Load) {
    (tokio::spawn(load(t.endpoint(), "acme", start, length)), tokio::spawn(load(t.endpoint(), "open", start, length)))
}

/// Redis killed and restarted under load, with the shipped timeout and breaker: every decision is
/// answered well within Envoy's 0.5 s, by its tenant's mode while Redis is gone, and decisions are
/// back to normal within a second of Redis answering again (its script cache empty: the first call
/// reloads on NOSCRIPT, and no decision fails for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_under_load() {
    let port = free_port();
    let redis = OwnRedis::start(port);
    let policy = both_modes_policy(redis.port);
    let t = Tollgate::start(&policy);
    let start = Instant::now();
    let (closed, open) = both_modes(&t, start, Duration::from_secs(6));

    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Taken before the kill: a decision answered before it surely saw Redis up (one that fails
    // fast while the kill is under way is already Redis gone).
    let killed = start.elapsed();
    drop(redis);
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let _back = OwnRedis::start(port);
    let back = start.elapsed();

    let mut seen = closed.await.unwrap();
    seen.extend(open.await.unwrap());
    judge(seen, killed, back, &t.log());
}

/// Redis stalled (a `DEBUG SLEEP` of 1.5 s, as a blocked script would) under the same load: its
/// calls time out, the breaker opens and every decision is answered by its tenant's mode without
/// waiting; once Redis answers again, a probe closes the breaker and decisions are back to normal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stalled_under_load() {
    let redis = OwnRedis::start_with(free_port(), &["--enable-debug-command", "yes"]);
    let policy = both_modes_policy(redis.port);
    let t = Tollgate::start(&policy);
    let start = Instant::now();
    let (closed, open) = both_modes(&t, start, Duration::from_secs(5));

    // On a connection opened beforehand: Redis stalls the moment the command arrives, so every
    // call asked after it is written waits behind it.
    let mut stall = std::net::TcpStream::connect(("127.0.0.1", redis.port)).unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stalled = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        stall.write_all(b"DEBUG SLEEP 1.5\r\n").unwrap();
        let stalled = start.elapsed();
        let mut reply = [0u8; 5];
        stall.read_exact(&mut reply).unwrap();
        assert_eq!(&reply, b"+OK\r\n");
        stalled
    })
    .await
    .unwrap();
    let back = start.elapsed();

    let mut seen = closed.await.unwrap();
    seen.extend(open.await.unwrap());
    assert!(t.log().contains("circuit open"), "the breaker opened:\n{}", t.log());
    judge(seen, stalled, back, &t.log());
}

/// The load's decisions around an outage from `down` to `back` (since the load's start): each
/// answered before Envoy would give up, by its tenant's mode; metered before the outage; back to
/// normal within 1.5 s of Redis answering, and none failing after that.
fn judge(mut seen: Vec<Seen>, down: Duration, back: Duration, log: &str) {
    seen.sort_by_key(|s| s.at);
    let slowest = seen.iter().map(|s| s.took).max().unwrap();
    eprintln!("{} decisions; the slowest took {slowest:?}", seen.len());
    for s in &seen {
        assert!(s.took < Duration::from_millis(450), "answered after Envoy would have given up: {s:?}\n{log}");
        let r = s.answer.as_ref().unwrap_or_else(|code| panic!("a gRPC error, not a decision: {code:?} {s:?}"));
        assert!(r.admitted || (s.tenant == "acme" && r.reason == "store_unavailable"), "{s:?}");
        if s.tenant == "open" {
            assert!(r.admitted, "fail_open admits, metered or not: {s:?}");
        }
        if s.at + s.took < down {
            assert!(r.admitted && !r.unmetered, "Redis was up: {s:?}");
        }
    }
    // Back to normal: the first metered admission after Redis answers again, and none refused after.
    let first = seen
        .iter()
        .find(|s| s.at > back && s.answer.as_ref().is_ok_and(|r| r.admitted && !r.unmetered))
        .unwrap_or_else(|| panic!("never back to normal\n{log}"));
    let resumed = first.at + first.took - back;
    eprintln!("decisions back to normal {resumed:?} after Redis answered again");
    assert!(resumed < Duration::from_millis(1500), "resumed {resumed:?} after Redis came back\n{log}");
    // Asked after that answer (a call made while the probe was out is still refused at once).
    for s in seen.iter().filter(|s| s.at > first.at + first.took) {
        assert!(s.answer.as_ref().is_ok_and(|r| r.admitted && !r.unmetered), "failed after recovery: {s:?}");
    }
    // Answered while Redis was surely gone (its return and this test's noticing it may be 100 ms apart).
    let during = seen.iter().filter(|s| s.at > down && s.at + s.took + Duration::from_millis(100) < back);
    assert!(during.clone().any(|s| s.tenant == "acme"), "the load ran while Redis was gone");
    assert!(
        during.filter(|s| s.tenant == "open").all(|s| s.answer.as_ref().is_ok_and(|r| r.unmetered)),
        "while Redis was gone, fail_open admits unmetered"
    );
}

/// `on_store_error: local` (the default): two replicas count themselves through Redis; with Redis
/// gone, each admits its share of the tenant's burst (1,000 tokens × 0.8 ÷ 2 = 400: four holds of
/// 100), then refuses with `token_rate` and a Retry-After from its share of the refill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_gone_each_replica_admits_its_local_share() {
    let redis = OwnRedis::start(free_port());
    let policy = format!(
        "store:\n  redis_url: redis://127.0.0.1:{}\nmodels:\n  m: {{ max_output_tokens: 10 }}\n\
         tenants:\n  acme:\n    limits: {{ tokens_per_minute: 600, burst_tokens: 1000 }}\n",
        redis.port
    );
    let replicas = [Tollgate::start(&policy), Tollgate::start(&policy)];
    let hold = ReserveRequest { prompt_tokens: 90, max_tokens: 10, ..reserve() };
    // Both heartbeats are in (one a second): a reserve and release each, while Redis is up.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut clients = Vec::new();
    for t in &replicas {
        let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
        let r = client.reserve(hold.clone()).await.unwrap().into_inner();
        assert!(r.admitted && !r.unmetered, "{r:?}");
        client.release(tollgate::proto::ReleaseRequest { reservation_id: r.reservation_id }).await.unwrap();
        clients.push(client);
    }
    drop(redis);
    for (client, t) in clients.iter_mut().zip(&replicas) {
        let mut admitted = 0;
        for _ in 0..4 {
            let r = client.reserve(hold.clone()).await.unwrap().into_inner();
            assert!(r.admitted && r.unmetered, "within the local share: {r:?}\n{}", t.log());
            admitted += 1;
        }
        let r = client.reserve(hold.clone()).await.unwrap().into_inner();
        assert_eq!((r.admitted, r.reason.as_str(), r.http_status), (false, "token_rate", 429), "{r:?}");
        // The share refills at 600 × 0.8 ÷ 2 = 240 tokens a minute: 100 tokens in 25 s at most.
        assert!(r.retry_after_ms > 0 && r.retry_after_ms <= 25_000, "{r:?}");
        assert!(r.message.contains("while the store is unreachable"), "{r:?}");
        assert_eq!(admitted, 4);
    }
}

/// A partial partition: of two replicas, one reaches Redis and one does not (its proxy stops
/// forwarding). The one cut off admits its local share (1,000 × 0.8 ÷ 2 = 400: four holds of 100),
/// the other all the store has (the whole burst: ten), so together they admit `limit × (1 +
/// local_factor × cut-off ÷ replicas)` = 1,400 tokens, the bound docs/failure-modes.md states, and
/// no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_partition_admits_the_limit_and_the_cut_off_replicas_shares() {
    let redis = OwnRedis::start(free_port());
    let proxy = support::proxy::FaultProxy::start(([127, 0, 0, 1], redis.port).into(), 1).await;
    let policy = |url: &str| {
        format!(
            "store:\n  redis_url: {url}\nmodels:\n  m: {{ max_output_tokens: 10 }}\n\
             tenants:\n  acme:\n    limits: {{ tokens_per_minute: 60, burst_tokens: 1000 }}\n"
        )
    };
    let reaching = Tollgate::start(&policy(&format!("redis://127.0.0.1:{}", redis.port)));
    let cut_off = Tollgate::start(&policy(&proxy.url()));
    let hold = ReserveRequest { prompt_tokens: 90, max_tokens: 10, ..reserve() };
    // Both heartbeats are in (one a second, the second of each counting two), with room to spare
    // on a busy machine.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let mut clients = Vec::new();
    for t in [&reaching, &cut_off] {
        let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
        let r = client.reserve(hold.clone()).await.unwrap().into_inner();
        assert!(r.admitted && !r.unmetered, "{r:?}");
        client.release(tollgate::proto::ReleaseRequest { reservation_id: r.reservation_id }).await.unwrap();
        clients.push(client);
    }
    proxy.pause(true);
    let mut admitted = [0, 0];
    for (i, client) in clients.iter_mut().enumerate() {
        for _ in 0..20 {
            let r = client.reserve(hold.clone()).await.unwrap().into_inner();
            if !r.admitted {
                assert_eq!(r.reason, "token_rate", "{r:?}");
                break;
            }
            assert_eq!(r.unmetered, i == 1, "decided by the store only where it is reached: {r:?}");
            admitted[i] += 100;
        }
    }
    assert_eq!(admitted, [1_000, 400], "the store's whole burst, and the cut-off replica's share\n{}", cut_off.log());
    proxy.pause(false);
}

/// A scope limited only by a daily budget gets a local share of what the store last said it had
/// left: 1,000 tokens a day, 600 used, so 400 × 0.8 = 320 tokens for the one replica while Redis
/// is gone (three holds of 100), then `budget` until midnight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_gone_a_budget_gets_a_share_of_what_remains() {
    let redis = OwnRedis::start(free_port());
    let policy = format!(
        "store:\n  redis_url: redis://127.0.0.1:{}\nmodels:\n  m: {{ max_output_tokens: 10 }}\n\
         tenants:\n  acme:\n    limits: {{ tokens_per_day: 1000 }}\n",
        redis.port
    );
    let t = Tollgate::start(&policy);
    let hold = ReserveRequest { prompt_tokens: 90, max_tokens: 10, ..reserve() };
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    for _ in 0..6 {
        let r = client.reserve(hold.clone()).await.unwrap().into_inner();
        assert!(r.admitted && !r.unmetered, "{r:?}");
        let c = CommitRequest {
            reservation_id: r.reservation_id,
            prompt_tokens: 90,
            completion_tokens: 10,
            ..Default::default()
        };
        client.commit(c).await.unwrap();
    }
    drop(redis);
    for i in 0..3 {
        let r = client.reserve(hold.clone()).await.unwrap().into_inner();
        assert!(r.admitted && r.unmetered, "hold {i}, within the local share of what remains: {r:?}\n{}", t.log());
    }
    let r = client.reserve(hold.clone()).await.unwrap().into_inner();
    assert_eq!((r.admitted, r.reason.as_str(), r.http_status), (false, "budget", 429), "{r:?}");
    assert!(r.retry_after_ms > 0 && r.retry_after_ms <= 86_400_000, "until midnight: {r:?}");
    assert!(r.message.contains("while the store is unreachable"), "{r:?}");
}

/// SIGTERM while a call is in flight: the call finishes (within drain_timeout_ms), then the
/// process exits cleanly. Redis is made to stall with DEBUG SLEEP so the call is surely in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_an_in_flight_call_finish() {
    let redis = OwnRedis::start_with(free_port(), &["--enable-debug-command", "yes"]);
    let policy = format!(
        "server:\n  drain_timeout_ms: 5000\nstore:\n  redis_url: redis://127.0.0.1:{}\n  command_timeout_ms: 3000\nmodels:\n  m: {{ max_output_tokens: 10 }}\ntenants:\n  acme: {{}}\n",
        redis.port
    );
    let mut t = Tollgate::start(&policy);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    assert!(client.reserve(reserve()).await.unwrap().into_inner().admitted);

    let stall = Command::new("redis-cli")
        .args(["-p", &redis.port.to_string(), "DEBUG", "SLEEP", "0.8"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let in_flight = tokio::spawn(async move { client.reserve(reserve()).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let status = t.terminate(Duration::from_secs(10)).expect("no exit within 10 s of SIGTERM");
    let reply = in_flight.await.unwrap().expect("the in-flight call was cut off").into_inner();
    assert!(reply.admitted, "{reply:?}");
    assert!(status.success(), "{status}\n{}", t.log());
    assert!(started.elapsed() >= Duration::from_millis(300), "exited before the stalled call could finish");
    let _ = stall.wait_with_output();
}
