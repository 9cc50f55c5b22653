//! Rust plugins: a `cdylib` crate built by cargo for `wasm32-wasip2`, with the guest helper
//! crate `idem-plugin` (bindings, field access, builders) beside it.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use super::{Kit, Language, ProjectFile, WORLD_WIT, require, run, run_quiet, toolchain_present};

const MANIFEST: &str = include_str!("../../../../templates/rust/Cargo.toml");
const HANDLER: &str = include_str!("../../../../templates/rust/lib.rs");
const HELPER_MANIFEST: &str = include_str!("../../../../../plugins/idem-plugin/Cargo.toml");
const HELPER: &str = include_str!("../../../../../plugins/idem-plugin/src/lib.rs");

const TARGET: &str = "wasm32-wasip2";

pub struct Rust;

/// A directory with a `Cargo.toml` is a Rust project, named by `package.name`.
pub fn recognise(directory: &Path) -> anyhow::Result<Option<(Language, String)>> {
    if !directory.join("Cargo.toml").is_file() {
        return Ok(None);
    }
    let name = super::toml_name(directory, "Cargo.toml", "package")?;
    Ok(Some((Language::Rust, name)))
}

impl Kit for Rust {
    fn label(&self) -> &'static str {
        "Rust"
    }

    fn files(&self, _name: &str) -> Vec<ProjectFile> {
        vec![
            ProjectFile::new("Cargo.toml", MANIFEST, "the crate, built for wasm32-wasip2"),
            ProjectFile::new("src/lib.rs", HANDLER, "the handler"),
            ProjectFile::new(
                "idem-plugin/Cargo.toml",
                HELPER_MANIFEST,
                "the guest helper crate (bindings, field access, builders)",
            ),
            ProjectFile::new("idem-plugin/src/lib.rs", HELPER, ""),
            ProjectFile::new("idem-plugin/wit/world.wit", WORLD_WIT, ""),
            ProjectFile::new(".gitignore", "target/\n*.wasm\n", ""),
        ]
    }

    fn prerequisites(&self) -> String {
        format!("Needs Rust with the {TARGET} target (`rustup target add {TARGET}`).\n")
    }

    fn build(&self, directory: &Path, name: &str, staging: &Path) -> anyhow::Result<()> {
        require(
            "cargo",
            "Rust is not installed: see https://rustup.rs, then `rustup target add wasm32-wasip2`",
        )?;
        if toolchain_present("rustup")
            && !run_quiet(Command::new("rustup").args(["target", "list", "--installed"]))
                .is_some_and(|installed| installed.lines().any(|line| line.trim() == TARGET))
        {
            bail!("the {TARGET} target is not installed: rustup target add {TARGET}");
        }
        let manifest = directory.join("Cargo.toml");
        let target_dir = target_directory(&manifest)?;
        let mut cargo = Command::new("cargo");
        cargo
            .args(["build", "--release", "--target", TARGET, "--manifest-path"])
            .arg(&manifest)
            // A build tool's own settings must not leak into this separate build.
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("CARGO_BUILD_TARGET");
        run(&mut cargo, "cargo build")?;
        let built = target_dir
            .join(TARGET)
            .join("release")
            .join(format!("{}.wasm", name.replace('-', "_")));
        std::fs::copy(&built, staging)
            .with_context(|| format!("cannot copy {}", built.display()))?;
        Ok(())
    }
}

/// Where cargo puts this crate's builds: its workspace's target directory (or
/// `CARGO_TARGET_DIR`, or a configured `build.target-dir`), as cargo itself decides.
fn target_directory(manifest: &Path) -> anyhow::Result<PathBuf> {
    let mut metadata = Command::new("cargo");
    metadata
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--manifest-path",
        ])
        .arg(manifest)
        .stderr(std::process::Stdio::inherit());
    let said = run_quiet(&mut metadata)
        .with_context(|| format!("cargo metadata failed for {}", manifest.display()))?;
    let metadata: serde_json::Value = serde_json::from_str(&said)
        .with_context(|| format!("cargo metadata for {} is not JSON", manifest.display()))?;
    metadata["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .with_context(|| {
            format!(
                "cargo metadata for {} names no target directory",
                manifest.display()
            )
        })
}
