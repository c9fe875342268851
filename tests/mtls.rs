//! Mutual TLS between Envoy and tollgate (`server.tls`, envoy/mtls.yaml), with certificates the
//! test makes: real Envoy presenting an allowed identity is served (Check, then the commit from the
//! response over the ext_proc stream); a certificate from the same CA naming another identity, one
//! from another CA, none at all, and plaintext are all refused in the handshake, so no call reaches
//! tollgate; the health port stays plaintext for probes; the `--tls-*` flags replace the policy's
//! TLS; and TLS files that cannot be used stop the start with the field named.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use support::certs::{Ca, Pem};
use support::procs::{Envoy, TempDir, Tollgate, free_port, grpcurl, grpcurl_bin, tollgate_cmd};
use support::upstream::{Upstream, post};

const ENVOY_ID: &str = "spiffe://cluster.local/ns/llm/sa/envoy";
const SERVER_NAME: &str = "tollgate.llm.svc";
const POLICY: &str =
    "models:\n  m: { max_output_tokens: 64 }\ntenants:\n  acme:\n    limits: { tokens_per_minute: 60000 }\n";
const CHAT: &str = r#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#;

/// A CA with tollgate's certificate and three clients: Envoy (allowed), an intruder (same CA,
/// another identity) and a stranger (Envoy's identity, another CA).
struct Pki {
    dir: TempDir,
    ca: Ca,
    server: Pem,
    envoy: Pem,
    intruder: Pem,
    stranger: Pem,
}

impl Pki {
    fn new() -> Pki {
        let dir = TempDir::new("pki");
        let ca = Ca::new(&dir, "ca");
        let server = ca.server(&dir, "tollgate", &[SERVER_NAME]);
        let envoy = ca.client(&dir, "envoy", ENVOY_ID);
        let intruder = ca.client(&dir, "intruder", "spiffe://cluster.local/ns/llm/sa/intruder");
        let stranger = Ca::new(&dir, "other-ca").client(&dir, "stranger", ENVOY_ID);
        Pki { dir, ca, server, envoy, intruder, stranger }
    }

    fn policy(&self, health_port: u16) -> String {
        format!(
            "server:\n  health_listen: 127.0.0.1:{health_port}\n  tls:\n    cert: {}\n    key: {}\n    client_ca: {}\n    allowed_clients: [\"{ENVOY_ID}\"]\n{POLICY}",
            self.server.cert(),
            self.server.key(),
            self.ca.cert()
        )
    }
}

/// envoy.yaml with envoy/mtls.yaml's transport socket in its tollgate cluster, presenting `client`.
fn with_mtls(config: String, client: &Pem, ca: &Path) -> String {
    let fragment = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("envoy/mtls.yaml")).unwrap();
    let socket: String = fragment
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| format!("      {l}\n"))
        .collect::<String>()
        .replace("/etc/envoy/tls/envoy.crt", client.cert())
        .replace("/etc/envoy/tls/envoy.key", client.key())
        .replace("/etc/envoy/tls/ca.crt", ca.to_str().unwrap());
    let anchor = "      connect_timeout: 0.25s\n";
    assert_eq!(config.matches(anchor).count(), 1, "envoy.yaml's tollgate cluster changed");
    config.replacen(anchor, &format!("{anchor}{socket}"), 1)
}

/// grpcurl over TLS, trusting the test CA, presenting `client` if any.
fn grpcurl_tls(addr: SocketAddr, ca: &Path, client: Option<&Pem>, args: &[&str]) -> Output {
    let mut cmd = Command::new(grpcurl_bin());
    cmd.args(["-max-time", "10", "-connect-timeout", "3", "-servername", SERVER_NAME, "-cacert", ca.to_str().unwrap()]);
    if let Some(c) = client {
        cmd.args(["-cert", c.cert(), "-key", c.key()]);
    }
    let (flags, rest): (Vec<&str>, Vec<&str>) = args.iter().partition(|a| a.starts_with('-') || a.starts_with('{'));
    cmd.args(flags).arg(addr.to_string()).args(rest);
    cmd.output().expect("run grpcurl")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_with_an_allowed_certificate_is_served_and_no_other_is() {
    let pki = Pki::new();
    let tollgate = Tollgate::start(&pki.policy(free_port()));
    // The backend commits nothing itself (its commits would need a client certificate too): the
    // commit from the response, over Envoy's ext_proc stream to tollgate, settles each hold.
    let upstream = Upstream::start(tollgate.endpoint()).await;
    let envoy = Envoy::start_edited(tollgate.addr, upstream.port, |c| with_mtls(c, &pki.envoy, &pki.ca.cert));
    let headers = [
        ("x-tenant-id", "acme"),
        ("x-test-skip-commit", "1"),
        ("x-test-silent-commit", "1"),
        ("x-test-output-tokens", "5"),
    ];
    let r = post(envoy.port, "/v1/chat/completions", &headers, CHAT).await;
    assert_eq!(r.status, 200, "{r:?}\n{}\n{}", envoy.log(), tollgate.log());
    let id = r.header("x-test-reservation").unwrap().to_string();
    assert!(id.starts_with("acme:"), "{r:?}");

    // Committed from the response; asked over mTLS with grpcurl, as an operator would.
    let renew = format!(r#"{{"reservation_id":"{id}","lease_ms":0}}"#);
    let start = Instant::now();
    loop {
        let out =
            grpcurl_tls(tollgate.addr, &pki.ca.cert, Some(&pki.envoy), &["-d", &renew, "tollgate.v1.Admission/Renew"]);
        assert!(out.status.success(), "{}", text(&out));
        if String::from_utf8_lossy(&out.stdout).contains("\"committed\"") {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "never committed: {}\n{}", text(&out), tollgate.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The same CA, another identity: the handshake fails, Envoy answers its status_on_error (503)
    // and nothing reaches the backend.
    let intruder = Envoy::start_edited(tollgate.addr, upstream.port, |c| with_mtls(c, &pki.intruder, &pki.ca.cert));
    let r = post(intruder.port, "/v1/chat/completions", &[("x-tenant-id", "acme")], CHAT).await;
    assert_eq!(r.status, 503, "{r:?}");
    assert!(r.header("x-test-reservation").is_none(), "reached the backend: {r:?}");
    let log = tollgate.log();
    assert!(log.contains("refused a client certificate") && log.contains("sa/intruder"), "{log}");
}

#[test]
fn only_an_allowed_client_completes_the_handshake() {
    let pki = Pki::new();
    let health_port = free_port();
    let tollgate = Tollgate::start(&pki.policy(health_port));
    let ca = &pki.ca.cert;
    let allowed = grpcurl_tls(tollgate.addr, ca, Some(&pki.envoy), &["list"]);
    assert!(allowed.status.success() && text(&allowed).contains("tollgate.v1.Admission"), "{}", text(&allowed));
    let reserve = r#"{"tenant":"acme","model":"m","max_tokens":1}"#;
    let admitted = grpcurl_tls(tollgate.addr, ca, Some(&pki.envoy), &["-d", reserve, "tollgate.v1.Admission/Reserve"]);
    assert!(text(&admitted).contains("\"admitted\": true"), "{}", text(&admitted));

    for (what, client) in
        [("no certificate", None), ("another identity", Some(&pki.intruder)), ("another CA", Some(&pki.stranger))]
    {
        let out = grpcurl_tls(tollgate.addr, ca, client, &["-d", reserve, "tollgate.v1.Admission/Reserve"]);
        assert!(!out.status.success(), "{what} was served: {}", text(&out));
        assert!(!text(&out).contains("admitted"), "{what}: {}", text(&out));
    }
    let plaintext = grpcurl(tollgate.addr, &["-connect-timeout", "2", "-d", reserve, "tollgate.v1.Admission/Reserve"]);
    assert!(!plaintext.status.success(), "plaintext was served: {}", text(&plaintext));

    // Probes stay plaintext, on the health port.
    let protoset = pki.dir.write("health.protoset", "");
    std::fs::write(&protoset, tonic_health::pb::FILE_DESCRIPTOR_SET).unwrap();
    let health: SocketAddr = format!("127.0.0.1:{health_port}").parse().unwrap();
    let probe = grpcurl(health, &["-protoset", protoset.to_str().unwrap(), "grpc.health.v1.Health/Check"]);
    assert!(text(&probe).contains("SERVING"), "{}", text(&probe));
    assert!(tollgate.log().contains("mutual TLS"), "the start says how it serves:\n{}", tollgate.log());
}

/// `--tls-*` flags replace the policy's TLS (here a plaintext policy); `*` allows any certificate
/// the CA signed, and only those.
#[test]
fn tls_flags_replace_the_policy_and_a_star_allows_the_whole_ca() {
    let pki = Pki::new();
    let flags = [
        "--tls-cert",
        pki.server.cert(),
        "--tls-key",
        pki.server.key(),
        "--tls-client-ca",
        pki.ca.cert(),
        "--tls-allow-client",
        "*",
    ];
    let tollgate = Tollgate::start_with(POLICY, &flags);
    let ca = &pki.ca.cert;
    for client in [&pki.envoy, &pki.intruder] {
        let out = grpcurl_tls(tollgate.addr, ca, Some(client), &["list"]);
        assert!(out.status.success(), "{}: {}", client.cert(), text(&out));
    }
    assert!(!grpcurl_tls(tollgate.addr, ca, Some(&pki.stranger), &["list"]).status.success());
    assert!(!grpcurl(tollgate.addr, &["-connect-timeout", "2", "list"]).status.success(), "plaintext served");
}

/// TLS files tollgate cannot use stop the start, naming the field and the file; check-config
/// reads them too.
#[test]
fn unusable_tls_files_stop_the_start() {
    let pki = Pki::new();
    let other = pki.ca.server(&pki.dir, "other", &[SERVER_NAME]);
    let missing = pki.dir.0.join("missing.crt");
    let not_pem = pki.dir.write("not-pem.crt", "not a certificate\n");
    let cases = [
        (missing.to_str().unwrap(), pki.server.key(), pki.ca.cert(), "server.tls.cert"),
        (not_pem.to_str().unwrap(), pki.server.key(), pki.ca.cert(), "holds no PEM certificate"),
        (pki.server.cert(), other.key(), pki.ca.cert(), "server.tls.key"),
        (pki.server.cert(), pki.server.key(), not_pem.to_str().unwrap(), "server.tls.client_ca"),
    ];
    for (i, (cert, key, ca, expected)) in cases.into_iter().enumerate() {
        let policy = format!(
            "server:\n  tls: {{ cert: {cert}, key: {key}, client_ca: {ca}, allowed_clients: [\"*\"] }}\n{POLICY}"
        );
        let file = pki.dir.write(&format!("policy-{i}.yaml"), &policy);
        let file = file.to_str().unwrap();
        let listen = format!("127.0.0.1:{}", free_port());
        for args in [vec!["check-config", file], vec!["serve", "--config", file, "--listen", &listen]] {
            let out = tollgate_cmd(&args, Duration::from_secs(10));
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{args:?} accepted {policy}");
            assert!(stderr.contains(expected), "{args:?}: expected {expected:?} in {stderr}");
        }
    }
    // A key that does not go with the certificate says so.
    let policy = format!("server:\n  tls: {{ cert: {}, key: {} }}\n{POLICY}", pki.server.cert(), other.key());
    let file = pki.dir.write("mismatch.yaml", &policy);
    let out = tollgate_cmd(&["check-config", file.to_str().unwrap()], Duration::from_secs(10));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not go with server.tls.cert"), "{out:?}");
}

/// What certificate tollgate presents to a new mutually authenticated connection.
async fn presented(addr: SocketAddr, ca: &Path, client: &Pem) -> Result<Vec<u8>, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore, crypto::ring};
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let chain: Vec<_> = CertificateDer::pem_file_iter(&client.cert).unwrap().map(Result::unwrap).collect();
    let key = PrivateKeyDer::from_pem_file(&client.key).unwrap();
    let config = ClientConfig::builder_with_provider(std::sync::Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tls = connector.connect(ServerName::try_from(SERVER_NAME).unwrap(), tcp).await.map_err(|e| e.to_string())?;
    let certs = tls.get_ref().1.peer_certificates().ok_or("no certificate")?;
    Ok(certs[0].as_ref().to_vec())
}

fn der(pem: &Pem) -> Vec<u8> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    CertificateDer::from_pem_file(&pem.cert).unwrap().as_ref().to_vec()
}

/// A certificate rotated on disk (as cert-manager rotates a Secret) is presented to new
/// connections within the reload interval, without a restart; files that cannot be used are
/// refused and the certificate in force stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_is_used_without_a_restart() {
    let pki = Pki::new();
    let live = TempDir::new("tls");
    let (cert, key) = (live.0.join("tls.crt"), live.0.join("tls.key"));
    let install = |pem: &Pem| {
        for (from, to) in [(&pem.key, &key), (&pem.cert, &cert)] {
            let tmp = to.with_extension("new");
            std::fs::copy(from, &tmp).unwrap();
            std::fs::rename(&tmp, to).unwrap();
        }
    };
    install(&pki.server);
    let policy = format!(
        "server:\n  tls:\n    cert: {}\n    key: {}\n    client_ca: {}\n    allowed_clients: [\"{ENVOY_ID}\"]\n    reload_ms: 100\n{POLICY}",
        cert.display(),
        key.display(),
        pki.ca.cert()
    );
    let tollgate = Tollgate::start(&policy);
    let ca = &pki.ca.cert;
    assert_eq!(presented(tollgate.addr, ca, &pki.envoy).await.unwrap(), der(&pki.server));

    let rotated = pki.ca.server(&pki.dir, "rotated", &[SERVER_NAME]);
    install(&rotated);
    let start = Instant::now();
    while presented(tollgate.addr, ca, &pki.envoy).await.ok() != Some(der(&rotated)) {
        assert!(start.elapsed() < Duration::from_secs(10), "never rotated:\n{}", tollgate.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A broken certificate file: refused, and the rotated certificate stays in force.
    std::fs::write(&cert, "not a certificate\n").unwrap();
    let start = Instant::now();
    while !tollgate.log().contains("cannot be used; the ones in force stay") {
        assert!(start.elapsed() < Duration::from_secs(10), "{}", tollgate.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(presented(tollgate.addr, ca, &pki.envoy).await.unwrap(), der(&rotated));
}

/// Budgets/Adjust over mutual TLS: the client certificate naming an identity `budget_admins`
/// lists may adjust (and is entered as who asked); Envoy's, allowed to connect, may not; loopback
/// is not enough when the list does not name it.
#[test]
fn only_a_budget_admins_certificate_may_adjust() {
    let pki = Pki::new();
    const OPS_ID: &str = "spiffe://cluster.local/ns/ops/sa/finance";
    let ops = pki.ca.client(&pki.dir, "ops", OPS_ID);
    let ledger = pki.dir.0.join("ledger.jsonl");
    let policy = format!(
        "server:\n  budget_admins: [\"{OPS_ID}\"]\n  tls:\n    cert: {}\n    key: {}\n    client_ca: {}\n    allowed_clients: [\"{ENVOY_ID}\", \"{OPS_ID}\"]\n\
         ledger:\n  file: {}\n\
         models:\n  m: {{ max_output_tokens: 64 }}\ntenants:\n  acme:\n    limits: {{ tokens_per_day: 1000 }}\n",
        pki.server.cert(),
        pki.server.key(),
        pki.ca.cert(),
        ledger.display()
    );
    let tollgate = Tollgate::start(&policy);
    let adjust = r#"{"tenant":"acme","budget":"tokens_per_day","amount":-10,"request_id":"fin-1","reason":"a test"}"#;
    let envoy =
        grpcurl_tls(tollgate.addr, &pki.ca.cert, Some(&pki.envoy), &["-d", adjust, "tollgate.v1.Budgets/Adjust"]);
    assert!(!envoy.status.success() && text(&envoy).contains("PermissionDenied"), "{}", text(&envoy));
    let by_ops = grpcurl_tls(tollgate.addr, &pki.ca.cert, Some(&ops), &["-d", adjust, "tollgate.v1.Budgets/Adjust"]);
    assert!(by_ops.status.success() && text(&by_ops).contains("\"adjusted\""), "{}", text(&by_ops));
    assert!(tollgate.log().contains(OPS_ID), "the log says who adjusted:\n{}", tollgate.log());
    // The ledger names the certificate's identity.
    let adjustment = |e: &serde_json::Value| e["id"] == "adjust:fin-1";
    let entries = support::procs::json_lines_when(&ledger, |e| e.iter().any(adjustment));
    let entry = entries.iter().find(|e| adjustment(e)).unwrap_or_else(|| panic!("not in the ledger: {entries:?}"));
    assert_eq!((&entry["adjusted_by"], &entry["reason"]), (&OPS_ID.into(), &"a test".into()), "{entry}");
}
