//! The Prometheus endpoint on the admin port, scraped from a running tollgate: every decision is
//! counted by tenant, model, tier, outcome and reason, and timed; the books' tokens and holds move
//! as the replies say (reserved, committed, refunded, released, expired); the store's calls are
//! timed and its failures counted, with the degraded mode in force; tenants the policy does not
//! name are one `other` series however many there are.

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use support::procs::{OwnRedis, Tollgate, free_port, http_get};
use tollgate::proto::admission_client::AdmissionClient;
use tollgate::proto::{CommitRequest, ReleaseRequest, ReserveRequest};

/// Every sample of a scrape, by its series (name and labels as printed).
fn scrape(addr: SocketAddr) -> BTreeMap<String, f64> {
    let (status, body) = http_get(addr, "/metrics");
    assert!(status.contains("200"), "{status}");
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap();
            (series.to_string(), value.parse::<f64>().unwrap_or_else(|_| panic!("{l}")))
        })
        .collect()
}

fn value(samples: &BTreeMap<String, f64>, series: &str) -> f64 {
    *samples.get(series).unwrap_or_else(|| panic!("no {series} in\n{}", dump(samples)))
}

fn dump(samples: &BTreeMap<String, f64>) -> String {
    samples.iter().map(|(k, v)| format!("{k} {v}\n")).collect()
}

fn reserve(tenant: &str, prompt: u64, max: u64) -> ReserveRequest {
    ReserveRequest {
        tenant: tenant.into(),
        model: "m".into(),
        prompt_tokens: prompt,
        max_tokens: max,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_counts_what_happened() {
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let policy = format!(
        "server:\n  admin_listen: {admin}\nmetrics:\n  budget_poll_ms: 100\n\
         models:\n  m: {{ max_output_tokens: 100, price: {{ input_per_million: 1, output_per_million: 3 }} }}\n\
         tenants:\n  acme:\n    lease_ttl_ms: 50\n    limits: {{ tokens_per_minute: 60, burst_tokens: 500, tokens_per_day: 100000 }}\n\
         default_tenant:\n  limits: {{ tokens_per_minute: 60000 }}\n"
    );
    let t = Tollgate::start(&policy);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();

    // acme: one hold committed under its hold, one released, one left to expire, one refused.
    let committed = client.reserve(reserve("acme", 20, 80)).await.unwrap().into_inner();
    let released = client.reserve(reserve("acme", 10, 90)).await.unwrap().into_inner();
    let expiring = client.reserve(reserve("acme", 10, 90)).await.unwrap().into_inner();
    assert!(committed.admitted && released.admitted && expiring.admitted);
    let refused = client.reserve(reserve("acme", 150, 100)).await.unwrap().into_inner();
    assert_eq!(refused.reason, "token_rate", "{refused:?}");
    let c = CommitRequest {
        reservation_id: committed.reservation_id.clone(),
        prompt_tokens: 20,
        completion_tokens: 30,
        ..Default::default()
    };
    client.commit(c.clone()).await.unwrap();
    client.commit(c).await.unwrap(); // a repeat settles nothing new
    client.release(ReleaseRequest { reservation_id: released.reservation_id }).await.unwrap();
    // The lease (50 ms) passes; the next reserve sweeps the hold, which stays charged (the
    // default expired_usage), so 400 tokens do not fit in the 350 left.
    tokio::time::sleep(Duration::from_millis(120)).await;
    let swept = client.reserve(reserve("acme", 310, 90)).await.unwrap().into_inner();
    assert_eq!(swept.reason, "token_rate", "{swept:?}");
    // Three tenants the policy does not name, and a model it does not serve.
    for tenant in ["t1", "t2", "t3"] {
        assert!(client.reserve(reserve(tenant, 1, 1)).await.unwrap().into_inner().admitted);
    }
    let unknown_model = ReserveRequest { model: "gpt-x".into(), ..reserve("acme", 1, 1) };
    assert_eq!(client.reserve(unknown_model).await.unwrap().into_inner().reason, "invalid_request");

    let s = scrape(admin);
    let decisions = |tenant: &str, model: &str, outcome: &str, reason: &str| {
        value(
            &s,
            &format!(
                "tollgate_decisions_total{{gen_ai_request_model=\"{model}\",outcome=\"{outcome}\",reason=\"{reason}\",tenant=\"{tenant}\",tier=\"standard\"}}"
            ),
        )
    };
    assert_eq!(decisions("acme", "m", "admitted", "ok"), 3.0);
    assert_eq!(decisions("acme", "m", "denied", "token_rate"), 2.0);
    assert_eq!(decisions("acme", "other", "denied", "invalid_request"), 1.0);
    assert_eq!(decisions("other", "m", "admitted", "ok"), 3.0, "t1..t3 are one series");
    assert!(!s.keys().any(|k| k.contains("t1")), "an unnamed tenant got a series of its own");
    assert_eq!(value(&s, "tollgate_decision_duration_seconds_count{outcome=\"admitted\"}"), 6.0);
    assert_eq!(value(&s, "tollgate_decision_duration_seconds_count{outcome=\"denied\"}"), 3.0);

    // The books: what the replies said, no more.
    let reserved = committed.reserved_tokens + released.reserved_tokens + expiring.reserved_tokens;
    assert_eq!(value(&s, "tollgate_tokens_total{event=\"reserved\",tenant=\"acme\"}"), reserved as f64);
    assert_eq!(value(&s, "tollgate_tokens_total{event=\"committed\",tenant=\"acme\"}"), 50.0);
    assert_eq!(value(&s, "tollgate_cost_total{tenant=\"acme\"}"), 110_000.0, "20 x 1,000 + 30 x 3,000 nanos");
    // Refunded: the commit's 100 - 50, and the release's whole hold.
    assert_eq!(
        value(&s, "tollgate_tokens_total{event=\"refunded\",tenant=\"acme\"}"),
        (50 + released.reserved_tokens) as f64
    );
    // Each by how its request ended: its counts reported, given back by its caller, left to expire.
    for (ending, state) in [("completed", "committed"), ("released", "released"), ("expired", "expired")] {
        let series = format!("tollgate_holds_total{{ending=\"{ending}\",state=\"{state}\",tenant=\"acme\"}}");
        assert_eq!(value(&s, &series), 1.0, "{series}");
    }
    assert_eq!(value(&s, "tollgate_hold_usage_ratio_count{tenant=\"acme\"}"), 1.0);
    // The day's budget, read every 100 ms: what the holds charged (the committed 50, the expired
    // hold's 100 and the new one's) is gone from the 100,000.
    let start = Instant::now();
    let remaining = loop {
        let s = scrape(admin);
        let series = "tollgate_budget_remaining{budget=\"tokens_per_day\",tenant=\"acme\"}";
        if let Some(&left) = s.get(series).filter(|&&left| left < 100_000.0) {
            assert_eq!(value(&s, "tollgate_budget_limit{budget=\"tokens_per_day\",tenant=\"acme\"}"), 100_000.0);
            let reset = value(&s, "tollgate_budget_reset_seconds{budget=\"tokens_per_day\",tenant=\"acme\"}");
            assert!(reset > 0.0 && reset <= 86_400.0, "{reset}");
            break left;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no budget gauge:\n{}", dump(&s));
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!((99_000.0..100_000.0).contains(&remaining), "{remaining}");
    assert_eq!(value(&s, "tollgate_hold_usage_ratio_sum{tenant=\"acme\"}"), 0.5);
    // The estimates behind that hold, per tenant and model: 30 of the 80 output tokens held, and
    // the 20 prompt tokens exactly.
    let estimate = |kind: &str, part: &str| {
        value(
            &s,
            &format!(
                "tollgate_estimate_ratio_{part}{{estimate=\"{kind}\",gen_ai_request_model=\"m\",tenant=\"acme\"}}"
            ),
        )
    };
    assert_eq!((estimate("output", "count"), estimate("output", "sum")), (1.0, 0.375));
    assert_eq!((estimate("prompt", "count"), estimate("prompt", "sum")), (1.0, 1.0));
    // And as the GenAI semantic conventions count a request's tokens.
    let usage = |kind: &str| {
        value(
            &s,
            &format!(
                "gen_ai_client_token_usage_sum{{gen_ai_request_model=\"m\",gen_ai_token_type=\"{kind}\",tenant=\"acme\"}}"
            ),
        )
    };
    assert_eq!((usage("input"), usage("output")), (20.0, 30.0));
    // Every store call is timed; the store answers.
    assert!(value(&s, "tollgate_store_duration_seconds_count{result=\"ok\",script=\"reserve\"}") >= 8.0);
    assert_eq!(value(&s, "tollgate_store_available"), 1.0);

    let (status, _) = http_get(admin, "/nope");
    assert!(status.contains("404"), "{status}");
}

/// A tenant the policy does not list, admitted under the plan its token names (or, where the
/// policy reads no plan header, under `default_tenant`), has its remaining-budget gauges once it
/// has a series of its own (`metrics.unlisted_tenants`); one folded into "other" has none, and
/// neither has "other".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlisted_tenant_with_a_series_of_its_own_has_budget_gauges() {
    let under_plan = "  plan_header: x-tollgate-plan\nplans:\n  team:\n    limits: { tokens_per_day: 5000 }\n";
    let under_default = "default_tenant:\n  limits: { tokens_per_day: 5000 }\n";
    for (terms, plan) in [(under_plan, "team"), (under_default, "")] {
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let policy = format!(
            "server:\n  admin_listen: {admin}\n{terms}metrics:\n  budget_poll_ms: 100\n  unlisted_tenants: 1\n\
             models:\n  m: {{ max_output_tokens: 100 }}\n"
        );
        let t = Tollgate::start(&policy);
        let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
        for tenant in ["newco", "later"] {
            let r = client.reserve(ReserveRequest { plan: plan.into(), ..reserve(tenant, 10, 90) }).await.unwrap();
            assert!(r.get_ref().admitted, "{tenant}: {r:?}");
        }
        let start = Instant::now();
        let s = loop {
            let s = scrape(admin);
            let series = "tollgate_budget_remaining{budget=\"tokens_per_day\",tenant=\"newco\"}";
            if s.get(series).is_some_and(|&left| left == 4900.0) {
                break s;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "no gauge for newco:\n{}\n{}", dump(&s), t.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(value(&s, "tollgate_budget_limit{budget=\"tokens_per_day\",tenant=\"newco\"}"), 5000.0);
        assert!(
            !s.keys().any(|k| k.starts_with("tollgate_budget_") && (k.contains("later") || k.contains("\"other\""))),
            "a folded tenant has budget gauges:\n{}",
            dump(&s)
        );
    }
}

/// With Redis gone, each decision the tenants' modes make is counted as degraded, the store's
/// failures by kind, and the store reads unavailable; when Redis is back, available again. The
/// scrape, with every instrument recorded by then, also holds what the shipped dashboard and
/// alerting rules query.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_shows_the_store_down_and_the_mode_in_force() {
    let port = free_port();
    let redis = OwnRedis::start(port);
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let policy = format!(
        "server:\n  admin_listen: {admin}\nstore:\n  redis_url: redis://127.0.0.1:{port}\n  breaker: {{ failures: 100 }}\n\
         models:\n  m: {{ max_output_tokens: 10 }}\n\
         metrics:\n  budget_poll_ms: 100\n\
         tenants:\n  closed: {{ on_store_error: fail_closed, lease_ttl_ms: 50 }}\n  open: {{ on_store_error: fail_open }}\n\
         \x20 near: {{ limits: {{ tokens_per_day: 1000000 }} }}\n"
    );
    let t = Tollgate::start(&policy);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    // While Redis is up: a hold committed, one released, one left to expire and swept.
    let mut held = Vec::new();
    for _ in 0..3 {
        let r = client.reserve(reserve("closed", 1, 1)).await.unwrap().into_inner();
        assert!(r.admitted, "{r:?}");
        held.push(r.reservation_id);
    }
    client
        .commit(CommitRequest {
            reservation_id: held[0].clone(),
            prompt_tokens: 1,
            completion_tokens: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    client.release(ReleaseRequest { reservation_id: held[1].clone() }).await.unwrap();
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(client.reserve(reserve("closed", 1, 1)).await.unwrap().into_inner().admitted);

    drop(redis);
    for tenant in ["closed", "open", "near"] {
        let r = client.reserve(reserve(tenant, 1, 1)).await.unwrap().into_inner();
        assert_eq!(r.admitted, tenant != "closed", "{tenant}: {r:?}");
    }
    let (_, text) = http_get(admin, "/metrics");
    let s = scrape(admin);
    for (tenant, mode, outcome) in
        [("closed", "fail_closed", "denied"), ("open", "fail_open", "unmetered"), ("near", "local", "unmetered")]
    {
        let series =
            format!("tollgate_degraded_decisions_total{{mode=\"{mode}\",outcome=\"{outcome}\",tenant=\"{tenant}\"}}");
        assert_eq!(value(&s, &series), 1.0, "{series}");
    }
    assert!(value(&s, "tollgate_store_errors_total{error=\"unavailable\",script=\"reserve\"}") >= 3.0);
    assert_eq!(value(&s, "tollgate_store_available"), 0.0);
    assert_eq!(value(&s, "tollgate_holds_total{ending=\"expired\",state=\"expired\",tenant=\"closed\"}"), 1.0);
    queries_name_only_exported_series(&text);

    let _back = OwnRedis::start(port);
    let start = Instant::now();
    while !client.reserve(reserve("closed", 1, 1)).await.unwrap().into_inner().admitted {
        assert!(start.elapsed() < Duration::from_secs(10), "Redis never came back\n{}", t.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(value(&scrape(admin), "tollgate_store_available"), 1.0);
}

/// Every `tollgate_*` series that deploy/grafana-dashboard.json and deploy/prometheus-rules.yaml
/// query is one of the families in `exposition` (a histogram's `_bucket`, `_sum` and `_count`
/// included), and each file queries at least one.
fn queries_name_only_exported_series(exposition: &str) {
    let mut exported = std::collections::BTreeSet::new();
    for line in exposition.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let (name, kind) = line.split_once(' ').unwrap();
        exported.insert(name.to_string());
        if kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                exported.insert(format!("{name}{suffix}"));
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("deploy/grafana-dashboard.json")).unwrap()).unwrap();
    let mut dashboard_queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            dashboard_queries.push(target["expr"].as_str().unwrap().to_string());
        }
    }
    let rules: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(root.join("deploy/prometheus-rules.yaml")).unwrap()).unwrap();
    let rule_queries: Vec<String> = rules["spec"]["groups"][0]["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| r["expr"].as_str().unwrap().to_string())
        .collect();
    for (file, queries) in [("dashboard", dashboard_queries), ("rules", rule_queries)] {
        assert!(!queries.is_empty(), "{file} has no queries");
        for query in &queries {
            let mut rest = query.as_str();
            let mut named = 0;
            while let Some(at) = rest.find("tollgate_") {
                let tail = &rest[at..];
                let end = tail.find(|c: char| !(c.is_ascii_lowercase() || c == '_')).unwrap_or(tail.len());
                let name = &tail[..end];
                assert!(exported.contains(name), "{file} queries {name}, which tollgate does not export: {query}");
                named += 1;
                rest = &tail[end..];
            }
            assert!(named > 0, "{file}: a query of nothing tollgate exports: {query}");
        }
    }
}

/// A request that waited in tollgate for a pool's slot: the wait is its own histogram, by tier and
/// outcome, and the decision's duration leaves it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_a_slot_is_measured_apart_from_the_decision() {
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let policy = format!(
        "server:\n  admin_listen: {admin}\n\
         pools:\n  gpu: {{ max_sequences: 1, prefill_tokens_per_second: 1000, decode_tokens_per_second: 100, max_queue_delay_ms: 5000, queue: tollgate }}\n\
         models:\n  m: {{ max_output_tokens: 100, pool: gpu }}\n\
         tenants:\n  acme:\n    limits: {{ tokens_per_minute: 60000 }}\n"
    );
    let t = Tollgate::start(&policy);
    let mut client = AdmissionClient::connect(t.endpoint()).await.unwrap();
    let first = client.reserve(reserve("acme", 10, 10)).await.unwrap().into_inner();
    assert!(first.admitted, "{first:?}");
    let mut second = client.clone();
    let waiting = tokio::spawn(async move { second.reserve(reserve("acme", 10, 10)).await.unwrap().into_inner() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the second request waits for the one slot");
    let c = CommitRequest {
        reservation_id: first.reservation_id,
        prompt_tokens: 10,
        completion_tokens: 10,
        ..Default::default()
    };
    client.commit(c).await.unwrap();
    assert!(waiting.await.unwrap().admitted);

    let s = scrape(admin);
    let waits = "tollgate_pool_wait_seconds_count{outcome=\"admitted\",tier=\"standard\"}";
    assert_eq!(value(&s, waits), 1.0, "{}", dump(&s));
    let waited = value(&s, "tollgate_pool_wait_seconds_sum{outcome=\"admitted\",tier=\"standard\"}");
    assert!(waited >= 0.25, "{waited}");
    assert_eq!(value(&s, "tollgate_decision_duration_seconds_count{outcome=\"admitted\"}"), 2.0);
    let decided = value(&s, "tollgate_decision_duration_seconds_sum{outcome=\"admitted\"}");
    assert!(decided < 0.2, "the decisions took {decided} s without the wait");
}
