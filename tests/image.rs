//! The container image recipe (`Containerfile`), tested as far as a machine without a container
//! engine can: the linter passes, the final stage is what the file promises (static base, no
//! shell, non-root, the binary's version in its label), and the Kubernetes example runs it the
//! way it was made to run. `scripts/test` runs the build stage's cargo command itself (checked).

mod support;

use std::path::Path;
use std::process::Command;

fn containerfile() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Containerfile")).unwrap()
}

/// The instructions of the last stage (from its `FROM`), continuation lines joined.
fn final_stage(text: &str) -> Vec<String> {
    let joined = text.replace("\\\n", " ");
    let lines: Vec<&str> = joined.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    let last_from = lines.iter().rposition(|l| l.starts_with("FROM ")).expect("a FROM");
    lines[last_from..].iter().map(|l| (*l).to_string()).collect()
}

#[test]
fn the_containerfile_passes_hadolint() {
    let hadolint = std::env::var("TOLLGATE_TEST_HADOLINT")
        .expect("TOLLGATE_TEST_HADOLINT is not set: run the suite with `bash scripts/test`, which installs hadolint");
    let out = Command::new(&hadolint)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Containerfile"))
        .output()
        .expect("hadolint runs");
    assert!(
        out.status.success(),
        "hadolint:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The linter does lint: a recipe with its classic mistakes fails.
    let dir = support::procs::TempDir::new("hadolint");
    let bad = dir.write("Containerfile", "FROM debian:latest\nRUN apt-get install curl\nADD . /src\n");
    assert!(!Command::new(&hadolint).arg(bad).output().unwrap().status.success());
}

#[test]
fn the_image_is_static_non_root_and_labelled_with_the_binary_version() {
    let text = containerfile();
    let stage = final_stage(&text);
    assert!(stage[0].starts_with("FROM gcr.io/distroless/static"), "a static, shell-less base: {}", stage[0]);
    assert!(!stage.iter().any(|l| l.starts_with("RUN ")), "nothing runs in the final stage: {stage:#?}");
    assert!(stage.iter().any(|l| l == "USER 65532:65532"), "non-root: {stage:#?}");
    assert!(stage.iter().any(|l| l == r#"ENTRYPOINT ["/usr/local/bin/tollgate"]"#));
    let version = stage.iter().find_map(|l| l.strip_prefix("ARG VERSION=")).expect("ARG VERSION");
    assert_eq!(version, env!("CARGO_PKG_VERSION"), "the label's default is Cargo.toml's version");
    assert!(stage.iter().any(|l| l.contains(r#"org.opencontainers.image.version="${VERSION}""#)));
    // The build stage builds the locked release binary that the final stage copies.
    assert!(text.contains("cargo build --release --locked --bin tollgate"));
    assert!(stage.iter().any(|l| l == "COPY --from=build /tollgate /usr/local/bin/tollgate"));
}

#[test]
fn the_kubernetes_example_runs_the_image_read_only_as_its_user() {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes.yaml")).unwrap();
    let docs: Vec<serde_yaml::Value> =
        serde_yaml::Deserializer::from_str(&text).map(|d| serde::Deserialize::deserialize(d).unwrap()).collect();
    let deployment = docs.iter().find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "inference").unwrap();
    let tollgate = deployment["spec"]["template"]["spec"]["initContainers"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "tollgate")
        .unwrap();
    assert_eq!(tollgate["image"].as_str(), Some(format!("tollgate:{}", env!("CARGO_PKG_VERSION")).as_str()));
    let sc = &tollgate["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["runAsUser"], 65532, "the image's user");
    assert_eq!(sc["allowPrivilegeEscalation"], false);
}
