//! The protocol's Lua, compiled into the binary. Each script is `lua/common.lua` followed by the
//! phase's own file, so the shared helpers exist once and every phase is still one script. The
//! tenant phases (reserve, commit, renew, release) touch one tenant's keys; the pool scripts touch
//! one backend pool's keys.

/// A Lua script and its SHA-1, the name Redis knows it by. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Script {
    pub name: &'static str,
    pub source: Arc<str>,
    pub sha1: Arc<str>,
}

impl Script {
    pub fn new(name: &'static str, source: String) -> Self {
        let sha1 = fred::util::sha1_hash(&source);
        Script { name, source: source.into(), sha1: sha1.into() }
    }

    fn phase(name: &'static str, body: &str) -> Self {
        Script::new(name, format!("{COMMON}\n{body}"))
    }
}

use std::sync::Arc;

const COMMON: &str = include_str!("../../lua/common.lua");

/// The protocol's scripts, built once.
#[derive(Debug, Clone)]
pub struct Scripts {
    pub reserve: Script,
    pub commit: Script,
    pub renew: Script,
    pub release: Script,
    pub pool_reserve: Script,
    pub pool_release: Script,
    pub pool_renew: Script,
    pub pool_progress: Script,
    pub pool_throttle: Script,
    pub pool_status: Script,
    pub estimate: Script,
    pub lease: Script,
    pub lease_forward: Script,
    pub heartbeat: Script,
    pub sweep: Script,
    pub sweep_note: Script,
    pub sweep_take: Script,
    pub sweep_done: Script,
    pub budget_get: Script,
    pub budget_adjust: Script,
}

impl Scripts {
    pub fn new() -> Self {
        Scripts {
            reserve: Script::phase("reserve", include_str!("../../lua/reserve.lua")),
            commit: Script::phase("commit", include_str!("../../lua/commit.lua")),
            renew: Script::phase("renew", include_str!("../../lua/renew.lua")),
            release: Script::phase("release", include_str!("../../lua/release.lua")),
            pool_reserve: Script::phase("pool_reserve", include_str!("../../lua/pool_reserve.lua")),
            pool_release: Script::phase("pool_release", include_str!("../../lua/pool_release.lua")),
            pool_renew: Script::phase("pool_renew", include_str!("../../lua/pool_renew.lua")),
            pool_progress: Script::phase("pool_progress", include_str!("../../lua/pool_progress.lua")),
            pool_throttle: Script::phase("pool_throttle", include_str!("../../lua/pool_throttle.lua")),
            pool_status: Script::phase("pool_status", include_str!("../../lua/pool_status.lua")),
            estimate: Script::phase("estimate", include_str!("../../lua/estimate.lua")),
            lease: Script::phase("lease", include_str!("../../lua/lease.lua")),
            lease_forward: Script::phase("lease_forward", include_str!("../../lua/lease_forward.lua")),
            heartbeat: Script::phase("heartbeat", include_str!("../../lua/heartbeat.lua")),
            sweep: Script::phase("sweep", include_str!("../../lua/sweep.lua")),
            sweep_note: Script::phase("sweep_note", include_str!("../../lua/sweep_note.lua")),
            sweep_take: Script::phase("sweep_take", include_str!("../../lua/sweep_take.lua")),
            sweep_done: Script::phase("sweep_done", include_str!("../../lua/sweep_done.lua")),
            budget_get: Script::phase("budget_get", include_str!("../../lua/budget_get.lua")),
            budget_adjust: Script::phase("budget_adjust", include_str!("../../lua/budget_adjust.lua")),
        }
    }

    pub fn all(&self) -> [&Script; 20] {
        [
            &self.reserve,
            &self.commit,
            &self.renew,
            &self.release,
            &self.pool_reserve,
            &self.pool_release,
            &self.pool_renew,
            &self.pool_progress,
            &self.pool_throttle,
            &self.pool_status,
            &self.estimate,
            &self.lease,
            &self.lease_forward,
            &self.heartbeat,
            &self.sweep,
            &self.sweep_note,
            &self.sweep_take,
            &self.sweep_done,
            &self.budget_get,
            &self.budget_adjust,
        ]
    }
}

impl Default for Scripts {
    fn default() -> Self {
        Scripts::new()
    }
}
