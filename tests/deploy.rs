//! The Kubernetes example parses, and says what it claims: tollgate as a native sidecar with gRPC
//! health probes, its policy valid, its Envoy bootstrap valid to Envoy itself.

mod support;

use std::path::Path;

use serde::Deserialize;
use serde_yaml::Value;
use tollgate::config::{Policy, StoreChoice};

fn manifests() -> Vec<Value> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let mut docs = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if !name.ends_with(".yaml") || name.ends_with("policy.yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value = Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if !value.is_null() {
                docs.push(value);
            }
        }
    }
    docs
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

#[test]
fn every_manifest_is_a_named_kubernetes_object() {
    let docs = manifests();
    assert!(docs.len() >= 6);
    for d in &docs {
        assert!(d["apiVersion"].as_str().is_some(), "{d:?}");
        assert!(d["kind"].as_str().is_some(), "{d:?}");
        assert!(d["metadata"]["name"].as_str().is_some(), "{d:?}");
    }
}

#[test]
fn tollgate_runs_as_a_native_sidecar_with_grpc_probes() {
    let docs = manifests();
    let pod = &find(&docs, "Deployment", "inference")["spec"]["template"]["spec"];
    let init = pod["initContainers"].as_sequence().unwrap();
    let tollgate = init.iter().find(|c| c["name"] == "tollgate").expect("tollgate init container");
    assert_eq!(tollgate["restartPolicy"], "Always", "a native sidecar");
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        assert_eq!(tollgate[probe]["grpc"]["port"], 50052, "{probe} uses the gRPC health service on its port");
    }
    let first = init[0]["name"].as_str().unwrap();
    assert_eq!(first, "tollgate", "tollgate starts before Envoy sends it Checks");
    assert!(init.iter().any(|c| c["name"] == "envoy"));
    assert!(pod["containers"].as_sequence().unwrap().iter().any(|c| c["name"] == "inference"));
    find(&docs, "Service", "redis");
}

#[test]
fn the_configmap_policy_is_valid_and_uses_redis() {
    let docs = manifests();
    let text = find(&docs, "ConfigMap", "tollgate-policy")["data"]["policy.yaml"].as_str().unwrap();
    let policy = Policy::parse("deploy/kubernetes.yaml#tollgate-policy", text).unwrap();
    assert_eq!(policy.store.choice, StoreChoice::Redis { url: "redis://redis:6379".into() });
    assert_eq!(policy.server.listen.to_string(), "127.0.0.1:50051", "decisions and Admission on loopback only");
    assert_eq!(policy.server.health_listen.map(|h| h.to_string()).as_deref(), Some("0.0.0.0:50052"));
    // Metrics on the pod's network for Prometheus, on the port the pod declares and annotates.
    let admin = policy.server.admin_listen.expect("the example serves /metrics");
    let pod = &find(&docs, "Deployment", "inference")["spec"]["template"];
    assert_eq!(pod["metadata"]["annotations"]["prometheus.io/port"].as_str(), Some(admin.port().to_string().as_str()));
    let tollgate = &pod["spec"]["initContainers"][0];
    let ports = tollgate["ports"].as_sequence().unwrap();
    assert!(
        ports.iter().any(|p| p["name"] == "metrics" && p["containerPort"].as_u64() == Some(u64::from(admin.port())))
    );
}

#[test]
fn the_configmap_envoy_bootstrap_validates() {
    let docs = manifests();
    let text = find(&docs, "ConfigMap", "envoy-config")["data"]["envoy.yaml"].as_str().unwrap();
    let out = support::procs::envoy_validate(text);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let authz = text.find("envoy.filters.http.ext_authz").expect("ext_authz");
    let ext_proc = text.find("envoy.filters.http.ext_proc").expect("ext_proc commits from the response");
    assert!(authz < ext_proc, "ext_proc runs after ext_authz, so it sees the reservation");
}

/// The connection manager of an Envoy bootstrap's first listener.
fn connection_manager(bootstrap: &Value) -> &Value {
    &bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
}

fn http_filter<'a>(manager: &'a Value, name: &str) -> &'a Value {
    let filters = manager["http_filters"].as_sequence().expect("http_filters");
    &filters.iter().find(|f| f["name"] == name).unwrap_or_else(|| panic!("no {name}"))["typed_config"]
}

/// The Kubernetes Envoy closes the loop exactly as envoy/envoy.yaml does (the tests run the latter):
/// the same ext_authz and ext_proc settings and access logs, so the two copies cannot drift apart.
#[test]
fn the_configmap_envoy_closes_the_loop_as_the_shipped_one() {
    let docs = manifests();
    let k8s: Value =
        serde_yaml::from_str(find(&docs, "ConfigMap", "envoy-config")["data"]["envoy.yaml"].as_str().unwrap()).unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("envoy/envoy.yaml");
    let shipped: Value = serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let (k8s, shipped) = (connection_manager(&k8s), connection_manager(&shipped));
    assert_eq!(k8s["access_log"], shipped["access_log"], "access logs");
    for filter in ["envoy.filters.http.ext_authz", "envoy.filters.http.ext_proc"] {
        assert_eq!(http_filter(k8s, filter), http_filter(shipped, filter), "{filter}");
    }
}

/// The shipped ext_proc filter forwards exactly the headers the commit from the response reads:
/// none it reads is left out (the read would find nothing, in production alone: a test's debug
/// build asserts it reads no other), and none it does not read is sent.
#[test]
fn the_shipped_ext_proc_forwards_exactly_the_headers_tollgate_reads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("envoy/envoy.yaml");
    let shipped: Value = serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ext_proc = http_filter(connection_manager(&shipped), "envoy.filters.http.ext_proc");
    let patterns = ext_proc["forward_rules"]["allowed_headers"]["patterns"].as_sequence().expect("forward_rules");
    let mut forwarded: Vec<&str> =
        patterns.iter().map(|p| p["exact"].as_str().unwrap_or_else(|| panic!("not an exact name: {p:?}"))).collect();
    let mut read = tollgate::grpc::headers::EXT_PROC_READS.to_vec();
    forwarded.sort_unstable();
    read.sort_unstable();
    assert_eq!(forwarded, read);
}

#[test]
fn the_demo_policy_is_valid_and_pools_its_model() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/demo-policy.yaml");
    let policy = Policy::load(&path).unwrap();
    assert_eq!(policy.models["sim"].pool.as_deref(), Some("gpu"));
}

#[test]
fn the_example_policy_is_valid() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/policy.yaml");
    let policy = Policy::load(&path).unwrap();
    assert_eq!(policy.store.choice, StoreChoice::Embedded);
    assert!(policy.default_tenant.is_some());
}

/// Every manifest in deploy/ is valid against the Kubernetes schemas (strict: no unknown field).
#[test]
fn every_manifest_passes_the_kubernetes_schemas() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml") && !p.to_string_lossy().ends_with("policy.yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    let refs: Vec<&Path> = files.iter().map(std::path::PathBuf::as_path).collect();
    support::procs::kube_validate(&refs);
}
