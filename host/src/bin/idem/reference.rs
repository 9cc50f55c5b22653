//! `idem reference <page>`: the reference pages of `docs/reference/`, made from the code: the
//! configuration from the schema `idem schema` prints, the command line from clap, the
//! metrics from the registry, the `x-idem-*` headers from `source::headers`. A test fails
//! when a page in the tree differs from what the code makes (`IDEM_BLESS=1` rewrites them).

use std::fmt::Write;

use clap::{CommandFactory, ValueEnum};
use serde_json::Value;

use crate::exit::Exit;

/// Print a reference page (docs/reference/), made from this binary's code.
#[derive(clap::Args)]
pub struct Args {
    page: Page,
}

/// The reference pages, each `docs/reference/<name>.md`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Page {
    Configuration,
    Cli,
    Metrics,
    Headers,
}

impl Args {
    pub fn run(self) -> anyhow::Result<Exit> {
        print!("{}", render(self.page));
        Ok(Exit::Success)
    }
}

/// The page as Markdown.
pub fn render(page: Page) -> String {
    let (title, body) = match page {
        Page::Configuration => ("Configuration keys (`pipelines.toml`)", configuration()),
        Page::Cli => ("Commands and flags", cli()),
        Page::Metrics => ("Metrics (`/metrics`)", metrics()),
        Page::Headers => ("Headers idem writes (`x-idem-*`)", headers()),
    };
    format!(
        "# {title}\n\nGenerated from the code by `idem reference {}`; `host/src/bin/idem/reference.rs` keeps it current; the guides start at [getting started](../getting-started.md).\n\n{body}",
        page.to_possible_value()
            .map_or(String::new(), |value| value.get_name().to_string())
    )
}

/// A table cell: one line, no pipe.
fn cell(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

/// Every table of the schema, each a section with its keys.
fn configuration() -> String {
    let schema = idem_host::config::json_schema();
    let mut out = String::new();
    section(&mut out, "(the file)", &schema, &schema["$defs"]);
    out
}

/// `schema`'s keys as a table under `path`, then each key that is a table of its own.
fn section(out: &mut String, path: &str, schema: &Value, defs: &Value) {
    let Some(properties) = schema["properties"].as_object() else {
        return;
    };
    let _ = writeln!(out, "## `{path}`\n");
    if let Some(description) = schema["description"].as_str() {
        let _ = writeln!(out, "{}\n", cell(description));
    }
    let _ = writeln!(out, "| key | type | description |\n|---|---|---|");
    let mut nested = Vec::new();
    for (key, property) in properties {
        let description = property["description"]
            .as_str()
            .or_else(|| resolve(property, defs)["description"].as_str())
            .unwrap_or("");
        let _ = writeln!(
            out,
            "| `{key}` | {} | {} |",
            cell(&type_name(property, defs)),
            cell(description)
        );
        let child = if path == "(the file)" {
            key.clone()
        } else {
            format!("{path}.{key}")
        };
        let resolved = resolve(property, defs);
        if resolved["properties"].is_object() {
            nested.push((child, resolved));
        } else if let Some(entries) = resolved
            .get("additionalProperties")
            .filter(|entries| entries.is_object())
        {
            let entries = resolve(entries, defs);
            if entries["properties"].is_object() {
                nested.push((format!("{child}.<name>"), entries));
            }
        }
    }
    let _ = writeln!(out);
    for (child, resolved) in nested {
        section(out, &child, resolved, defs);
    }
}

/// `schema` with a `$ref`, or an optional one (`anyOf` with null), followed.
fn resolve<'schema>(schema: &'schema Value, defs: &'schema Value) -> &'schema Value {
    if let Some(reference) = schema["$ref"].as_str() {
        let name = reference.trim_start_matches("#/$defs/");
        return resolve(&defs[name], defs);
    }
    if let Some(options) = schema["anyOf"].as_array() {
        let present: Vec<&Value> = options
            .iter()
            .filter(|option| option["type"] != "null")
            .collect();
        if let [only] = present[..] {
            return resolve(only, defs);
        }
    }
    schema
}

/// How a key is written: `string`, `integer`, `table`, `list of string`, `"a" | "b"`.
fn type_name(schema: &Value, defs: &Value) -> String {
    let schema = resolve(schema, defs);
    if let Some(values) = schema["enum"].as_array() {
        return values
            .iter()
            .map(Value::to_string)
            .collect::<Vec<_>>()
            .join(" \\| ");
    }
    if let Some(options) = schema["oneOf"].as_array().or(schema["anyOf"].as_array()) {
        return options
            .iter()
            .map(|option| match &option["const"] {
                Value::Null => type_name(option, defs),
                constant => constant.to_string(),
            })
            .collect::<Vec<_>>()
            .join(" or ");
    }
    if schema["properties"].is_object() {
        return "table".into();
    }
    let kinds: Vec<&str> = match &schema["type"] {
        Value::String(kind) => vec![kind.as_str()],
        Value::Array(kinds) => kinds
            .iter()
            .filter_map(Value::as_str)
            .filter(|kind| *kind != "null")
            .collect(),
        _ => Vec::new(),
    };
    match kinds.as_slice() {
        ["array"] => format!("list of {}", type_name(&schema["items"], defs)),
        ["object"] => match schema.get("additionalProperties") {
            Some(entries) if entries.is_object() => {
                format!("table of {}", type_name(entries, defs))
            }
            _ => "table".into(),
        },
        [] => "any".into(),
        kinds => kinds.join(" or "),
    }
}

/// Every command and subcommand with its arguments.
fn cli() -> String {
    let mut out = String::new();
    commands(&mut out, &crate::Cli::command(), "idem");
    out
}

fn commands(out: &mut String, command: &clap::Command, path: &str) {
    for sub in command.get_subcommands() {
        if sub.is_hide_set() {
            continue;
        }
        let name = format!("{path} {}", sub.get_name());
        let _ = writeln!(out, "## `{name}`\n");
        if let Some(about) = sub.get_long_about().or(sub.get_about()) {
            let _ = writeln!(out, "{}\n", cell(&about.to_string()));
        }
        let arguments: Vec<&clap::Arg> = sub
            .get_arguments()
            .filter(|argument| !argument.is_hide_set() && argument.get_id().as_str() != "help")
            .collect();
        if !arguments.is_empty() {
            let _ = writeln!(out, "| argument | default | description |\n|---|---|---|");
            for argument in arguments {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} |",
                    written(argument),
                    defaults(argument),
                    cell(
                        &argument
                            .get_help()
                            .map(ToString::to_string)
                            .unwrap_or_default()
                    )
                );
            }
            let _ = writeln!(out);
        }
        commands(out, sub, &name);
    }
}

/// How an argument is written: `--config`, `-c`, or `<PAGE>`.
fn written(argument: &clap::Arg) -> String {
    let mut forms = Vec::new();
    if let Some(long) = argument.get_long() {
        forms.push(format!("`--{long}`"));
    }
    if let Some(short) = argument.get_short() {
        forms.push(format!("`-{short}`"));
    }
    if forms.is_empty() {
        forms.push(format!("`<{}>`", argument.get_id().as_str().to_uppercase()));
    }
    if let Some(variable) = argument.get_env() {
        forms.push(format!("`${}`", variable.to_string_lossy()));
    }
    forms.join(", ")
}

/// An argument's default, or its choices.
fn defaults(argument: &clap::Arg) -> String {
    let defaults: Vec<String> = argument
        .get_default_values()
        .iter()
        .map(|value| format!("`{}`", value.to_string_lossy()))
        .collect();
    if !defaults.is_empty() {
        return defaults.join(", ");
    }
    let choices: Vec<String> = argument
        .get_possible_values()
        .iter()
        .map(|value| format!("`{}`", value.get_name()))
        .collect();
    choices.join(" \\| ")
}

/// A registry with a sample in every family (an empty family is not encoded), through the
/// host's own recording calls.
fn every_family() -> idem_host::telemetry::metrics::Metrics {
    use idem_host::telemetry::metrics::{Metrics, OutboxSample, SourceSample};
    use std::time::Duration;
    let metrics = Metrics::new();
    let (pipeline, second) = ("p", Duration::from_secs(1));
    metrics.message_settled(pipeline, "applied", second);
    metrics.pipeline_paused(pipeline, false);
    metrics.pipeline_operator_paused(pipeline, false);
    metrics.batch_size(pipeline, 1);
    metrics.plugin_called(pipeline, second);
    metrics.transaction_finished(pipeline, second);
    metrics.database_retried(pipeline, "40001");
    metrics.outbox_delivered("d", "delivered");
    metrics.plugin_reloaded(pipeline, "applied");
    metrics.claims_deleted(pipeline, 1);
    let sample = SourceSample {
        waiting: 1,
        unacknowledged: Some(1),
        dead_letters: 1,
        oldest_age: Some(second),
    };
    metrics.source_sampled(pipeline, sample);
    let waiting = [(("t".to_string(), 0), 1)].into_iter().collect();
    metrics.source_partitions_sampled(pipeline, &waiting);
    metrics.source_rebalances(pipeline, 1);
    metrics.outbox_sampled("default", OutboxSample::default());
    metrics.claims_sampled(pipeline, 1, second, second);
    metrics
}

/// Every metric the registry holds, with its type and help.
fn metrics() -> String {
    let text = every_family().encode();
    let mut kinds = std::collections::BTreeMap::new();
    let mut helps = std::collections::BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some((name, kind)) = rest.split_once(' ') {
                kinds.insert(name.to_string(), kind.to_string());
            }
        } else if let Some(rest) = line.strip_prefix("# HELP ")
            && let Some((name, help)) = rest.split_once(' ')
        {
            helps.insert(name.to_string(), help.to_string());
        }
    }
    let mut out = String::from(
        "Counters are exposed with `_total`, histograms as `_bucket`, `_sum` and `_count`. The labels of each are in [operations](../operations.md).\n\n| metric | type | help |\n|---|---|---|\n",
    );
    for (name, kind) in &kinds {
        let exposed = if kind == "counter" {
            format!("{name}_total")
        } else {
            name.clone()
        };
        let help = helps.get(name).map_or("", String::as_str);
        let _ = writeln!(out, "| `{exposed}` | {kind} | {} |", cell(help));
    }
    out
}

/// Every `x-idem-*` header `source::headers` names, with what it holds (its doc comment).
fn headers() -> String {
    let source = include_str!("../../source/headers.rs");
    let mut out = String::from("| header | what it holds |\n|---|---|\n");
    let mut doc = String::new();
    let mut last = String::new();
    for line in source.lines() {
        let line = line.trim();
        if let Some(text) = line.strip_prefix("///") {
            doc.push_str(text.trim());
            doc.push(' ');
        } else if let Some(rest) = line.strip_prefix("pub const ")
            && let Some((_, value)) = rest.split_once("= \"")
        {
            let header = value.trim_end_matches("\";");
            if !doc.is_empty() {
                last = doc.trim().to_string();
            }
            doc.clear();
            if header.len() > "x-idem-".len() && header.starts_with("x-idem-") {
                let _ = writeln!(out, "| `{header}` | {} |", cell(&last));
            }
        } else {
            doc.clear();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each page in docs/reference/ is what the code makes now; `IDEM_BLESS=1` writes them.
    #[test]
    fn the_reference_pages_are_current() {
        let directory = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reference");
        let bless = std::env::var("IDEM_BLESS").is_ok_and(|value| value == "1");
        let mut stale = Vec::new();
        for page in Page::value_variants() {
            let page = *page;
            let name = page.to_possible_value().expect("a page's name");
            let path = directory.join(format!("{}.md", name.get_name()));
            let made = render(page);
            if bless {
                std::fs::create_dir_all(&directory).expect("docs/reference");
                std::fs::write(&path, &made).expect("write the page");
            } else if std::fs::read_to_string(&path).ok().as_deref() != Some(made.as_str()) {
                stale.push(path.display().to_string());
            }
        }
        assert!(
            stale.is_empty(),
            "stale reference pages (write them with IDEM_BLESS=1 cargo test -p idem-host --bin idem the_reference_pages): {stale:?}"
        );
    }

    /// The pages hold what they are made from: a key of a nested table, a subcommand's flag,
    /// a counter and a header.
    #[test]
    fn the_pages_hold_the_codes_names() {
        assert!(render(Page::Configuration).contains("## `pipelines.<name>.retry`"));
        assert!(render(Page::Configuration).contains("| `metrics_listen` |"));
        assert!(render(Page::Cli).contains("## `idem dlq replay`"));
        assert!(render(Page::Cli).contains("`--format`"));
        assert!(render(Page::Metrics).contains("| `idem_messages_total` | counter |"));
        assert!(render(Page::Headers).contains("| `x-idem-attempt` |"));
    }
}
