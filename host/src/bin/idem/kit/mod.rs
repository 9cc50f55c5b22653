//! Plugin languages: `idem new` writes a project, `idem build` finds its language and builds
//! it with that language's pinned toolchain. One file per language (`rust`, `python`, `js`,
//! `c` for C and C++), each giving its project files, what to install, how to recognise a
//! project and how to build it; this file holds the list of them and what all share.
//!
//! The files are embedded in the binary: the contract (`wit/world.wit`), the guest helper of
//! the language (the same sources the example plugins in `plugins/` use), the build files with
//! pinned versions, a handler, its cases, a pipeline fragment and a README.

mod c;
mod js;
mod python;
mod rust;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use clap::ValueEnum;

use crate::exit::Exit;

/// The languages `idem new` writes and `idem build` builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Language {
    Rust,
    Python,
    Js,
    C,
    Cpp,
}

/// One file of a new project: where, what, and its line in the project's README (empty for
/// none).
pub struct ProjectFile {
    path: &'static str,
    contents: String,
    described: &'static str,
}

impl ProjectFile {
    fn new(path: &'static str, contents: impl Into<String>, described: &'static str) -> Self {
        ProjectFile {
            path,
            contents: contents.into(),
            described,
        }
    }
}

/// What a language gives: its name, a new project's files, what to install, and the build.
trait Kit: Sync {
    /// The language's name in messages and the README.
    fn label(&self) -> &'static str;
    /// The project's own files, beside the common ones; `{{name}}` is replaced afterwards.
    fn files(&self, name: &str) -> Vec<ProjectFile>;
    /// The README's prerequisites paragraph.
    fn prerequisites(&self) -> String;
    /// Builds the project in `directory` (absolute) named `name` into `staging` (absolute).
    fn build(&self, directory: &Path, name: &str, staging: &Path) -> anyhow::Result<()>;
}

impl Language {
    fn kit(self) -> &'static dyn Kit {
        match self {
            Language::Rust => &rust::Rust,
            Language::Python => &python::Python,
            Language::Js => &js::Js,
            Language::C => &c::Clang::C,
            Language::Cpp => &c::Clang::Cpp,
        }
    }
}

/// A project's language and name, when the directory holds one of that language.
type Recogniser = fn(&Path) -> anyhow::Result<Option<(Language, String)>>;

/// How `idem build` recognises a project, in order: the first language whose manifest is in
/// the directory decides (a Rust crate may also carry a `package.json`, not the reverse).
const RECOGNISERS: [Recogniser; 4] = [
    rust::recognise,
    c::recognise,
    js::recognise,
    python::recognise,
];

const WORLD_WIT: &str = idem_host::sandbox::WORLD_WIT;
const CASES: &str = include_str!("../../../../templates/common/cases.json");
const ORDER: &str = include_str!("../../../../templates/common/order.json");
const SCHEMA: &str = include_str!("../../../../templates/common/schema.sql");
const PIPELINE: &str = include_str!("../../../../templates/common/pipeline.toml");
const README: &str = include_str!("../../../../templates/common/README.md");

/// `idem new <language> <dir>`: writes a project named after the directory.
pub fn new(language: Language, directory: &Path) -> anyhow::Result<Exit> {
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
    let kit = language.kit();
    let files = kit.files(&name);
    let listed: String = files
        .iter()
        .filter(|file| !file.described.is_empty())
        .map(|file| format!("| `{}` | {} |\n", file.path, file.described))
        .collect();
    let readme = README
        .replace("{{language}}", kit.label())
        .replace("{{files}}", &listed)
        .replace("{{prerequisites}}", &kit.prerequisites());
    let common = [
        ProjectFile::new("wit/world.wit", WORLD_WIT, ""),
        ProjectFile::new("cases.json", CASES, ""),
        ProjectFile::new("order.json", ORDER, ""),
        ProjectFile::new("pipeline.toml", PIPELINE, ""),
        ProjectFile::new("schema.sql", SCHEMA, ""),
        ProjectFile::new("README.md", readme, ""),
    ];
    for file in files.into_iter().chain(common) {
        let target = directory.join(file.path);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create {}", parent.display()))?;
        }
        std::fs::write(&target, file.contents.replace("{{name}}", &name))
            .with_context(|| format!("cannot write {}", target.display()))?;
    }
    println!(
        "idem new: wrote the {} plugin {name:?} in {}",
        kit.label(),
        directory.display()
    );
    println!(
        "next: cd {} && idem build && idem test --plugin {name}.wasm --cases cases.json",
        directory.display()
    );
    Ok(Exit::Success)
}

fn valid_name(name: &str) -> bool {
    name.starts_with(|first: char| first.is_ascii_lowercase())
        && name.chars().all(|character| {
            character.is_ascii_lowercase() || character.is_ascii_digit() || character == '-'
        })
        && !name.ends_with('-')
}

/// `idem build [dir] [--output file]`: builds the project in `directory` into `output`
/// (default `<name>.wasm` beside the project's files).
pub fn build(directory: &Path, output: Option<&Path>) -> anyhow::Result<Exit> {
    // Absolute: the toolchains run inside the project, and their output paths must not move.
    let directory = std::path::absolute(directory)
        .with_context(|| format!("cannot resolve {}", directory.display()))?;
    let (language, name) = recognise(&directory)?;
    let output = match output {
        Some(output) => std::path::absolute(output)
            .with_context(|| format!("cannot resolve {}", output.display()))?,
        None => directory.join(format!("{name}.wasm")),
    };
    let staging = staging_beside(&output)?;
    let started = std::time::Instant::now();
    let kit = language.kit();
    kit.build(&directory, &name, &staging)?;
    // Replaced by rename: a host watching the file never reads half of it.
    std::fs::rename(&staging, &output)
        .with_context(|| format!("cannot write {}", output.display()))?;
    let size = std::fs::metadata(&output).map_or(0, |metadata| metadata.len());
    println!(
        "idem build: {} ({} KiB, {} plugin) in {:.1} s",
        output.display(),
        size / 1024,
        kit.label(),
        started.elapsed().as_secs_f64()
    );
    Ok(Exit::Success)
}

/// A hidden file in the output's directory (so the final rename stays on one filesystem).
fn staging_beside(output: &Path) -> anyhow::Result<PathBuf> {
    let file_name = output
        .file_name()
        .and_then(|name| name.to_str())
        .with_context(|| format!("{} does not name a file", output.display()))?;
    let parent = output.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    Ok(parent.join(format!(".{file_name}.building")))
}

/// The project's language and name, from its manifest.
fn recognise(directory: &Path) -> anyhow::Result<(Language, String)> {
    for recogniser in RECOGNISERS {
        if let Some(found) = recogniser(directory)? {
            return Ok(found);
        }
    }
    bail!(
        "{} is not a plugin project (no Cargo.toml, idem.toml, package.json, or pyproject.toml with app.py); create one with `idem new <rust|python|js|c|cpp> <dir>`",
        directory.display()
    )
}

/// The text of a project's file, its error naming the path.
fn read(directory: &Path, file: &str) -> anyhow::Result<String> {
    let path = directory.join(file);
    std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))
}

/// `<table>.name` of a project's TOML manifest.
fn toml_name(directory: &Path, file: &str, table: &str) -> anyhow::Result<String> {
    let manifest: toml::Table = read(directory, file)?
        .parse()
        .with_context(|| format!("{} is not valid TOML", directory.join(file).display()))?;
    manifest
        .get(table)
        .and_then(|table| table.get("name"))
        .and_then(|name| name.as_str())
        .map(str::to_string)
        .with_context(|| format!("{}: no {table}.name", directory.join(file).display()))
}

fn toolchain_present(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok()
}

/// Fails with `install` (what to install) when `program` does not run.
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
