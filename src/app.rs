//! `serve`, assembled once: the policy and its overrides, the one store choice, the decorators
//! around it, [`Admission`], the background tasks under one tracker (so the drain waits for every
//! task it spawned), the gRPC server, and the drain. [`serve`] takes its listeners and its shutdown
//! as arguments, so a test binds port 0 and cancels a token of its own; [`run`] is what the binary
//! calls.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::Admission;
use crate::config::{ConfigError, Policy};
use crate::grpc::server::{ServeError, serve as serve_grpc};
use crate::grpc::tls::{LiveTls, TlsError};
use crate::metrics::exposition::{ExporterError, Registry};
use crate::reload::Adjust;
use crate::store::backend::Backend;
use crate::store::clock::SystemClock;
use crate::store::{Protocol, Store, StoreError};

/// Why `serve` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Metrics(#[from] ExporterError),
    #[error(transparent)]
    Serve(#[from] ServeError),
}

/// What `tollgate serve` was asked to do.
pub struct ServeOptions {
    /// The policy file, watched for changes.
    pub config: PathBuf,
    /// The file as read at start (before the runtime, whose workers and log format it may set).
    pub loaded: Result<Policy, ConfigError>,
    /// In place of `server.listen`.
    pub listen: Option<SocketAddr>,
    /// What the command line changes in every policy loaded (the health port, the TLS flags).
    pub adjust: Adjust,
    /// Where OTLP metrics and traces go, if anywhere.
    pub otlp_endpoint: Option<String>,
}

/// `tollgate serve`: loads the policy, binds every port, and serves until SIGTERM or SIGINT.
pub async fn run(options: ServeOptions) -> Result<(), RunError> {
    let ServeOptions { config, loaded, listen, adjust, otlp_endpoint } = options;
    let mut policy = loaded?;
    adjust(&mut policy)?;
    let policy = Arc::new(policy);
    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone());
    let registry = Arc::new(Registry::new(otlp_endpoint.as_deref())?);
    let listeners = bind(&policy, listen).await?;
    serve(policy, listeners, shutdown, registry, Some(Watched { path: config, adjust })).await
}

/// `tollgate check-config`: what the policy enforces, or why it would stop `serve` (its TLS
/// files are read too).
pub fn check_config(file: &Path) -> Result<String, String> {
    let policy = Policy::load(file).map_err(|e| e.to_string())?;
    if let Some(tls) = &policy.server.tls {
        crate::grpc::tls::server_config(tls).map_err(|e| format!("{}: {e}", file.display()))?;
    }
    Ok(policy.summary())
}

/// The ports `serve` answers on, and the TLS the main one speaks.
pub struct Listeners {
    pub main: TcpListener,
    pub tls: Option<Arc<LiveTls>>,
    pub health: Option<TcpListener>,
    /// `/metrics`, with `server.admin_listen`.
    pub admin: Option<TcpListener>,
}

/// Reads the TLS files, then binds the policy's (or the override's) address, and the health and
/// admin addresses if there are any. All are bound before anything is served, so a client (or a
/// probe, or a scraper) that finds the main port open finds every port open.
pub async fn bind(policy: &Policy, listen: Option<SocketAddr>) -> Result<Listeners, RunError> {
    let tls = policy.server.tls.as_ref().map(LiveTls::load).transpose()?;
    let addr = listen.unwrap_or(policy.server.listen);
    if policy.server.unauthenticated_beyond_loopback(addr) {
        tracing::warn!(
            %addr,
            "Admission (Commit, Release, Renew, Reserve) is open to every client that reaches this address: \
             bind to loopback beside Envoy, or set server.tls with client_ca and allowed_clients"
        );
    }
    let bind = |addr: SocketAddr| async move {
        TcpListener::bind(addr).await.map_err(|source| RunError::Bind { addr, source })
    };
    let health = match policy.server.health_listen {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    let admin = match policy.server.admin_listen {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    Ok(Listeners { main: bind(addr).await?, tls, health, admin })
}

/// The policy file `serve` reloads, and what it does to each policy it loads.
pub struct Watched {
    pub path: PathBuf,
    pub adjust: Adjust,
}

/// Opens the policy's store, loads the scripts, and serves on `listeners` until `shutdown`,
/// recording into `registry`. Every store call is timed.
pub async fn serve(
    policy: Arc<Policy>,
    listeners: Listeners,
    shutdown: CancellationToken,
    registry: Arc<Registry>,
    watched: Option<Watched>,
) -> Result<(), RunError> {
    let metrics = registry.metrics(&policy);
    let store = Backend::open(&policy, Arc::new(SystemClock)).await?;
    // Outermost, so a call the breaker refuses is timed and counted as the caller saw it.
    let store = crate::metrics::store::measured(store, metrics.clone(), &registry.meter());
    let protocol = Protocol::new(store).await?;
    let admission = Arc::new(Admission::new(Arc::clone(&policy), protocol).with_metrics(metrics));
    serve_admission(&policy, admission, listeners, shutdown, registry, watched).await
}

/// Serves `admission` on `listeners`, with its background tasks, until `shutdown`; then drains.
async fn serve_admission<S: Store>(
    policy: &Policy,
    admission: Arc<Admission<S>>,
    listeners: Listeners,
    shutdown: CancellationToken,
    registry: Arc<Registry>,
    watched: Option<Watched>,
) -> Result<(), RunError> {
    let addr = listeners.main.local_addr().ok();
    let health = listeners.health.as_ref().and_then(|l| l.local_addr().ok());
    let admin_addr = listeners.admin.as_ref().and_then(|l| l.local_addr().ok());
    let tls = policy.server.tls.as_ref().map_or_else(|| "plaintext".to_string(), |t| t.describe());
    // The effective configuration in one line, the same fields in text and JSON.
    tracing::info!(
        listen = %addr.map_or_else(|| "?".to_string(), |a| a.to_string()),
        health = %health.map_or_else(|| "off".to_string(), |a| a.to_string()),
        admin = %admin_addr.map_or_else(|| "off".to_string(), |a| a.to_string()),
        %tls,
        store = %policy.store_address(),
        on_store_error = %policy.store_down_modes(),
        leasing = %policy.leasing_terms(),
        policy_version = %policy.version,
        tenants = policy.tenants.len(),
        plans = policy.plans.len(),
        models = policy.models.len(),
        pools = policy.pools.len(),
        worker_threads = tokio::runtime::Handle::current().metrics().num_workers(),
        "tollgate serving"
    );
    // Lease windows, heartbeats and the admin port run until the server has drained; the policy
    // file is watched until shutdown (no reload while draining). One tracker holds them all, so
    // the drain ends only when every one of them has.
    let drained = CancellationToken::new();
    let tasks = TaskTracker::new();
    if let Some(admin) = listeners.admin {
        // The registry lives as long as the server: its last reference going flushes OTLP.
        tasks.spawn(crate::admin::serve(admin, Arc::clone(&registry), drained.clone()));
    }
    if let Some(w) = watched {
        let every = policy.server.policy_poll;
        tasks.spawn(crate::reload::watch(w.path, every, Arc::clone(&admission), w.adjust, shutdown.clone()));
    }
    let leasing = tasks.spawn(Arc::clone(&admission).run_leases(drained.clone()));
    // Every expired hold settled within a bound, even of tenants that never call again.
    tasks.spawn(Arc::clone(&admission).run_sweeper(drained.clone()));
    // The remaining-budget gauges (nothing is read while nothing records them).
    if let Some(every) = policy.metrics.budget_poll {
        let admission = Arc::clone(&admission);
        let done = drained.clone();
        tasks.spawn(async move { admission.run_budget_gauges(every, done).await });
    }
    // The replica count that on_store_error: local shares limits by.
    tasks.spawn({
        let admission = Arc::clone(&admission);
        let done = drained.clone();
        async move { admission.run_heartbeat(done).await }
    });
    let drain = policy.server.drain_timeout;
    let served =
        serve_grpc(listeners.main, listeners.tls, listeners.health, Arc::clone(&admission), shutdown, drain).await;
    // (The server waited for the reserves whose callers left: what nobody received is given back
    // before the slices are returned.)
    drained.cancel();
    tasks.close();
    if leasing.await.is_err() {
        tracing::warn!("the lease task ended abnormally; unreturned slices stay charged until their lease");
    }
    tasks.wait().await;
    drop(registry);
    served?;
    tracing::info!("tollgate stopped");
    Ok(())
}

/// Kubernetes sends SIGTERM to stop a pod; a terminal sends SIGINT. Either cancels `shutdown`.
/// The handlers are installed before this returns, so call it before the port opens: a signal
/// that arrives once the process is seen to listen is always a drain, never the default kill.
pub fn cancel_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let listen = |kind: SignalKind, name: &'static str| match signal(kind) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!("cannot listen for {name}: {e}");
            None
        }
    };
    let (mut interrupt, mut terminate) =
        (listen(SignalKind::interrupt(), "SIGINT"), listen(SignalKind::terminate(), "SIGTERM"));
    // SIGHUP reloads the policy (crate::reload). Its default action ends the process, so it is
    // taken over from the start: one that arrives before the watcher listens is only missed.
    let _ = listen(SignalKind::hangup(), "SIGHUP");
    tokio::spawn(async move {
        // A signal that cannot be listened for (or whose stream ends) never fires.
        let received = |s: Option<tokio::signal::unix::Signal>| async move {
            if let Some(mut s) = s
                && s.recv().await.is_some()
            {
                return;
            }
            std::future::pending::<()>().await
        };
        tokio::select! {
            () = received(interrupt.take()) => tracing::info!("SIGINT: draining"),
            () = received(terminate.take()) => tracing::info!("SIGTERM: draining"),
        }
        shutdown.cancel();
    });
}
