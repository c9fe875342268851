//! Processes started by tests: tollgate itself, Envoy and grpcurl. Each is started on free
//! loopback ports and killed when its handle drops, so a failing test leaves nothing running.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// A loopback port free now, and never one this test binary handed out before: two calls in a
/// row (a server's main and admin ports) cannot get the same port, which the OS may well give
/// twice once the first probe is closed.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    for _ in 0..1000 {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if GIVEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(port) {
            return port;
        }
    }
    panic!("no loopback port this test binary has not used already in 1,000 tries");
}

/// An HTTP/1.1 GET (the admin port's `/metrics`): the status line and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: tollgate\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// The JSON lines of `path` (a ledger file tollgate appends to) once `done` holds of them, or
/// as they are after 10 s of looking (the caller's assertions then say what is missing).
pub fn json_lines_when(path: &Path, done: impl Fn(&[serde_json::Value]) -> bool) -> Vec<serde_json::Value> {
    let read = || -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let start = Instant::now();
    let mut lines = read();
    while !done(&lines) && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
        lines = read();
    }
    lines
}

/// A directory that is removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("{prefix}-{:016x}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::File::create(&path).unwrap().write_all(text.as_bytes()).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits until `child` accepts TCP connections on `addr` (a listener its own process holds), or
/// panics after `limit`.
pub fn wait_for_port(addr: SocketAddr, limit: Duration, what: &str, child: &mut Child) {
    if let Err(status) = listening(addr, limit, what, child) {
        panic!("{what} exited with {status} before listening on {addr}");
    }
}

/// Waits until the child accepts TCP connections on `addr`, on a listener its own process holds
/// (see holds_listener): the child's exit status if it exited first; panics after `limit`.
fn listening(addr: SocketAddr, limit: Duration, what: &str, child: &mut Child) -> Result<(), ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        // (A connection from an ephemeral port that happens to be `addr`'s own connects to
        // itself while nothing listens there yet: that one does not count.)
        let to_itself = |s: &TcpStream| s.local_addr().ok() == Some(addr);
        if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok_and(|s| !to_itself(&s))
            && holds_listener(child.id(), addr)
        {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{what} did not listen on {addr} within {limit:?}");
}

/// Whether process `pid` holds a socket listening on `addr` (an IPv4 one), by `/proc`: a
/// connection `listening` made may have reached another listener that had the port for a
/// moment (another test's free_port probe, in this very process) while the child was still
/// starting, and the child may then have found the port taken and exited. Where `/proc` cannot
/// tell (not Linux), the connection is taken at its word.
fn holds_listener(pid: u32, addr: SocketAddr) -> bool {
    let SocketAddr::V4(v4) = addr else { return true };
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else { return true };
    // (/proc/net/tcp writes an address as its four bytes in host order, then the port, in hex.)
    let local = format!("{:08X}:{:04X}", u32::from_le_bytes(v4.ip().octets()), v4.port());
    let listening: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            (cols.get(1) == Some(&local.as_str()) && cols.get(3) == Some(&"0A"))
                .then(|| cols.get(9).map(|inode| format!("socket:[{inode}]")))
                .flatten()
        })
        .collect();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|target| listening.iter().any(|l| target.as_os_str() == l.as_str()))
    })
}

pub fn tollgate_bin() -> &'static str {
    env!("CARGO_BIN_EXE_tollgate")
}

/// A running `tollgate serve`.
pub struct Tollgate {
    pub child: Child,
    pub addr: SocketAddr,
    pub dir: TempDir,
}

/// How many ports a test's tollgate start tries before it gives up (see `Tollgate::start_in`).
const START_ATTEMPTS: u32 = 3;

impl Tollgate {
    /// Starts tollgate with this policy text on a free port and waits until it listens.
    pub fn start(policy: &str) -> Tollgate {
        Tollgate::start_with(policy, &[])
    }

    /// The same, with extra `serve` arguments.
    pub fn start_with(policy: &str, extra: &[&str]) -> Tollgate {
        let dir = TempDir::new("tollgate");
        let config = dir.write("policy.yaml", policy);
        Tollgate::start_in(dir, &config, extra)
    }

    /// tollgate serving the policy file at `config` (which the test may change), logging into `dir`.
    pub fn start_in(dir: TempDir, config: &Path, extra: &[&str]) -> Tollgate {
        // On the real clock: its test's budgets count inside one period (see `wait_for_a_turn`).
        std::thread::sleep(super::wait_for_a_turn(super::REAL_CLOCK_SPAN));
        // (`--log info` unless the test gives its own filter.)
        let filter: &[&str] = if extra.contains(&"--log") { &[] } else { &["--log", "info"] };
        let mut attempts = 0;
        loop {
            attempts += 1;
            let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let log = std::fs::File::create(dir.0.join("tollgate.log")).unwrap();
            let mut child = Command::new(tollgate_bin())
                .args(["serve", "--config"])
                .arg(config)
                .args(["--listen", &addr.to_string()])
                .args(filter)
                .args(extra)
                .env_remove("TOLLGATE_LOG_FORMAT")
                .env_remove("RUST_LOG")
                .env_remove("NO_COLOR")
                .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("spawn tollgate");
            let Err(status) = listening(addr, Duration::from_secs(20), "tollgate", &mut child) else {
                return Tollgate { child, addr, dir };
            };
            let log = std::fs::read_to_string(dir.0.join("tollgate.log")).unwrap_or_default();
            // (A free port can be taken before tollgate binds it, by an outgoing connection's
            // ephemeral port among others: another one is tried.)
            if attempts < START_ATTEMPTS && log.contains("cannot listen on") {
                continue;
            }
            panic!("tollgate exited with {status} before listening on {addr}:\n{log}");
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("tollgate.log")).unwrap_or_default()
    }

    /// Sends SIGTERM, as Kubernetes does, and waits (bounded) for the exit.
    pub fn terminate(&mut self, limit: Duration) -> Option<ExitStatus> {
        self.signal("TERM", limit)
    }

    /// Sends a signal by name (`TERM`, `INT`) and waits (bounded) for the exit.
    pub fn signal(&mut self, name: &str, limit: Duration) -> Option<ExitStatus> {
        Command::new("kill").args([&format!("-{name}"), &self.child.id().to_string()]).status().unwrap();
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Tollgate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `tollgate` with arguments to completion, bounded in time. Its output is read as it comes,
/// so a command that writes more than a pipe holds does not stall.
pub fn tollgate_cmd(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(tollgate_bin())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tollgate");
    let drain = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Output { status, stdout: stdout.join().unwrap(), stderr: stderr.join().unwrap() };
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("tollgate {args:?} did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `tollgate` with `input` on stdin: (success, stdout, stderr).
pub fn tollgate_with_stdin(args: &[&str], input: &str) -> (bool, String, String) {
    use std::io::Write;
    let mut child = Command::new(tollgate_bin())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tollgate");
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_string();
    // Written from a thread of its own, so a large output cannot stall a large input.
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    (out.status.success(), String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

/// Validates Kubernetes manifests against the official schemas, offline and strictly (unknown
/// fields are errors): kubernetes-validate, installed from PyPI by `scripts/test`. Kinds it has no
/// schema for (cert-manager's, Prometheus Operator's) pass with a warning. Panics with its report.
pub fn kube_validate(files: &[&Path]) {
    let bin = std::env::var("TOLLGATE_TEST_KUBE_VALIDATE").expect(
        "TOLLGATE_TEST_KUBE_VALIDATE is not set: run the suite with `bash scripts/test`, which installs kubernetes-validate",
    );
    let out = Command::new(bin).args(["--strict", "--quiet"]).args(files).output().expect("kubernetes-validate runs");
    assert!(
        out.status.success(),
        "kubernetes-validate refused {files:?}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn envoy_bin() -> String {
    std::env::var("TOLLGATE_TEST_ENVOY")
        .expect("TOLLGATE_TEST_ENVOY is not set: run the suite with `bash scripts/test`, which installs Envoy")
}

pub fn grpcurl_bin() -> String {
    std::env::var("TOLLGATE_TEST_GRPCURL")
        .expect("TOLLGATE_TEST_GRPCURL is not set: run the suite with `bash scripts/test`, which installs grpcurl")
}

/// The project's Envoy bootstrap with its four ports moved to the given ones.
pub fn envoy_config(listen: u16, admin: u16, tollgate: u16, upstream: u16) -> String {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("envoy/envoy.yaml")).unwrap();
    let mut out = text;
    for (from, to) in [(10000, listen), (9901, admin), (50051, tollgate), (8000, upstream)] {
        let needle = format!("port_value: {from} ");
        assert!(out.contains(&needle), "envoy.yaml no longer has {needle:?}");
        out = out.replace(&needle, &format!("port_value: {to} "));
    }
    out
}

/// Runs `envoy --mode validate` on a bootstrap's text.
pub fn envoy_validate(config: &str) -> Output {
    let dir = TempDir::new("envoy-validate");
    let path = dir.write("envoy.yaml", config);
    Command::new(envoy_bin()).args(["--mode", "validate", "-c"]).arg(&path).output().expect("run envoy")
}

/// A running Envoy.
pub struct Envoy {
    pub child: Child,
    pub port: u16,
    pub dir: TempDir,
}

impl Envoy {
    pub fn start(tollgate: SocketAddr, upstream: u16) -> Envoy {
        Envoy::start_edited(tollgate, upstream, |config| config)
    }

    /// The same, with the bootstrap's text edited first (a route added, a filter changed).
    pub fn start_edited(tollgate: SocketAddr, upstream: u16, edit: impl FnOnce(String) -> String) -> Envoy {
        let dir = TempDir::new("envoy");
        let (port, admin) = (free_port(), free_port());
        let config = dir.write("envoy.yaml", &edit(envoy_config(port, admin, tollgate.port(), upstream)));
        let log = std::fs::File::create(dir.0.join("envoy.log")).unwrap();
        let mut child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&config)
            .args(["--use-dynamic-base-id", "--disable-hot-restart", "-l", "warning", "--concurrency", "1"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn envoy");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        wait_for_port(addr, Duration::from_secs(30), "envoy", &mut child);
        Envoy { child, port, dir }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("envoy.log")).unwrap_or_default()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs grpcurl against `addr` (plaintext), bounded in time.
pub fn grpcurl(addr: SocketAddr, args: &[&str]) -> Output {
    let mut cmd = Command::new(grpcurl_bin());
    cmd.args(["-plaintext", "-max-time", "10"]);
    let (flags, rest): (Vec<&str>, Vec<&str>) = split_grpcurl_args(args);
    cmd.args(flags).arg(addr.to_string()).args(rest);
    cmd.output().expect("run grpcurl")
}

/// grpcurl wants its flags before the address and the verb after it: `-d {..}` stays a flag.
fn split_grpcurl_args<'a>(args: &[&'a str]) -> (Vec<&'a str>, Vec<&'a str>) {
    let mut flags = Vec::new();
    let mut rest = Vec::new();
    let mut i = 0;
    while i < args.len() {
        if args[i].starts_with('-') {
            flags.push(args[i]);
            if matches!(args[i], "-d" | "-H" | "-max-time" | "-protoset" | "-connect-timeout") && i + 1 < args.len() {
                flags.push(args[i + 1]);
                i += 1;
            }
        } else {
            rest.push(args[i]);
        }
        i += 1;
    }
    (flags, rest)
}

/// A redis-server of this test's own, so stopping it disturbs no other test.
pub struct OwnRedis {
    pub child: Child,
    pub port: u16,
    _dir: TempDir,
}

impl OwnRedis {
    pub fn start(port: u16) -> OwnRedis {
        OwnRedis::start_with(port, &[])
    }

    pub fn start_with(port: u16, extra: &[&str]) -> OwnRedis {
        let dir = TempDir::new("own-redis");
        let mut child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir.0)
            .args(extra)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on PATH (scripts/test installs it)");
        let start = Instant::now();
        // (Redis itself answering, not whatever took the port first: then this one has exited.)
        while redis_cli(port, &["PING"]).trim() != "PONG" {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("redis-server exited with {status} before it answered on port {port} (was the port taken?)");
            }
            assert!(start.elapsed() < Duration::from_secs(10), "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        OwnRedis { child, port, _dir: dir }
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A command's reply from the loopback Redis on `port`, as redis-cli prints it (empty when it does
/// not answer).
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli").args(["-p", &port.to_string()]).args(args).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits (at most 30 s) until every node on `ports` says `cluster_state:ok`.
pub fn wait_for_cluster(ports: &[u16]) {
    let start = Instant::now();
    while !ports.iter().all(|&p| redis_cli(p, &["CLUSTER", "INFO"]).contains("cluster_state:ok")) {
        assert!(start.elapsed() < Duration::from_secs(30), "the cluster on {ports:?} did not form");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A Redis Cluster of the test's own on loopback, each primary with one replica, for tests that
/// kill a node (the suite's shared Cluster has no replicas, and other tests use it).
pub struct OwnCluster {
    pub nodes: Vec<OwnRedis>,
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
pub struct ClusterNode {
    pub id: String,
    pub port: u16,
    pub primary: bool,
    pub failed: bool,
    /// The primary it replicates, for a replica.
    pub of: Option<String>,
    pub slots: Vec<(u16, u16)>,
}

impl OwnCluster {
    /// `primaries` primaries and as many replicas; a node is judged failed after `node_timeout_ms`.
    pub fn start(primaries: usize, node_timeout_ms: u64) -> OwnCluster {
        let nodes: Vec<OwnRedis> = (0..primaries * 2)
            .map(|_| {
                let bus = free_port().to_string();
                let timeout = node_timeout_ms.to_string();
                // Each node has a directory of its own, where its nodes.conf goes.
                OwnRedis::start_with(
                    free_port(),
                    &["--cluster-enabled", "yes", "--cluster-port", &bus, "--cluster-node-timeout", &timeout],
                )
            })
            .collect();
        let addresses: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli on PATH (scripts/test installs it)");
        assert!(created.status.success(), "cluster create: {}", String::from_utf8_lossy(&created.stdout));
        let cluster = OwnCluster { nodes };
        // Ready when every node sees every slot served and every replica has synced.
        let start = Instant::now();
        loop {
            let ok =
                cluster.nodes.iter().all(|n| cluster.cli(n.port, &["CLUSTER", "INFO"]).contains("cluster_state:ok"));
            let view = cluster.view();
            let synced = view.iter().filter(|n| !n.primary).count() == primaries
                && view
                    .iter()
                    .filter(|n| !n.primary)
                    .all(|n| cluster.cli(n.port, &["INFO", "replication"]).contains("master_link_status:up"));
            if ok && synced {
                return cluster;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "the cluster did not form: {view:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Every node's address, for `store.redis_cluster`.
    pub fn addresses(&self) -> Vec<String> {
        self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect()
    }

    /// A command's reply as redis-cli prints it (empty when the node does not answer).
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        redis_cli(port, args)
    }

    /// The cluster as the first live node sees it.
    pub fn view(&self) -> Vec<ClusterNode> {
        let text = self
            .nodes
            .iter()
            .map(|n| self.cli(n.port, &["CLUSTER", "NODES"]))
            .find(|t| !t.trim().is_empty())
            .expect("a live node");
        text.lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let port = f.get(1)?.split(['@', ':']).nth(1)?.parse().ok()?;
                let slots = f[8..]
                    .iter()
                    .filter(|s| !s.starts_with('['))
                    .filter_map(|s| {
                        let (a, b) = s.split_once('-').unwrap_or((s, s));
                        Some((a.parse().ok()?, b.parse().ok()?))
                    })
                    .collect();
                Some(ClusterNode {
                    id: f[0].to_string(),
                    port,
                    primary: f[2].contains("master"),
                    failed: f[2].contains("fail"),
                    of: (f[3] != "-").then(|| f[3].to_string()),
                    slots,
                })
            })
            .collect()
    }

    /// The hash slot of a key.
    pub fn slot(&self, key: &str) -> u16 {
        self.cli(self.nodes[0].port, &["CLUSTER", "KEYSLOT", key]).trim().parse().unwrap()
    }

    /// The live primary serving `slot`, if any.
    fn serving(view: &[ClusterNode], slot: u16) -> Option<&ClusterNode> {
        view.iter().find(|n| n.primary && !n.failed && n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
    }

    /// The primary serving `slot`, and its replica.
    pub fn owners(&self, slot: u16) -> (ClusterNode, ClusterNode) {
        let view = self.view();
        let primary = OwnCluster::serving(&view, slot).expect("a primary serves every slot").clone();
        let replica = view.iter().find(|n| n.of.as_ref() == Some(&primary.id)).expect("a replica").clone();
        (primary, replica)
    }

    /// Kills the node on `port` (SIGKILL: no goodbye to the cluster or to clients).
    pub fn kill(&mut self, port: u16) {
        let node = self.nodes.iter_mut().find(|n| n.port == port).unwrap();
        let _ = node.child.kill();
        let _ = node.child.wait();
    }

    /// Waits (at most `limit`) until the node on `port` serves `slot` as a primary, every live node
    /// agrees and the cluster is ok again.
    pub fn wait_serving(&self, port: u16, slot: u16, limit: Duration) {
        let start = Instant::now();
        loop {
            let primary = OwnCluster::serving(&self.view(), slot).map(|n| n.port);
            let ok = self
                .nodes
                .iter()
                .map(|n| self.cli(n.port, &["CLUSTER", "INFO"]))
                .filter(|t| !t.is_empty())
                .all(|t| t.contains("cluster_state:ok"));
            if primary == Some(port) && ok {
                return;
            }
            assert!(start.elapsed() < limit, "no failover within {limit:?}: {:?}", self.view());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
