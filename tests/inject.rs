//! `tollgate inject` on real manifests (tests/inject/workloads.yaml: a Service, a Deployment with
//! an init container, a StatefulSet that annotates its port, a DaemonSet with a volume, a bare Pod,
//! a ConfigMap): what it adds, that it adds nothing else and removes nothing, that a second run
//! changes nothing, what it refuses, and that the Envoy it configures passes real Envoy's
//! validation.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_yaml::Value;
use support::procs::{Tollgate, free_port, tollgate_cmd, tollgate_with_stdin, wait_for_port};

fn fixture() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/inject/workloads.yaml")).unwrap()
}

/// `tollgate inject` with `input` on stdin: (success, stdout, stderr).
fn inject(input: &str, args: &[&str]) -> (bool, String, String) {
    let mut all = vec!["inject"];
    all.extend_from_slice(args);
    tollgate_with_stdin(&all, input)
}

fn docs(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text).map(|d| serde::Deserialize::deserialize(d).unwrap()).collect()
}

/// The pod template (or the pod) of a workload document.
fn pod(doc: &Value) -> &Value {
    if doc["kind"] == "Pod" { doc } else { &doc["spec"]["template"] }
}

fn pod_mut(doc: &mut Value) -> &mut Value {
    if doc["kind"] == "Pod" { doc } else { &mut doc["spec"]["template"] }
}

/// The document as it was before inject: its sidecars, volume and annotation taken out again,
/// and the lists and mappings inject had to create removed if they are left empty.
fn uninjected(mut doc: Value) -> Value {
    let p = pod_mut(&mut doc);
    let spec = p["spec"].as_mapping_mut().unwrap();
    for (list, name) in
        [("initContainers", "tollgate"), ("initContainers", "tollgate-envoy"), ("volumes", "tollgate-policy")]
    {
        if let Some(items) = spec.get_mut(list).and_then(Value::as_sequence_mut) {
            items.retain(|c| c["name"] != name);
            if items.is_empty() {
                spec.remove(list);
            }
        }
    }
    let meta = p["metadata"].as_mapping_mut().unwrap();
    let annotations = meta.get_mut("annotations").and_then(Value::as_mapping_mut).unwrap();
    annotations.remove("tollgate.io/injected");
    if annotations.is_empty() {
        meta.remove("annotations");
    }
    doc
}

const WORKLOADS: [&str; 4] = ["Deployment", "StatefulSet", "DaemonSet", "Pod"];

#[test]
fn every_workload_gets_both_sidecars_and_nothing_else_changes() {
    let input = fixture();
    let (ok, out, err) = inject(&input, &[]);
    assert!(ok, "{err}");
    let (before, after) = (docs(&input), docs(&out));
    assert_eq!(before.len(), after.len());
    for (b, a) in before.iter().zip(&after) {
        if !WORKLOADS.contains(&b["kind"].as_str().unwrap()) {
            assert_eq!(a, b, "{:?} is not a workload", b["kind"]);
            continue;
        }
        let spec = &pod(a)["spec"];
        let init = spec["initContainers"].as_sequence().unwrap();
        assert_eq!((init[0]["name"].as_str(), init[1]["name"].as_str()), (Some("tollgate"), Some("tollgate-envoy")));
        let (tollgate, envoy) = (&init[0], &init[1]);
        for sidecar in [tollgate, envoy] {
            assert_eq!(sidecar["restartPolicy"], "Always", "a native sidecar");
            assert_eq!(sidecar["securityContext"]["readOnlyRootFilesystem"], true);
        }
        for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
            assert_eq!(tollgate[probe]["grpc"]["port"], 50052, "{probe}");
        }
        assert_eq!(tollgate["volumeMounts"][0]["name"], "tollgate-policy");
        let args: Vec<&str> = tollgate["args"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
        assert_eq!(&args[..3], ["serve", "--config", "/etc/tollgate/policy.yaml"]);
        assert!(args.windows(2).any(|w| w == ["--health-listen", "0.0.0.0:50052"]), "{args:?}");
        assert!(args.windows(2).any(|w| w == ["--log-format", "json"]), "a log pipeline reads JSON: {args:?}");
        let volume = spec["volumes"].as_sequence().unwrap().iter().find(|v| v["name"] == "tollgate-policy").unwrap();
        assert_eq!(volume["configMap"]["name"], "tollgate-policy");
        assert_eq!(pod(a)["metadata"]["annotations"]["tollgate.io/injected"], env!("CARGO_PKG_VERSION"));
        // Envoy forwards to the application's port: annotated, or the first declared.
        let expected_port = match b["kind"].as_str().unwrap() {
            "Deployment" => 8000,
            "StatefulSet" => 9000,
            "DaemonSet" => 7000,
            _ => 8001,
        };
        let bootstrap: serde_json::Value = serde_json::from_str(envoy["args"][1].as_str().unwrap()).unwrap();
        let clusters = bootstrap["static_resources"]["clusters"].as_array().unwrap();
        let inference = clusters.iter().find(|c| c["name"] == "inference").unwrap();
        let address = &inference["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"];
        assert_eq!(address["socket_address"]["port_value"], expected_port, "{:?}", b["kind"]);
        assert_eq!(envoy["ports"][0]["containerPort"], 8080);
        // Every field the document had is still there, as it was.
        assert_eq!(&uninjected(a.clone()), b, "{:?} changed beyond the injection", b["kind"]);
    }
    // The Deployment's own init container still runs, after the sidecars have started.
    let deployment = after.iter().find(|d| d["kind"] == "Deployment").unwrap();
    assert_eq!(pod(deployment)["spec"]["initContainers"][2]["name"], "fetch-weights");
}

#[test]
fn documents_inject_leaves_alone_are_written_back_byte_for_byte() {
    let input = fixture();
    let (ok, out, err) = inject(&input, &[]);
    assert!(ok, "{err}");
    let service = input.split("\n---\n").next().unwrap();
    assert!(out.starts_with(service), "the Service, its comments included, is as it was");
    let configmap = input.rsplit("\n---\n").next().unwrap();
    assert!(out.ends_with(configmap), "the ConfigMap is as it was");
}

#[test]
fn injecting_twice_changes_nothing() {
    let (ok, once, err) = inject(&fixture(), &[]);
    assert!(ok, "{err}");
    let (ok, twice, err) = inject(&once, &[]);
    assert!(ok, "{err}");
    assert_eq!(once, twice);
}

#[test]
fn a_file_argument_reads_the_same_as_stdin() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/inject/workloads.yaml");
    let out = tollgate_cmd(&["inject", path.to_str().unwrap()], Duration::from_secs(10));
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), inject(&fixture(), &[]).1);
}

#[test]
fn what_cannot_be_injected_is_refused_and_nothing_is_written() {
    let deployment = |spec: &str, annotations: &str| {
        format!(
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{ name: web }}\nspec:\n  template:\n    metadata:\n{annotations}      labels: {{ app: web }}\n    spec:\n{spec}"
        )
    };
    let app = "      containers:\n        - { name: app, image: a, ports: [{ containerPort: 8000 }] }\n";
    let cases = [
        (
            deployment(
                "      containers:\n        - { name: tollgate, image: mine, ports: [{ containerPort: 8000 }] }\n",
                "",
            ),
            "document 1 (Deployment web): already has a container named tollgate",
        ),
        (
            deployment("      containers:\n        - { name: app, image: a }\n", ""),
            "cannot tell the application's port",
        ),
        (
            deployment(app, "      annotations: { tollgate.io/app-port: \"http\" }\n"),
            "annotation tollgate.io/app-port is not a port",
        ),
        (
            deployment("      containers:\n        - { name: app, image: a, ports: [{ containerPort: 8080 }] }\n", ""),
            "the application's port 8080 is Envoy's in an injected pod",
        ),
        (
            deployment(&format!("{app}      volumes:\n        - {{ name: tollgate-policy, emptyDir: {{}} }}\n"), ""),
            "already has a volume named tollgate-policy",
        ),
        (deployment(&format!("{app}      hostNetwork: true\n"), ""), "uses the host's network"),
        (
            "apiVersion: batch/v1\nkind: CronJob\nmetadata: { name: nightly }\nspec: {}\n".to_string(),
            "document 1 (CronJob nightly): CronJob is not injected",
        ),
        ("kind: Pod\nmetadata: [unclosed\n".to_string(), "document 1: not YAML"),
    ];
    for (input, expected) in cases {
        // After a document that injects, so a refusal anywhere writes nothing at all.
        let stream = format!("{}---\n{input}", fixture());
        let (ok, out, err) = inject(&stream, &[]);
        assert!(!ok, "accepted:\n{input}");
        assert!(out.is_empty(), "wrote something for:\n{input}");
        let expected = expected.replace("document 1", "document 7");
        assert!(err.contains(&expected), "expected {expected:?}, got {err:?}");
    }
}

#[test]
fn the_injected_envoy_passes_real_envoys_validation() {
    let (ok, out, err) = inject(&fixture(), &["--proxy-port", "18080"]);
    assert!(ok, "{err}");
    let deployment = docs(&out).into_iter().find(|d| d["kind"] == "Deployment").unwrap();
    let envoy = &pod(&deployment)["spec"]["initContainers"][1];
    assert_eq!(envoy["ports"][0]["containerPort"], 18080);
    let bootstrap = envoy["args"][1].as_str().unwrap();
    let out = Command::new(support::procs::envoy_bin())
        .args(["--mode", "validate", "--config-yaml", bootstrap])
        .output()
        .expect("envoy runs");
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

/// The health port inject's probes use is set from the command line, whatever the policy says.
#[test]
fn serve_takes_the_health_port_from_the_command_line() {
    let health = format!("127.0.0.1:{}", free_port());
    let mut tollgate = Tollgate::start_with("models:\n  m: { max_output_tokens: 10 }\n", &["--health-listen", &health]);
    wait_for_port(health.parse().unwrap(), Duration::from_secs(10), "tollgate's health port", &mut tollgate.child);
}

/// What inject writes is valid against the Kubernetes schemas (strict: no unknown field), for
/// every kind it injects.
#[test]
fn injected_manifests_pass_the_kubernetes_schemas() {
    let (ok, out, err) = inject(&fixture(), &[]);
    assert!(ok, "{err}");
    let dir = support::procs::TempDir::new("inject-schemas");
    let file = dir.write("injected.yaml", &out);
    support::procs::kube_validate(&[file.as_path()]);
}
