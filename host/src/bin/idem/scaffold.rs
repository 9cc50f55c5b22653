//! `idem new` and `idem build`: a plugin project outside any idem checkout, in Rust, Python,
//! JavaScript, C or C++, built with its language's pinned toolchain (C and C++: `clang`).
//!
//! The files are embedded in the binary: the contract (`wit/world.wit`), the guest helper of
//! the language (the same sources the example plugins in `plugins/` use), the build files with
//! pinned versions, a handler, its cases, a pipeline fragment and a README.

use std::path::Path;
use std::process::{Command, ExitCode};

use anyhow::{Context, bail};
use clap::ValueEnum;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Language {
    Rust,
    Python,
    Js,
    C,
    Cpp,
}

/// The pinned componentize-py, as the repository's own Python plugin is built with.
const COMPONENTIZE_PY: &str = "0.25.1";

const WORLD_WIT: &str = idem_host::sandbox::WORLD_WIT;
const CASES: &str = include_str!("../../../templates/common/cases.json");
const ORDER: &str = include_str!("../../../templates/common/order.json");
const SCHEMA: &str = include_str!("../../../templates/common/schema.sql");
const PIPELINE: &str = include_str!("../../../templates/common/pipeline.toml");
const README: &str = include_str!("../../../templates/common/README.md");

const RUST_MANIFEST: &str = include_str!("../../../templates/rust/Cargo.toml");
const RUST_HANDLER: &str = include_str!("../../../templates/rust/lib.rs");
const RUST_HELPER_MANIFEST: &str = include_str!("../../../../plugins/idem-plugin/Cargo.toml");
const RUST_HELPER: &str = include_str!("../../../../plugins/idem-plugin/src/lib.rs");

const PYTHON_HANDLER: &str = include_str!("../../../templates/python/app.py");
const PYTHON_PROJECT: &str = include_str!("../../../templates/python/pyproject.toml");
const PYTHON_HELPER: &str = include_str!("../../../../plugins/idem-py/idem.py");

const JS_HANDLER: &str = include_str!("../../../templates/js/plugin.js");
const JS_BUILD: &str = include_str!("../../../templates/js/build.mjs");
const JS_HELPER: &str = include_str!("../../../../plugins/idem-js/idem.js");
/// The JavaScript toolchain pins: the repository's JavaScript plugin's, renamed.
const JS_PACKAGE: &str = include_str!("../../../../plugins/loyalty-js/package.json");
const JS_LOCK: &str = include_str!("../../../../plugins/loyalty-js/package-lock.json");
const JS_PACKAGE_NAME: &str = "idem-loyalty-js";

const C_HANDLER: &str = include_str!("../../../templates/c/plugin.c");
const CPP_HANDLER: &str = include_str!("../../../templates/cpp/plugin.cpp");
const C_HELPER: &str = include_str!("../../../../plugins/idem-c/idem.h");
const C_MANIFEST: &str = include_str!("../../../templates/c/idem.toml");

impl Language {
    fn label(self) -> &'static str {
        match self {
            Language::Rust => "Rust",
            Language::Python => "Python",
            Language::Js => "JavaScript",
            Language::C => "C",
            Language::Cpp => "C++",
        }
    }

    /// The project's own files, beside the common ones, as (path, contents, README line).
    fn files(self, name: &str) -> Vec<(&'static str, String, &'static str)> {
        match self {
            Language::Rust => vec![
                (
                    "Cargo.toml",
                    RUST_MANIFEST.to_string(),
                    "the crate, built for wasm32-wasip2",
                ),
                ("src/lib.rs", RUST_HANDLER.to_string(), "the handler"),
                (
                    "idem-plugin/Cargo.toml",
                    RUST_HELPER_MANIFEST.to_string(),
                    "the guest helper crate (bindings, field access, builders)",
                ),
                ("idem-plugin/src/lib.rs", RUST_HELPER.to_string(), ""),
                ("idem-plugin/wit/world.wit", WORLD_WIT.to_string(), ""),
                (".gitignore", "target/\n*.wasm\n".to_string(), ""),
            ],
            Language::Python => vec![
                ("app.py", PYTHON_HANDLER.to_string(), "the handler"),
                (
                    "idem.py",
                    PYTHON_HELPER.to_string(),
                    "the guest helper (field access, builders)",
                ),
                (
                    "pyproject.toml",
                    PYTHON_PROJECT.to_string(),
                    "the project, with the pinned componentize-py",
                ),
                (".gitignore", "__pycache__/\n*.wasm\n".to_string(), ""),
            ],
            Language::Js => vec![
                ("plugin.js", JS_HANDLER.to_string(), "the handler"),
                (
                    "idem.js",
                    JS_HELPER.to_string(),
                    "the guest helper (field access, builders)",
                ),
                (
                    "build.mjs",
                    JS_BUILD.to_string(),
                    "the componentize-js build",
                ),
                (
                    "package.json",
                    JS_PACKAGE.replace(JS_PACKAGE_NAME, name).replace(
                        "The loyalty consumer as a JavaScript idem plugin",
                        "An idem plugin in JavaScript",
                    ),
                    "the pinned componentize-js (package-lock.json pins the rest)",
                ),
                (
                    "package-lock.json",
                    JS_LOCK.replace(JS_PACKAGE_NAME, name),
                    "",
                ),
                (".gitignore", "node_modules/\n*.wasm\n".to_string(), ""),
            ],
            Language::C | Language::Cpp => self.c_files(),
        }
    }

    /// A C or C++ project's own files.
    fn c_files(self) -> Vec<(&'static str, String, &'static str)> {
        let (handler, source, language) = match self {
            Language::C => ("plugin.c", C_HANDLER, "c"),
            _ => ("plugin.cpp", CPP_HANDLER, "cpp"),
        };
        vec![
            (handler, source.to_string(), "the handler"),
            (
                "idem.h",
                C_HELPER.to_string(),
                "the guest helper (JSON field access, builders; C and C++)",
            ),
            (
                "idem.toml",
                C_MANIFEST
                    .replace("{{language}}", language)
                    .replace("{{source}}", handler),
                "what `idem build` compiles, and extra compiler flags",
            ),
            (
                ".gitignore",
                format!("{}/\n*.wasm\n", crate::clang::BINDINGS),
                "",
            ),
        ]
    }

    fn prerequisites(self) -> String {
        match self {
            Language::Rust => {
                "Needs Rust with the wasm32-wasip2 target (`rustup target add wasm32-wasip2`).\n"
                    .to_string()
            }
            Language::Python => format!(
                "Needs componentize-py {COMPONENTIZE_PY} (`pip install componentize-py=={COMPONENTIZE_PY}`).\n"
            ),
            Language::Js => {
                "Needs Node.js 20 or later with npm; `idem build` runs `npm ci` the first time.\n"
                    .to_string()
            }
            Language::C => format!(
                "Needs clang, lld and wasi-libc for wasm32-wasi (Debian: `apt install {}`), or a WASI SDK with `WASI_SYSROOT` set to its sysroot. `idem build` writes the contract's C bindings into `{}/` each time.\n",
                crate::clang::C_PACKAGES,
                crate::clang::BINDINGS
            ),
            Language::Cpp => format!(
                "Needs clang, lld, wasi-libc and libc++ for wasm32-wasi (Debian: `apt install {} {}`), or a WASI SDK with `WASI_SYSROOT` set to its sysroot. C++ is built without exceptions. `idem build` writes the contract's C bindings into `{}/` each time.\n",
                crate::clang::C_PACKAGES,
                crate::clang::CPP_PACKAGES,
                crate::clang::BINDINGS
            ),
        }
    }
}

/// `idem new <language> <dir>`: writes a project named after the directory.
pub fn new(language: Language, directory: &Path) -> anyhow::Result<ExitCode> {
    let name = directory
        .file_name()
        .and_then(|name| name.to_str())
        .context("name the project's directory, e.g. `idem new rust ./orders`")?
        .to_string();
    if !valid_name(&name) {
        bail!(
            "{name:?} cannot name a plugin: use lowercase letters, digits and hyphens, starting with a letter (it names the crate or package, the .wasm file and the pipeline)"
        );
    }
    if directory.exists()
        && std::fs::read_dir(directory)
            .with_context(|| format!("cannot read {}", directory.display()))?
            .next()
            .is_some()
    {
        bail!(
            "{} exists and is not empty; idem new writes a new project",
            directory.display()
        );
    }
    let files = language.files(&name);
    let listed: String = files
        .iter()
        .filter(|(_, _, line)| !line.is_empty())
        .map(|(path, _, line)| format!("| `{path}` | {line} |\n"))
        .collect();
    let readme = README
        .replace("{{language}}", language.label())
        .replace("{{files}}", &listed)
        .replace("{{prerequisites}}", &language.prerequisites());
    let common = [
        ("wit/world.wit", WORLD_WIT.to_string()),
        ("cases.json", CASES.to_string()),
        ("order.json", ORDER.to_string()),
        ("pipeline.toml", PIPELINE.to_string()),
        ("schema.sql", SCHEMA.to_string()),
        ("README.md", readme),
    ];
    let all = files
        .into_iter()
        .map(|(path, contents, _)| (path, contents))
        .chain(common);
    for (path, contents) in all {
        let target = directory.join(path);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create {}", parent.display()))?;
        }
        std::fs::write(&target, contents.replace("{{name}}", &name))
            .with_context(|| format!("cannot write {}", target.display()))?;
    }
    println!(
        "idem new: wrote the {} plugin {name:?} in {}",
        language.label(),
        directory.display()
    );
    println!(
        "next: cd {} && idem build && idem test --plugin {name}.wasm --cases cases.json",
        directory.display()
    );
    Ok(ExitCode::SUCCESS)
}

fn valid_name(name: &str) -> bool {
    name.starts_with(|first: char| first.is_ascii_lowercase())
        && name.chars().all(|character| {
            character.is_ascii_lowercase() || character.is_ascii_digit() || character == '-'
        })
        && !name.ends_with('-')
}

/// `idem build [dir]`: builds the project in `directory` into `<name>.wasm` beside it.
pub fn build(directory: &Path) -> anyhow::Result<ExitCode> {
    let (language, name) = detect(directory)?;
    let output = directory.join(format!("{name}.wasm"));
    let staging = directory.join(format!(".{name}.wasm.building"));
    let started = std::time::Instant::now();
    match language {
        Language::Rust => build_rust(directory, &name, &staging)?,
        Language::Python => build_python(directory, &staging)?,
        Language::Js => build_js(directory, &staging)?,
        Language::C | Language::Cpp => {
            crate::clang::build(directory, &c_manifest(directory)?, &staging)?
        }
    }
    // Replaced by rename: a host watching the file never reads half of it.
    std::fs::rename(&staging, &output)
        .with_context(|| format!("cannot write {}", output.display()))?;
    let size = std::fs::metadata(&output).map_or(0, |metadata| metadata.len());
    println!(
        "idem build: {} ({} KiB, {} plugin) in {:.1} s",
        output.display(),
        size / 1024,
        language.label(),
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

/// Builds a Rust plugin project with cargo into `staging`.
fn build_rust(directory: &Path, name: &str, staging: &Path) -> anyhow::Result<()> {
    require(
        "cargo",
        "Rust is not installed: see https://rustup.rs, then `rustup target add wasm32-wasip2`",
    )?;
    if toolchain_present("rustup")
        && !run_quiet(Command::new("rustup").args(["target", "list", "--installed"]))
            .is_some_and(|installed| installed.lines().any(|line| line.trim() == "wasm32-wasip2"))
    {
        bail!("the wasm32-wasip2 target is not installed: rustup target add wasm32-wasip2");
    }
    let target_dir = directory.join("target");
    let mut cargo = Command::new("cargo");
    cargo
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip2",
            "--manifest-path",
        ])
        .arg(directory.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        // A build tool's own settings must not leak into this separate build.
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET");
    run(&mut cargo, "cargo build")?;
    let built = target_dir
        .join("wasm32-wasip2/release")
        .join(format!("{}.wasm", name.replace('-', "_")));
    std::fs::copy(&built, staging).with_context(|| format!("cannot copy {}", built.display()))?;
    Ok(())
}

/// Builds a Python plugin project with componentize-py into `staging`.
fn build_python(directory: &Path, staging: &Path) -> anyhow::Result<()> {
    let version =
        run_quiet(Command::new("componentize-py").arg("--version")).with_context(|| {
            format!(
                "componentize-py is not installed: pip install componentize-py=={COMPONENTIZE_PY}"
            )
        })?;
    if !version.contains(COMPONENTIZE_PY) {
        eprintln!(
            "idem build: warning: {} is installed; this project is tested with componentize-py {COMPONENTIZE_PY} (pip install componentize-py=={COMPONENTIZE_PY})",
            version.trim()
        );
    }
    let mut componentize = Command::new("componentize-py");
    componentize
        .current_dir(directory)
        .args([
            "-d",
            "wit",
            "-w",
            "plugin",
            "componentize",
            "--stub-wasi",
            "-p",
            ".",
            "app",
            "-o",
        ])
        .arg(staging);
    run(&mut componentize, "componentize-py")?;
    Ok(())
}

/// Builds a JavaScript plugin project with componentize-js (installed by `npm ci` when
/// missing) into `staging`.
fn build_js(directory: &Path, staging: &Path) -> anyhow::Result<()> {
    require(
        "node",
        "Node.js is not installed: install Node.js 20 or later with npm (e.g. apt install nodejs npm)",
    )?;
    if !directory
        .join("node_modules/@bytecodealliance/componentize-js")
        .is_dir()
    {
        require(
            "npm",
            "npm is not installed: install Node.js 20 or later with npm (e.g. apt install nodejs npm)",
        )?;
        eprintln!("idem build: installing the pinned componentize-js (npm ci)");
        let mut npm = Command::new("npm");
        npm.current_dir(directory)
            .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"]);
        run(&mut npm, "npm ci")?;
    }
    let mut node = Command::new("node");
    node.current_dir(directory).arg("build.mjs").arg(staging);
    run(&mut node, "node build.mjs")?;
    Ok(())
}

/// The project's language and name, from its manifest.
fn detect(directory: &Path) -> anyhow::Result<(Language, String)> {
    let read = |file: &str| -> anyhow::Result<String> {
        let path = directory.join(file);
        std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))
    };
    let toml_name = |file: &str, table: &str| -> anyhow::Result<String> {
        let manifest: toml::Table = read(file)?
            .parse()
            .with_context(|| format!("{} is not valid TOML", directory.join(file).display()))?;
        manifest
            .get(table)
            .and_then(|table| table.get("name"))
            .and_then(|name| name.as_str())
            .map(str::to_string)
            .with_context(|| format!("{}: no {table}.name", directory.join(file).display()))
    };
    if directory.join("Cargo.toml").is_file() {
        return Ok((Language::Rust, toml_name("Cargo.toml", "package")?));
    }
    if directory.join(C_MANIFEST_FILE).is_file() {
        let manifest = c_manifest(directory)?;
        let language = if manifest.is_cpp() {
            Language::Cpp
        } else {
            Language::C
        };
        return Ok((language, manifest.plugin.name));
    }
    if directory.join("package.json").is_file() {
        let package: serde_json::Value = serde_json::from_str(&read("package.json")?)
            .with_context(|| {
                format!(
                    "{} is not valid JSON",
                    directory.join("package.json").display()
                )
            })?;
        let name = package["name"]
            .as_str()
            .context("package.json has no name")?
            .to_string();
        return Ok((Language::Js, name));
    }
    if directory.join("pyproject.toml").is_file() && directory.join("app.py").is_file() {
        return Ok((Language::Python, toml_name("pyproject.toml", "project")?));
    }
    bail!(
        "{} is not a plugin project (no Cargo.toml, package.json, idem.toml, or pyproject.toml with app.py); create one with `idem new <rust|python|js|c|cpp> <dir>`",
        directory.display()
    )
}

/// The manifest of a C or C++ project.
const C_MANIFEST_FILE: &str = "idem.toml";

/// The C or C++ project's `idem.toml`, its errors naming the file and field.
fn c_manifest(directory: &Path) -> anyhow::Result<crate::clang::Manifest> {
    let path = directory.join(C_MANIFEST_FILE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("{} is not a valid idem.toml", path.display()))
}

fn toolchain_present(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok()
}

fn require(program: &str, install: &str) -> anyhow::Result<()> {
    if toolchain_present(program) {
        Ok(())
    } else {
        bail!("{install}")
    }
}

/// The program's stdout when it ran and succeeded.
fn run_quiet(command: &mut Command) -> Option<String> {
    let output = command.output().ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Runs a build step with its output shown; its failure is the build's.
fn run(command: &mut Command, what: &str) -> anyhow::Result<()> {
    let status = command
        .status()
        .with_context(|| format!("cannot run {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status}); its output is above");
    }
    Ok(())
}
