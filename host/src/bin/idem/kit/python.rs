//! Python plugins: `app.py` with the guest helper `idem.py`, made a component by the pinned
//! componentize-py (`--stub-wasi`: the sandbox gives a plugin no files, clocks or network).

use std::path::Path;
use std::process::Command;

use std::path::PathBuf;

use anyhow::Context;

use super::{Kit, Language, ProjectFile, run, run_quiet};

/// The pinned componentize-py, as the repository's own Python plugin is built with.
const COMPONENTIZE_PY: &str = "0.25.1";

const HANDLER: &str = include_str!("../../../../templates/python/app.py");
const PROJECT: &str = include_str!("../../../../templates/python/pyproject.toml");
const HELPER: &str = include_str!("../../../../../plugins/idem-py/idem.py");

pub struct Python;

/// A directory with `pyproject.toml` and `app.py` is a Python project, named by
/// `project.name`.
pub fn recognise(directory: &Path) -> anyhow::Result<Option<(Language, String)>> {
    if !(directory.join("pyproject.toml").is_file() && directory.join("app.py").is_file()) {
        return Ok(None);
    }
    let name = super::toml_name(directory, "pyproject.toml", "project")?;
    Ok(Some((Language::Python, name)))
}

impl Kit for Python {
    fn label(&self) -> &'static str {
        "Python"
    }

    fn files(&self, _name: &str) -> Vec<ProjectFile> {
        vec![
            ProjectFile::new("app.py", HANDLER, "the handler"),
            ProjectFile::new(
                "idem.py",
                HELPER,
                "the guest helper (field access, builders)",
            ),
            ProjectFile::new(
                "pyproject.toml",
                PROJECT,
                "the project, with the pinned componentize-py",
            ),
            ProjectFile::new(".gitignore", "__pycache__/\n*.wasm\n", ""),
        ]
    }

    fn prerequisites(&self) -> String {
        format!(
            "Needs componentize-py {COMPONENTIZE_PY} (`pip install componentize-py=={COMPONENTIZE_PY}`).\n"
        )
    }

    fn build(&self, directory: &Path, _name: &str, staging: &Path) -> anyhow::Result<()> {
        let layout = Layout::read(directory)?;
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
            .arg("-d")
            .arg(&layout.wit)
            .args(["-w", "plugin", "componentize", "--stub-wasi", "-p", "."]);
        for path in &layout.paths {
            componentize.arg("-p").arg(path);
        }
        componentize.args(["app", "-o"]).arg(staging);
        run(&mut componentize, "componentize-py")
    }
}

/// Where a project's contract and modules are, from `[tool.idem]` in `pyproject.toml`: `wit`
/// (default `wit`) and `paths`, directories searched for modules besides the project's own
/// (componentize-py sees only the directories it is given, so a link out of the project is
/// not followed).
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Layout {
    #[serde(default = "default_wit")]
    wit: PathBuf,
    #[serde(default)]
    paths: Vec<PathBuf>,
}

fn default_wit() -> PathBuf {
    PathBuf::from("wit")
}

impl Layout {
    fn read(directory: &Path) -> anyhow::Result<Layout> {
        let path = directory.join("pyproject.toml");
        let project: toml::Table = super::read(directory, "pyproject.toml")?
            .parse()
            .with_context(|| format!("{} is not valid TOML", path.display()))?;
        let Some(idem) = project
            .get("tool")
            .and_then(|tool| tool.get("idem"))
            .cloned()
        else {
            return Ok(Layout {
                wit: default_wit(),
                paths: Vec::new(),
            });
        };
        idem.try_into()
            .with_context(|| format!("{}: [tool.idem] takes wit and paths", path.display()))
    }
}
