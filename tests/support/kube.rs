//! Rendered Kubernetes objects (by kustomize or Helm), as the deploy tests read them.

use serde_yaml::Value;
use tollgate::config::Policy;

/// Every document of a multi-document YAML text, empty ones left out.
pub fn documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|d: &Value| !d.is_null())
        .collect()
}

/// A YAML list of strings (a container's `args`, a certificate's `dnsNames`).
pub fn strings(v: &Value) -> Vec<&str> {
    v.as_sequence().unwrap().iter().map(|a| a.as_str().unwrap()).collect()
}

/// The policy a Deployment's pods mount (volume `policy`) and the Envoy bootstrap they mount
/// (volume `envoy-config`), read from the ConfigMaps rendered beside it: a pod that mounts a
/// ConfigMap which is not rendered fails the test.
pub fn mounted(docs: &[Value], deployment: &Value) -> (Policy, String) {
    let volumes = deployment["spec"]["template"]["spec"]["volumes"].as_sequence().unwrap();
    let data = |volume: &str, key: &str| {
        let name = volumes.iter().find(|v| v["name"] == volume).unwrap()["configMap"]["name"].as_str().unwrap();
        let map = docs
            .iter()
            .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("the pods mount {name}, which is not rendered"));
        map["data"][key].as_str().unwrap().to_string()
    };
    (Policy::parse("rendered", &data("policy", "policy.yaml")).unwrap(), data("envoy-config", "envoy.yaml"))
}
