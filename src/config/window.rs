//! How long a commit from a response waits for more of its tenant's (`store.commit_window_ms`;
//! see `admission::batch`).

use std::time::Duration;

use super::Policy;
use super::validate::COMMIT_WINDOWS_IN_A_LEASE;

/// `store.commit_window_ms` as the policy says it. The window a commit waits is
/// [`Policy::commit_window`]'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitWindow {
    /// Each commit goes at once: the policy's 0, and the embedded store's unless set.
    Off,
    /// As the policy sets it: at most a tenth of its shortest lease (a policy or a reload that
    /// leases for less is refused while it is in force).
    Set(Duration),
    /// Redis's and a Cluster's unless set: [`DEFAULT_COMMIT_WINDOW`], or a tenth of the policy's
    /// shortest lease where that is less (a reload's leases shorten it).
    Default,
}

/// The commit window on Redis and a Redis Cluster unless `store.commit_window_ms` says otherwise:
/// at a few hundred requests a second of a tenant a window of 5 ms carries two or three commits a
/// call, 50 ms twenty or more, and each call a commit does not make saves Redis its round trip.
/// (A commit that frees what its tenant is short of goes within [`SHORT_COMMIT_WINDOW`]; see
/// `admission::batch`.)
pub const DEFAULT_COMMIT_WINDOW: Duration = Duration::from_millis(50);

/// The most a commit waits whose hold frees a slot its tenant is short of, or a pool's: another
/// request may be waiting for it.
pub const SHORT_COMMIT_WINDOW: Duration = Duration::from_millis(5);

impl Policy {
    /// How long a commit from a response waits for more of its tenant's (see `admission::batch`),
    /// `None` for not at all: as the store's settings say, a default window never more than a
    /// tenth of this policy's shortest lease. (Worked out once: see
    /// [`Policy::fit_commit_window`].)
    pub fn commit_window(&self) -> Option<Duration> {
        self.commit_wait
    }

    /// Works out [`Policy::commit_window`] from the store's settings and this policy's leases:
    /// as the policy is read, and again once a reload has given it the store settings in force.
    pub fn fit_commit_window(&mut self) {
        self.commit_wait = match self.store.commit_window {
            CommitWindow::Off => None,
            CommitWindow::Set(window) => Some(window),
            CommitWindow::Default => {
                let tenth = Duration::from_millis(self.shortest_lease_ms() / COMMIT_WINDOWS_IN_A_LEASE);
                Some(DEFAULT_COMMIT_WINDOW.min(tenth))
            }
        };
    }
}
