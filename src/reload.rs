//! Live policy: the policy file is looked at every `server.policy_poll_ms` (1 s by default) and
//! reloaded when it changed, and at once on SIGHUP. A changed file is validated like at start; a
//! good one is swapped in whole ([`Admission::reload`]), a broken one is refused and the policy in
//! force stays, with the reason in the log and `tollgate_policy_reloads_total{result="error"}`.
//!
//! "Changed" is the file's identity and size and modification time, as `stat` sees them through
//! symlinks: an edit in place, a rename over it, and the symlink swap a Kubernetes ConfigMap
//! volume makes (`..data` pointed at a new directory) all change it. A file whose text is the
//! version in force is left alone.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::admission::Admission;
use crate::config::{ConfigError, Policy, version_of};
use crate::store::Store;

/// What `serve` does to every policy it loads before using it (the `--tls-*` flags).
pub type Adjust = Arc<dyn Fn(&mut Policy) -> Result<(), ConfigError> + Send + Sync>;

/// The file as `stat` sees it: a change to any of these is a change to look at. (The TLS files
/// are watched the same way: [`crate::grpc::tls`].)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

/// `path` as `stat` sees it now, through symlinks; `None` when it cannot be read.
pub fn seen(path: &Path) -> Option<Seen> {
    let m = std::fs::metadata(path).ok()?;
    Some(Seen {
        dev: m.dev(),
        ino: m.ino(),
        len: m.len(),
        mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
    })
}

/// How a reload went.
#[derive(Debug, PartialEq, Eq)]
pub enum Reloaded {
    /// The text is the version in force.
    Unchanged,
    /// In force now; the named settings wait for a restart.
    Applied { version: String, kept: Vec<&'static str> },
    /// Refused; the policy in force stays.
    Refused(String),
}

/// Reads, validates and (if it is new and good) puts `path`'s policy in force.
pub async fn reload<S: Store>(path: &Path, admission: &Admission<S>, adjust: &Adjust) -> Reloaded {
    let file = path.to_path_buf();
    let adjust = Arc::clone(adjust);
    let (current, window) = {
        let policy = admission.policy();
        (policy.version.clone(), policy.store.commit_window)
    };
    // Reading and validating a large policy is work: off the runtime's threads.
    let loaded = tokio::task::spawn_blocking(move || -> Result<Option<Policy>, ConfigError> {
        let text = std::fs::read_to_string(&file)
            .map_err(|source| ConfigError::Read { file: file.display().to_string(), source })?;
        if version_of(&text) == current {
            return Ok(None);
        }
        let mut policy = Policy::parse(&file.display().to_string(), &text)?;
        adjust(&mut policy)?;
        policy.check_window_in_force(&file.display().to_string(), window)?;
        Ok(Some(policy))
    })
    .await;
    let outcome = match loaded {
        Ok(Ok(None)) => return Reloaded::Unchanged,
        Ok(Ok(Some(policy))) => {
            let version = policy.version.clone();
            let kept = admission.reload(policy);
            Reloaded::Applied { version, kept }
        }
        Ok(Err(e)) => Reloaded::Refused(e.to_string()),
        Err(e) => Reloaded::Refused(format!("the reload task failed: {e}")),
    };
    match &outcome {
        Reloaded::Applied { version, kept } => {
            admission.metrics().reload_tried(true);
            tracing::info!(%version, "policy reloaded");
            if !kept.is_empty() {
                tracing::warn!(settings = ?kept, "these settings changed in the file and apply on restart only; the rest is in force");
            }
        }
        Reloaded::Refused(why) => {
            admission.metrics().reload_tried(false);
            tracing::error!(error = %why, "policy reload refused; the policy in force is kept");
        }
        Reloaded::Unchanged => {}
    }
    outcome
}

/// Watches `path` every `every` (none: SIGHUP only) until `shutdown`.
pub async fn watch<S: Store>(
    path: PathBuf,
    every: Option<Duration>,
    admission: Arc<Admission<S>>,
    adjust: Adjust,
    shutdown: CancellationToken,
) {
    let mut hangups = match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; the policy reloads by polling only");
            None
        }
    };
    let mut ticks = tokio::time::interval(every.unwrap_or(Duration::from_secs(3600)));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // No baseline: the first look reads the file, so a change made between the start's load and
    // this task's first look is not missed (an unchanged text is left alone).
    let mut last = None;
    loop {
        let hangup = async {
            match hangups.as_mut() {
                Some(h) => h.recv().await,
                None => std::future::pending().await,
            }
        };
        let hung_up = tokio::select! {
            _ = ticks.tick() => false,
            received = hangup => {
                if received.is_none() {
                    // The signal stream ended (the runtime is stopping): poll only.
                    hangups = None;
                    continue;
                }
                true
            }
            () = shutdown.cancelled() => return,
        };
        let now = seen(&path);
        if !hung_up && (every.is_none() || now == last) {
            continue;
        }
        if hung_up {
            tracing::info!("SIGHUP: reloading the policy");
        }
        last = now;
        reload(&path, &admission, &adjust).await;
    }
}
