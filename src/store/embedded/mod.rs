//! The embedded store: the protocol's own Lua, run in-process on Lua 5.1 (the version Redis embeds)
//! against an in-memory [`Keyspace`]. For a single replica with no Redis, and for tests that move
//! an injected clock instead of sleeping.
//!
//! The Lua state and the keyspace live on a thread of their own, which runs one script at a time,
//! start to finish, as Redis runs them on its one thread; so the atomicity argument is the same on
//! both stores. Callers send it a job and await the reply, so a script never runs on (or blocks) a
//! server worker thread.

mod keyspace;
mod ledger_file;

use std::collections::HashMap;
use std::sync::{Arc, mpsc};

use mlua::{Function, Lua, MultiValue, Value};
use tokio::sync::oneshot;

pub use keyspace::{Keyspace, LedgerSink};
use keyspace::{Resp, format_number};

use super::clock::{Clock, SystemClock};
use super::{Reply, Script, Store, StoreError, keys};

/// How many expired keys each script call reclaims, at most, besides the ones it touches.
const PURGE_PER_CALL: usize = 32;

/// The scripts that make new hold records: refused while the keyspace is over its memory cap with
/// nothing left to evict. (Settling, renewing and reading go on: they are what frees memory. A
/// lease call draws slices, which make no records, and hands back what leased holds settled.)
const MAKES_HOLDS: [&str; 2] = ["reserve", "pool_reserve"];

/// Once full, the keyspace counts as full until it is back under this share of its cap (per
/// mille), so that near the cap every settled hold does not flip it back and forth.
const ROOM_AGAIN_PER_MILLE: usize = 900;

/// The store thread's state.
struct Host {
    lua: Lua,
    /// Compiled scripts by SHA-1, like Redis's script cache.
    scripts: HashMap<Arc<str>, Function>,
}

/// What the `redis.call` callback needs, kept in the Lua state's app data.
struct Context {
    keyspace: Keyspace,
    clock: Arc<dyn Clock>,
    /// The memory cap (bytes); `None`: uncapped.
    cap: Option<usize>,
    /// Whether the keyspace was over its cap with nothing left to evict, at the last call.
    full: bool,
}

/// Work for the store thread.
enum Job {
    Load { script: Script, reply: oneshot::Sender<Result<(), StoreError>> },
    Eval { script: Script, keys: Vec<String>, args: Vec<String>, reply: oneshot::Sender<Result<Reply, StoreError>> },
    Size { reply: oneshot::Sender<KeyspaceSize> },
    Cap { bytes: usize },
}

/// How much the keyspace holds: its keys, the entries of its expiry index (never more), and the
/// bytes it counts against the memory cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyspaceSize {
    pub keys: usize,
    pub expiry_index: usize,
    pub bytes: usize,
}

/// The in-process store. Clones share one keyspace; the thread ends when the last clone drops.
#[derive(Clone)]
pub struct EmbeddedStore {
    jobs: mpsc::Sender<Job>,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore").finish_non_exhaustive()
    }
}

fn stopped() -> StoreError {
    StoreError::Unavailable("the embedded store thread has stopped".into())
}

impl EmbeddedStore {
    /// A store on the wall clock.
    pub fn new() -> Result<Self, StoreError> {
        EmbeddedStore::with_clock(Arc::new(SystemClock))
    }

    /// A store on the given clock (a [`super::clock::ManualClock`] in tests).
    pub fn with_clock(clock: Arc<dyn Clock>) -> Result<Self, StoreError> {
        EmbeddedStore::open(clock, None)
    }

    /// A store on the given clock whose usage ledger is also appended to `ledger_file`, as JSON
    /// lines (see [`crate::hold::ledger`]).
    pub fn with_ledger_file(clock: Arc<dyn Clock>, ledger_file: &std::path::Path) -> Result<Self, StoreError> {
        let sink = ledger_file::file_sink(ledger_file).map_err(|e| {
            StoreError::Unavailable(format!("cannot open the ledger file {}: {e}", ledger_file.display()))
        })?;
        EmbeddedStore::open(clock, Some(sink))
    }

    fn open(clock: Arc<dyn Clock>, sink: Option<LedgerSink>) -> Result<Self, StoreError> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let (ready, started) = mpsc::sync_channel::<Result<(), StoreError>>(1);
        std::thread::Builder::new()
            .name("tollgate-embedded-store".into())
            .spawn(move || {
                let lua = Lua::new();
                if let Err(e) = install_redis_api(&lua) {
                    let _ = ready.send(Err(script_error("redis api", e)));
                    return;
                }
                let mut keyspace = sink.map_or_else(Keyspace::default, Keyspace::with_sink);
                keyspace.evict_only(keys::is_settled_bucket);
                lua.set_app_data(Context { keyspace, clock, cap: None, full: false });
                let _ = ready.send(Ok(()));
                let mut host = Host { lua, scripts: HashMap::new() };
                for job in queue {
                    host.run(job);
                }
            })
            .map_err(|e| StoreError::Unavailable(format!("cannot start the embedded store thread: {e}")))?;
        started.recv().map_err(|_| stopped())??;
        Ok(EmbeddedStore { jobs })
    }
}

impl EmbeddedStore {
    /// The keyspace's size, for memory checks.
    pub async fn size(&self) -> Result<KeyspaceSize, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.jobs.send(Job::Size { reply }).map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())
    }

    /// Caps the keyspace at `bytes`: past them the settled buckets are evicted, oldest first, and
    /// when none is left the scripts that make holds are refused (as a store error: each tenant's
    /// `on_store_error` decides) until settled holds bring it back under.
    pub fn cap_memory(&self, bytes: usize) -> Result<(), StoreError> {
        self.jobs.send(Job::Cap { bytes }).map_err(|_| stopped())
    }
}

impl Host {
    fn run(&mut self, job: Job) {
        match job {
            Job::Load { script, reply } => {
                let _ = reply.send(self.compile(&script).map(|_| ()));
            }
            Job::Eval { script, keys, args, reply } => {
                let _ = reply.send(self.eval(&script, keys, args));
            }
            Job::Size { reply } => {
                if let Some(ctx) = self.lua.app_data_ref::<Context>() {
                    let k = &ctx.keyspace;
                    let _ =
                        reply.send(KeyspaceSize { keys: k.len(), expiry_index: k.expiry_index_len(), bytes: k.used() });
                }
            }
            Job::Cap { bytes } => {
                if let Some(mut ctx) = self.lua.app_data_mut::<Context>() {
                    ctx.cap = Some(bytes);
                }
            }
        }
    }

    fn compile(&mut self, script: &Script) -> Result<Function, StoreError> {
        if let Some(f) = self.scripts.get(&script.sha1) {
            return Ok(f.clone());
        }
        let f = self
            .lua
            .load(&*script.source)
            .set_name(script.name)
            .into_function()
            .map_err(|e| script_error(script.name, e))?;
        self.scripts.insert(script.sha1.clone(), f.clone());
        Ok(f)
    }

    fn eval(&mut self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        let f = self.compile(script)?;
        let lua = &self.lua;
        if let Some(mut ctx) = lua.app_data_mut::<Context>() {
            let now = ctx.clock.now_ms();
            ctx.keyspace.purge_expired(now, PURGE_PER_CALL);
            if let Some(cap) = ctx.cap {
                if ctx.keyspace.used() > cap {
                    // What has expired goes before anything is evicted.
                    ctx.keyspace.purge_expired(now, usize::MAX);
                }
                let room = if ctx.full { (cap / 1000).saturating_mul(ROOM_AGAIN_PER_MILLE) } else { cap };
                let full = !ctx.keyspace.make_room(room);
                if full != ctx.full {
                    ctx.full = full;
                    let (used_mb, cap_mb) = (ctx.keyspace.used() >> 20, cap >> 20);
                    if full {
                        tracing::error!(
                            used_mb,
                            cap_mb,
                            "the embedded store is at its memory cap with no settled record left to evict: no new hold until some settle"
                        );
                    } else {
                        tracing::warn!(used_mb, cap_mb, "the embedded store is back under its memory cap");
                    }
                }
                if full && MAKES_HOLDS.contains(&script.name) {
                    return Err(StoreError::Unavailable(format!(
                        "the embedded store holds {} MB with no settled record left to evict, over its cap (store.max_memory_mb: {})",
                        ctx.keyspace.used() >> 20,
                        cap >> 20
                    )));
                }
            }
        }
        let globals = lua.globals();
        let set = || -> mlua::Result<()> {
            globals.set("KEYS", lua.create_sequence_from(keys)?)?;
            globals.set("ARGV", lua.create_sequence_from(args)?)?;
            Ok(())
        };
        set().map_err(|e| script_error(script.name, e))?;
        let value: Value = f.call(()).map_err(|e| script_error(script.name, e))?;
        to_reply(value).map_err(|message| StoreError::Script { script: script.name, message })
    }
}

impl Store for EmbeddedStore {
    async fn load(&self, script: &Script) -> Result<(), StoreError> {
        let (reply, answer) = oneshot::channel();
        self.jobs.send(Job::Load { script: script.clone(), reply }).map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }

    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.jobs.send(Job::Eval { script: script.clone(), keys, args, reply }).map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

fn script_error(script: &'static str, e: mlua::Error) -> StoreError {
    StoreError::Script { script, message: e.to_string() }
}

/// Installs `redis.call` and `redis.pcall`, and removes what Redis's sandbox does not offer.
fn install_redis_api(lua: &Lua) -> mlua::Result<()> {
    let globals = lua.globals();
    for name in ["os", "io", "dofile", "loadfile", "require", "module", "package", "debug"] {
        globals.set(name, Value::Nil)?;
    }
    let redis = lua.create_table()?;
    redis.set("call", lua.create_function(|lua, args: MultiValue| call(lua, args, true))?)?;
    redis.set("pcall", lua.create_function(|lua, args: MultiValue| call(lua, args, false))?)?;
    globals.set("redis", redis)?;
    Ok(())
}

/// `redis.call`: raises on error. `redis.pcall`: returns `{err = message}` instead.
fn call(lua: &Lua, args: MultiValue, raise: bool) -> mlua::Result<Value> {
    let mut argv = Vec::with_capacity(args.len());
    for arg in args {
        argv.push(match arg {
            Value::String(s) => s.as_bytes().to_vec(),
            Value::Integer(n) => n.to_string().into_bytes(),
            Value::Number(n) => format_number(n).into_bytes(),
            _ => {
                return Err(mlua::Error::runtime("Lua redis lib command arguments must be strings or integers"));
            }
        });
    }
    let result = {
        let mut ctx =
            lua.app_data_mut::<Context>().ok_or_else(|| mlua::Error::runtime("embedded store context missing"))?;
        let now = ctx.clock.now_ms();
        ctx.keyspace.command(now, &argv)
    };
    match result {
        Ok(resp) => to_lua(lua, resp),
        Err(message) if raise => Err(mlua::Error::runtime(message)),
        Err(message) => {
            let t = lua.create_table()?;
            t.set("err", message)?;
            Ok(Value::Table(t))
        }
    }
}

/// Redis reply → Lua value, by Redis's conversion table (nil becomes `false`).
fn to_lua(lua: &Lua, resp: Resp) -> mlua::Result<Value> {
    Ok(match resp {
        Resp::Nil => Value::Boolean(false),
        Resp::Int(n) => Value::Number(n as f64),
        Resp::Bulk(b) => Value::String(lua.create_string(b)?),
        Resp::Status(s) => {
            let t = lua.create_table()?;
            t.set("ok", s)?;
            Value::Table(t)
        }
        Resp::Array(items) => {
            let t = lua.create_table_with_capacity(items.len(), 0)?;
            for (i, item) in (1..).zip(items) {
                t.raw_set(i, to_lua(lua, item)?)?;
            }
            Value::Table(t)
        }
    })
}

/// Lua value → script reply, by Redis's conversion table (numbers truncate to integers; an array
/// stops at its first nil).
fn to_reply(value: Value) -> Result<Reply, String> {
    Ok(match value {
        Value::Nil | Value::Boolean(false) => Reply::Nil,
        Value::Boolean(true) => Reply::Int(1),
        Value::Integer(n) => Reply::Int(n),
        // Redis turns a Lua number into an integer reply by truncation; `as` saturates past i64.
        #[allow(clippy::cast_possible_truncation)]
        Value::Number(n) => Reply::Int(n.trunc() as i64),
        Value::String(s) => Reply::Text(s.to_string_lossy()),
        Value::Table(t) => {
            if let Ok(Value::String(e)) = t.raw_get::<Value>("err") {
                return Err(e.to_string_lossy());
            }
            if let Ok(Value::String(ok)) = t.raw_get::<Value>("ok") {
                return Ok(Reply::Text(ok.to_string_lossy()));
            }
            let mut items = Vec::new();
            for i in 1.. {
                match t.raw_get::<Value>(i).map_err(|e| e.to_string())? {
                    Value::Nil => break,
                    v => items.push(to_reply(v)?),
                }
            }
            Reply::Array(items)
        }
        other => return Err(format!("unsupported script reply type {}", other.type_name())),
    })
}
