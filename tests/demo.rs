//! The README's demo command runs end to end: Envoy, tollgate, the simulated backend and the
//! mixed load, and prints a row per class and the backend's utilisation; with `RETRIES=2`, refused
//! requests wait their hint and retry, and the printout says how many their first retry got in.

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn the_demo_runs_and_reports_every_class() {
    let started = Instant::now();
    let out = Command::new("bash")
        .args(["scripts/demo", "3"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("TOLLGATE_BIN", env!("CARGO_BIN_EXE_tollgate"))
        .env("RETRIES", "2")
        .output()
        .expect("run scripts/demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for class in ["interactive", "standard", "batch"] {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(&format!("| {class} |")))
            .unwrap_or_else(|| panic!("no {class} row:\n{stdout}"));
        let sent: u64 = row.split('|').nth(2).unwrap().trim().parse().unwrap();
        assert!(sent > 0, "{row}");
    }
    assert!(stdout.contains("queue_full"), "the batch flood meets capacity admission:\n{stdout}");
    assert!(stdout.contains("refused and retried on the hint: "), "its refusals retried on their hints:\n{stdout}");
    let utilisation = stdout
        .lines()
        .find_map(|l| l.strip_prefix("backend utilisation: ")?.split('%').next()?.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no utilisation line:\n{stdout}"));
    assert!(utilisation > 0.0 && utilisation <= 100.5, "{utilisation}");
    assert!(started.elapsed() < Duration::from_secs(120));
}
