//! C and C++ plugins: an `idem.toml` naming the sources, compiled by clang for `wasm32-wasi`
//! (Debian's `clang`, `lld` and `wasi-libc`, or a WASI SDK named by `WASI_SYSROOT`) with C
//! bindings generated from the project's `wit/` (wit-bindgen's C generator, in this binary),
//! and the core module made a component with the contract embedded and wasmtime's WASI
//! preview-1 adapter (also in this binary). Nothing is downloaded.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use super::{Kit, Language, ProjectFile};

const C_HANDLER: &str = include_str!("../../../../templates/c/plugin.c");
const CPP_HANDLER: &str = include_str!("../../../../templates/cpp/plugin.cpp");
const HELPER: &str = include_str!("../../../../../plugins/idem-c/idem.h");
const PROJECT: &str = include_str!("../../../../templates/c/idem.toml");

/// The manifest of a C or C++ project.
const MANIFEST_FILE: &str = "idem.toml";

/// The two languages clang builds here.
pub enum Clang {
    C,
    Cpp,
}

/// A directory with an `idem.toml` is a C or C++ project (its `plugin.language`), named by
/// `plugin.name`.
pub fn recognise(directory: &Path) -> anyhow::Result<Option<(Language, String)>> {
    if !directory.join(MANIFEST_FILE).is_file() {
        return Ok(None);
    }
    let manifest = Manifest::read(directory)?;
    let language = if manifest.is_cpp() {
        Language::Cpp
    } else {
        Language::C
    };
    Ok(Some((language, manifest.plugin.name)))
}

impl Kit for Clang {
    fn label(&self) -> &'static str {
        match self {
            Clang::C => "C",
            Clang::Cpp => "C++",
        }
    }

    fn files(&self, _name: &str) -> Vec<ProjectFile> {
        let (handler, source, language) = match self {
            Clang::C => ("plugin.c", C_HANDLER, "c"),
            Clang::Cpp => ("plugin.cpp", CPP_HANDLER, "cpp"),
        };
        let manifest = PROJECT
            .replace("{{language}}", language)
            .replace("{{source}}", handler);
        vec![
            ProjectFile::new(handler, source, "the handler"),
            ProjectFile::new(
                "idem.h",
                HELPER,
                "the guest helper (JSON field access, builders; C and C++)",
            ),
            ProjectFile::new(
                MANIFEST_FILE,
                manifest,
                "what `idem build` compiles, and extra compiler flags",
            ),
            ProjectFile::new(".gitignore", format!("{BINDINGS}/\n*.wasm\n"), ""),
        ]
    }

    fn prerequisites(&self) -> String {
        let (what, packages, exceptions) = match self {
            Clang::C => ("clang, lld and wasi-libc", C_PACKAGES.to_string(), ""),
            Clang::Cpp => (
                "clang, lld, wasi-libc and libc++",
                format!("{C_PACKAGES} {CPP_PACKAGES}"),
                " C++ is built without exceptions.",
            ),
        };
        format!(
            "Needs {what} for wasm32-wasi (Debian: `apt install {packages}`), or a WASI SDK with `WASI_SYSROOT` set to its sysroot.{exceptions} `idem build` writes the contract's C bindings into `{BINDINGS}/` each time.\n"
        )
    }

    fn build(&self, directory: &Path, _name: &str, staging: &Path) -> anyhow::Result<()> {
        build(directory, &Manifest::read(directory)?, staging)
    }
}

/// What Debian needs for C, and for C++ too.
const C_PACKAGES: &str = "clang lld wasi-libc libclang-rt-14-dev-wasm32";
const CPP_PACKAGES: &str = "libc++-14-dev-wasm32 libc++abi-14-dev-wasm32";

/// The generated bindings' directory in a project, rewritten by every build.
const BINDINGS: &str = "bindings";

/// A C or C++ project's `idem.toml`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    plugin: PluginTable,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PluginTable {
    /// Names the `.wasm` file.
    name: String,
    /// `c` or `cpp` (any other value is refused where the file is read, naming the line).
    language: ManifestLanguage,
    /// The sources to compile, relative to the project.
    sources: Vec<PathBuf>,
    /// Extra compiler flags, e.g. `["-DNDEBUG"]`.
    #[serde(default)]
    flags: Vec<String>,
    /// The contract's directory, relative to the project (default `wit`).
    #[serde(default = "default_wit")]
    wit: PathBuf,
}

fn default_wit() -> PathBuf {
    PathBuf::from("wit")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum ManifestLanguage {
    C,
    Cpp,
}

impl Manifest {
    /// The project's `idem.toml`, its errors naming the file and field.
    fn read(directory: &Path) -> anyhow::Result<Manifest> {
        let path = directory.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        toml::from_str(&text)
            .with_context(|| format!("{} is not a valid idem.toml", path.display()))
    }

    /// Whether this is a C++ project (`language = "cpp"`).
    fn is_cpp(&self) -> bool {
        self.plugin.language == ManifestLanguage::Cpp
    }
}

/// Builds the project in `directory` described by `manifest` into `staging`.
fn build(directory: &Path, manifest: &Manifest, staging: &Path) -> anyhow::Result<()> {
    let wit = directory.join(&manifest.plugin.wit);
    let bindings = directory.join(BINDINGS);
    write_bindings(&wit, &bindings)?;
    // Relative to the project, where clang runs.
    let core = Path::new(BINDINGS).join(format!("{}.core.wasm", manifest.plugin.name));
    compile(directory, manifest, &core)?;
    let core = directory.join(core);
    let module = std::fs::read(&core).with_context(|| format!("cannot read {}", core.display()))?;
    let component = componentize(&module)?;
    std::fs::write(staging, component)
        .with_context(|| format!("cannot write {}", staging.display()))
}

/// The contract of the project's `wit/` and its `plugin` world.
fn contract_world(wit: &Path) -> anyhow::Result<(wit_parser::Resolve, wit_parser::WorldId)> {
    let mut resolve = wit_parser::Resolve::default();
    let (package, _) = resolve
        .push_dir(wit)
        .with_context(|| format!("cannot read the plugin contract in {}", wit.display()))?;
    let world = resolve
        .select_world(&[package], Some("plugin"))
        .with_context(|| format!("{} has no `plugin` world", wit.display()))?;
    Ok((resolve, world))
}

/// Writes the C bindings of the contract in `wit` into `bindings`: `plugin.h`, `plugin.c`,
/// and `plugin_component_type.o`, which carries the contract into the linked module.
fn write_bindings(wit: &Path, bindings: &Path) -> anyhow::Result<()> {
    let (mut resolve, world) = contract_world(wit)?;
    let mut files = wit_bindgen_core::Files::default();
    wit_bindgen_c::Opts::default()
        .build()
        .generate(&mut resolve, world, &mut files)
        .context("cannot generate the C bindings")?;
    std::fs::create_dir_all(bindings)
        .with_context(|| format!("cannot create {}", bindings.display()))?;
    for (name, contents) in files.iter() {
        let path = bindings.join(name);
        std::fs::write(&path, contents)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// Compiles every source (C with `clang`, C++ with `clang++`) and the bindings, and links
/// them into the core module `core`.
fn compile(directory: &Path, manifest: &Manifest, core: &Path) -> anyhow::Result<()> {
    let cpp = manifest.is_cpp();
    let packages = if cpp {
        format!("{C_PACKAGES} {CPP_PACKAGES}")
    } else {
        C_PACKAGES.to_string()
    };
    let mut objects = Vec::new();
    let bindings_source = Path::new(BINDINGS).join("plugin.c");
    let sources = manifest.plugin.sources.iter().chain([&bindings_source]);
    for source in sources {
        let is_cpp = source
            .extension()
            .and_then(|extension| extension.to_str())
            .is_some_and(|extension| matches!(extension, "cpp" | "cc" | "cxx"));
        let object = Path::new(BINDINGS).join(format!(
            "{}.o",
            source.to_string_lossy().replace(['/', '\\'], "_")
        ));
        let mut command = clang(is_cpp, directory);
        command
            .args(["-c", "-O2", "-Wall", "-Wextra", "-I", ".", "-I", BINDINGS])
            .args(if is_cpp {
                ["-std=c++17", "-fno-exceptions"].as_slice()
            } else {
                ["-std=c11"].as_slice()
            })
            .args(&manifest.plugin.flags)
            .arg(source)
            .arg("-o")
            .arg(&object);
        run_clang(&mut command, &packages)?;
        objects.push(object);
    }
    let mut link = clang(cpp, directory);
    link.args(["-mexec-model=reactor"])
        .args(&objects)
        .arg(Path::new(BINDINGS).join("plugin_component_type.o"))
        .arg("-o")
        .arg(core);
    run_clang(&mut link, &packages)
}

/// `clang` (or `clang++`) for `wasm32-wasi`, in `directory`, with `WASI_SYSROOT` when set.
fn clang(cpp: bool, directory: &Path) -> Command {
    let mut command = Command::new(if cpp { "clang++" } else { "clang" });
    command.current_dir(directory).arg("--target=wasm32-wasi");
    if let Some(sysroot) = std::env::var_os("WASI_SYSROOT") {
        command.arg("--sysroot").arg(sysroot);
    }
    command
}

/// Runs a compile or link; a missing compiler, linker or WASI library gets the packages that
/// bring it.
fn run_clang(command: &mut Command, packages: &str) -> anyhow::Result<()> {
    let program = command.get_program().to_string_lossy().into_owned();
    let output = match command.output() {
        Ok(output) => output,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => bail!(
            "{program} is not installed: apt install {packages} (or set WASI_SYSROOT to a WASI SDK's sysroot with its clang on PATH)"
        ),
        Err(error) => bail!("cannot run {program}: {error}"),
    };
    let said = String::from_utf8_lossy(&output.stderr);
    eprint!("{said}");
    if output.status.success() {
        return Ok(());
    }
    // What clang says when the WASI libraries, headers or the wasm linker are missing.
    let toolchain_missing = [
        "unable to find library -lc",
        "stdlib.h' file not found",
        "stdint.h' file not found",
        "'string' file not found",
        "Executable \"wasm-ld\"",
        "libclang_rt.builtins-wasm32",
    ]
    .iter()
    .any(|sign| said.contains(sign));
    if toolchain_missing {
        bail!(
            "{program} failed: the wasm32-wasi toolchain is incomplete: apt install {packages} (or set WASI_SYSROOT to a WASI SDK's sysroot)"
        );
    }
    bail!("{program} failed ({})", output.status)
}

/// The component of core module `module` (which carries its contract), WASI preview 1
/// adapted to preview 2.
fn componentize(module: &[u8]) -> anyhow::Result<Vec<u8>> {
    wit_component::ComponentEncoder::default()
        .module(module)
        .and_then(|encoder| {
            encoder.adapter(
                wasi_preview1_component_adapter_provider::WASI_SNAPSHOT_PREVIEW1_ADAPTER_NAME,
                wasi_preview1_component_adapter_provider::WASI_SNAPSHOT_PREVIEW1_REACTOR_ADAPTER,
            )
        })
        .and_then(|encoder| encoder.validate(true).encode())
        .context("cannot make a component of the compiled module (does it export the handler? build it with `idem build`)")
}
