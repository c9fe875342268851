//! A broken policy stops the start with a message that names the file, the field and why. One
//! fixture per rejected configuration in tests/config/, its expected message on its first line.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use support::procs::tollgate_cmd;
use tollgate::config::Policy;

fn fixtures() -> Vec<(PathBuf, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/config");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("tests/config is readable") {
        let path = entry.expect("a directory entry").path();
        let text = std::fs::read_to_string(&path).expect("a fixture is readable");
        let expected = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# error: "))
            .unwrap_or_else(|| panic!("{} lacks its '# error: ' line", path.display()))
            .to_string();
        out.push((path, expected));
    }
    out.sort();
    assert!(out.len() >= 10, "fixtures missing from {}", dir.display());
    out
}

#[test]
fn every_rejected_policy_fails_with_its_message() {
    for (path, expected) in fixtures() {
        let err = Policy::load(&path).expect_err(&format!("{} was accepted", path.display())).to_string();
        assert!(err.starts_with(&path.display().to_string()), "{err}: the file is not named");
        assert!(err.contains(&expected), "{}:\n  expected: {expected}\n  got:      {err}", path.display());
    }
}

#[test]
fn check_config_prints_the_error_and_fails() {
    let (path, expected) = fixtures().into_iter().find(|(p, _)| p.ends_with("user_above_tenant.yaml")).unwrap();
    let out = tollgate_cmd(&["check-config", path.to_str().unwrap()], Duration::from_secs(10));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&expected), "{stderr}");
}

#[test]
fn check_config_summarises_a_good_policy() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/policy.yaml");
    let out = tollgate_cmd(&["check-config", path.to_str().unwrap()], Duration::from_secs(10));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with("policy OK"), "{stdout}");
    assert!(stdout.contains("tenant acme: 120000 tokens/min (burst 40000)"), "{stdout}");
    assert!(stdout.contains("store: embedded"), "{stdout}");
    assert!(stdout.contains("plans: 2 (team, trial)"), "{stdout}");
    // globex takes the team plan's rate and day budget, and its own concurrency.
    assert!(
        stdout.contains(
            "tenant globex: 30000 tokens/min (burst 30000), 300 requests/min, 8 concurrent, 20000000 tokens/day"
        ),
        "{stdout}"
    );
}

#[test]
fn check_config_says_when_the_policy_leases() {
    let text = "leasing: { window_ms: 500, max_share: 0.25 }\nmodels:\n  m: { max_output_tokens: 100 }\n\
                tenants:\n  acme: { strict: true }\n";
    let policy = Policy::parse("leasing.yaml", text).unwrap();
    assert!(policy.summary().contains("leasing: window 500 ms, slices up to 25% of a scope"), "{}", policy.summary());
    assert!(policy.tenants["acme"].strict);
}

#[test]
fn check_config_says_the_budgets_over_months_and_in_money() {
    let text = "models:\n  m: { max_output_tokens: 100, price: { input_per_million: 2.5, output_per_million: 10 } }\n\
                tenants:\n  acme:\n    limits: { tokens_per_month: 90000000, cost_per_day: 12.5, cost_per_month: 250 }\n";
    let policy = Policy::parse("money.yaml", text).unwrap();
    let summary = policy.summary();
    assert!(summary.contains("12.5 a day, 90000000 tokens/month, 250 a month"), "{summary}");
    let price = policy.models["m"].price.unwrap();
    assert_eq!((price.input_nanos, price.output_nanos), (2_500, 10_000), "nanos per token");
    assert_eq!(policy.tenants["acme"].limits.cost_per_day.unwrap().0, 12_500_000_000);
}

#[test]
fn check_config_says_the_budgets_of_each_side_and_period_and_the_zone() {
    let text = "models:\n  m: { max_output_tokens: 100 }\nplans:\n  team:\n    time_zone: Europe/Berlin\n    \
                limits: { input_tokens_per_minute: 400000, output_tokens_per_minute: 80000, tokens_per_hour: 5000000, \
                output_tokens_per_week: 20000000 }\ntenants:\n  acme: { plan: team }\n";
    let policy = Policy::parse("sides.yaml", text).unwrap();
    let summary = policy.summary();
    assert!(
        summary.contains(
            "tenant acme: 400000 input tokens/min, 80000 output tokens/min, 5000000 tokens/hour, \
             20000000 output tokens/week (periods in Europe/Berlin)"
        ),
        "{summary}"
    );
}

#[test]
fn check_config_says_where_the_ledger_goes() {
    let text =
        "ledger: { max_len: 5000, file: /var/lib/tollgate/ledger.jsonl }\nmodels:\n  m: { max_output_tokens: 100 }\n";
    let summary = Policy::parse("ledger.yaml", text).unwrap().summary();
    assert!(
        summary.contains(
            "ledger: every settled hold, per tenant up to ~5000 entries for 604800000 ms; also appended to \
             /var/lib/tollgate/ledger.jsonl"
        ),
        "{summary}"
    );
}

#[test]
fn check_config_says_how_redis_is_guarded_and_what_each_tenant_does_without_it() {
    let text = "store:\n  redis_url: redis://127.0.0.1:6379\n  breaker: { failures: 5, open_ms: 100 }\n\
                models:\n  m: { max_output_tokens: 100 }\n\
                tenants:\n  acme: {}\n  paid: { on_store_error: fail_open }\n  free: { on_store_error: fail_closed }\n";
    let summary = Policy::parse("guarded.yaml", text).unwrap().summary();
    let says = |s: &str| assert!(summary.contains(s), "{s:?} missing from:\n{summary}");
    says("calls time out after 250 ms; 5 failures in a row stop them for 100-500 ms");
    says("tenant acme:");
    says("; commits from responses batched by tenant over 50 ms (5 ms where they free what the tenant is short of)");
    // A window the policy does not set fits itself to its shortest lease, a reload's too: such a
    // reload is not refused for the window in force.
    let short_leases =
        Policy::parse("short.yaml", &text.replace("  acme: {}", "  acme: { lease_ttl_ms: 300 }")).unwrap();
    let summary_short = short_leases.summary();
    assert!(summary_short.contains("batched by tenant over 30 ms (5 ms where"), "{summary_short}");
    use tollgate::config::CommitWindow;
    let window_in_force = |w| short_leases.check_window_in_force("short.yaml", w).map_err(|e| e.to_string());
    assert!(window_in_force(CommitWindow::Set(Duration::from_millis(50))).is_err(), "a set window is held to");
    window_in_force(CommitWindow::Default).unwrap();
    let alone = text.replace("  breaker:", "  commit_window_ms: 0\n  breaker:");
    let summary_alone = Policy::parse("alone.yaml", &alone).unwrap().summary();
    assert!(!summary_alone.contains("batched"), "commit_window_ms: 0 commits each at once: {summary_alone}");
    let embedded = "models:\n  m: { max_output_tokens: 100 }\ntenants:\n  acme: {}\n";
    let summary_embedded = Policy::parse("embedded.yaml", embedded).unwrap().summary();
    assert!(!summary_embedded.contains("batched"), "the embedded store batches only when told: {summary_embedded}");
    for (tenant, mode) in [("acme", "local"), ("paid", "fail_open"), ("free", "fail_closed")] {
        let line = summary.lines().find(|l| l.contains(&format!("tenant {tenant}:"))).unwrap();
        assert!(line.contains(&format!("store down: {mode}")), "{line}");
    }
}

#[test]
fn serve_refuses_a_broken_policy_naming_the_field() {
    let (path, expected) = fixtures().into_iter().find(|(p, _)| p.ends_with("zero_limit.yaml")).unwrap();
    let out = tollgate_cmd(&["serve", "--config", path.to_str().unwrap()], Duration::from_secs(10));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&expected), "{stderr}");
}
