//! JavaScript plugins: `plugin.js` with the guest helper `idem.js`, made a component by the
//! pinned componentize-js through the project's `build.mjs` (npm installs it the first time).

use std::path::Path;
use std::process::Command;

use anyhow::Context;

use super::{Kit, Language, ProjectFile, read, require, run};

const HANDLER: &str = include_str!("../../../../templates/js/plugin.js");
const BUILD: &str = include_str!("../../../../templates/js/build.mjs");
const HELPER: &str = include_str!("../../../../../plugins/idem-js/idem.js");
/// The JavaScript toolchain pins: the repository's JavaScript plugin's, renamed.
const PACKAGE: &str = include_str!("../../../../../plugins/loyalty-js/package.json");
const LOCK: &str = include_str!("../../../../../plugins/loyalty-js/package-lock.json");
const PACKAGE_NAME: &str = "idem-loyalty-js";

const NODE_MISSING: &str =
    "Node.js is not installed: install Node.js 20 or later with npm (e.g. apt install nodejs npm)";

pub struct Js;

/// A directory with a `package.json` is a JavaScript project, named by its `name`.
pub fn recognise(directory: &Path) -> anyhow::Result<Option<(Language, String)>> {
    if !directory.join("package.json").is_file() {
        return Ok(None);
    }
    let package: serde_json::Value = serde_json::from_str(&read(directory, "package.json")?)
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
    Ok(Some((Language::Js, name)))
}

impl Kit for Js {
    fn label(&self) -> &'static str {
        "JavaScript"
    }

    fn files(&self, name: &str) -> Vec<ProjectFile> {
        let package = PACKAGE.replace(PACKAGE_NAME, name).replace(
            "The loyalty consumer as a JavaScript idem plugin",
            "An idem plugin in JavaScript",
        );
        vec![
            ProjectFile::new("plugin.js", HANDLER, "the handler"),
            ProjectFile::new(
                "idem.js",
                HELPER,
                "the guest helper (field access, builders)",
            ),
            ProjectFile::new("build.mjs", BUILD, "the componentize-js build"),
            ProjectFile::new(
                "package.json",
                package,
                "the pinned componentize-js (package-lock.json pins the rest)",
            ),
            ProjectFile::new("package-lock.json", LOCK.replace(PACKAGE_NAME, name), ""),
            ProjectFile::new(".gitignore", "node_modules/\n*.wasm\n", ""),
        ]
    }

    fn prerequisites(&self) -> String {
        "Needs Node.js 20 or later with npm; `idem build` runs `npm ci` the first time.\n"
            .to_string()
    }

    fn build(&self, directory: &Path, _name: &str, staging: &Path) -> anyhow::Result<()> {
        require("node", NODE_MISSING)?;
        if !directory
            .join("node_modules/@bytecodealliance/componentize-js")
            .is_dir()
        {
            require("npm", NODE_MISSING)?;
            eprintln!("idem build: installing the pinned componentize-js (npm ci)");
            let mut npm = Command::new("npm");
            npm.current_dir(directory)
                .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"]);
            run(&mut npm, "npm ci")?;
        }
        let mut node = Command::new("node");
        node.current_dir(directory).arg("build.mjs").arg(staging);
        run(&mut node, "node build.mjs")
    }
}
