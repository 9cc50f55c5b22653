//! Tells the tests where the plugins they load are (`plugins/dist/`, built by
//! `scripts/build-plugins.sh`, which `scripts/test.sh` runs before the tests) and where the
//! repository is. It builds nothing: building plugins needs the `idem` binary, which this
//! workspace is still compiling when a build script runs.

use std::path::PathBuf;

fn main() {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest_dir
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf();
    println!("cargo:rerun-if-changed=build.rs");
    let dist = root.join("plugins/dist");
    println!("cargo:rustc-env=IDEM_PLUGIN_DIST={}", dist.display());
    println!("cargo:rustc-env=IDEM_REPO_ROOT={}", root.display());
}
