//! Where idem's own tables are: the claims (`processed_messages`), the outbox, the consumers'
//! retention windows and idem's migration history, in `[database] schema` or, without it, in
//! the first schema of the connection's search path (where earlier versions put them).
//!
//! Architecture invariant: every statement idem runs on its own tables names them through
//! `Tables::sql`, qualified by the configured schema, never by the search path alone: the
//! message transactions share their sessions with the plugins' statements, whose search path
//! is the application's, and behind a transaction pooler no session `SET` would last.

use tokio_postgres::types::Type;

use crate::config::DatabaseConfig;

/// The claims table: one row per applied message (the guide's Step 1).
const CLAIMS: &str = "processed_messages";
/// The transactional outbox (the guide's Step 6).
const OUTBOX: &str = "idem_outbox";
/// Every consumer's retention window.
const CONSUMERS: &str = "idem_consumers";
/// Dead letters archived by an operator.
const ARCHIVE: &str = "idem_dead_letters";
/// Where each consumer resumes in a log read by offset (`store::offsets`).
const OFFSETS: &str = "idem_offsets";
/// idem's migration history: its own, so an application's migrator (sqlx's
/// `_sqlx_migrations`, Flyway's, Rails' …) never sees idem's versions, nor idem the
/// application's.
const HISTORY: &str = "idem_migrations";

/// The mark a message transaction opens with (`ledger`, an expression of its opening
/// `SELECT`): the host's claims write only under it (`inside_open_transaction!`).
pub(crate) const MARK_OPEN: &str = "set_config('idem.transaction', 'open', true)";

/// The condition every host claim is written under: the transaction `ledger` opened and
/// marked (`MARK_OPEN`) is open. A flight's statements are each synced on their own, so if
/// `BEGIN` failed (a cancel landing on it, say), the statements after it in its flight run
/// outside any transaction and commit alone. Under this condition a claim then writes
/// nothing, and the flight's error, `BEGIN`'s, has the message retried.
macro_rules! inside_open_transaction {
    () => {
        "current_setting('idem.transaction', true) = 'open'"
    };
}

/// The guide's Step 2 claim: zero rows affected means another delivery already applied it.
/// The claim also records which plugin build decided (`plugin_digest`).
const CLAIM: &str = concat!(
    "INSERT INTO {claims} (consumer, message_key, plugin_digest) \
     SELECT $1, $2, $3 WHERE ",
    inside_open_transaction!(),
    " ON CONFLICT DO NOTHING"
);

/// The claim a whole message transaction rides behind in one flight (`ledger`): a key claimed
/// already raises 23505, which aborts the transaction, so the effects sent after it in the
/// same flight fail (25P02) and its `COMMIT` rolls back. Only on sessions whose writes outside
/// a transaction fail (`Session::writes_only_in_transactions`).
const ABORTING_CLAIM: &str = concat!(
    "INSERT INTO {claims} (consumer, message_key, plugin_digest) \
     SELECT $1, $2, $3 WHERE ",
    inside_open_transaction!()
);

/// Partition mode's claim (see `partition`), run after `PARTITIONED_LOCK`: insert only if no
/// partition holds the key yet.
const PARTITIONED_CLAIM: &str = concat!(
    "INSERT INTO {claims} (consumer, message_key, plugin_digest) \
     SELECT $1, $2, $3 WHERE NOT EXISTS \
       (SELECT 1 FROM {claims} WHERE consumer = $1 AND message_key = $2) \
     AND ",
    inside_open_transaction!(),
    " ON CONFLICT DO NOTHING"
);

/// The claims of every ledger plan of a batch in one statement, in byte order of the key
/// (the order every host and the savepoint path take them in); returns the keys that were
/// new.
const BULK_CLAIM: &str = concat!(
    "INSERT INTO {claims} (consumer, message_key, plugin_digest) \
     SELECT $1, claim.key, claim.digest FROM unnest($2::text[], $3::text[]) AS claim(key, digest) \
     WHERE ",
    inside_open_transaction!(),
    " ORDER BY claim.key COLLATE \"C\" \
     ON CONFLICT DO NOTHING RETURNING message_key"
);

/// An outbox row, written once per (destination, idempotency key): a repeat of the same
/// row, from a pipeline without a claim, changes nothing. `$1` the consumer, `$2` the
/// message's key, then the row's fields in order.
const OUTBOX_INSERT: &str = "INSERT INTO {outbox} \
     (consumer, message_key, destination, idempotency_key, payload, headers, traceparent, tracestate) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT ON CONSTRAINT idem_outbox_once DO NOTHING";

/// The parameter types of the single claims (`claim`, `aborting_claim`, `partitioned_claim`), for their unnamed
/// statements behind a transaction pooler.
pub(crate) const CLAIM_TYPES: [Type; 3] = [Type::TEXT, Type::TEXT, Type::TEXT];
/// `bulk_claim`'s parameter types.
pub(crate) const BULK_CLAIM_TYPES: [Type; 3] = [Type::TEXT, Type::TEXT_ARRAY, Type::TEXT_ARRAY];
/// `outbox_insert`'s parameter types.
pub(crate) const OUTBOX_INSERT_TYPES: [Type; 8] = [
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::BYTEA,
    Type::JSONB,
    Type::TEXT,
    Type::TEXT,
];

/// idem's tables in one database, and the statements of the message transactions that
/// write them, built once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tables {
    /// The schema as configured, unquoted; `None`: the search path's first.
    schema: Option<String>,
    claims: String,
    outbox: String,
    consumers: String,
    archive: String,
    offsets: String,
    history: String,
    pub(crate) claim: String,
    pub(crate) aborting_claim: String,
    pub(crate) partitioned_claim: String,
    pub(crate) bulk_claim: String,
    pub(crate) outbox_insert: String,
}

impl Tables {
    /// idem's tables in `schema` (checked at load: lower case letters, digits and `_`), or
    /// in the search path's first schema.
    pub fn new(schema: Option<&str>) -> Tables {
        let qualified = |table: &str| match schema {
            Some(schema) => format!("{}.{table}", quote_identifier(schema)),
            None => table.to_string(),
        };
        let mut tables = Tables {
            schema: schema.map(str::to_string),
            claims: qualified(CLAIMS),
            outbox: qualified(OUTBOX),
            consumers: qualified(CONSUMERS),
            archive: qualified(ARCHIVE),
            offsets: qualified(OFFSETS),
            history: qualified(HISTORY),
            claim: String::new(),
            aborting_claim: String::new(),
            partitioned_claim: String::new(),
            bulk_claim: String::new(),
            outbox_insert: String::new(),
        };
        tables.claim = tables.sql(CLAIM);
        tables.aborting_claim = tables.sql(ABORTING_CLAIM);
        tables.partitioned_claim = tables.sql(PARTITIONED_CLAIM);
        tables.bulk_claim = tables.sql(BULK_CLAIM);
        tables.outbox_insert = tables.sql(OUTBOX_INSERT);
        tables
    }

    /// `template` with `{claims}`, `{outbox}`, `{consumers}`, `{archive}`, `{offsets}` and
    /// `{history}` replaced by those tables' qualified names, and `{schema}` by the schema's
    /// name as a string literal (the search path's first schema, `current_schema()`, without one).
    pub fn sql(&self, template: &str) -> String {
        let schema = match &self.schema {
            Some(schema) => format!("'{schema}'"),
            None => "current_schema()".to_string(),
        };
        template
            .replace("{claims}", &self.claims)
            .replace("{outbox}", &self.outbox)
            .replace("{consumers}", &self.consumers)
            .replace("{archive}", &self.archive)
            .replace("{offsets}", &self.offsets)
            .replace("{history}", &self.history)
            .replace("{schema}", &schema)
    }

    /// The claims table, qualified.
    pub fn claims(&self) -> &str {
        &self.claims
    }

    /// The outbox table, qualified.
    pub fn outbox(&self) -> &str {
        &self.outbox
    }

    /// The consumers' retention windows, qualified.
    pub fn consumers(&self) -> &str {
        &self.consumers
    }

    /// The archived dead letters, qualified.
    pub fn archive(&self) -> &str {
        &self.archive
    }

    /// Where the consumers resume in the logs they read by offset, qualified.
    pub fn offsets(&self) -> &str {
        &self.offsets
    }

    /// idem's migration history, qualified.
    pub fn history(&self) -> &str {
        &self.history
    }

    /// `table` (another of idem's tables: a partition of the claims, say), qualified.
    pub fn qualified(&self, table: &str) -> String {
        match &self.schema {
            Some(schema) => format!("{}.{}", quote_identifier(schema), quote_identifier(table)),
            None => quote_identifier(table),
        }
    }

    /// idem's tables in the database `config` names.
    pub fn of(config: &DatabaseConfig) -> Tables {
        Tables::new(config.schema.as_deref())
    }

    /// The configured schema, unquoted.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// Where the tables are, for messages: `schema "idem"`, or `the search path's first schema`.
    pub fn place(&self) -> String {
        match &self.schema {
            Some(schema) => format!("schema {schema:?}"),
            None => "the search path's first schema".to_string(),
        }
    }
}

impl Default for Tables {
    /// In the search path's first schema.
    fn default() -> Tables {
        Tables::new(None)
    }
}

/// `name` as a quoted SQL identifier.
pub(crate) fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_statement_names_the_configured_schema() {
        for tables in [Tables::new(None), Tables::new(Some("order"))] {
            for sql in [
                &tables.claim,
                &tables.aborting_claim,
                &tables.partitioned_claim,
                &tables.bulk_claim,
                &tables.outbox_insert,
            ] {
                assert!(!sql.contains('{'), "a placeholder is left in {sql}");
                assert_eq!(
                    sql.contains("\"order\"."),
                    tables.schema().is_some(),
                    "{sql}"
                );
            }
        }
        let tables = Tables::new(Some("order"));
        assert_eq!(
            tables.sql("SELECT * FROM {claims}, {history} WHERE {schema} = 'x'"),
            "SELECT * FROM \"order\".processed_messages, \"order\".idem_migrations WHERE 'order' = 'x'"
        );
        assert_eq!(
            tables.qualified("processed_messages_p20261205"),
            "\"order\".\"processed_messages_p20261205\""
        );
        assert_eq!(
            Tables::new(None).sql("FROM {outbox} WHERE {schema}"),
            "FROM idem_outbox WHERE current_schema()"
        );
    }
}
