//! `tollgate inject`: adds tollgate and its Envoy to the pods of Kubernetes workloads, as
//! `linkerd inject` does for its proxy. Both go in as native sidecars (init containers with
//! `restartPolicy: Always`), tollgate first, so each is up before the next starts and both outlive
//! the application:
//!
//! - `tollgate`: `serve` with the policy mounted from a ConfigMap, decisions on loopback, gRPC
//!   health on its own port for the kubelet's gRPC probes, read-only and unprivileged;
//! - `tollgate-envoy`: the shipped bootstrap (`envoy/envoy.yaml`: ext_authz for the decision,
//!   ext_proc for the commit from the response) passed inline, listening on the pod's network and
//!   forwarding to the application's port on loopback. Point the Service at the `tollgate-http`
//!   port.
//!
//! Every other byte stays as it was: a document inject does not change (another kind, an already
//! injected pod) is written back verbatim, separators and comments included; a changed one is
//! re-serialized with its fields and their order kept (its comments go). Injecting twice changes
//! nothing. What cannot be injected is refused, naming the document and why.

use serde_yaml::{Mapping, Value};

/// The pod annotation that marks an injected pod, with the version that injected it.
pub const INJECTED: &str = "tollgate.io/injected";
/// The pod annotation naming the application's port (else the first container's first port).
pub const APP_PORT: &str = "tollgate.io/app-port";
/// The containers inject adds, and the volume.
pub const TOLLGATE: &str = "tollgate";
pub const ENVOY: &str = "tollgate-envoy";
pub const POLICY_VOLUME: &str = "tollgate-policy";
/// Ports inside the pod: tollgate's gRPC (loopback), its health (pod network), Envoy's admin.
pub const GRPC_PORT: u16 = 50051;
pub const HEALTH_PORT: u16 = 50052;
pub const ENVOY_ADMIN_PORT: u16 = 9901;

const ENVOY_BOOTSTRAP: &str = include_str!("../../envoy/envoy.yaml");

/// What inject adds.
#[derive(Debug, Clone)]
pub struct Options {
    pub image: String,
    pub envoy_image: String,
    /// The ConfigMap holding `policy.yaml`.
    pub policy_config_map: String,
    /// The application's port, when the pod does not say (annotation, or its first port).
    pub app_port: Option<u16>,
    /// Envoy's port on the pod's network: where the Service sends clients.
    pub proxy_port: u16,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            image: format!("tollgate:{}", env!("CARGO_PKG_VERSION")),
            envoy_image: "envoyproxy/envoy:v1.40.0".into(),
            policy_config_map: "tollgate-policy".into(),
            app_port: None,
            proxy_port: 8080,
        }
    }
}

/// Why a document could not be injected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InjectError {
    #[error("document {doc}: not YAML: {why}")]
    Yaml { doc: usize, why: String },
    #[error("document {doc} ({what}): {why}")]
    Refused { doc: usize, what: String, why: String },
}

/// Where a kind keeps its pod: the path to the pod template's metadata and spec.
fn pod_paths(kind: &str) -> Option<(&'static [&'static str], &'static [&'static str])> {
    match kind {
        "Pod" => Some((&["metadata"], &["spec"])),
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => {
            Some((&["spec", "template", "metadata"], &["spec", "template", "spec"]))
        }
        _ => None,
    }
}

/// Kinds that hold pods inject does not reach into: refused rather than passed over in silence.
const UNSUPPORTED: [&str; 3] = ["CronJob", "List", "ReplicationController"];

/// Injects every workload of a multi-document YAML text.
pub fn inject(text: &str, options: &Options) -> Result<String, InjectError> {
    let mut out = String::with_capacity(text.len().saturating_mul(2));
    for (i, (separator, body)) in documents(text).into_iter().enumerate() {
        let doc = i.saturating_add(1);
        out.push_str(separator);
        let value: Value = serde_yaml::from_str(body).map_err(|e| InjectError::Yaml { doc, why: e.to_string() })?;
        match inject_document(value, options).map_err(|(what, why)| InjectError::Refused { doc, what, why })? {
            Some(changed) => {
                let text =
                    serde_yaml::to_string(&changed).map_err(|e| InjectError::Yaml { doc, why: e.to_string() })?;
                out.push_str(&text);
            }
            None => out.push_str(body),
        }
    }
    Ok(out)
}

/// The documents of a YAML stream: each with the separator line before it (empty for the first,
/// unless the stream starts with one).
fn documents(text: &str) -> Vec<(&str, &str)> {
    let mut docs = Vec::new();
    let (mut separator, mut body_start, mut at) = ((0, 0), 0, 0);
    for line in text.split_inclusive('\n') {
        let next = at + line.len();
        let bare = line.trim_end();
        if bare == "---" || bare.starts_with("--- ") || bare.starts_with("---\t") {
            if at > 0 {
                docs.push((&text[separator.0..separator.1], &text[body_start..at]));
            }
            (separator, body_start) = ((at, next), next);
        }
        at = next;
    }
    docs.push((&text[separator.0..separator.1], &text[body_start..]));
    docs
}

type Refusal = (String, String);

/// One pod (as the API server sends it to the webhook), injected; `None` when it stays as it is
/// (already injected); the reason when inject refuses it.
pub fn inject_pod(mut pod: Value, options: &Options) -> Result<Option<Value>, String> {
    if let Some(m) = pod.as_mapping_mut() {
        m.insert("kind".into(), "Pod".into());
    }
    inject_document(pod, options).map_err(|(_, why)| why)
}

/// The document with tollgate injected, or `None` when it stays as it is.
fn inject_document(mut doc: Value, options: &Options) -> Result<Option<Value>, Refusal> {
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or_default().to_string();
    let name = doc.get("metadata").and_then(|m| m.get("name")).and_then(Value::as_str).unwrap_or("?").to_string();
    let what = format!("{kind} {name}");
    if UNSUPPORTED.contains(&kind.as_str()) {
        return Err((what, format!("{kind} is not injected: inject the workloads it holds one by one")));
    }
    let Some((meta_path, spec_path)) = pod_paths(&kind) else { return Ok(None) };
    let refuse = |why: String| Err((what.clone(), why));
    let annotations = path(&doc, meta_path).and_then(|m| m.get("annotations")).and_then(Value::as_mapping);
    if annotations.is_some_and(|a| a.contains_key(INJECTED)) {
        return Ok(None);
    }
    let annotated_port = annotations.and_then(|a| a.get(APP_PORT)).cloned();
    let Some(spec) = path_mut(&mut doc, spec_path).and_then(Value::as_mapping_mut) else {
        return refuse("has no pod spec".into());
    };
    for list in ["containers", "initContainers"] {
        for c in spec.get(list).and_then(Value::as_sequence).into_iter().flatten() {
            let n = c.get("name").and_then(Value::as_str).unwrap_or_default();
            if n == TOLLGATE || n == ENVOY {
                return refuse(format!("already has a container named {n}, and no {INJECTED} annotation"));
            }
        }
    }
    if spec
        .get("volumes")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .any(|v| v.get("name") == Some(&POLICY_VOLUME.into()))
    {
        return refuse(format!("already has a volume named {POLICY_VOLUME}"));
    }
    if spec.get("hostNetwork").and_then(Value::as_bool) == Some(true) {
        return refuse("uses the host's network: its sidecars' ports would be the node's".into());
    }
    let app_port = match annotated_port {
        Some(v) => match v
            .as_str()
            .and_then(|s| s.parse::<u16>().ok())
            .or_else(|| v.as_u64().and_then(|n| u16::try_from(n).ok()))
        {
            Some(p) if p > 0 => p,
            _ => return refuse(format!("annotation {APP_PORT} is not a port: {v:?}")),
        },
        None => match options.app_port.or_else(|| first_port(spec)) {
            Some(p) => p,
            None => {
                return refuse(format!(
                    "cannot tell the application's port: it declares none; set the {APP_PORT} annotation or --app-port"
                ));
            }
        },
    };
    for (port, user) in [
        (options.proxy_port, "Envoy"),
        (GRPC_PORT, "tollgate"),
        (HEALTH_PORT, "tollgate's health"),
        (ENVOY_ADMIN_PORT, "Envoy's admin"),
    ] {
        if port == app_port {
            return refuse(format!("the application's port {app_port} is {user}'s in an injected pod"));
        }
    }

    let sidecars = vec![tollgate_container(options), envoy_container(options, app_port)];
    let init = spec.entry("initContainers".into()).or_insert_with(|| Value::Sequence(Vec::new()));
    let Some(init) = init.as_sequence_mut() else { return refuse("initContainers is not a list".into()) };
    init.splice(0..0, sidecars);
    let volumes = spec.entry("volumes".into()).or_insert_with(|| Value::Sequence(Vec::new()));
    let Some(volumes) = volumes.as_sequence_mut() else { return refuse("volumes is not a list".into()) };
    volumes.push(yaml(&format!(
        "{{ name: {POLICY_VOLUME}, configMap: {{ name: {} }} }}",
        serde_json::Value::from(options.policy_config_map.as_str())
    )));

    let meta =
        ensure_mapping(&mut doc, meta_path).ok_or_else(|| (what.clone(), "metadata is not a mapping".to_string()))?;
    let annotations = meta.entry("annotations".into()).or_insert_with(|| Value::Mapping(Mapping::new()));
    let Some(annotations) = annotations.as_mapping_mut() else {
        return refuse("annotations is not a mapping".into());
    };
    annotations.insert(INJECTED.into(), env!("CARGO_PKG_VERSION").into());
    Ok(Some(doc))
}

fn first_port(spec: &Mapping) -> Option<u16> {
    let first = spec.get("containers")?.as_sequence()?.first()?;
    let port = first.get("ports")?.as_sequence()?.first()?.get("containerPort")?.as_u64()?;
    u16::try_from(port).ok()
}

fn path<'a>(v: &'a Value, keys: &[&str]) -> Option<&'a Value> {
    keys.iter().try_fold(v, |v, k| v.get(*k))
}

fn path_mut<'a>(v: &'a mut Value, keys: &[&str]) -> Option<&'a mut Value> {
    keys.iter().try_fold(v, |v, k| v.get_mut(*k))
}

/// The mapping at `keys`, made (empty) where it is missing.
fn ensure_mapping<'a>(v: &'a mut Value, keys: &[&str]) -> Option<&'a mut Mapping> {
    let mut at = v;
    for k in keys {
        let map = at.as_mapping_mut()?;
        at = map.entry((*k).into()).or_insert_with(|| Value::Mapping(Mapping::new()));
    }
    at.as_mapping_mut()
}

/// A YAML literal of this module's own making.
fn yaml(text: &str) -> Value {
    serde_yaml::from_str(text).unwrap_or_else(|e| unreachable!("inject's own YAML is valid: {e}: {text}"))
}

/// Envoy's security context: the official image's `envoy` user (101), read-only, unprivileged.
const ENVOY_SECURITY: &str = "{ runAsUser: 101, runAsNonRoot: true, readOnlyRootFilesystem: true, \
                              allowPrivilegeEscalation: false, capabilities: { drop: [ALL] } }";

fn tollgate_container(o: &Options) -> Value {
    let image = serde_json::Value::from(o.image.as_str());
    yaml(&format!(
        "name: {TOLLGATE}
image: {image}
restartPolicy: Always
args: [serve, --config, /etc/tollgate/policy.yaml, --listen, '127.0.0.1:{GRPC_PORT}', --health-listen, '0.0.0.0:{HEALTH_PORT}', --log-format, json]
ports:
  - {{ name: tollgate-health, containerPort: {HEALTH_PORT} }}
startupProbe: {{ grpc: {{ port: {HEALTH_PORT} }}, periodSeconds: 1, failureThreshold: 30 }}
readinessProbe: {{ grpc: {{ port: {HEALTH_PORT} }}, periodSeconds: 5 }}
livenessProbe: {{ grpc: {{ port: {HEALTH_PORT} }}, periodSeconds: 10 }}
resources: {{ requests: {{ cpu: 100m, memory: 32Mi }}, limits: {{ memory: 128Mi }} }}
securityContext: {{ runAsUser: 65532, runAsNonRoot: true, readOnlyRootFilesystem: true, allowPrivilegeEscalation: false, capabilities: {{ drop: [ALL] }} }}
volumeMounts:
  - {{ name: {POLICY_VOLUME}, mountPath: /etc/tollgate, readOnly: true }}
"
    ))
}

fn envoy_container(o: &Options, app_port: u16) -> Value {
    let image = serde_json::Value::from(o.envoy_image.as_str());
    let bootstrap = serde_json::Value::from(envoy_bootstrap(o.proxy_port, app_port));
    let proxy = o.proxy_port;
    yaml(&format!(
        "name: {ENVOY}
image: {image}
restartPolicy: Always
args: [--config-yaml, {bootstrap}, --concurrency, '2']
ports:
  - {{ name: tollgate-http, containerPort: {proxy} }}
readinessProbe: {{ tcpSocket: {{ port: {proxy} }}, periodSeconds: 5 }}
resources: {{ requests: {{ cpu: 100m, memory: 64Mi }}, limits: {{ memory: 256Mi }} }}
securityContext: {ENVOY_SECURITY}
"
    ))
}

/// The shipped Envoy bootstrap, as one line of JSON: clients on `proxy_port` on the pod's
/// network, the application on `app_port` on loopback, tollgate on its loopback port.
pub fn envoy_bootstrap(proxy_port: u16, app_port: u16) -> String {
    let mut b: Value = yaml(ENVOY_BOOTSTRAP);
    let set = |v: Option<&mut Value>, address: &str, port: u16| {
        if let Some(Value::Mapping(m)) = v {
            m.insert("address".into(), address.into());
            m.insert("port_value".into(), u64::from(port).into());
        }
    };
    set(path_mut(&mut b, &["admin", "address", "socket_address"]), "127.0.0.1", ENVOY_ADMIN_PORT);
    set(
        b.get_mut("static_resources")
            .and_then(|s| s.get_mut("listeners"))
            .and_then(|l| l.get_mut(0))
            .and_then(|l| path_mut(l, &["address", "socket_address"])),
        "0.0.0.0",
        proxy_port,
    );
    for (cluster, port) in [("tollgate", GRPC_PORT), ("inference", app_port)] {
        let clusters =
            b.get_mut("static_resources").and_then(|s| s.get_mut("clusters")).and_then(Value::as_sequence_mut);
        let found = clusters.into_iter().flatten().find(|c| c.get("name").and_then(Value::as_str) == Some(cluster));
        let endpoint = found.and_then(|c| {
            path_mut(c, &["load_assignment", "endpoints"])
                .and_then(|e| e.get_mut(0))
                .and_then(|e| e.get_mut("lb_endpoints"))
                .and_then(|e| e.get_mut(0))
                .and_then(|e| path_mut(e, &["endpoint", "address", "socket_address"]))
        });
        set(endpoint, "127.0.0.1", port);
    }
    serde_json::to_string(&b).unwrap_or_else(|e| unreachable!("a YAML value is JSON: {e}"))
}
