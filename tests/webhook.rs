//! `tollgate inject --serve`, the mutating admission webhook: real AdmissionReview v1 requests,
//! as the API server posts them, over HTTPS to the running binary. An opted-in pod comes back with
//! a JSON patch that, applied, gives the pod `tollgate inject` makes; an opted-out, an already
//! injected and a refused pod are admitted unchanged (the refused one with a warning); what is not
//! an AdmissionReview is answered 400.

mod support;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use support::certs::Ca;
use support::procs::{TempDir, tollgate_bin};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SERVER_NAME: &str = "tollgate-injector.tollgate.svc";

struct Webhook {
    child: Child,
    addr: SocketAddr,
    ca: std::path::PathBuf,
    _dir: TempDir,
}

impl Drop for Webhook {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Webhook {
    fn start() -> Webhook {
        let dir = TempDir::new("webhook");
        let ca = Ca::new(&dir, "cluster-ca");
        let server = ca.server(&dir, "injector", &[SERVER_NAME]);
        // Port 0: the webhook says where it listens, so no other test's server can be mistaken
        // for it.
        let mut child = Command::new(tollgate_bin())
            .args([
                "inject",
                "--serve",
                "--listen",
                "127.0.0.1:0",
                "--tls-cert",
                server.cert(),
                "--tls-key",
                server.key(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.split("https://").nth(1) {
                    let _ = tx.send(addr.trim().to_string());
                }
            }
        });
        let addr: SocketAddr = rx
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("the webhook did not say where it listens: {:?}", child.try_wait()))
            .parse()
            .unwrap();
        Webhook { child, addr, ca: ca.cert.clone(), _dir: dir }
    }

    /// One HTTPS request: (status, body).
    async fn request(&self, method: &str, body: &str) -> (u16, String) {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, ServerName};
        use tokio_rustls::rustls::{ClientConfig, RootCertStore, crypto::ring};
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&self.ca).unwrap() {
            roots.add(cert.unwrap()).unwrap();
        }
        let config = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let mut tls = connector.connect(ServerName::try_from(SERVER_NAME).unwrap(), tcp).await.unwrap();
        let request = format!(
            "{method} /inject?timeout=10s HTTP/1.1\r\nHost: {SERVER_NAME}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(request.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        let _ = tls.read_to_end(&mut response).await;
        let text = String::from_utf8(response).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP response: {text:?}"));
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, body.to_string())
    }

    /// Posts an AdmissionReview for `pod`; returns its response.
    async fn review(&self, pod: &Value) -> Value {
        let review = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": { "group": "", "version": "v1", "kind": "Pod" },
                "resource": { "group": "", "version": "v1", "resource": "pods" },
                "namespace": "chat",
                "operation": "CREATE",
                "userInfo": { "username": "system:serviceaccount:kube-system:replicaset-controller" },
                "object": pod,
                "dryRun": false
            }
        });
        let (status, body) = self.request("POST", &review.to_string()).await;
        assert_eq!(status, 200, "{body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            (answer["apiVersion"].as_str(), answer["kind"].as_str()),
            (Some("admission.k8s.io/v1"), Some("AdmissionReview"))
        );
        let response = answer["response"].clone();
        assert_eq!(response["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002", "the request's uid");
        assert_eq!(response["allowed"], true, "a pod is never refused: {response}");
        response
    }
}

/// A pod as a ReplicaSet creates it (no name yet, a generateName).
fn pod(annotations: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "generateName": "chat-7d4b9c-", "namespace": "chat", "labels": { "app": "chat" }, "annotations": annotations },
        "spec": {
            "containers": [{ "name": "vllm", "image": "vllm/vllm-openai:latest", "ports": [{ "containerPort": 8000 }] }],
            "serviceAccountName": "chat"
        }
    })
}

/// Applies a JSON patch of `add` operations (all the webhook sends).
fn apply(mut doc: Value, ops: &Value) -> Value {
    for op in ops.as_array().unwrap() {
        assert_eq!(op["op"], "add", "{op}");
        let path: Vec<String> =
            op["path"].as_str().unwrap().split('/').skip(1).map(|p| p.replace("~1", "/").replace("~0", "~")).collect();
        let (last, parents) = path.split_last().unwrap();
        let mut at = &mut doc;
        for p in parents {
            at = at.get_mut(p.as_str()).unwrap_or_else(|| panic!("no {p} for {op}"));
        }
        at.as_object_mut().unwrap().insert(last.clone(), op["value"].clone());
    }
    doc
}

fn patch_of(response: &Value) -> Option<Value> {
    let patch = response["patch"].as_str()?;
    assert_eq!(response["patchType"], "JSONPatch");
    Some(serde_json::from_slice(&base64::engine::general_purpose::STANDARD.decode(patch).unwrap()).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_opted_in_pod_is_patched_into_the_pod_inject_makes() {
    let webhook = Webhook::start();
    let original = pod(json!({ "tollgate.io/inject": "enabled" }));
    let response = webhook.review(&original).await;
    let patched = apply(original.clone(), &patch_of(&response).expect("a patch"));
    let init = patched["spec"]["initContainers"].as_array().unwrap();
    assert_eq!((init[0]["name"].as_str(), init[1]["name"].as_str()), (Some("tollgate"), Some("tollgate-envoy")));
    assert_eq!(init[0]["restartPolicy"], "Always");
    assert_eq!(init[0]["readinessProbe"]["grpc"]["port"], 50052);
    assert_eq!(patched["spec"]["volumes"][0]["configMap"]["name"], "tollgate-policy");
    assert_eq!(patched["metadata"]["annotations"]["tollgate.io/injected"], env!("CARGO_PKG_VERSION"));
    assert_eq!(patched["metadata"]["annotations"]["tollgate.io/inject"], "enabled", "the pod's annotations stay");
    assert_eq!(patched["spec"]["containers"], original["spec"]["containers"], "the application is untouched");
    assert_eq!(patched["spec"]["serviceAccountName"], "chat");
    // The same pod through `tollgate inject` is the same pod.
    let yaml = serde_yaml::to_string(&original).unwrap();
    let (ok, out, err) = support::procs::tollgate_with_stdin(&["inject"], &yaml);
    assert!(ok, "{err}");
    let injected: Value = serde_json::to_value(serde_yaml::from_str::<serde_yaml::Value>(&out).unwrap()).unwrap();
    assert_eq!(patched, injected);
    // Sent again (a retried admission), the injected pod needs nothing more.
    let again = webhook.review(&patched).await;
    assert!(patch_of(&again).is_none(), "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opted_out_and_refused_pods_are_admitted_as_they_are() {
    let webhook = Webhook::start();
    for disabled in [json!({ "tollgate.io/inject": "disabled" })] {
        let response = webhook.review(&pod(disabled)).await;
        assert!(patch_of(&response).is_none(), "{response}");
    }
    let mut labelled = pod(json!({}));
    labelled["metadata"]["labels"]["tollgate.io/inject"] = "disabled".into();
    assert!(patch_of(&webhook.review(&labelled).await).is_none());
    // A pod inject refuses is admitted unchanged, with the reason as a warning.
    let mut mine = pod(json!({}));
    mine["spec"]["containers"][0]["name"] = "tollgate".into();
    let response = webhook.review(&mine).await;
    assert!(patch_of(&response).is_none());
    let warning = response["warnings"][0].as_str().unwrap();
    assert!(warning.contains("already has a container named tollgate"), "{warning}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_not_an_admission_review_is_answered_400() {
    let webhook = Webhook::start();
    let (status, body) = webhook.request("POST", "{not json").await;
    assert_eq!(status, 400);
    assert!(body.contains("not JSON"), "{body}");
    let (status, body) = webhook.request("POST", r#"{"apiVersion":"v1","kind":"Pod"}"#).await;
    assert_eq!(status, 400);
    assert!(body.contains("not an admission.k8s.io/v1 AdmissionReview"), "{body}");
    let no_uid = json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": { "object": {} } });
    let (status, body) = webhook.request("POST", &no_uid.to_string()).await;
    assert_eq!(status, 400);
    assert!(body.contains("no request.uid"), "{body}");
    let (status, _) = webhook.request("GET", "").await;
    assert_eq!(status, 405);
}

/// deploy/webhook.yaml wires what this file tests: the configuration calls the Service, on the
/// path and port the injector serves, with the CA cert-manager issues for the Service's name; it
/// selects opted-in namespaces and opted-in pods, never both for one pod, never a disabled one.
#[test]
fn the_deployed_webhook_calls_the_injector_it_deploys() {
    let text =
        std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/webhook.yaml")).unwrap();
    let docs: Vec<serde_yaml::Value> =
        serde_yaml::Deserializer::from_str(&text).map(|d| serde::Deserialize::deserialize(d).unwrap()).collect();
    let find = |kind: &str| docs.iter().find(|d| d["kind"] == kind).unwrap_or_else(|| panic!("no {kind}"));
    let (config, service, deployment, certificate) =
        (find("MutatingWebhookConfiguration"), find("Service"), find("Deployment"), find("Certificate"));
    let namespace = service["metadata"]["namespace"].as_str().unwrap();
    let service_name = service["metadata"]["name"].as_str().unwrap();
    assert_eq!(
        config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].as_str(),
        Some(format!("{namespace}/{}", certificate["metadata"]["name"].as_str().unwrap()).as_str())
    );
    assert_eq!(certificate["spec"]["dnsNames"][0].as_str(), Some(format!("{service_name}.{namespace}.svc").as_str()));
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = container["args"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert_eq!(&args[..2], ["inject", "--serve"]);
    assert!(args.contains(&"--listen=0.0.0.0:8443"));
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "webhook");
    assert_eq!(container["ports"][0]["containerPort"], 8443);
    let secret = deployment["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"].as_str();
    assert_eq!(secret, certificate["spec"]["secretName"].as_str(), "the injector mounts the certificate's secret");
    let webhooks = config["webhooks"].as_sequence().unwrap();
    assert_eq!(webhooks.len(), 2);
    for w in webhooks {
        let client = &w["clientConfig"]["service"];
        assert_eq!((client["name"].as_str(), client["namespace"].as_str()), (Some(service_name), Some(namespace)));
        assert_eq!(client["port"], service["spec"]["ports"][0]["port"]);
        assert_eq!(w["admissionReviewVersions"][0], "v1");
        assert_eq!(w["rules"][0]["resources"][0], "pods");
    }
    let (by_namespace, by_pod) = (&webhooks[0], &webhooks[1]);
    assert_eq!(by_namespace["namespaceSelector"]["matchLabels"]["tollgate.io/inject"], "enabled");
    assert_eq!(by_namespace["objectSelector"]["matchExpressions"][0]["values"][0], "disabled");
    assert_eq!(by_pod["objectSelector"]["matchLabels"]["tollgate.io/inject"], "enabled");
    assert_eq!(by_pod["namespaceSelector"]["matchExpressions"][0]["values"][0], "enabled", "never called twice");
}
