//! The usage ledger read out: `tollgate ledger` on a Redis and a Redis Cluster (every tenant's
//! stream, through a consumer group, at least once), and the embedded store's ledger file written
//! by a `tollgate serve` that commits from the responses Envoy passes it.
//! (What each settlement enters is checked on every store in tests/conformance.rs, and that the
//! entries charge what the counters charged in tests/protocol_model.rs.)

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::procs::{Envoy, TempDir, Tollgate, tollgate_cmd};
use support::upstream::post;
use support::{Backend, Harness, admitted};
use tollgate::store::redis::RedisStore;
use tollgate::store::{Reply, Script, Store, keys};

const LEDGER: &str = "ledger:\n  retention_ms: 600000\n---top---\nlimits: { tokens_per_minute: 60000 }\n";

async fn harness(backend: Backend) -> Harness<RedisStore> {
    match backend {
        Backend::Cluster => support::cluster(LEDGER).await,
        _ => support::redis(LEDGER).await,
    }
}

/// The store arguments `tollgate ledger` takes for this backend.
fn store_args(backend: Backend) -> Vec<String> {
    match backend {
        Backend::Cluster => vec!["--redis-cluster".into(), support::redis_cluster_nodes().join(",")],
        _ => vec!["--redis-url".into(), support::redis_url()],
    }
}

/// Runs `tollgate ledger --once` and returns the lines it wrote for `tenants`.
fn read_once(backend: Backend, extra: &[&str], tenants: &[&str]) -> Vec<Value> {
    let mut args: Vec<String> = vec!["ledger".into(), "--once".into()];
    args.extend(store_args(backend));
    args.extend(extra.iter().map(|s| (*s).to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = tollgate_cmd(&args, Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "tollgate ledger failed: {stderr}");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{l:?} is not JSON: {e}")))
        .filter(|v| tenants.iter().any(|t| v["tenant"] == *t))
        .collect()
}

fn unique_group() -> String {
    support::unique_tenant("group")
}

/// Settles three holds of two tenants (a commit, a release, a commit): the ids in order.
async fn settle_some(a: &Harness<RedisStore>, b: &Harness<RedisStore>) -> Vec<String> {
    let x = admitted(&a.reserve(10, 90).await).reservation_id.clone();
    a.admission.commit(&x, 10, 20).await.unwrap();
    let y = admitted(&a.reserve(10, 90).await).reservation_id.clone();
    a.admission.release(&y).await.unwrap();
    let z = admitted(&b.reserve(5, 45).await).reservation_id.clone();
    b.admission.commit(&z, 5, 5).await.unwrap();
    vec![x, y, z]
}

async fn reads_every_tenants_stream_once(backend: Backend) {
    let (a, b) = (harness(backend).await, harness(backend).await);
    let ids = settle_some(&a, &b).await;
    let tenants = [a.tenant.as_str(), b.tenant.as_str()];
    let group = unique_group();
    let lines = read_once(backend, &["--group", &group, "--consumer", "c1"], &tenants);
    let by_id: BTreeMap<&str, &Value> = lines.iter().map(|v| (v["id"].as_str().unwrap(), v)).collect();
    assert_eq!(lines.len(), 3, "one line per settled hold: {lines:#?}");
    let x = by_id[ids[0].as_str()];
    assert_eq!((x["outcome"].as_str(), x["usage"].as_str()), (Some("committed"), Some("exact")), "{x}");
    assert_eq!(
        (x["prompt_tokens"].as_u64(), x["output_tokens"].as_u64(), x["charged_tokens"].as_u64()),
        (Some(10), Some(20), Some(30)),
        "{x}"
    );
    assert_eq!((x["cost_nanos"].as_u64(), x["reserved_cost_nanos"].as_u64()), (Some(70_000), Some(280_000)), "{x}");
    assert_eq!((x["tenant"].as_str(), x["model"].as_str(), x["user"].is_null()), (Some(tenants[0]), Some("m"), true));
    assert!(x["entry"].as_str().unwrap().contains('-'), "the stream entry id: {x}");
    assert_eq!(by_id[ids[1].as_str()]["outcome"], "released");
    assert_eq!(by_id[ids[2].as_str()]["tenant"], tenants[1]);
    // Acknowledged: the group is not given them again; another group gets them all.
    assert!(read_once(backend, &["--group", &group, "--consumer", "c2"], &tenants).is_empty());
    assert_eq!(read_once(backend, &["--group", &unique_group()], &tenants).len(), 3);
    // The stream lives as long as the retention from its last entry.
    let key = keys::ledger(&a.tenant);
    let pttl = a.inspect(vec![key.clone()]).await[&key].pttl;
    assert!((1..=600_000).contains(&pttl), "{pttl}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reader_writes_every_tenants_entries_once_on_redis() {
    reads_every_tenants_stream_once(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reader_writes_every_tenants_entries_once_on_the_cluster() {
    reads_every_tenants_stream_once(Backend::Cluster).await;
}

/// Reads one entry as `consumer` of `group` and does not acknowledge it: a reader that stopped
/// between reading and writing out.
async fn read_without_ack(h: &Harness<RedisStore>, group: &str, consumer: &str) -> String {
    let script = Script::new(
        "read_without_ack",
        "pcall(redis.call, 'XGROUP', 'CREATE', KEYS[1], ARGV[1], '0')\n\
         local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', KEYS[1], '>')\n\
         return r[1][2][1][1]"
            .to_string(),
    );
    let store = h.admission.protocol().store();
    let reply = store.eval(&script, vec![keys::ledger(&h.tenant)], vec![group.into(), consumer.into()]).await.unwrap();
    let Reply::Text(id) = reply else { panic!("{reply:?}") };
    id
}

async fn what_was_read_and_not_acknowledged_is_written_again(backend: Backend) {
    let (a, b) = (harness(backend).await, harness(backend).await);
    settle_some(&a, &b).await;
    let tenants = [a.tenant.as_str()];
    let group = unique_group();
    // c1 read the first entry and stopped before writing it out: c1, started again, writes it
    // (with the one nobody read).
    let entry = read_without_ack(&a, &group, "c1").await;
    let lines = read_once(backend, &["--group", &group, "--consumer", "c1"], &tenants);
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert_eq!(lines[0]["entry"], entry.as_str(), "the pending entry first");
    // c0 read one and never came back: another reader takes it over once it has waited long enough.
    let more = admitted(&a.reserve(1, 1).await).reservation_id.clone();
    a.admission.release(&more).await.unwrap();
    read_without_ack(&a, &group, "c0").await;
    assert!(
        read_once(backend, &["--group", &group, "--consumer", "c2", "--claim-idle-ms", "600000"], &tenants).is_empty()
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let lines = read_once(backend, &["--group", &group, "--consumer", "c2", "--claim-idle-ms", "10"], &tenants);
    assert_eq!(lines.iter().map(|v| v["id"].as_str().unwrap()).collect::<Vec<_>>(), vec![more.as_str()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_was_read_and_not_acknowledged_is_written_again_on_redis() {
    what_was_read_and_not_acknowledged_is_written_again(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_was_read_and_not_acknowledged_is_written_again_on_the_cluster() {
    what_was_read_and_not_acknowledged_is_written_again(Backend::Cluster).await;
}

#[test]
fn the_reader_says_the_embedded_store_keeps_a_file() {
    let dir = TempDir::new("ledger");
    let config = dir.write(
        "policy.yaml",
        "models:\n  m: { max_output_tokens: 100 }\nledger:\n  file: /var/lib/tollgate/ledger.jsonl\n",
    );
    let out = tollgate_cmd(&["ledger", "--config", config.to_str().unwrap()], Duration::from_secs(10));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("writes its ledger to ledger.file (/var/lib/tollgate/ledger.jsonl)"), "{stderr}");
    let out = tollgate_cmd(&["ledger", "--once"], Duration::from_secs(10));
    assert!(String::from_utf8_lossy(&out.stderr).contains("name a store"), "{out:?}");
}

/// One replica on the embedded store, behind Envoy, in front of a backend that commits nothing:
/// the ledger file bills what each response reported (or what tollgate metered), as it happens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_ledger_file_bills_what_the_responses_said() {
    let dir = TempDir::new("ledger-serve");
    let file = dir.0.join("ledger.jsonl");
    let policy = format!(
        "models:\n  sim: {{ max_output_tokens: 4096, bytes_per_token: 4 }}\n\
         ledger:\n  file: {}\ntenants:\n  acme:\n    limits: {{ max_concurrency: 10 }}\n",
        file.display()
    );
    let tollgate = Tollgate::start(&policy);
    let (port, shutdown) = support::sim_backend(10_000.0, tollgate::tools::sim::formats::Text::Tok).await;
    let envoy = Envoy::start(tollgate.addr, port);
    let chat = |stream: bool| {
        format!(
            r#"{{"model":"sim","max_tokens":100,"stream":{stream},"messages":[{{"role":"user","content":"{}"}}]}}"#,
            "x".repeat(200)
        )
    };
    let tenant = [("x-tenant-id", "acme"), ("x-user-id", "alice")];
    let json = post(envoy.port, "/v1/chat/completions", &tenant, chat(false)).await;
    assert_eq!(json.status, 200, "{json:?}");
    let streamed = post(envoy.port, "/v1/chat/completions", &tenant, chat(true)).await;
    assert_eq!(streamed.status, 200, "{streamed:?}");

    let start = Instant::now();
    let lines = loop {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        if lines.len() >= 2 || start.elapsed() > Duration::from_secs(10) {
            break lines;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    shutdown.cancel();
    let log = || format!("--- tollgate ---\n{}\n--- envoy ---\n{}", tollgate.log(), envoy.log());
    assert_eq!(lines.len(), 2, "{lines:#?}\n{}", log());
    let by_id: BTreeMap<&str, &Value> = lines.iter().map(|v| (v["id"].as_str().unwrap(), v)).collect();
    let first = by_id[json.header("x-sim-reservation").unwrap()];
    let usage = &json.json()["usage"];
    assert_eq!(
        (first["outcome"].as_str(), first["usage"].as_str(), first["user"].as_str()),
        (Some("committed"), Some("exact"), Some("alice"))
    );
    assert_eq!(first["prompt_tokens"], usage["prompt_tokens"]);
    assert_eq!(first["output_tokens"], usage["completion_tokens"]);
    let second = by_id[streamed.header("x-sim-reservation").unwrap()];
    assert_eq!((second["outcome"].as_str(), second["usage"].as_str()), (Some("committed"), Some("metered")));
    assert_eq!(second["output_tokens"], 40, "metered from the stream");
}

/// An entry trimmed between its read and its acknowledgement is gone: the reader acknowledges it,
/// writes nothing for it, and says how many it lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_trimmed_before_its_acknowledgement_is_counted_lost() {
    let h = harness(Backend::Redis).await;
    let id = admitted(&h.reserve(1, 1).await).reservation_id.clone();
    h.admission.release(&id).await.unwrap();
    let group = unique_group();
    read_without_ack(&h, &group, "c1").await;
    let trim = Script::new("trim", "return redis.call('XTRIM', KEYS[1], 'MAXLEN', 0)".to_string());
    h.admission.protocol().store().eval(&trim, vec![keys::ledger(&h.tenant)], vec![]).await.unwrap();
    let mut args =
        vec!["ledger".to_string(), "--once".into(), "--group".into(), group, "--consumer".into(), "c1".into()];
    args.extend(store_args(Backend::Redis));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = tollgate_cmd(&args, Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains(&h.tenant), "nothing written for it");
    assert!(stderr.contains("1 lost to trimming"), "{stderr}");
}

/// Without --once the reader keeps going: a tenant that appears after it started is found at the
/// next rescan and its entries are written as they come; SIGTERM ends it cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reader_follows_new_tenants_until_sigterm() {
    use std::io::BufRead;
    let group = unique_group();
    let mut child = std::process::Command::new(support::procs::tollgate_bin())
        .args(["ledger", "--group", &group, "--poll-ms", "50", "--rescan-ms", "100"])
        .args(store_args(Backend::Redis))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (lines, seen) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                return;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A tenant the reader has never seen.
    let h = harness(Backend::Redis).await;
    let id = admitted(&h.reserve(1, 1).await).reservation_id.clone();
    h.admission.commit(&id, 1, 1).await.unwrap();
    let start = Instant::now();
    let found = loop {
        match seen.recv_timeout(Duration::from_millis(100)) {
            Ok(line) if line.contains(&id) => break Some(line),
            _ if start.elapsed() > Duration::from_secs(10) => break None,
            _ => {}
        }
    };
    let line = found.unwrap_or_else(|| {
        let _ = child.kill();
        panic!("the reader never wrote {id}")
    });
    assert!(line.contains("\"committed\""), "{line}");
    std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "the reader did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
}

/// Ten thousand entries acknowledged in one call: more than Lua can spread into one command, so
/// the script acknowledges them in batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_entries_are_acknowledged_in_one_call() {
    let store = RedisStore::connect(
        &tollgate::store::redis::RedisTarget::Single(support::redis_url()),
        tollgate::store::redis::RedisOptions::default(),
    )
    .await
    .unwrap();
    let stream = keys::ledger(&support::unique_tenant("ack"));
    let fill = Script::new(
        "fill",
        "redis.call('XGROUP', 'CREATE', KEYS[1], 'g', '$', 'MKSTREAM')\n\
         for i = 1, tonumber(ARGV[1]) do redis.call('XADD', KEYS[1], '*', 'n', i) end\n\
         local read = redis.call('XREADGROUP', 'GROUP', 'g', 'c', 'COUNT', ARGV[1], 'STREAMS', KEYS[1], '>')\n\
         local ids = {}\n\
         for _, e in ipairs(read[1][2]) do ids[#ids + 1] = e[1] end\n\
         redis.call('PEXPIRE', KEYS[1], 60000)\n\
         return ids"
            .to_string(),
    );
    let Reply::Array(ids) = store.eval(&fill, vec![stream.clone()], vec!["10000".into()]).await.unwrap() else {
        panic!("ids")
    };
    let ids: Vec<String> = ids.iter().map(|r| r.as_text().unwrap().to_string()).collect();
    assert_eq!(ids.len(), 10_000);
    let streams = tollgate::store::phase::ledger::LedgerStreams::new(store.clone()).await.unwrap();
    streams.ack(&stream, "g", ids.into_iter()).await.expect("acknowledged in batches");
    let pending = Script::new("pending", "return redis.call('XPENDING', KEYS[1], 'g')[1]".to_string());
    assert_eq!(store.eval(&pending, vec![stream], vec![]).await.unwrap(), Reply::Int(0), "none left pending");
}
