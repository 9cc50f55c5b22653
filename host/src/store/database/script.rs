//! `idem migrate --print`: the SQL `idem migrate` would run in a database, as one script a
//! DBA can read, review and run: the steps not applied yet, each recorded in idem's history
//! as `idem migrate` records it, in one transaction under the migrations' lock.

use std::fmt::Write;

use sqlx::PgPool;

use super::migrate::{CREATE_HISTORY, MIGRATION_LOCK, MIGRATOR};
use super::schema::literal;
use crate::store::bookkeeping;
use crate::store::tables::{Tables, quote_identifier};

/// The versions applied where `tables` are: none when idem's history is not there yet.
pub async fn applied_versions(pool: &PgPool, tables: &Tables) -> Result<Vec<i64>, sqlx::Error> {
    let exists: bool = bookkeeping::query_scalar(&format!(
        "SELECT to_regclass({}) IS NOT NULL",
        literal(tables.history())
    ))
    .fetch_one(pool)
    .await?;
    if !exists {
        return Ok(Vec::new());
    }
    bookkeeping::query_scalar(&tables.sql("SELECT version FROM {history} WHERE success"))
        .fetch_all(pool)
        .await
}

/// The script for the steps not in `applied`, where `tables` are. It does not move an
/// installation from another schema (`idem migrate` does, and says so).
pub fn script(tables: &Tables, applied: &[i64]) -> String {
    let mut sql = String::new();
    let _ = writeln!(sql, "BEGIN;");
    let _ = writeln!(sql, "SELECT pg_advisory_xact_lock({MIGRATION_LOCK});");
    if let Some(schema) = tables.schema() {
        let _ = writeln!(
            sql,
            "CREATE SCHEMA IF NOT EXISTS {};",
            quote_identifier(schema)
        );
    }
    let _ = writeln!(sql, "{};", tables.sql(CREATE_HISTORY));
    if let Some(schema) = tables.schema() {
        // The steps name their tables unqualified: they land in idem's schema.
        let _ = writeln!(
            sql,
            "SET LOCAL search_path TO {};",
            quote_identifier(schema)
        );
    }
    let mut pending = 0;
    for step in MIGRATOR.iter() {
        if step.migration_type.is_down_migration() || applied.contains(&step.version) {
            continue;
        }
        pending += 1;
        let _ = writeln!(sql, "\n-- {} {}", step.version, step.description);
        let _ = writeln!(sql, "{}", step.sql.as_str().trim_end());
        let _ = writeln!(
            sql,
            "{} VALUES ({}, '{}', true, '\\x{}'::bytea, 0);",
            tables.sql(
                "INSERT INTO {history} (version, description, success, checksum, execution_time)"
            ),
            step.version,
            step.description.replace('\'', "''"),
            hex::encode(&*step.checksum)
        );
    }
    if pending == 0 {
        let _ = writeln!(sql, "-- every step is applied already");
    }
    let _ = writeln!(sql, "COMMIT;");
    sql
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every step for a new database, in order, each recorded; none for one that has them.
    #[test]
    fn the_script_holds_the_steps_not_applied() {
        let tables = Tables::new(Some("idem"));
        let all = script(&tables, &[]);
        assert!(all.starts_with("BEGIN;\n"), "{all}");
        assert!(all.trim_end().ends_with("COMMIT;"), "{all}");
        assert!(all.contains("CREATE SCHEMA IF NOT EXISTS"), "{all}");
        assert!(all.contains("SET LOCAL search_path TO"), "{all}");
        let versions: Vec<i64> = MIGRATOR
            .iter()
            .filter(|step| !step.migration_type.is_down_migration())
            .map(|step| step.version)
            .collect();
        let mut at = 0;
        for version in &versions {
            let found = all[at..]
                .find(&format!("-- {version} "))
                .unwrap_or_else(|| panic!("step {version} missing or out of order"));
            at += found + 1;
            assert!(all.contains(&format!("VALUES ({version}, '")), "{all}");
        }
        let none = script(&tables, &versions);
        assert!(none.contains("every step is applied already"), "{none}");
        assert!(!none.contains("INSERT INTO"), "{none}");
    }
}
