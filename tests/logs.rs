//! What an operator's log pipeline reads from `serve` run as a container runtime runs it, its
//! output sent to a file: no colour codes, and with `--log-format json` (or the policy's
//! `server.log_format`) one JSON object a line, with stable fields for the start's effective
//! configuration and for every decision.

mod support;

use std::time::Duration;

use envoy_types::pb::envoy::service::auth::v3::authorization_client::AuthorizationClient;
use serde_json::Value;
use support::checks::{check, reason, reservation};
use support::procs::{TempDir, Tollgate, tollgate_cmd};

const POLICY: &str = "models:\n  m: { max_output_tokens: 64 }\ntenants:\n  acme:\n    limits: { tokens_per_minute: 6000, max_concurrency: 1 }\n";
const BODY: &[u8] = br#"{"model":"m","max_tokens":10}"#;

/// Sends an admitted request, one refused for concurrency (the first still holds the only slot),
/// one refused for want of a tenant, and one refused before admission could read it (a body that
/// is not JSON); returns the admitted reservation id.
async fn admitted_then_refused(t: &Tollgate) -> String {
    let mut client = AuthorizationClient::connect(t.endpoint()).await.unwrap();
    let headers = [("x-tenant-id", "acme"), ("x-user-id", "u1")];
    let first = client.check(check(&headers, BODY)).await.unwrap().into_inner();
    let (id, _) = reservation(&first).unwrap_or_else(|| panic!("admitted: {first:?}"));
    let second = client.check(check(&headers, BODY)).await.unwrap().into_inner();
    assert_eq!(reason(&second), "concurrency");
    let anonymous = client.check(check(&[], BODY)).await.unwrap().into_inner();
    assert_eq!(reason(&anonymous), "unauthenticated");
    let unread = client.check(check(&[("x-tenant-id", "acme")], b"{not json")).await.unwrap().into_inner();
    assert_eq!(reason(&unread), "invalid_request");
    id
}

/// The log, once it has `lines` lines naming `needle` (the writer may lag the answer a little).
fn log_with(t: &Tollgate, needle: &str, lines: usize) -> String {
    for _ in 0..250 {
        let log = t.log();
        if log.lines().filter(|l| l.contains(needle)).count() >= lines {
            return log;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the log never had {lines} lines with {needle}:\n{}", t.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_sent_to_a_file_carry_no_escape_codes() {
    let t = Tollgate::start_with(POLICY, &["--log", "debug"]);
    admitted_then_refused(&t).await;
    let log = log_with(&t, "decision", 4);
    assert!(!log.contains('\u{1b}'), "an escape byte in a log written to a file:\n{log}");
    let start = log.lines().find(|l| l.contains("tollgate serving")).expect("the start line");
    for field in ["listen=127.0.0.1:", "store=embedded", "on_store_error=local", "leasing=off", "tls=plaintext"] {
        assert!(start.contains(field), "the start line states {field}: {start}");
    }
    let refused = log.lines().find(|l| l.contains("outcome=\"denied\"") || l.contains("outcome=denied"));
    assert!(refused.is_some_and(|l| l.contains("concurrency")), "{log}");
    // Its first heartbeat heard itself alone: it says it writes compact records.
    log_with(&t, "every replica heard reads compact reservation records", 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_parse_line_by_line_with_the_fields_operators_search_by() {
    let t = Tollgate::start_with(POLICY, &["--log-format", "json", "--log", "info,decision=debug"]);
    let id = admitted_then_refused(&t).await;
    let log = log_with(&t, "\"decision\"", 4);
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l:?}")))
        .collect();
    for line in &lines {
        assert!(line["timestamp"].is_string() && line["level"].is_string(), "{line}");
    }
    // (A key twice in one object is JSON a parser may take either way: every key once.)
    for (line, text) in lines.iter().zip(log.lines()) {
        for key in line.as_object().unwrap().keys() {
            assert_eq!(text.matches(&format!("\"{key}\":")).count(), 1, "{key} twice: {text}");
        }
    }

    let start = lines.iter().find(|l| l["message"] == "tollgate serving").expect("the start line");
    assert!(start["listen"].as_str().unwrap().starts_with("127.0.0.1:"), "{start}");
    assert_eq!(start["store"], "embedded", "{start}");
    assert_eq!(start["on_store_error"], "local", "{start}");
    assert_eq!(start["leasing"], "off", "{start}");
    assert_eq!(start["tls"], "plaintext", "{start}");
    assert_eq!(start["tenants"], 1, "{start}");

    let decisions: Vec<&Value> = lines.iter().filter(|l| l["target"] == "decision").collect();
    let admitted = decisions.iter().find(|l| l["outcome"] == "admitted").expect("the admitted request's line");
    assert_eq!(admitted["tenant"], "acme", "{admitted}");
    assert_eq!(admitted["user"], "u1", "{admitted}");
    assert_eq!(admitted["model"], "m", "{admitted}");
    assert_eq!(admitted["reason"], "ok", "{admitted}");
    assert_eq!(admitted["reservation_id"], id.as_str(), "{admitted}");
    assert!(admitted["reserved_tokens"].as_u64().unwrap() >= 10, "{admitted}");
    assert_eq!(admitted["store_mode"], "store", "{admitted}");
    assert!(admitted["latency_ms"].as_f64().unwrap() >= 0.0, "{admitted}");

    let refused = decisions.iter().find(|l| l["reason"] == "concurrency").expect("the refused request's line");
    assert_eq!(refused["outcome"], "denied", "{refused}");
    assert_eq!(refused["tenant"], "acme", "{refused}");
    assert_eq!(refused["user"], "u1", "{refused}");
    assert_eq!(refused["model"], "m", "{refused}");
    assert_eq!(refused["store_mode"], "store", "{refused}");
    assert!(refused["retry_after_ms"].as_u64().is_some(), "{refused}");
    assert!(refused.get("reservation_id").is_none(), "a refusal holds nothing: {refused}");
    assert!(refused["latency_ms"].as_f64().unwrap() >= 0.0, "{refused}");

    let anonymous = decisions.iter().find(|l| l["reason"] == "unauthenticated").expect("the anonymous request's line");
    assert_eq!((&anonymous["outcome"], &anonymous["store_mode"]), (&"denied".into(), &"none".into()), "{anonymous}");
    assert_eq!(anonymous["model"], "m", "{anonymous}");

    let unread = decisions.iter().find(|l| l["reason"] == "invalid_request").expect("the unread request's line");
    assert_eq!((&unread["outcome"], &unread["store_mode"]), (&"denied".into(), &"none".into()), "{unread}");
    assert!(unread["detail"].as_str().is_some_and(|d| d.contains("JSON")), "why, in its own field: {unread}");
    assert!(unread["latency_ms"].as_f64().is_some(), "{unread}");
}

/// With leasing, a request this replica's slices cover is decided without a store call, and its
/// line says so; a request that drew slices says `store`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_from_the_lease_says_so() {
    let policy = "leasing: { window_ms: 1000, max_share: 0.5 }\nmodels:\n  m: { max_output_tokens: 64 }\n\
                  tenants:\n  acme:\n    limits: { tokens_per_minute: 6000000, max_concurrency: 10000 }\n";
    let t = Tollgate::start_with(policy, &["--log-format", "json", "--log", "info,decision=debug"]);
    let mut client = AuthorizationClient::connect(t.endpoint()).await.unwrap();
    for _ in 0..20 {
        let reply = client.check(check(&[("x-tenant-id", "acme")], BODY)).await.unwrap().into_inner();
        assert_eq!(reason(&reply), "admitted");
    }
    let log = log_with(&t, "\"decision\"", 20);
    let modes: Vec<String> = log
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|l| l["target"] == "decision")
        .map(|l| l["store_mode"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(modes.first().map(String::as_str), Some("store"), "the first draws the slices: {modes:?}");
    // (Slices grow with the demand seen, so a few more calls are made while it ramps up.)
    let leased = modes.iter().filter(|m| *m == "lease").count();
    assert!(leased >= 10 && modes.iter().all(|m| m == "lease" || m == "store"), "{modes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_chooses_the_format_and_the_flag_overrides_it() {
    let policy = format!("server:\n  log_format: json\n{POLICY}");
    let json = Tollgate::start(&policy);
    let log = log_with(&json, "tollgate serving", 1);
    let start = log.lines().find(|l| l.contains("tollgate serving")).unwrap();
    assert_eq!(serde_json::from_str::<Value>(start).unwrap()["store"], "embedded", "{start}");

    let text = Tollgate::start_with(&policy, &["--log-format", "text"]);
    let log = log_with(&text, "tollgate serving", 1);
    let start = log.lines().find(|l| l.contains("tollgate serving")).unwrap();
    assert!(serde_json::from_str::<Value>(start).is_err() && start.contains("store=embedded"), "{start}");
}

#[test]
fn a_log_format_the_policy_cannot_mean_stops_the_start_naming_the_field() {
    let dir = TempDir::new("logs");
    let config = dir.write("policy.yaml", &format!("server:\n  log_format: xml\n{POLICY}"));
    let out = tollgate_cmd(&["check-config", config.to_str().unwrap()], Duration::from_secs(10));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("log_format") && stderr.contains("xml"), "{stderr}");
    let out = tollgate_cmd(&["serve", "--config", config.to_str().unwrap()], Duration::from_secs(10));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("log_format"), "{stderr}");
}
