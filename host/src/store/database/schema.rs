//! Whether idem's tables, where the configuration says, are idem's and up to date: the
//! claims table's shape (a hand-written consumer's `processed_messages` is not adopted), and
//! probes of every table the host reads.

use sqlx::PgPool;

use super::DatabaseError;
use crate::config::{DatabaseConfig, redact_url};
use crate::store::bookkeeping;
use crate::store::tables::Tables;

/// The columns the claims need, with their types as `format_type` writes them.
const CLAIM_COLUMNS: [(&str, &str); 4] = [
    ("consumer", "text"),
    ("message_key", "text"),
    ("processed_at", "timestamp with time zone"),
    ("plugin_digest", "text"),
];

/// How the `processed_messages` that idem's statements reach (by the search path) differs
/// from the claims table idem needs: a column missing or of another type, a column the
/// claims would leave empty that may not be, no unique key on `(consumer, message_key)`
/// (`processed_at` added on a partitioned one). Empty when it is idem's, or absent.
pub(super) async fn claims_table_problems(
    connection: &mut sqlx::PgConnection,
    tables: &Tables,
) -> Result<Vec<String>, sqlx::Error> {
    let claims = literal(tables.claims());
    // No parameters: the simple protocol, one exchange (see `bookkeeping`).
    let columns = bookkeeping::raw(&format!(
        "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), \
                (a.attnotnull AND NOT a.atthasdef AND a.attidentity = '')::text \
         FROM pg_attribute a \
         WHERE a.attrelid = to_regclass({claims}) AND a.attnum > 0 \
           AND NOT a.attisdropped"
    ))
    .fetch_all(&mut *connection)
    .await?;
    if columns.is_empty() {
        return Ok(Vec::new());
    }
    let column = |row: &sqlx::postgres::PgRow, index: usize| -> Result<String, sqlx::Error> {
        sqlx::Row::try_get::<String, _>(row, index)
    };
    let mut found = Vec::with_capacity(columns.len());
    for row in &columns {
        found.push((column(row, 0)?, column(row, 1)?, column(row, 2)? == "true"));
    }
    let mut problems = Vec::new();
    for (name, wanted) in CLAIM_COLUMNS {
        match found.iter().find(|(column, ..)| column == name) {
            None => problems.push(format!("no column {name} ({wanted})")),
            Some((_, kind, _)) if kind != wanted => {
                problems.push(format!("column {name} is {kind}, idem needs {wanted}"));
            }
            Some(_) => {}
        }
    }
    for (name, _, required) in &found {
        if *required && !CLAIM_COLUMNS.iter().any(|(column, _)| column == name) {
            problems.push(format!(
                "column {name} is NOT NULL without a default (idem's claims do not fill it)"
            ));
        }
    }
    let keys = bookkeeping::raw(&format!(
        "SELECT string_agg(a.attname::text, ',' ORDER BY a.attname) \
         FROM pg_index i JOIN pg_attribute a \
           ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey) \
         WHERE i.indrelid = to_regclass({claims}) AND i.indisunique \
         GROUP BY i.indexrelid"
    ))
    .fetch_all(&mut *connection)
    .await?;
    let mut unique = Vec::with_capacity(keys.len());
    for row in &keys {
        unique.push(column(row, 0)?);
    }
    let claim_key = ["consumer,message_key", "consumer,message_key,processed_at"];
    if !unique.iter().any(|key| claim_key.contains(&key.as_str())) {
        problems.push(format!(
            "no unique key on (consumer, message_key) (unique keys: {})",
            if unique.is_empty() {
                "none".to_string()
            } else {
                unique
                    .iter()
                    .map(|key| format!("({})", key.replace(',', ", ")))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ));
    }
    Ok(problems)
}

/// Fails unless the host's tables (claims, and the outbox when `outbox` is configured) exist
/// and are usable: a missing table must stop start-up, not dead-letter every message.
pub async fn check_schema(
    pool: &PgPool,
    config: &DatabaseConfig,
    outbox: bool,
) -> Result<(), DatabaseError> {
    let tables = Tables::of(config);
    let mut probes = vec![
        "SELECT consumer, message_key, processed_at, plugin_digest FROM {claims} LIMIT 0",
        "SELECT consumer, retention_window, recorded_at, paused_at, pause_reason \
         FROM {consumers} LIMIT 0",
    ];
    if outbox {
        probes.push(
            "SELECT id, destination, idempotency_key, payload, headers, attempts, next_attempt_at, \
             last_error, delivered_at, parked_at, traceparent, tracestate FROM {outbox} LIMIT 0",
        );
    }
    let schema_error = |source| DatabaseError::Schema {
        endpoint: redact_url(&config.url),
        place: tables.place(),
        source,
    };
    // Another consumer's table first: `idem migrate` would not adopt it either.
    let mut connection = pool.acquire().await.map_err(schema_error)?;
    let problems = claims_table_problems(&mut connection, &tables)
        .await
        .map_err(schema_error)?;
    if !problems.is_empty() {
        return Err(foreign_claims(config, &tables, problems));
    }
    for probe in probes {
        // No parameters: the simple protocol, one exchange (see `bookkeeping`).
        bookkeeping::raw(&tables.sql(probe))
            .execute(&mut *connection)
            .await
            .map_err(schema_error)?;
    }
    Ok(())
}

/// `DatabaseError::ForeignClaims` for a claims table with `problems`.
pub(super) fn foreign_claims(
    config: &DatabaseConfig,
    tables: &Tables,
    problems: Vec<String>,
) -> DatabaseError {
    DatabaseError::ForeignClaims {
        endpoint: redact_url(&config.url),
        place: tables.place(),
        problems: problems.join("; "),
    }
}

/// `text` as a SQL string literal.
pub(super) fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}
