//! The dependency policy, checked offline from the workspace's locked graph (`cargo metadata
//! --offline --locked`, for this machine's platform): every crate comes from crates.io (or
//! is ours), every license is one of `LICENSES` (an SPDX expression satisfied by them), and a
//! crate found in several versions at once is one of `DUPLICATES`. A new license, source or
//! duplicate fails here until it is looked at and added with its reason.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// Licenses a dependency may be used under: permissive ones, and LLVM's exception to
/// Apache-2.0 (wasmtime's).
const LICENSES: &[&str] = &[
    "MIT",
    "MIT-0",
    "Apache-2.0",
    "Apache-2.0 WITH LLVM-exception",
    "BSD-2-Clause",
    "BSD-3-Clause",
    "ISC",
    "Zlib",
    "Unicode-3.0",
    "CC0-1.0",
    "BSL-1.0",
    "Unlicense",
];

/// The only registry crates come from.
const CRATES_IO: &str = "registry+https://github.com/rust-lang/crates.io-index";

/// Crates allowed in more than one version at once. Each is two generations of one family
/// that different dependencies have not all moved to yet: RustCrypto's digests, hashes and
/// macs (`digest`, `sha1`, `sha2`, `hmac`, `block-buffer`, `crypto-common`, `const-oid`,
/// `cpufeatures`), rand's (`rand`, `rand_core`, `rand_chacha`, `getrandom`), the parsers
/// wasmtime, toml and x509 pin (`wasmparser`, `wasm-encoder`, `winnow`, `toml_datetime`,
/// `nom`, `syn`, `synstructure`), and `base64`, `hashbrown`, `itertools`, `untrusted`,
/// `embedded-io`, `io-lifetimes`.
const DUPLICATES: &[&str] = &[
    "base64",
    "block-buffer",
    "const-oid",
    "cpufeatures",
    "crypto-common",
    "digest",
    "embedded-io",
    "getrandom",
    "hashbrown",
    "hmac",
    "io-lifetimes",
    "itertools",
    "nom",
    "rand",
    "rand_chacha",
    "rand_core",
    "sha1",
    "sha2",
    "syn",
    "synstructure",
    "toml_datetime",
    "untrusted",
    "wasm-encoder",
    "wasmparser",
    "winnow",
];

/// The packages of the locked graph for this machine's platform: (name, version, source,
/// license).
fn locked_packages() -> Vec<(String, String, Option<String>, Option<String>)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let rustc = Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("rustc -vV");
    let host = String::from_utf8_lossy(&rustc.stdout)
        .lines()
        .find_map(|line| line.strip_prefix("host: ").map(str::to_string))
        .expect("rustc's host");
    let output = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--offline", "--locked"])
        .args(["--filter-platform", &host])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata");
    assert!(
        output.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("cargo metadata's JSON");
    let resolved: BTreeSet<&str> = metadata["resolve"]["nodes"]
        .as_array()
        .expect("the resolve graph")
        .iter()
        .filter_map(|node| node["id"].as_str())
        .collect();
    metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter(|package| {
            package["id"]
                .as_str()
                .is_some_and(|id| resolved.contains(id))
        })
        .map(|package| {
            let text = |key: &str| package[key].as_str().map(str::to_string);
            (
                text("name").unwrap_or_default(),
                text("version").unwrap_or_default(),
                text("source"),
                text("license"),
            )
        })
        .collect()
}

#[test]
fn every_dependency_keeps_the_policy() {
    let packages = locked_packages();
    assert!(
        packages.len() > 100,
        "the graph looks empty: {}",
        packages.len()
    );
    let mut problems = Vec::new();
    let mut versions: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (name, version, source, license) in &packages {
        versions.entry(name).or_default().insert(version);
        match source {
            // Ours: the workspace's own crates.
            None => continue,
            Some(source) if source == CRATES_IO => {}
            Some(source) => problems.push(format!("{name} {version} comes from {source}")),
        }
        let Some(license) = license else {
            problems.push(format!("{name} {version} declares no license"));
            continue;
        };
        match spdx::Expression::parse_mode(license, spdx::ParseMode::LAX) {
            Ok(expression) => {
                if !expression
                    .evaluate(|requirement| LICENSES.contains(&requirement.to_string().as_str()))
                {
                    problems.push(format!("{name} {version}: license {license:?}"));
                }
            }
            Err(error) => problems.push(format!("{name} {version}: license {license:?}: {error}")),
        }
    }
    for (name, found) in &versions {
        if found.len() > 1 && !DUPLICATES.contains(name) {
            problems.push(format!("{name} in versions {found:?}"));
        }
    }
    for name in DUPLICATES {
        if versions.get(name).is_none_or(|found| found.len() < 2) {
            problems.push(format!(
                "{name} is no longer duplicated: take it off DUPLICATES"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
