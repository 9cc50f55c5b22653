//! The documentation holds together: the README stays a front door (at most 200 lines), and
//! every relative link in it, in `docs/` and in the plugin guide reaches a file that exists,
//! and a heading there when it names one (`page.md#heading`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The pages the checks read: the README, every page of `docs/` and `docs/reference/`, the
/// plugin guide.
fn pages() -> Vec<PathBuf> {
    let root = repository();
    let mut pages = vec![root.join("README.md"), root.join("plugins/README.md")];
    for folder in ["docs", "docs/reference"] {
        let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join(folder))
            .expect("a docs folder")
            .map(|entry| entry.expect("a docs entry").path())
            .filter(|path| path.extension().is_some_and(|extension| extension == "md"))
            .collect();
        docs.sort();
        pages.extend(docs);
    }
    pages
}

/// The text outside code fences, line by line.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            if line.starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// Every `](target)` of `line`.
fn links(line: &str) -> Vec<&str> {
    line.match_indices("](")
        .filter_map(|(at, _)| {
            let rest = &line[at + 2..];
            rest.find(')').map(|end| &rest[..end])
        })
        .collect()
}

/// A heading's anchor as GitHub makes it: lower case, punctuation but `-` and `_` dropped,
/// spaces as `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|character| character.is_alphanumeric() || matches!(character, ' ' | '-' | '_'))
        .map(|character| if character == ' ' { '-' } else { character })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    prose(text)
        .into_iter()
        .filter_map(|line| {
            line.trim_start_matches('#')
                .strip_prefix(' ')
                .filter(|_| line.starts_with('#'))
        })
        .map(anchor)
        .collect()
}

#[test]
fn the_readme_is_a_front_door() {
    let text = std::fs::read_to_string(repository().join("README.md")).expect("README.md");
    let lines = text.lines().count();
    assert!(
        lines <= 200,
        "README.md has {lines} lines: keep it a front door (at most 200) and put the rest under docs/"
    );
}

#[test]
fn every_relative_link_reaches_its_page_and_heading() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("a page");
        for line in prose(&text) {
            for target in links(line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (file, heading) = target.split_once('#').unwrap_or((target, ""));
                let linked = if file.is_empty() {
                    page.clone()
                } else {
                    page.parent().expect("a page's directory").join(file)
                };
                let Ok(linked_text) = std::fs::read_to_string(&linked).or_else(|error| {
                    // A directory or an image is there or not; only pages have headings.
                    if linked.exists() && heading.is_empty() {
                        Ok(String::new())
                    } else {
                        Err(error)
                    }
                }) else {
                    broken.push(format!("{}: {target} (no such file)", page.display()));
                    continue;
                };
                if !heading.is_empty() && !anchors(&linked_text).contains(heading) {
                    broken.push(format!("{}: {target} (no such heading)", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn a_heading_anchor_is_made_as_github_makes_it() {
    assert_eq!(anchor("Compiled-plugin cache"), "compiled-plugin-cache");
    assert_eq!(
        anchor("Configuration reference (`pipelines.toml`)"),
        "configuration-reference-pipelinestoml"
    );
    assert_eq!(
        links("see [a](docs/a.md#x) and [b](b.md)"),
        ["docs/a.md#x", "b.md"]
    );
}
