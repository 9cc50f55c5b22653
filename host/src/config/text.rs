//! How `pipelines.toml` writes its values, for every table: `${VAR}` expansion, durations,
//! and errors that name the file, the line and the key.

use std::fmt::Display;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};
use toml::Spanned;

use super::ConfigError;

/// The file being read: what an error names, and where relative paths resolve.
#[derive(Debug, Clone, Copy)]
pub(super) struct Document<'a> {
    pub path: &'a Path,
    pub text: &'a str,
}

impl Document<'_> {
    /// An error about the file as a whole.
    pub fn invalid(&self, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.to_path_buf(),
            message: message.into(),
        }
    }

    /// An error about `key` (its full dotted name), on the line where `span` starts when
    /// known.
    pub fn at(&self, span: Option<Range<usize>>, key: &str, problem: impl Display) -> ConfigError {
        match span {
            Some(span) => self.invalid(format!(
                "line {}: {key}: {problem}",
                line_of(self.text, span.start)
            )),
            None => self.invalid(format!("{key}: {problem}")),
        }
    }

    /// The config file's directory, against which relative paths resolve.
    pub fn base_dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }

    /// `path` resolved against the config file's directory (an absolute one stays).
    pub fn resolve(&self, path: &Path) -> PathBuf {
        self.base_dir().join(path)
    }
}

/// A table of the file, for errors about its keys.
#[derive(Debug, Clone)]
pub(super) struct Table<'a> {
    pub document: &'a Document<'a>,
    /// Its dotted name, e.g. `pipelines.loyalty.source`.
    pub name: String,
    /// Where it is written, when known: the line of errors about keys without one of
    /// their own.
    pub span: Option<Range<usize>>,
}

impl Table<'_> {
    /// An error about `key` of this table, on the line where `span` starts (or the table's).
    pub fn at(&self, span: Option<Range<usize>>, key: &str, problem: impl Display) -> ConfigError {
        self.document.at(
            span.or_else(|| self.span.clone()),
            &format!("{}.{key}", self.name),
            problem,
        )
    }
}

/// The line (from 1) holding byte `offset` of `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .map_or(0, |before| before.matches('\n').count())
        + 1
}

/// Parses a duration as humantime writes one: `30d`, `12h`, `90m`, `45s`, `250ms`, or
/// several together (`1h30m`, `2m 30s`).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    humantime::parse_duration(text).map_err(|error| {
        format!("{text:?} is not a duration ({error}): write 30d, 12h, 90m, 45s, 250ms or 1h30m")
    })
}

/// A duration as `pipelines.toml` writes it, for `idem schema`.
pub(super) fn duration_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "pattern": "^\\s*([0-9]+\\s*[a-zA-Z]+\\s*)+$",
        "examples": ["250ms", "30s", "5m", "1h30m", "30d"]
    })
}

pub(super) fn duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(deserializer)?;
    parse_duration(&text).map_err(serde::de::Error::custom)
}

pub(super) fn duration_option<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Duration>, D::Error> {
    duration(deserializer).map(Some)
}

/// A service URL without its credentials, for logs and errors.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    // As URL parsers read it: the authority ends at the first '/', '?' or '#', and its last
    // '@' ends the user information.
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if key.to_ascii_lowercase().contains("pass") => {
                        format!("{key}=redacted")
                    }
                    _ => pair.to_string(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_string(),
    };
    format!("{scheme}://{host}{tail}")
}

pub(super) fn interpolated<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    let raw = String::deserialize(deserializer)?;
    expand_env(&raw, |name| std::env::var(name).ok()).map_err(serde::de::Error::custom)
}

fn interpolated_spanned<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Spanned<String>, D::Error> {
    let raw = Spanned::<String>::deserialize(deserializer)?;
    let span = raw.span();
    let value = expand_env(raw.get_ref(), |name| std::env::var(name).ok())
        .map_err(serde::de::Error::custom)?;
    Ok(Spanned::new(span, value))
}

pub(super) fn interpolated_spanned_option<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Spanned<String>>, D::Error> {
    interpolated_spanned(deserializer).map(Some)
}

pub(super) fn interpolated_spanned_list<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Spanned<Vec<String>>>, D::Error> {
    let raw = Spanned::<Vec<String>>::deserialize(deserializer)?;
    let span = raw.span();
    let values = raw
        .into_inner()
        .iter()
        .map(|value| expand_env(value, |name| std::env::var(name).ok()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(serde::de::Error::custom)?;
    Ok(Some(Spanned::new(span, values)))
}

/// One string or a list of them, each expanded: always a list.
pub(super) fn interpolated_one_or_many<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    let raw = match OneOrMany::deserialize(deserializer)? {
        OneOrMany::One(one) => vec![one],
        OneOrMany::Many(many) => many,
    };
    raw.iter()
        .map(|value| expand_env(value, |name| std::env::var(name).ok()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(serde::de::Error::custom)
}

pub(super) fn interpolated_one_or_many_option<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<String>>, D::Error> {
    interpolated_one_or_many(deserializer).map(Some)
}

pub(super) fn interpolated_option<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<String>, D::Error> {
    interpolated(deserializer).map(Some)
}

pub(super) fn interpolated_path_option<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<PathBuf>, D::Error> {
    Ok(interpolated_option(deserializer)?.map(PathBuf::from))
}

pub(super) fn interpolated_path<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<PathBuf, D::Error> {
    interpolated(deserializer).map(PathBuf::from)
}

/// Replaces `${NAME}` and `${NAME:-default}` with the variable's value, `${file:PATH}` with
/// the file's content (one trailing line break dropped: a secret mounted by Docker or
/// Kubernetes), and `$${` with a literal `${`. An unset variable without a default, or a file
/// that cannot be read, is an error (which never shows a value); `$` not followed by `{` is
/// kept.
fn expand_env(raw: &str, lookup: impl Fn(&str) -> Option<String>) -> Result<String, String> {
    expand(raw, lookup, |path| {
        std::fs::read_to_string(path).map_err(|error| error.to_string())
    })
}

/// [`expand_env`] with the variables from `lookup` and the files from `read`.
fn expand(
    raw: &str,
    lookup: impl Fn(&str) -> Option<String>,
    read: impl Fn(&str) -> Result<String, String>,
) -> Result<String, String> {
    let mut expanded = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(start) = rest.find("${") {
        if rest[..start].ends_with('$') {
            // `$${`: a literal `${`.
            expanded.push_str(&rest[..start - 1]);
            expanded.push_str("${");
            rest = &rest[start + 2..];
            continue;
        }
        expanded.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("unclosed \"${{\" in {raw:?} (write $${{ for a literal ${{)"))?;
        let expression = &after[..end];
        if let Some(path) = expression.strip_prefix("file:") {
            let content =
                read(path).map_err(|error| format!("cannot read ${{file:{path}}}: {error}"))?;
            let content = content.strip_suffix('\n').unwrap_or(&content);
            expanded.push_str(content.strip_suffix('\r').unwrap_or(content));
        } else {
            expanded.push_str(&variable(expression, raw, &lookup)?);
        }
        rest = &after[end + 1..];
    }
    expanded.push_str(rest);
    Ok(expanded)
}

/// The value of `${expression}` (`NAME` or `NAME:-default`) in `raw`.
fn variable(
    expression: &str,
    raw: &str,
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<String, String> {
    let (name, default) = match expression.split_once(":-") {
        Some((name, default)) => (name, Some(default)),
        None => (expression, None),
    };
    if name.is_empty()
        || !name
            .chars()
            .all(|character| character.is_ascii_alphanumeric() || character == '_')
    {
        return Err(format!("invalid variable name {name:?} in {raw:?}"));
    }
    match (lookup(name).filter(|value| !value.is_empty()), default) {
        (Some(value), _) => Ok(value),
        (None, Some(default)) => Ok(default.to_string()),
        (None, None) => Err(format!(
            "environment variable {name} is not set and has no default (write ${{{name}:-default}})"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check_redact(url: &str, expected: &str) {
        assert_eq!(redact_url(url), expected);
    }

    #[test]
    fn redaction() {
        check_redact(
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "amqp://127.0.0.1:5672/%2f",
        );
        check_redact("amqp://127.0.0.1", "amqp://127.0.0.1");
        check_redact("postgres://u:p@w@host/db", "postgres://host/db");
        check_redact("not a url", "not a url");
        check_redact(
            "postgres://host/db?user=u&password=secret&sslmode=require",
            "postgres://host/db?user=u&password=redacted&sslmode=require",
        );
        check_redact(
            "postgres://u@host/db?sslpassword=a@b",
            "postgres://host/db?sslpassword=redacted",
        );
    }

    #[track_caller]
    fn check_duration(text: &str, expected: Result<Duration, &str>) {
        match (parse_duration(text), expected) {
            (Ok(actual), Ok(expected)) => assert_eq!(actual, expected),
            (Err(error), Err(fragment)) => assert!(error.contains(fragment), "{error}"),
            (actual, expected) => panic!("{text:?}: {actual:?} vs {expected:?}"),
        }
    }

    #[test]
    fn duration_parsing() {
        check_duration("30d", Ok(Duration::from_secs(30 * 86_400)));
        check_duration("12h", Ok(Duration::from_secs(12 * 3_600)));
        check_duration("90m", Ok(Duration::from_secs(90 * 60)));
        check_duration("45s", Ok(Duration::from_secs(45)));
        check_duration("250ms", Ok(Duration::from_millis(250)));
        check_duration("0s", Ok(Duration::ZERO));
        check_duration("1h30m", Ok(Duration::from_secs(90 * 60)));
        check_duration("2m 30s", Ok(Duration::from_secs(150)));
        check_duration("30", Err("not a duration"));
        check_duration("d", Err("not a duration"));
        check_duration("3 parsecs", Err("not a duration"));
    }

    #[track_caller]
    fn check_expand(raw: &str, expected: Result<&str, &str>) {
        let lookup = |name: &str| match name {
            "SET" => Some("value".to_string()),
            "EMPTY" => Some(String::new()),
            _ => None,
        };
        let read = |path: &str| match path {
            "/run/secrets/password" => Ok("s3cret\n".to_string()),
            "/run/secrets/crlf" => Ok("two\r\n".to_string()),
            _ => Err("No such file or directory (os error 2)".to_string()),
        };
        let actual = expand(raw, lookup, read);
        match expected {
            Ok(expected) => assert_eq!(actual.as_deref(), Ok(expected)),
            Err(fragment) => {
                let error = actual.expect_err("expected an error");
                assert!(error.contains(fragment), "{error:?} lacks {fragment:?}");
            }
        }
    }

    #[test]
    fn env_expansion() {
        check_expand("plain", Ok("plain"));
        check_expand("${SET}", Ok("value"));
        check_expand("a-${SET}-b", Ok("a-value-b"));
        check_expand("${UNSET:-fallback}", Ok("fallback"));
        check_expand("${EMPTY:-fallback}", Ok("fallback"));
        check_expand("${SET:-fallback}", Ok("value"));
        check_expand("${UNSET:-}", Ok(""));
        check_expand("cost $5", Ok("cost $5"));
        check_expand("${UNSET}", Err("UNSET is not set"));
        check_expand("${SET", Err("unclosed"));
        check_expand("${bad name}", Err("invalid variable name"));
        check_expand("pw=${file:/run/secrets/password}!", Ok("pw=s3cret!"));
        check_expand("${file:/run/secrets/crlf}", Ok("two"));
        check_expand(
            "${file:/run/secrets/none}",
            Err("cannot read ${file:/run/secrets/none}"),
        );
        check_expand("$${SET} and $${file:x}", Ok("${SET} and ${file:x}"));
        check_expand("$$${SET}", Ok("$${SET}"));
        check_expand("cost $$5", Ok("cost $$5"));
    }
}
