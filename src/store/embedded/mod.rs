//! The embedded store: the protocol's own Lua, run in-process on Lua 5.1 (the version Redis embeds)
//! against an in-memory [`Keyspace`]. For a single replica with no Redis, and for tests that move
//! an injected clock instead of sleeping.
//!
//! A script runs under one mutex, start to finish, as Redis runs it under its one thread; so the
//! atomicity argument is the same on both stores.

mod keyspace;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use mlua::{Function, Lua, MultiValue, Value};

pub use keyspace::Keyspace;
use keyspace::{Resp, format_number};

use super::clock::{Clock, SystemClock};
use super::{Reply, Script, Store, StoreError};

/// How many expired keys each script call reclaims, at most, besides the ones it touches.
const PURGE_PER_CALL: usize = 32;

struct Host {
    lua: Lua,
    /// Compiled scripts by SHA-1, like Redis's script cache.
    scripts: HashMap<String, Function>,
}

/// What the `redis.call` callback needs, kept in the Lua state's app data.
struct Context {
    keyspace: Keyspace,
    clock: Arc<dyn Clock>,
}

/// The in-process store. Clones share one keyspace.
#[derive(Clone)]
pub struct EmbeddedStore {
    host: Arc<Mutex<Host>>,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore").finish_non_exhaustive()
    }
}

impl EmbeddedStore {
    /// A store on the wall clock.
    pub fn new() -> Result<Self, StoreError> {
        EmbeddedStore::with_clock(Arc::new(SystemClock))
    }

    /// A store on the given clock (a [`super::clock::ManualClock`] in tests).
    pub fn with_clock(clock: Arc<dyn Clock>) -> Result<Self, StoreError> {
        let lua = Lua::new();
        install_redis_api(&lua).map_err(|e| script_error("redis api", e))?;
        lua.set_app_data(Context { keyspace: Keyspace::default(), clock });
        Ok(EmbeddedStore { host: Arc::new(Mutex::new(Host { lua, scripts: HashMap::new() })) })
    }

    /// Number of keys held, expired ones not yet reclaimed included.
    pub fn key_count(&self) -> usize {
        let host = self.lock();
        host.lua.app_data_ref::<Context>().map_or(0, |c| c.keyspace.len())
    }

    fn lock(&self) -> MutexGuard<'_, Host> {
        // A panic inside a script call cannot leave the keyspace half-written in a way a later call
        // could observe differently from Redis (which would also have applied the writes so far).
        self.host.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn compile(host: &mut Host, script: &Script) -> Result<Function, StoreError> {
        if let Some(f) = host.scripts.get(&script.sha1) {
            return Ok(f.clone());
        }
        let f = host
            .lua
            .load(&script.source)
            .set_name(script.name)
            .into_function()
            .map_err(|e| script_error(script.name, e))?;
        host.scripts.insert(script.sha1.clone(), f.clone());
        Ok(f)
    }

    /// Runs a script synchronously. The async [`Store`] methods call this: a script takes
    /// microseconds, less than a hop to a blocking thread would.
    pub fn eval_now(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        let mut host = self.lock();
        let f = EmbeddedStore::compile(&mut host, script)?;
        let lua = &host.lua;
        if let Some(mut ctx) = lua.app_data_mut::<Context>() {
            let now = ctx.clock.now_ms();
            ctx.keyspace.purge_expired(now, PURGE_PER_CALL);
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
        EmbeddedStore::compile(&mut self.lock(), script).map(|_| ())
    }

    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<String>) -> Result<Reply, StoreError> {
        self.eval_now(script, keys, args)
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
            for (i, item) in items.into_iter().enumerate() {
                t.raw_set(i + 1, to_lua(lua, item)?)?;
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
