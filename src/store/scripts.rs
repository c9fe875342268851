//! The protocol's Lua, compiled into the binary. Each phase is `lua/common.lua` followed by the
//! phase's own file, so the shared helpers exist once and every phase is still one atomic call.
//! The tenant phases (reserve, commit, renew, release) touch one tenant's keys; the pool scripts
//! touch one backend pool's keys.
//!
//! On Redis the phases are one function library ([`Library`]): `common.lua` runs once, when the
//! library is loaded, and each call runs only its phase (a script called by `EVALSHA` would run
//! the helpers' definitions again with every call: about 13 µs of Redis a call). The embedded
//! store runs each phase as a script, helpers and all.

use std::sync::Arc;

/// A Lua script and its SHA-1, the name Redis knows it by; and, for a phase of the protocol, the
/// function that runs it in the protocol's library. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Script {
    pub name: &'static str,
    /// The script as `EVAL` runs it (for a phase: the helpers, then the phase).
    pub source: Arc<str>,
    pub sha1: Arc<str>,
    /// The phase as a function of the protocol's library: called by `FCALL` where the store has
    /// functions (Redis 7).
    pub function: Option<Function>,
}

/// A phase's function: its name, and the library that registers it.
#[derive(Debug, Clone)]
pub struct Function {
    pub name: Arc<str>,
    pub library: Arc<Library>,
}

/// Every phase as one Redis function library. Its name, and every function's, carry a hash of its
/// code: replicas of two versions side by side (a rolling upgrade) each call their own, and
/// loading one never replaces the other's.
#[derive(Debug)]
pub struct Library {
    pub name: String,
    /// What `FUNCTION LOAD` takes.
    pub code: String,
}

impl Script {
    pub fn new(name: &'static str, source: String) -> Self {
        let sha1 = fred::util::sha1_hash(&source);
        Script { name, source: source.into(), sha1: sha1.into(), function: None }
    }
}

const COMMON: &str = include_str!("../../lua/common.lua");

/// The phases, by name, as their files say them.
const PHASES: [(&str, &str); 21] = [
    ("reserve", include_str!("../../lua/reserve.lua")),
    ("commit", include_str!("../../lua/commit.lua")),
    ("commit_many", include_str!("../../lua/commit_many.lua")),
    ("renew", include_str!("../../lua/renew.lua")),
    ("release", include_str!("../../lua/release.lua")),
    ("pool_reserve", include_str!("../../lua/pool_reserve.lua")),
    ("pool_release", include_str!("../../lua/pool_release.lua")),
    ("pool_renew", include_str!("../../lua/pool_renew.lua")),
    ("pool_progress", include_str!("../../lua/pool_progress.lua")),
    ("pool_throttle", include_str!("../../lua/pool_throttle.lua")),
    ("pool_status", include_str!("../../lua/pool_status.lua")),
    ("estimate", include_str!("../../lua/estimate.lua")),
    ("lease", include_str!("../../lua/lease.lua")),
    ("lease_forward", include_str!("../../lua/lease_forward.lua")),
    ("heartbeat", include_str!("../../lua/heartbeat.lua")),
    ("sweep", include_str!("../../lua/sweep.lua")),
    ("sweep_note", include_str!("../../lua/sweep_note.lua")),
    ("sweep_take", include_str!("../../lua/sweep_take.lua")),
    ("sweep_done", include_str!("../../lua/sweep_done.lua")),
    ("budget_get", include_str!("../../lua/budget_get.lua")),
    ("budget_adjust", include_str!("../../lua/budget_adjust.lua")),
];

/// What every phase runs first, in the library and on the embedded store: common.lua's `bind()`.
const PROLOGUE: &str = "bind()\n";

/// Stands for the library's version in its code until the code is hashed.
const VERSION_MARK: &str = "@version@";

/// The library of `PHASES`: the helpers at its top (run once, at load: so they may only define,
/// not call the standard library), then each phase registered as a function of `(KEYS, ARGV)`.
/// Its version is the hash of all of that, wrapping included, so any change to what Redis runs
/// names a new library, and replicas of two versions never replace each other's.
fn library() -> Arc<Library> {
    let mut code = format!("{COMMON}\n");
    for (phase, body) in PHASES {
        code.push_str(&format!(
            "redis.register_function('{}', function(KEYS, ARGV)\n{PROLOGUE}{body}\nend)\n",
            function_name(phase, VERSION_MARK)
        ));
    }
    let version = &fred::util::sha1_hash(&code)[..12];
    let name = format!("tollgate_{version}");
    let code = format!("#!lua name={name}\n{}", code.replace(VERSION_MARK, version));
    Arc::new(Library { name, code })
}

fn function_name(phase: &str, version: &str) -> String {
    format!("tollgate_{phase}_{version}")
}

/// The protocol's scripts, built once.
#[derive(Debug, Clone)]
pub struct Scripts {
    pub reserve: Script,
    pub commit: Script,
    pub commit_many: Script,
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
        let library = library();
        let version = library.name.trim_start_matches("tollgate_").to_string();
        let phase = |name: &'static str| {
            let (_, body) = PHASES.iter().find(|(n, _)| *n == name).expect("a phase of PHASES");
            let function = Function { name: function_name(name, &version).into(), library: Arc::clone(&library) };
            Script { function: Some(function), ..Script::new(name, format!("{COMMON}\n{PROLOGUE}{body}")) }
        };
        Scripts {
            reserve: phase("reserve"),
            commit: phase("commit"),
            commit_many: phase("commit_many"),
            renew: phase("renew"),
            release: phase("release"),
            pool_reserve: phase("pool_reserve"),
            pool_release: phase("pool_release"),
            pool_renew: phase("pool_renew"),
            pool_progress: phase("pool_progress"),
            pool_throttle: phase("pool_throttle"),
            pool_status: phase("pool_status"),
            estimate: phase("estimate"),
            lease: phase("lease"),
            lease_forward: phase("lease_forward"),
            heartbeat: phase("heartbeat"),
            sweep: phase("sweep"),
            sweep_note: phase("sweep_note"),
            sweep_take: phase("sweep_take"),
            sweep_done: phase("sweep_done"),
            budget_get: phase("budget_get"),
            budget_adjust: phase("budget_adjust"),
        }
    }

    pub fn all(&self) -> [&Script; 21] {
        [
            &self.reserve,
            &self.commit,
            &self.commit_many,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_phase_is_a_function_of_one_library_named_by_its_code() {
        let scripts = Scripts::new();
        let library = &scripts.reserve.function.as_ref().unwrap().library;
        let version = library.name.strip_prefix("tollgate_").unwrap();
        assert!(version.len() == 12 && version.chars().all(|c| c.is_ascii_hexdigit()), "{}", library.name);
        assert!(library.code.starts_with(&format!("#!lua name={}\n", library.name)));
        assert_eq!(scripts.all().len(), PHASES.len());
        for script in scripts.all() {
            let f = script.function.as_ref().unwrap();
            assert!(Arc::ptr_eq(&f.library, library), "{}: one library", script.name);
            assert_eq!(&*f.name, format!("tollgate_{}_{version}", script.name));
            assert!(library.code.contains(&format!("redis.register_function('{}', ", f.name)));
            assert!(script.source.starts_with(COMMON), "{}: the embedded store's script has the helpers", script.name);
        }
        // The name covers every byte Redis runs, the wrapping of each phase included.
        let code = library.code.split_once('\n').unwrap().1.replace(version, VERSION_MARK);
        assert_eq!(&fred::util::sha1_hash(&code)[..12], version);
    }
}
