//! A TCP proxy between tollgate and Redis that misbehaves as a network does, on the test's word:
//! it can cut a connection right after forwarding a script call (the script runs, its reply is
//! lost), hold replies back past the command timeout, or stop forwarding altogether (a pause).
//! Loopback only; every connection it proxies ends when the proxy is dropped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::procs::{OwnRedis, free_port, redis_cli, wait_for_cluster};

/// What the proxy does to the traffic, changed at any time.
#[derive(Default)]
struct Faults {
    /// Per mille of chunks carrying a script call (`FCALL`, `EVALSHA`) after which the connection
    /// is cut.
    cut_per_mille: AtomicU32,
    /// Replies are held this long before they are forwarded (0: at once)...
    hold_ms: AtomicU64,
    /// ...while any of this many are left to hold.
    holds_left: AtomicU32,
    /// Nothing is forwarded either way while set.
    paused: AtomicBool,
    /// Connections cut so far.
    cuts: AtomicU32,
    /// The cuts are random, and repeat with the seed.
    rng: super::rng::Seeded,
}

impl Faults {
    fn roll(&self, per_mille: u32) -> bool {
        self.rng.below(1000) < u64::from(per_mille)
    }

    async fn wait_while_paused(&self) {
        // Bounded: a pause the test forgot to end lets traffic through after a minute.
        for _ in 0..6_000 {
            if !self.paused.load(Ordering::Relaxed) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A running fault proxy in front of `upstream`.
pub struct FaultProxy {
    pub addr: SocketAddr,
    faults: Arc<Faults>,
    accept: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr, seed: u64) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy listens");
        let addr = listener.local_addr().unwrap();
        let faults = Arc::new(Faults { rng: super::rng::Seeded::new(seed), ..Faults::default() });
        let shared = Arc::clone(&faults);
        let accept = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let faults = Arc::clone(&shared);
                connections.spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        proxy(client, server, &faults).await;
                    }
                });
            }
        });
        FaultProxy { addr, faults, accept }
    }

    /// The `redis://` URL of the proxy.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Cuts the connection after this per mille of the script calls it forwards.
    pub fn cut_after_scripts(&self, per_mille: u32) {
        self.faults.cut_per_mille.store(per_mille, Ordering::Relaxed);
    }

    /// Holds the next `count` replies back `ms` each (then none): a stretch that ends by itself,
    /// however many calls the test makes into it.
    pub fn hold_replies(&self, ms: u64, count: u32) {
        self.faults.holds_left.store(count, Ordering::Relaxed);
        self.faults.hold_ms.store(ms, Ordering::Relaxed);
    }

    /// Stops forwarding (`true`) or resumes.
    pub fn pause(&self, paused: bool) {
        self.faults.paused.store(paused, Ordering::Relaxed);
    }

    /// No faults from now on.
    pub fn calm(&self) {
        self.cut_after_scripts(0);
        self.hold_replies(0, 0);
        self.pause(false);
    }

    /// Connections cut so far.
    pub fn cuts(&self) -> u32 {
        self.faults.cuts.load(Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Forwards one connection both ways until either side closes or a fault cuts it.
async fn proxy(client: TcpStream, server: TcpStream, faults: &Faults) {
    let (mut client_rd, mut client_wr) = client.into_split();
    let (mut server_rd, mut server_wr) = server.into_split();
    let requests = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_rd.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            faults.wait_while_paused().await;
            let chunk = &buf[..n];
            let script = [&b"FCALL"[..], b"EVALSHA"]
                .iter()
                .any(|call| chunk.windows(call.len()).any(|w| w.eq_ignore_ascii_case(call)));
            if server_wr.write_all(chunk).await.is_err() {
                return;
            }
            if script && faults.roll(faults.cut_per_mille.load(Ordering::Relaxed)) {
                // Let the script run, then lose its reply with the connection.
                tokio::time::sleep(Duration::from_millis(20)).await;
                faults.cuts.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    };
    let replies = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_rd.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            faults.wait_while_paused().await;
            let hold = faults.hold_ms.load(Ordering::Relaxed);
            let counted = faults.holds_left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
            if hold > 0 && counted.is_ok() {
                tokio::time::sleep(Duration::from_millis(hold)).await;
            }
            if client_wr.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    // Either direction ending ends the connection: both halves drop here.
    tokio::select! {
        () = requests => {}
        () = replies => {}
    }
}

/// A 3-node Redis Cluster of its own, every node behind a [`FaultProxy`]: each node announces its
/// proxy's port as its own (`cluster-announce-port`), so a client that follows the cluster's slot
/// map reaches every node through its proxy; the nodes gossip on their bus ports, unproxied. The
/// nodes stop when it drops.
pub struct ProxiedCluster {
    pub proxies: Vec<FaultProxy>,
    _nodes: Vec<OwnRedis>,
}

impl ProxiedCluster {
    pub async fn start(seed: u64) -> ProxiedCluster {
        let (mut proxies, mut nodes, mut buses) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..3u64 {
            let (port, bus) = (free_port(), free_port().to_string());
            let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], port)), seed.wrapping_add(i)).await;
            let announced = proxy.addr.port().to_string();
            nodes.push(OwnRedis::start_with(
                port,
                &["--cluster-enabled", "yes", "--cluster-port", &bus, "--cluster-node-timeout", "2000"],
            ));
            // (Announced once the node runs: its own port is free until it binds.)
            redis_cli(port, &["config", "set", "cluster-announce-ip", "127.0.0.1"]);
            redis_cli(port, &["config", "set", "cluster-announce-port", &announced]);
            redis_cli(port, &["config", "set", "cluster-announce-bus-port", &bus]);
            proxies.push(proxy);
            buses.push(bus);
        }
        let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
        for (&port, (first, last)) in ports.iter().zip([(0, 5460), (5461, 10922), (10923, 16383)]) {
            redis_cli(port, &["cluster", "addslotsrange", &first.to_string(), &last.to_string()]);
        }
        for i in 1..3 {
            let announced = proxies[i].addr.port().to_string();
            redis_cli(ports[0], &["cluster", "meet", "127.0.0.1", &announced, &buses[i]]);
        }
        // (A blocking wait, once, while the cluster forms: the proxies forward on other threads.)
        tokio::task::block_in_place(|| wait_for_cluster(&ports));
        ProxiedCluster { proxies, _nodes: nodes }
    }

    /// The nodes' addresses as the cluster announces them: the proxies'.
    pub fn nodes(&self) -> Vec<String> {
        self.proxies.iter().map(|p| p.addr.to_string()).collect()
    }
}
