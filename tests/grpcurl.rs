//! Debugging with real grpcurl, as the README shows it: list and describe by reflection, then a
//! Check and a Commit by hand.

mod support;

use support::procs::{Tollgate, grpcurl};

const POLICY: &str = "models:\n  m:\n    max_output_tokens: 512\n  p:\n    max_output_tokens: 512\n    pool: gpu\n\
                      pools:\n  gpu: { max_sequences: 4, prefill_tokens_per_second: 1000, decode_tokens_per_second: 100, max_queue_delay_ms: 1000, \
                      provider_limits: { tokens_per_minute: 90000, requests_per_minute: 600 } }\n\
                      tenants:\n  acme:\n    limits: { tokens_per_minute: 6000 }\n";

fn run(t: &Tollgate, args: &[&str]) -> String {
    let out = grpcurl(t.addr, args);
    assert!(out.status.success(), "grpcurl {args:?} failed: {}\n{}", String::from_utf8_lossy(&out.stderr), t.log());
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn grpcurl_lists_every_service_by_reflection() {
    let t = Tollgate::start(POLICY);
    let list = run(&t, &["list"]);
    for service in [
        "envoy.service.auth.v3.Authorization",
        "envoy.service.ext_proc.v3.ExternalProcessor",
        "tollgate.v1.Admission",
        "tollgate.v1.Budgets",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(list.lines().any(|l| l.trim() == service), "{service} missing from:\n{list}");
    }
    let admission = run(&t, &["describe", "tollgate.v1.Admission"]);
    for rpc in ["rpc Reserve", "rpc Commit", "rpc Renew", "rpc Release", "rpc PoolStatus"] {
        assert!(admission.contains(rpc), "{rpc} missing from:\n{admission}");
    }
    let authz = run(&t, &["describe", "envoy.service.auth.v3.Authorization"]);
    assert!(authz.contains("rpc Check"), "{authz}");
    let health = run(&t, &["grpc.health.v1.Health/Check"]);
    assert!(health.contains("SERVING"), "{health}");
}

#[test]
fn grpcurl_calls_check_then_commit() {
    let t = Tollgate::start(POLICY);
    let body = r#"{"model":"m","max_tokens":20,"messages":[{"role":"user","content":"hello"}]}"#;
    let mut request = serde_json::json!({
        "attributes": {"request": {"http": {
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": {"x-tenant-id": "acme", "content-type": "application/json"},
            "body": body
        }}}
    });
    let check = request.to_string();
    let out = run(&t, &["-d", &check, "envoy.service.auth.v3.Authorization/Check"]);
    let reply: serde_json::Value = serde_json::from_str(&out).unwrap();
    let headers = reply["okResponse"]["headers"].as_array().unwrap_or_else(|| panic!("not admitted: {out}"));
    let value = |key: &str| {
        headers
            .iter()
            .find(|h| h["header"]["key"] == key)
            .and_then(|h| h["header"]["value"].as_str())
            .unwrap_or_else(|| panic!("{key} missing: {out}"))
            .to_string()
    };
    let id = value("x-tollgate-reservation");
    // The body's bytes at 4 bytes/token, rounded up, plus max_tokens 20.
    let held = body.len().div_ceil(4) + 20;
    assert_eq!(value("x-tollgate-reserved-tokens"), held.to_string());

    let commit = serde_json::json!({"reservation_id": id, "prompt_tokens": 12, "completion_tokens": 7}).to_string();
    let out = run(&t, &["-d", &commit, "tollgate.v1.Admission/Commit"]);
    let reply: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(reply["state"], "committed", "{out}");
    assert_eq!(reply["usedTokens"], "19", "{out}");
    assert_eq!(reply["refundedTokens"], (held - 19).to_string(), "{out}");

    // What the tenant's bucket has left after it: the 19 tokens used, less what refilled since
    // (100 a second), and how long until it is full again (10 ms a token).
    let out = run(&t, &["-d", r#"{"tenant":"acme"}"#, "tollgate.v1.Budgets/Get"]);
    let reply: serde_json::Value = serde_json::from_str(&out).unwrap();
    let tenant = &reply["scopes"][0];
    assert_eq!(tenant["scope"], "tenant", "{out}");
    let bucket = &tenant["limits"][0];
    assert_eq!((&bucket["name"], &bucket["limit"]), (&"tokens_per_minute".into(), &"6000".into()), "{out}");
    // (proto3's JSON leaves a zero out: a bucket refilled by the time of the call has no reset.)
    let number = |field: &str| bucket[field].as_str().map_or(0, |v| v.parse::<u64>().unwrap());
    let (used, remaining, full_in) = (number("used"), number("remaining"), number("resetsInMs"));
    assert!(used <= 19 && used + remaining == 6000 && full_in.abs_diff(used * 10) <= 10, "{out}");

    // A denial is an OK gRPC answer holding a Denied response.
    request["attributes"]["request"]["http"]["headers"].as_object_mut().unwrap().remove("x-tenant-id");
    let anonymous = request.to_string();
    let out = run(&t, &["-d", &anonymous, "envoy.service.auth.v3.Authorization/Check"]);
    let reply: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(reply["deniedResponse"]["status"]["code"], "Unauthorized", "{out}");
}

#[test]
fn grpcurl_shows_a_pools_load_and_throttle() {
    let t = Tollgate::start(POLICY);
    let out = run(&t, &["-d", r#"{"pool":"gpu"}"#, "tollgate.v1.Admission/PoolStatus"]);
    let reply: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(reply["share"], 1.0, "an unthrottled pool admits its whole share: {out}");
    // The provider's limits, as Budgets/Get shows a scope's: full, nothing used yet.
    let provider = reply["provider"].as_array().unwrap_or_else(|| panic!("no provider limits: {out}"));
    let limit = |name: &str| provider.iter().find(|l| l["name"] == name).unwrap_or_else(|| panic!("{name}: {out}"));
    assert_eq!(
        (limit("tokens_per_minute")["limit"].as_str(), limit("tokens_per_minute")["remaining"].as_str()),
        (Some("90000"), Some("90000")),
        "{out}"
    );
    assert_eq!(limit("requests_per_minute")["limit"].as_str(), Some("600"), "{out}");
    let out = grpcurl(t.addr, &["-d", r#"{"pool":"nope"}"#, "tollgate.v1.Admission/PoolStatus"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("InvalidArgument"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// With `server.health_listen`, probes have a port of their own that answers grpc.health.v1 and
/// nothing else, so the main port can stay on loopback (reachable by the Envoy beside tollgate).
#[test]
fn the_health_port_answers_probes_and_nothing_else() {
    let health_port = support::procs::free_port();
    let t = Tollgate::start(&format!("server:\n  health_listen: 127.0.0.1:{health_port}\n{POLICY}"));
    let health: std::net::SocketAddr = format!("127.0.0.1:{health_port}").parse().unwrap();
    // No reflection there either: grpcurl is given the descriptors (a probe needs none).
    let protoset = |name: &str, bytes: &[u8]| {
        let path = t.dir.write(name, "");
        std::fs::write(&path, bytes).unwrap();
        path.to_str().unwrap().to_string()
    };
    let health_set = protoset("health.protoset", tonic_health::pb::FILE_DESCRIPTOR_SET);
    let own_set = protoset("tollgate.protoset", tollgate::proto::REFLECTION_DESCRIPTOR_SET);
    let check =
        ["-protoset", &health_set, "-d", r#"{"service":"tollgate.v1.Admission"}"#, "grpc.health.v1.Health/Check"];
    let out = grpcurl(health, &check);
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stderr), t.log());
    assert!(String::from_utf8_lossy(&out.stdout).contains("SERVING"));
    // Admission is not served there.
    let body = r#"{"tenant":"acme","model":"m","max_tokens":1}"#;
    let reserve = grpcurl(health, &["-protoset", &own_set, "-d", body, "tollgate.v1.Admission/Reserve"]);
    let refused = String::from_utf8_lossy(&reserve.stderr);
    assert!(!reserve.status.success() && refused.contains("Unimplemented"), "Admission on the health port: {refused}");
    // The main port serves everything, as before.
    let admitted = run(&t, &["-d", body, "tollgate.v1.Admission/Reserve"]);
    assert!(admitted.contains("\"admitted\": true"), "{admitted}");
}

/// Adjust with grpcurl: refused to a caller `server.budget_admins` does not name; for one it
/// names (here `loopback`, an operator on the pod), made once however often it is sent.
#[test]
fn grpcurl_adjusts_a_budget_only_for_an_allowed_caller() {
    let budgets = "models:\n  m: { max_output_tokens: 512 }\ntenants:\n  acme:\n    limits: { tokens_per_day: 1000 }\n";
    let adjust = r#"{"tenant":"acme","budget":"tokens_per_day","amount":-300,"request_id":"ops-1","reason":"a test"}"#;
    let closed = Tollgate::start(budgets);
    let out = grpcurl(closed.addr, &["-d", adjust, "tollgate.v1.Budgets/Adjust"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("PermissionDenied"), "{stderr}");

    let open = Tollgate::start(&format!("server:\n  budget_admins: [loopback]\n{budgets}"));
    for state in ["adjusted", "repeated"] {
        let reply: serde_json::Value =
            serde_json::from_str(&run(&open, &["-d", adjust, "tollgate.v1.Budgets/Adjust"])).unwrap();
        assert_eq!((&reply["state"], &reply["countedAfter"]), (&state.into(), &"300".into()), "{reply}");
    }
    let out = run(&open, &["-d", r#"{"tenant":"acme"}"#, "tollgate.v1.Budgets/Get"]);
    let reply: serde_json::Value = serde_json::from_str(&out).unwrap();
    let day = &reply["scopes"][0]["limits"][0];
    assert_eq!(
        (&day["name"], &day["used"], &day["remaining"]),
        (&"tokens_per_day".into(), &"300".into(), &"700".into()),
        "{out}"
    );
}

/// A week's output budget in a zone behind UTC, adjusted and read by its policy name.
#[test]
fn grpcurl_adjusts_and_reads_a_weekly_output_budget() {
    let policy = "server:\n  budget_admins: [loopback]\nmodels:\n  m: { max_output_tokens: 512 }\ntenants:\n  acme:\n    \
                  time_zone: America/Chicago\n    limits: { input_tokens_per_minute: 6000, output_tokens_per_week: 5000 }\n";
    let t = Tollgate::start(policy);
    let adjust = r#"{"tenant":"acme","budget":"output_tokens_per_week","amount":-1200,"request_id":"w-1","reason":"carried over"}"#;
    let reply: serde_json::Value =
        serde_json::from_str(&run(&t, &["-d", adjust, "tollgate.v1.Budgets/Adjust"])).unwrap();
    assert_eq!(&reply["countedAfter"], &"1200", "{reply}");
    let bad = r#"{"tenant":"acme","budget":"output_tokens_per_fortnight","amount":1,"request_id":"w-2"}"#;
    let out = grpcurl(t.addr, &["-d", bad, "tollgate.v1.Budgets/Adjust"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("InvalidArgument") && stderr.contains("per_week"), "{stderr}");
    let out = run(&t, &["-d", r#"{"tenant":"acme"}"#, "tollgate.v1.Budgets/Get"]);
    let reply: serde_json::Value = serde_json::from_str(&out).unwrap();
    let limits = reply["scopes"][0]["limits"].as_array().unwrap();
    let names: Vec<&str> = limits.iter().map(|l| l["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["input_tokens_per_minute", "output_tokens_per_week"], "{out}");
    let week = &limits[1];
    assert_eq!((&week["used"], &week["remaining"]), (&"1200".into(), &"3800".into()), "{out}");
    // Monday 00:00 in Chicago is at most a week away.
    let resets: u64 = week["resetsInMs"].as_str().unwrap().parse().unwrap();
    assert!(resets > 0 && resets <= 7 * 86_400_000, "{out}");
}

/// The README's Adjust as it is written, then Get on a user's and a model's scopes, and Check at
/// exactly what Get says is left: admitted, and one token more refused. Each adjustment is in the
/// ledger, naming who asked (`loopback`: grpcurl on the host) and why.
#[test]
fn grpcurl_gets_and_adjusts_every_scope_and_check_finds_what_get_said() {
    let dir = support::procs::TempDir::new("grpcurl-ledger");
    let ledger = dir.0.join("ledger.jsonl");
    let policy = format!(
        "server:\n  budget_admins: [loopback]\nledger:\n  file: {}\nmodels:\n  m: {{ max_output_tokens: 512 }}\n  \
         n: {{ max_output_tokens: 512 }}\ntenants:\n  acme:\n    limits: {{ tokens_per_day: 100000 }}\n    \
         default_user: {{ tokens_per_day: 2000 }}\n    models: {{ n: {{ tokens_per_day: 3000 }} }}\n",
        ledger.display()
    );
    let t = Tollgate::start(&policy);
    let adjust = |body: &str| -> serde_json::Value {
        serde_json::from_str(&run(&t, &["-d", body, "tollgate.v1.Budgets/Adjust"])).unwrap()
    };
    let debit =
        r#"{"tenant":"acme","budget":"tokens_per_day","amount":-60000,"request_id":"ops-0","reason":"a day's batch"}"#;
    assert_eq!(adjust(debit)["countedAfter"], "60000");
    // The README's command, word for word.
    let readme = r#"{"tenant":"acme","budget":"tokens_per_day","amount":50000,
    "request_id":"ticket-4411","reason":"refund a failed batch"}"#;
    let reply = adjust(readme);
    assert_eq!((&reply["state"], &reply["countedAfter"]), (&"adjusted".into(), &"10000".into()), "{reply}");
    let user = serde_json::json!({
        "tenant": "acme", "user": "alice", "budget": "tokens_per_day", "amount": -1500,
        "request_id": "u-1", "reason": "carried over",
    })
    .to_string();
    let user = user.as_str();
    assert_eq!(adjust(user)["countedAfter"], "1500");

    let get = run(&t, &["-d", r#"{"tenant":"acme","user":"alice","model":"n"}"#, "tollgate.v1.Budgets/Get"]);
    let reply: serde_json::Value = serde_json::from_str(&get).unwrap();
    let day = |scope: &str| -> (u64, u64) {
        let s = reply["scopes"].as_array().unwrap().iter().find(|s| s["scope"] == scope);
        let limit = &s.unwrap_or_else(|| panic!("no {scope} scope: {get}"))["limits"][0];
        assert_eq!(limit["name"], "tokens_per_day", "{get}");
        // (proto3's JSON leaves a zero out.)
        let number = |f: &str| limit[f].as_str().map_or(0, |v| v.parse::<u64>().unwrap());
        (number("used"), number("remaining"))
    };
    assert_eq!([day("tenant"), day("user alice"), day("model n")], [(10_000, 90_000), (1500, 500), (0, 3000)], "{get}");

    // Alice asks for model n: the user's 500 left is the tightest. A Check holding exactly 500 is
    // admitted (the body at 4 bytes a token, plus max_tokens); one more token is refused.
    let check = |max_tokens: usize| -> serde_json::Value {
        let body = format!(r#"{{"model":"n","max_tokens":{max_tokens},"messages":[]}}"#);
        let request = serde_json::json!({
            "attributes": {"request": {"http": {
                "method": "POST",
                "path": "/v1/chat/completions",
                "headers": {"x-tenant-id": "acme", "x-user-id": "alice", "content-type": "application/json"},
                "body": body
            }}}
        });
        serde_json::from_str(&run(&t, &["-d", &request.to_string(), "envoy.service.auth.v3.Authorization/Check"]))
            .unwrap()
    };
    let prompt = r#"{"model":"n","max_tokens":490,"messages":[]}"#.len().div_ceil(4);
    let over = check(501 - prompt);
    assert_eq!(over["deniedResponse"]["status"]["code"], "TooManyRequests", "{over}");
    assert!(over.to_string().contains("daily token budget of scope user"), "{over}");
    let exact = check(500 - prompt);
    assert!(exact["okResponse"].is_object(), "{exact}");
    assert!(check(1)["deniedResponse"].is_object(), "the user's day is spent");

    // The ledger: each adjustment once, who asked and why (its numbers are JSON numbers).
    let adjusted = |entries: &[serde_json::Value]| entries.iter().filter(|e| e["outcome"] == "adjusted").count();
    let entries = support::procs::json_lines_when(&ledger, |e| adjusted(e) >= 3);
    assert_eq!(adjusted(&entries), 3, "{entries:#?}");
    let entry = entries.iter().find(|e| e["id"] == "adjust:ticket-4411").expect("the README's adjustment");
    for (field, value) in [
        ("budget", serde_json::json!("tokens_per_day")),
        ("counted_before", serde_json::json!(60_000)),
        ("counted_after", serde_json::json!(10_000)),
        ("adjusted_by", serde_json::json!("loopback")),
        ("reason", serde_json::json!("refund a failed batch")),
    ] {
        assert_eq!(entry[field], value, "{field} of {entry}");
    }
    let alice = entries.iter().find(|e| e["id"] == "adjust:u-1").expect("the user's adjustment");
    assert_eq!((&alice["user"], &alice["counted_after"]), (&"alice".into(), &1500.into()), "{alice}");
}
