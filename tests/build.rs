//! Builds the plugins the tests load (`scripts/build-plugins.sh`) and tells the tests where they are.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest_dir
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf();
    // Watch sources only: plugins/target and plugins/dist change with every build.
    for watched in [
        "wit",
        "host/contracts",
        "scripts/build-plugins.sh",
        "plugins/Cargo.toml",
        "plugins/loyalty-py/app.py",
        "plugins/idem-py/idem.py",
        "plugins/idem-js/idem.js",
        "plugins/loyalty-js/loyalty.js",
        "plugins/loyalty-js/build.mjs",
        "plugins/loyalty-js/package-lock.json",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(watched).display());
    }
    let plugins = std::fs::read_dir(root.join("plugins")).expect("plugins/ exists");
    for entry in plugins.flatten() {
        let plugin_dir = entry.path();
        if plugin_dir.join("Cargo.toml").is_file() {
            println!(
                "cargo:rerun-if-changed={}",
                plugin_dir.join("Cargo.toml").display()
            );
            println!(
                "cargo:rerun-if-changed={}",
                plugin_dir.join("src").display()
            );
        }
    }
    let status = Command::new(root.join("scripts/build-plugins.sh"))
        .env_remove("CARGO_MAKEFLAGS")
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .status();
    match status {
        Ok(status) if status.success() => {}
        Ok(status) => panic!("scripts/build-plugins.sh failed ({status}); see its output above"),
        Err(error) => panic!("cannot run scripts/build-plugins.sh: {error}"),
    }
    let dist = root.join("plugins/dist");
    println!("cargo:rustc-env=IDEM_PLUGIN_DIST={}", dist.display());
    println!("cargo:rustc-env=IDEM_REPO_ROOT={}", root.display());
}
