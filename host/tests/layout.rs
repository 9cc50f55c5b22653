//! The layout ARCHITECTURE.md describes, checked: the modules a message passes through
//! (`source/`, `sandbox/`, `store/`, and the outbox's `relay/`) never import the layers above
//! them, no two modules of a folder import each other, broker and delivery clients are used
//! only where messages enter and leave (`source/`, `relay/`), no function grows past a
//! screen, and no file past 600 lines of code.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers that put the lower modules together; the lower ones never import them.
const UPPER: [&str; 4] = ["pipeline", "cases", "triage", "http"];
/// The lower layers: one folder each.
const LOWER: [&str; 4] = ["source", "sandbox", "store", "relay"];

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

/// The top-level module a file belongs to: `store` for `src/store/ledger/mod.rs`.
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

/// The module path of a file under `src/`: `["source", "rabbitmq", "dead_letters"]` for
/// `src/source/rabbitmq/dead_letters.rs`, `["source"]` for `src/source/mod.rs`.
fn module_path(source: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(source).expect("under src");
    let mut path: Vec<String> = relative
        .components()
        .map(|component| {
            component
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string()
        })
        .collect();
    if path
        .last()
        .is_some_and(|last| last == "mod" || last == "lib")
    {
        path.pop();
    }
    path
}

/// Every module path `text`'s code names, made absolute from `module` (the file's own path):
/// `crate::a::b`, `super::a`, `super::super::a`, `self::a`, and each name of a group
/// `super::{a, b::c}`.
fn paths_named(text: &str, module: &[String]) -> Vec<Vec<String>> {
    let code: String = text
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let identifier = |rest: &str| -> String {
        rest.chars()
            .take_while(|character| character.is_ascii_alphanumeric() || *character == '_')
            .collect()
    };
    let mut named = Vec::new();
    for (at, _) in code
        .match_indices("crate::")
        .chain(code.match_indices("super::"))
        .chain(code.match_indices("self::"))
    {
        // Only where a path starts, not in the middle of one (`super::super::`).
        let before = code[..at].chars().next_back();
        if before.is_some_and(|character| {
            character == ':' || character.is_ascii_alphanumeric() || character == '_'
        }) {
            continue;
        }
        let mut base: Vec<String> = Vec::new();
        let mut rest = &code[at..];
        if let Some(after) = rest.strip_prefix("crate::") {
            rest = after;
        } else {
            base = module.to_vec();
            loop {
                if let Some(after) = rest.strip_prefix("super::") {
                    base.pop();
                    rest = after;
                } else if let Some(after) = rest.strip_prefix("self::") {
                    rest = after;
                } else {
                    break;
                }
            }
        }
        let mut path = base;
        loop {
            if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let name = identifier(item.trim());
                    if !name.is_empty() && name != "self" {
                        let mut item_path = path.clone();
                        item_path.push(name);
                        named.push(item_path);
                    }
                }
                break;
            }
            let name = identifier(rest);
            if name.is_empty() {
                break;
            }
            rest = &rest[name.len()..];
            path.push(name);
            match rest.strip_prefix("::") {
                Some(after) => rest = after,
                None => break,
            }
        }
        if !path.is_empty() {
            named.push(path);
        }
    }
    named
}

/// Inside every folder, no two of its modules import each other, however deep the files that
/// do it: `source::dead_letters` and `source::rabbitmq` (through `rabbitmq/dead_letters.rs`)
/// would be such a circle. A module may use its parent's items; siblings must not go both ways.
#[test]
fn no_two_modules_of_one_folder_import_each_other() {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&source, &mut files);
    let modules: BTreeSet<Vec<String>> = files
        .iter()
        .map(|file| module_path(&source, file))
        .collect();
    // (folder, from, to): a file under folder/from names folder/to.
    let mut edges: BTreeMap<(Vec<String>, String, String), String> = BTreeMap::new();
    for file in &files {
        let module = module_path(&source, file);
        let text = std::fs::read_to_string(file).expect("read");
        for named in paths_named(&text, &module) {
            let common = module
                .iter()
                .zip(&named)
                .take_while(|(left, right)| left == right)
                .count();
            if common == 0 || common >= module.len() || common >= named.len() {
                continue;
            }
            let folder = module[..common].to_vec();
            let mut target = folder.clone();
            target.push(named[common].clone());
            if !modules.contains(&target) {
                continue;
            }
            edges
                .entry((folder, module[common].clone(), named[common].clone()))
                .or_insert_with(|| file.display().to_string());
        }
    }
    let mut violations = Vec::new();
    for ((folder, from, to), file) in &edges {
        if from < to
            && let Some(back) = edges.get(&(folder.clone(), to.clone(), from.clone()))
        {
            violations.push(format!(
                "crate::{folder}::{from} and crate::{folder}::{to} import each other ({file}; {back})",
                folder = folder.join("::")
            ));
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

/// `src/`, and every Rust file under it, the command line's included.
fn every_source() -> (PathBuf, Vec<PathBuf>) {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&source, &mut files);
    sources(&source.join("bin"), &mut files);
    (source, files)
}

/// The crates that talk to brokers and delivery endpoints.
const CLIENT_CRATES: [&str; 4] = ["lapin", "async_nats", "rdkafka", "reqwest"];

/// `lapin`, `async_nats`, `rdkafka` and `reqwest` appear only in `source/` (each kind's client, and
/// `config/source/`'s check of a broker URL) and `relay/` (the outbox's deliveries): the
/// store, the sandbox, the consume loop and the command line name no client.
#[test]
fn broker_clients_stay_in_source_and_relay() {
    let (source, files) = every_source();
    let mut violations = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&source).expect("under src");
        let allowed = relative
            .components()
            .any(|component| matches!(component.as_os_str().to_str(), Some("source" | "relay")));
        if allowed {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("read");
        for (number, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            for client in CLIENT_CRATES {
                if line.contains(&format!("{client}::")) {
                    violations.push(format!("{}:{}: {client}", file.display(), number + 1));
                }
            }
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

/// Every sqlx statement of the host goes through `store::bookkeeping`, which never names one
/// (a named statement breaks behind a transaction pooler).
#[test]
fn sqlx_statements_go_through_bookkeeping() {
    let (source, files) = every_source();
    let mut violations = Vec::new();
    for file in &files {
        if file.strip_prefix(&source).expect("under src") == Path::new("store/bookkeeping.rs") {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("read");
        // Unit tests (after `#[cfg(test)]`) prepare on connections of their own.
        let code = text
            .lines()
            .take_while(|line| line.trim() != "#[cfg(test)]");
        for (number, line) in code.enumerate() {
            let named = ["sqlx::query(", "sqlx::query_as(", "sqlx::query_scalar("]
                .iter()
                .chain(&[".prepare(", "MIGRATOR.run("])
                .any(|call| line.contains(call));
            // tokio-postgres `prepare`s are the sessions' (`store::session`).
            let session = file.ends_with("store/session.rs");
            if named && !session && !line.trim_start().starts_with("//") {
                violations.push(format!(
                    "{}:{}: {}",
                    file.display(),
                    number + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

/// Lines a function of the host may span, signature and closing brace included.
const FUNCTION_LINES: usize = 80;

/// No function of the host (tests aside) runs past [`FUNCTION_LINES`]: a longer one is split
/// into steps that each have a name.
#[test]
fn no_function_is_longer_than_a_screen() {
    let (_, files) = every_source();
    let mut violations = Vec::new();
    for file in &files {
        if file.file_name().is_some_and(|name| name == "tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("read");
        // Unit tests sit at the end of a file, after `#[cfg(test)]`.
        let code = text.split("\n#[cfg(test)]").next().unwrap_or_default();
        let lines: Vec<&str> = code.lines().collect();
        for (start, line) in lines.iter().enumerate() {
            let trimmed = line.trim_start();
            let indent = &line[..line.len() - trimmed.len()];
            let is_fn = ["fn ", "pub fn ", "async fn ", "pub async fn ", "const fn "]
                .iter()
                .chain(&["pub const fn ", "pub(crate) fn ", "pub(super) fn "])
                .chain(&["pub(crate) async fn ", "pub(super) async fn "])
                .any(|prefix| trimmed.starts_with(prefix));
            if !is_fn || trimmed.ends_with(';') {
                continue;
            }
            let closing = format!("{indent}}}");
            let Some(length) = lines[start..].iter().position(|line| *line == closing) else {
                continue;
            };
            if length + 1 > FUNCTION_LINES {
                violations.push(format!(
                    "{}:{}: {} lines",
                    file.display(),
                    start + 1,
                    length + 1
                ));
            }
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

/// Lines of code (before its unit tests) a file of the host may hold.
const FILE_LINES: usize = 600;

/// The files that are test modules as a whole (`#[cfg(test)] mod upgrades;` beside them).
fn test_only_files(files: &[PathBuf]) -> BTreeSet<PathBuf> {
    let mut test_only = BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(file).expect("read");
        let folder = match file.file_name().and_then(|name| name.to_str()) {
            Some("mod.rs" | "lib.rs" | "main.rs") => file.parent().expect("a folder").to_path_buf(),
            _ => file.with_extension(""),
        };
        let lines: Vec<&str> = text.lines().collect();
        for pair in lines.windows(2) {
            let declared = pair[1]
                .strip_prefix("mod ")
                .and_then(|rest| rest.strip_suffix(';'));
            if let (Some(name), "#[cfg(test)]") = (declared, pair[0].trim()) {
                test_only.insert(folder.join(format!("{name}.rs")));
                test_only.insert(folder.join(name).join("mod.rs"));
            }
        }
    }
    test_only
}

/// No file of the host runs past [`FILE_LINES`] lines of code: its unit tests, after
/// `#[cfg(test)]`, and whole test modules aside. A longer one is split along its seams.
#[test]
fn no_file_is_longer_than_its_seams() {
    let (_, files) = every_source();
    let test_only = test_only_files(&files);
    let mut violations = Vec::new();
    for file in &files {
        if test_only.contains(file) {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("read");
        let code = text.split("\n#[cfg(test)]").next().unwrap_or_default();
        let lines = code.lines().count();
        if lines > FILE_LINES {
            violations.push(format!("{}: {lines} lines of code", file.display()));
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

/// The module a path names, as the files of `src/` (`["store", "ledger"]` for
/// `store/ledger/mod.rs`), with the text of every file in it.
fn module_texts(source: &Path, files: &[PathBuf]) -> BTreeMap<Vec<String>, String> {
    let mut texts: BTreeMap<Vec<String>, String> = BTreeMap::new();
    for file in files {
        let text = std::fs::read_to_string(file).expect("read");
        let module = module_path(source, file);
        // A folder's module holds its children's names too (`source::Delivery` is in
        // `source/mod.rs`, `source::rabbitmq::Acks` re-exported from `acks.rs`).
        for depth in 1..=module.len() {
            texts
                .entry(module[..depth].to_vec())
                .or_default()
                .push_str(&text);
        }
    }
    texts
}

/// Whether `word` stands in `text` as a whole identifier.
fn names(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        let boundary = |c: Option<char>| !c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        boundary(before) && boundary(after)
    })
}

/// Every `module::item` ARCHITECTURE.md names in backticks exists: its module path (from the
/// top, or the end of a longer one: `session::GUARD` is `store::session`) and the items after
/// it in that module's files; a path that starts with a type (`Pipeline::start`) names words
/// of the host's code.
#[test]
fn every_name_architecture_gives_exists() {
    let (source, files) = every_source();
    let texts = module_texts(&source, &files);
    let all: String = texts
        .iter()
        .filter(|(module, _)| module.len() == 1)
        .map(|(_, text)| text.as_str())
        .collect();
    let map =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../ARCHITECTURE.md"))
            .expect("ARCHITECTURE.md");
    let mut missing = Vec::new();
    for span in map.split('`').skip(1).step_by(2) {
        let path = span.split(['(', ' ', '<', '!']).next().unwrap_or_default();
        let path = path
            .trim_start_matches("idem_host::")
            .trim_start_matches("crate::");
        let segments: Vec<&str> = path.split("::").collect();
        let is_path = segments.len() > 1
            && segments.iter().all(|segment| {
                !segment.is_empty()
                    && segment
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_')
            });
        if !is_path {
            continue;
        }
        // The longest module prefix any module path ends with; the items after it in one of
        // those modules (`http::triage` is `http/triage.rs`, not `config/http.rs`'s).
        let found = (1..segments.len()).rev().find_map(|length| {
            let prefix: Vec<String> = segments[..length].iter().map(|s| s.to_string()).collect();
            let modules: Vec<&String> = texts
                .iter()
                .filter(|(module, _)| module.ends_with(&prefix))
                .map(|(_, text)| text)
                .collect();
            (!modules.is_empty()).then_some((length, modules))
        });
        let exists = match found {
            Some((length, modules)) => modules
                .iter()
                .any(|text| segments[length..].iter().all(|item| names(text, item))),
            None => segments.iter().all(|item| names(&all, item)),
        };
        if !exists {
            missing.push(span.to_string());
        }
    }
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names what is not there: {missing:?}"
    );
}
