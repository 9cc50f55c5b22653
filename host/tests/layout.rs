//! The layout ARCHITECTURE.md describes, checked: the modules a message passes through
//! (`source/`, `sandbox/`, `store/`) never import the layers above them, and no two
//! top-level modules import each other.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers that put the lower modules together; the lower ones never import them.
const UPPER: [&str; 5] = ["consumer", "process", "pipeline", "reload", "cases"];
/// The lower layers: one folder each.
const LOWER: [&str; 3] = ["source", "sandbox", "store"];

fn sources(directory: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(directory).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            if path.file_name().is_some_and(|name| name != "bin") {
                sources(&path, found);
            }
        } else if path.extension().is_some_and(|extension| extension == "rs") {
            found.push(path);
        }
    }
}

/// The top-level module a file belongs to: `store` for `src/store/ledger.rs`.
fn module_of(source: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(source).expect("under src");
    let first = relative.components().next().expect("a component");
    first
        .as_os_str()
        .to_string_lossy()
        .trim_end_matches(".rs")
        .to_string()
}

/// The top-level modules `text`'s code (not its comments) names through `crate::`.
fn imports(text: &str) -> BTreeSet<String> {
    let code: String = text
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    code.match_indices("crate::")
        .map(|(at, _)| {
            code[at + "crate::".len()..]
                .chars()
                .take_while(|character| character.is_ascii_alphanumeric() || *character == '_')
                .collect::<String>()
        })
        .filter(|name| !name.is_empty())
        .collect()
}

#[test]
fn lower_layers_do_not_import_upper_ones_and_nothing_is_circular() {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&source, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut violations = Vec::new();
    for file in &files {
        let module = module_of(&source, file);
        if module == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("read");
        let imported = imports(&text);
        if LOWER.contains(&module.as_str()) {
            for upper in UPPER.iter().filter(|upper| imported.contains(**upper)) {
                violations.push(format!("{} imports crate::{upper}", file.display()));
            }
        }
        let edges = graph.entry(module.clone()).or_default();
        edges.extend(imported.into_iter().filter(|name| *name != module));
    }
    for (module, edges) in &graph {
        for other in edges {
            if graph.get(other).is_some_and(|back| back.contains(module)) && module < other {
                violations.push(format!(
                    "crate::{module} and crate::{other} import each other"
                ));
            }
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}
