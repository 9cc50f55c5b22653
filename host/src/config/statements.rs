//! A pipeline's `statements`: named SQL, checked at load. A statement may change its own
//! transaction's settings (`SET LOCAL`, `set_config(…, true)`), never the session's: idem's
//! sessions are pooled and serve every message and pipeline after it, so a session-level
//! `search_path` would send the next message's claim to another table, `SET ROLE` would run
//! it as another role, and `SET default_transaction_read_only = off` would lift the guard
//! that keeps a lost `BEGIN` from committing anything.

use std::collections::BTreeMap;

use toml::Spanned;

use super::ConfigError;
use super::text::Table;

/// Checks a pipeline's `statements` table: at least one, none empty, none changing the
/// session.
pub(super) fn check(
    statements: &Spanned<BTreeMap<String, Spanned<String>>>,
    table: &Table,
) -> Result<(), ConfigError> {
    if statements.get_ref().is_empty() {
        return Err(table.at(
            Some(statements.span()),
            "statements",
            "a pipeline needs at least one named statement",
        ));
    }
    for (name, sql) in statements.get_ref() {
        let key = format!("statements.{name}");
        if sql.get_ref().trim().is_empty() {
            return Err(table.at(Some(sql.span()), &key, "statement is empty"));
        }
        if let Some(change) = session_change(sql.get_ref()) {
            return Err(table.at(
                Some(sql.span()),
                &key,
                format!(
                    "changes the session, not only its transaction: {change}; idem's sessions serve the next messages too (use SET LOCAL or set_config(…, true))"
                ),
            ));
        }
    }
    Ok(())
}

/// Why `sql` would change the session beyond its transaction, if it would.
fn session_change(sql: &str) -> Option<String> {
    let code = code_only(sql);
    let words: Vec<&str> = code.split_whitespace().take(3).collect();
    let first = words.first().map(|word| word.to_ascii_lowercase());
    let second = words.get(1).map(|word| word.to_ascii_lowercase());
    match (first.as_deref(), second.as_deref()) {
        (Some("set"), Some("local" | "transaction" | "constraints")) => {}
        (Some("set"), _) => {
            return Some("SET without LOCAL sets it for the session".into());
        }
        (Some("reset"), _) => {
            return Some("RESET resets the session's setting".into());
        }
        (Some("discard"), _) => {
            return Some("DISCARD drops the session's state".into());
        }
        _ => {}
    }
    let lower = code.to_ascii_lowercase();
    for function in SESSION_LOCKS {
        if calls(&lower, function).next().is_some() {
            return Some(format!(
                "{function}() holds its lock for the session (use the _xact_ form)"
            ));
        }
    }
    for arguments in calls(&lower, "set_config") {
        let is_local = top_level_arguments(arguments)
            .get(2)
            .map(|argument| argument.trim());
        if is_local != Some("true") {
            return Some("set_config() with is_local not true sets it for the session".into());
        }
    }
    None
}

/// Advisory locks held until the session ends, not the transaction.
const SESSION_LOCKS: [&str; 4] = [
    "pg_advisory_lock",
    "pg_advisory_lock_shared",
    "pg_try_advisory_lock",
    "pg_try_advisory_lock_shared",
];

/// `sql` without comments, and with the contents of string literals and quoted identifiers
/// blanked (so a word inside one is never taken for code).
fn code_only(sql: &str) -> String {
    let mut code = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '-' if chars.peek() == Some(&'-') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        break;
                    }
                }
                code.push(' ');
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut previous = ' ';
                for c in chars.by_ref() {
                    if previous == '*' && c == '/' {
                        break;
                    }
                    previous = c;
                }
                code.push(' ');
            }
            '\'' | '"' => {
                // A doubled quote inside reads as the end and a new start: blank either way.
                for inner in chars.by_ref() {
                    if inner == c {
                        break;
                    }
                }
                code.push(c);
                code.push(c);
            }
            c => code.push(c),
        }
    }
    code
}

/// The argument lists (between the parentheses) of every call of `function` in `code`.
fn calls<'a>(code: &'a str, function: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    code.match_indices(function).filter_map(move |(at, _)| {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            return None;
        }
        let rest = code[at + function.len()..].trim_start();
        let inside = rest.strip_prefix('(')?;
        let mut depth = 0usize;
        for (index, c) in inside.char_indices() {
            match c {
                '(' => depth += 1,
                ')' if depth == 0 => return Some(&inside[..index]),
                ')' => depth -= 1,
                _ => {}
            }
        }
        Some(inside)
    })
}

/// The arguments of a call, split at its top-level commas.
fn top_level_arguments(arguments: &str) -> Vec<&str> {
    let mut depth = 0usize;
    let mut start = 0;
    let mut parts = Vec::new();
    for (index, c) in arguments.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&arguments[start..index]);
                start = index + 1;
            }
            _ => {}
        }
    }
    parts.push(&arguments[start..]);
    parts
}

#[cfg(test)]
mod tests {
    use super::session_change;

    #[test]
    fn session_level_changes_are_named() {
        for sql in [
            "SET search_path = other",
            "  set role app",
            "SET SESSION AUTHORIZATION app",
            "SET default_transaction_read_only = off",
            "-- note\nRESET ALL",
            "DISCARD ALL",
            "SELECT set_config('search_path', 'other', false)",
            "SELECT pg_catalog.set_config('search_path', $1, false)",
            "SELECT set_config('x.y', $1, $2)",
            "SELECT set_config('x.y', $1)",
            "SELECT pg_advisory_lock(hashtext($1))",
            "SELECT PG_TRY_ADVISORY_LOCK(1)",
        ] {
            assert!(session_change(sql).is_some(), "{sql}");
        }
    }

    #[test]
    fn transaction_level_changes_and_plain_statements_pass() {
        for sql in [
            "SET LOCAL search_path = other",
            "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            "SET CONSTRAINTS ALL DEFERRED",
            "SELECT set_config('app.tenant', $1, true)",
            "SELECT set_config('app.tenant', lower(concat($1, 'x')), TRUE)",
            "SELECT pg_advisory_xact_lock(hashtext($1))",
            "INSERT INTO settings (name) VALUES ('SET search_path')",
            "INSERT INTO notes (body) VALUES ($1) -- not a SET",
            "UPDATE \"set\" SET value = $1 WHERE name = $2",
            "INSERT INTO point_ledger (customer_id, points) VALUES ($1, $2)",
        ] {
            assert_eq!(session_change(sql), None, "{sql}");
        }
    }
}
