//! The module map in `src/lib.rs` is the order of the house: each top-level module imports only
//! modules listed above it, so the imports draw no circle and nothing the sidecar runs reaches
//! the tools. This reads the map and every `crate::` path in the code (comments aside) and holds
//! one to the other.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The top-level modules in the order `lib.rs`'s layout map lists them.
fn layers() -> Vec<String> {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    lib.lines()
        .filter_map(|l| l.strip_prefix("//! - [`"))
        .filter_map(|l| l.split_once("`]").map(|(name, _)| name.to_string()))
        .collect()
}

/// Every `.rs` file under `dir` (or the file itself).
fn files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_dir() {
        for entry in std::fs::read_dir(path).unwrap() {
            files(&entry.unwrap().path(), out);
        }
    } else if path.is_file() && path.extension().is_some_and(|e| e == "rs") {
        out.push(path.to_path_buf());
    }
}

/// The top-level modules a module's code names with `crate::`, outside comments.
fn imports(module: &str) -> BTreeMap<String, String> {
    let mut paths = Vec::new();
    files(&src().join(module), &mut paths);
    files(&src().join(format!("{module}.rs")), &mut paths);
    let mut found = BTreeMap::new();
    for path in paths {
        let text = std::fs::read_to_string(&path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            let mut rest = code;
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                // `crate::name` or `crate::{a, b::c}`: the first segment of each path.
                let names: Vec<String> = match rest.strip_prefix('{') {
                    Some(group) => group
                        .split('}')
                        .next()
                        .unwrap_or("")
                        .split(',')
                        .map(|path| {
                            path.trim().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect()
                        })
                        .collect(),
                    None => vec![rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect()],
                };
                for name in names.into_iter().filter(|name| name != module && !name.is_empty()) {
                    found.entry(name).or_insert_with(|| format!("{}:{}", path.display(), n + 1));
                }
            }
        }
    }
    found
}

#[test]
fn every_module_is_in_the_map_and_the_map_is_every_module() {
    let listed = layers();
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    let declared: Vec<String> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod "))
        .map(|l| l.trim_end_matches(';').trim_end_matches(" {").to_string())
        .collect();
    let mut a = listed.clone();
    let mut b = declared.clone();
    a.sort();
    b.sort();
    assert_eq!(a, b, "lib.rs's layout map and its `pub mod`s");
}

#[test]
fn modules_import_only_what_the_map_lists_above_them() {
    let listed = layers();
    assert!(listed.len() > 10, "the map was read: {listed:?}");
    for (rank, module) in listed.iter().enumerate() {
        for (imported, at) in imports(module) {
            let Some(theirs) = listed.iter().position(|m| *m == imported) else {
                panic!("{at}: {module} names crate::{imported}, which the map does not list");
            };
            assert!(theirs < rank, "{at}: {module} imports {imported}, listed below it: an upward import");
        }
    }
}
