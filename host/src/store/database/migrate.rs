//! `idem migrate`: idem's tables created or brought up to date where the configuration says,
//! never leaving a claim behind.
//!
//! Before anything is created, the database is searched for idem's installations: every
//! schema holding a `processed_messages` beside another of idem's tables (its history, its
//! consumers, its outbox, or its versions in an application's `_sqlx_migrations`). Creating a
//! schema can change where unqualified names lead (a role named like the schema reaches it
//! through `"$user"`), so where the hosts' names lead now is read first, too.
//!
//! - The configured place holds an installation: it is brought up to date.
//! - `[database] schema` is set and empty, and the hosts' names lead to an installation in
//!   another schema (one from before the setting): it is moved into the schema with every
//!   row, and its history is left behind with a marker row, so an older idem migrating with
//!   the old configuration finds every version applied and creates nothing there.
//! - Otherwise, while an installation with rows is elsewhere, nothing is created: creating
//!   empty tables where this configuration looks would forget every claim. The operator
//!   names the schema, or asks for a separate installation (`Elsewhere::Ignore`).

use sqlx::PgPool;
use sqlx::migrate::{MigrateError, Migrator};
use tracing::info;

use super::DatabaseError;
use super::schema::{claims_table_problems, foreign_claims, literal};
use crate::config::{DatabaseConfig, redact_url};
use crate::store::bookkeeping;
use crate::store::tables::{Tables, quote_identifier};

/// The host's own tables (`processed_messages`), embedded at build time.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The version of the marker row a move leaves in the old home's history: below every
/// migration's, so no version of idem runs or expects it.
const MOVED_MARKER: i64 = 0;

/// What `migrate` did besides applying migrations.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Migration {
    /// idem's tables were moved from this schema into `[database] schema`.
    pub moved_from: Option<String>,
    /// idem's rows were taken out of sqlx's `_sqlx_migrations` (where versions of idem
    /// before its own history wrote them), leaving the application's.
    pub history_adopted: u64,
    /// Migrations applied now.
    pub applied: usize,
}

/// What `migrate` does when it would create idem's tables while another installation of
/// idem, with rows, is in another schema of the database.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Elsewhere {
    /// Create nothing and name that schema (the claims there are most likely this
    /// configuration's, left behind by a changed `schema` or search path).
    #[default]
    Refuse,
    /// Create a separate installation (`idem migrate --new-installation`).
    Ignore,
}

/// Why the migration changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum MigrateFailure {
    #[error(transparent)]
    Sql(#[from] MigrateError),
    /// The claims table is not idem's: its problems.
    #[error("the claims table is not idem's: {}", .0.join("; "))]
    ForeignClaims(Vec<String>),
    /// idem's tables, with rows, are in these schemas, not where the configuration looks.
    #[error("idem's tables are in schema {}", .0.join(", "))]
    Elsewhere(Vec<String>),
}

impl From<sqlx::Error> for MigrateFailure {
    fn from(error: sqlx::Error) -> MigrateFailure {
        MigrateFailure::Sql(MigrateError::Execute(error))
    }
}

/// Applies the host's migrations (see the module's documentation for where).
///
/// In one transaction, under a transaction-scoped advisory lock, so two hosts migrating at
/// once take turns, and nothing outlives the transaction (safe behind a transaction
/// pooler, where sqlx's migrator, holding a session lock and named statements, is not). The
/// history is idem's own (`idem_migrations`, beside its tables), never an application's:
/// idem's rows in `_sqlx_migrations`, from versions before it, are moved there.
///
/// A `processed_messages` of another shape is not adopted: the transaction rolls back and
/// nothing is changed.
pub async fn migrate(
    pool: &PgPool,
    config: &DatabaseConfig,
    elsewhere: Elsewhere,
) -> Result<Migration, DatabaseError> {
    let tables = Tables::of(config);
    let endpoint = || redact_url(&config.url);
    let migration = match migrate_tables(pool, &tables, elsewhere).await {
        Ok(migration) => migration,
        Err(MigrateFailure::Sql(source)) => {
            return Err(DatabaseError::Migrate {
                endpoint: endpoint(),
                source,
            });
        }
        Err(MigrateFailure::ForeignClaims(problems)) => {
            return Err(foreign_claims(config, &tables, problems));
        }
        Err(MigrateFailure::Elsewhere(schemas)) => {
            return Err(DatabaseError::Elsewhere {
                endpoint: endpoint(),
                place: tables.place(),
                found: schemas
                    .iter()
                    .map(|schema| format!("{schema:?}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                first: schemas.first().cloned().unwrap_or_default(),
            });
        }
    };
    if let Some(from) = &migration.moved_from {
        info!(from = %from, to = %tables.place(), "Moved idem's tables.");
    }
    if migration.history_adopted > 0 {
        info!(
            rows = migration.history_adopted,
            "Moved idem's migration history out of _sqlx_migrations into idem_migrations."
        );
    }
    Ok(migration)
}

/// The advisory lock key migrations take (`idem-migrate`).
pub(super) const MIGRATION_LOCK: i64 = 0x1de3_0000_0000_0002;

/// idem's migration history: sqlx's columns, so the rows read the same as before.
pub(super) const CREATE_HISTORY: &str = "CREATE TABLE IF NOT EXISTS {history} (\
       version bigint PRIMARY KEY, description text NOT NULL, \
       installed_on timestamptz NOT NULL DEFAULT now(), success boolean NOT NULL, \
       checksum bytea NOT NULL, execution_time bigint NOT NULL)";

/// Applies what is missing where `tables` are, moving an earlier installation there first,
/// then checks the claims table; commits only if it is idem's. Changes nothing when it
/// fails.
pub async fn migrate_tables(
    pool: &PgPool,
    tables: &Tables,
    elsewhere: Elsewhere,
) -> Result<Migration, MigrateFailure> {
    let mut transaction = bookkeeping::begin(pool, "").await?;
    bookkeeping::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut *transaction)
        .await?;
    let survey = Survey::take(&mut transaction, tables).await?;
    let mut migration = Migration::default();
    let from = survey.move_from(tables);
    let left_elsewhere = survey.elsewhere(tables, from.as_deref());
    if survey.in_place != Some(true) && !left_elsewhere.is_empty() && elsewhere == Elsewhere::Refuse
    {
        transaction.rollback().await?;
        return Err(MigrateFailure::Elsewhere(left_elsewhere));
    }
    if let Some(schema) = tables.schema() {
        bookkeeping::raw(&format!(
            "CREATE SCHEMA IF NOT EXISTS {}",
            quote_identifier(schema)
        ))
        .execute(&mut *transaction)
        .await?;
        if let Some(from) = from {
            move_tables(&mut transaction, &from, schema).await?;
            migration.moved_from = Some(from);
        }
    }
    migration.history_adopted = adopt_history(&mut transaction, tables).await?;
    migration.applied = apply_steps(&mut transaction, tables).await?;
    if let Some(from) = &migration.moved_from {
        leave_marker(&mut transaction, tables, from).await?;
    }
    let problems = claims_table_problems(&mut transaction, tables).await?;
    if !problems.is_empty() {
        transaction.rollback().await?;
        return Err(MigrateFailure::ForeignClaims(problems));
    }
    transaction.commit().await?;
    Ok(migration)
}

/// Where idem's tables are in a database, read before anything is created.
struct Survey {
    /// Schemas holding an installation of idem, and whether it has rows (claims, outbox
    /// rows or consumers).
    installations: Vec<(String, bool)>,
    /// The schema the hosts' unqualified names lead to now (`processed_messages` by the
    /// search path), if any.
    resolved: Option<String>,
    /// Whether the configured place holds an installation already, and if so whether it has
    /// rows.
    in_place: Option<bool>,
}

impl Survey {
    async fn take(
        transaction: &mut sqlx::PgConnection,
        tables: &Tables,
    ) -> Result<Survey, sqlx::Error> {
        let resolved: Option<String> = bookkeeping::query_scalar(
            "SELECT c.relnamespace::regnamespace::text FROM pg_class c \
             WHERE c.oid = to_regclass('processed_messages')",
        )
        .fetch_optional(&mut *transaction)
        .await?;
        let resolved = resolved.map(|schema| unquote(&schema));
        let installations = installations(transaction).await?;
        let place = tables.schema().or(resolved.as_deref());
        let in_place = installations
            .iter()
            .find(|(found, _)| Some(found.as_str()) == place)
            .map(|(_, rows)| *rows);
        Ok(Survey {
            installations,
            resolved,
            in_place,
        })
    }

    /// The installation to move into the configured schema: the one the hosts' names lead
    /// to now, when the schema holds none yet.
    fn move_from(&self, tables: &Tables) -> Option<String> {
        let schema = tables.schema()?;
        let home = self.resolved.as_ref()?;
        (self.in_place.is_none()
            && home != schema
            && self.installations.iter().any(|(found, _)| found == home))
        .then(|| home.clone())
    }

    /// The schemas, other than the configured place and `moving`, whose installations have
    /// rows.
    fn elsewhere(&self, tables: &Tables, moving: Option<&str>) -> Vec<String> {
        let place = tables.schema().or(self.resolved.as_deref());
        self.installations
            .iter()
            .filter(|(schema, rows)| {
                *rows && Some(schema.as_str()) != moving && Some(schema.as_str()) != place
            })
            .map(|(schema, _)| schema.clone())
            .collect()
    }
}

/// `regnamespace::text` quotes a name only where it needs quotes.
fn unquote(name: &str) -> String {
    match name
        .strip_prefix('"')
        .and_then(|name| name.strip_suffix('"'))
    {
        Some(quoted) => quoted.replace("\"\"", "\""),
        None => name.to_string(),
    }
}

/// Every schema holding idem's claims table beside another of idem's tables, or beside idem's
/// versions in a `_sqlx_migrations` (an installation from before idem's own history), with
/// whether it has rows.
async fn installations(
    transaction: &mut sqlx::PgConnection,
) -> Result<Vec<(String, bool)>, sqlx::Error> {
    let candidates: Vec<(String, bool, bool, bool, bool)> = bookkeeping::query_as(
        "SELECT n.nspname::text, \
                to_regclass(format('%I.idem_migrations', n.nspname)) IS NOT NULL, \
                to_regclass(format('%I.idem_outbox', n.nspname)) IS NOT NULL, \
                to_regclass(format('%I.idem_consumers', n.nspname)) IS NOT NULL, \
                to_regclass(format('%I._sqlx_migrations', n.nspname)) IS NOT NULL \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.relname = 'processed_messages' AND c.relkind IN ('r', 'p') \
         ORDER BY n.nspname",
    )
    .fetch_all(&mut *transaction)
    .await?;
    let first_version = MIGRATOR.iter().next().map_or(0, |step| step.version);
    let mut found = Vec::new();
    for (schema, history, outbox, consumers, sqlx_history) in candidates {
        let place = Tables::new(Some(&schema));
        let mut idems = history || outbox || consumers;
        if !idems && sqlx_history {
            idems = bookkeeping::query_scalar(&format!(
                "SELECT EXISTS (SELECT 1 FROM {}._sqlx_migrations WHERE version = $1)",
                quote_identifier(&schema)
            ))
            .bind(first_version)
            .fetch_one(&mut *transaction)
            .await?;
        }
        if !idems {
            continue;
        }
        let mut rows = vec![format!("SELECT 1 FROM {}", place.claims())];
        if outbox {
            rows.push(format!("SELECT 1 FROM {}", place.outbox()));
        }
        if consumers {
            rows.push(format!("SELECT 1 FROM {}", place.consumers()));
        }
        let used: bool =
            bookkeeping::query_scalar(&format!("SELECT EXISTS ({})", rows.join(" UNION ALL ")))
                .fetch_one(&mut *transaction)
                .await?;
        found.push((schema, used));
    }
    Ok(found)
}

/// Applies the migrations `tables`' history lacks; returns how many.
async fn apply_steps(
    transaction: &mut sqlx::PgConnection,
    tables: &Tables,
) -> Result<usize, MigrateFailure> {
    let applied: Vec<(i64, Vec<u8>, bool)> =
        bookkeeping::query_as(&tables.sql("SELECT version, checksum, success FROM {history}"))
            .fetch_all(&mut *transaction)
            .await?;
    if let Some(schema) = tables.schema() {
        // The migrations name their tables unqualified: they land in idem's schema.
        bookkeeping::raw(&format!(
            "SET LOCAL search_path TO {}",
            quote_identifier(schema)
        ))
        .execute(&mut *transaction)
        .await?;
    }
    let mut count = 0;
    for step in MIGRATOR.iter() {
        if step.migration_type.is_down_migration() {
            continue;
        }
        match applied
            .iter()
            .find(|(version, ..)| *version == step.version)
        {
            Some((version, _, false)) => return Err(MigrateError::Dirty(*version).into()),
            Some((version, checksum, true)) if *checksum != *step.checksum => {
                return Err(MigrateError::VersionMismatch(*version).into());
            }
            Some(_) => continue,
            None => {}
        }
        let started = std::time::Instant::now();
        sqlx::raw_sql(step.sql.clone())
            .execute(&mut *transaction)
            .await?;
        bookkeeping::query(&tables.sql(
            "INSERT INTO {history} (version, description, success, checksum, execution_time) \
             VALUES ($1, $2, true, $3, $4)",
        ))
        .bind(step.version)
        .bind(&*step.description)
        .bind(&*step.checksum)
        .bind(i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX))
        .execute(&mut *transaction)
        .await?;
        count += 1;
    }
    Ok(count)
}

/// Moves idem's tables of the installation in `home` into `schema` (with their indexes,
/// sequences and rows, and the claims' day partitions).
async fn move_tables(
    transaction: &mut sqlx::PgConnection,
    home: &str,
    schema: &str,
) -> Result<(), sqlx::Error> {
    let there = Tables::new(Some(home));
    let partitions: Vec<String> = bookkeeping::query_scalar(&format!(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = to_regclass({})",
        literal(there.claims())
    ))
    .fetch_all(&mut *transaction)
    .await?;
    let mut moved: Vec<String> = [
        there.claims(),
        there.outbox(),
        there.consumers(),
        there.archive(),
        there.offsets(),
        there.history(),
    ]
    .map(str::to_string)
    .to_vec();
    moved.extend(
        partitions
            .iter()
            .map(|partition| there.qualified(partition)),
    );
    for table in moved {
        if table_exists(transaction, &table).await? {
            bookkeeping::raw(&format!(
                "ALTER TABLE {table} SET SCHEMA {}",
                quote_identifier(schema)
            ))
            .execute(&mut *transaction)
            .await?;
        }
    }
    Ok(())
}

/// After a move out of `home`: a copy of the history stays there, with a marker row naming
/// where the tables went. An older idem migrating with the old configuration finds every
/// version applied and creates no empty tables for the hosts that look there (they stay
/// paused on the missing tables instead of resuming without their claims); this version
/// refuses to, naming the schema. Dropped by the operator once no older idem runs.
async fn leave_marker(
    transaction: &mut sqlx::PgConnection,
    tables: &Tables,
    home: &str,
) -> Result<(), sqlx::Error> {
    let there = Tables::new(Some(home));
    let to = tables.schema().unwrap_or_default();
    bookkeeping::raw(&there.sql(CREATE_HISTORY))
        .execute(&mut *transaction)
        .await?;
    bookkeeping::raw(&format!(
        "INSERT INTO {marker} SELECT * FROM {history} ON CONFLICT (version) DO NOTHING; \
         INSERT INTO {marker} (version, description, success, checksum, execution_time) \
         VALUES ({MOVED_MARKER}, {description}, true, '\\x', 0) ON CONFLICT (version) DO NOTHING; \
         COMMENT ON TABLE {marker} IS {comment}",
        marker = there.history(),
        history = tables.history(),
        description = literal(&format!("moved to schema {to:?}")),
        comment = literal(&format!(
            "idem's tables moved to schema {to:?}: this copy of their history keeps an older \
             idem from creating empty ones here; drop it once no older idem runs"
        )),
    ))
    .execute(&mut *transaction)
    .await?;
    Ok(())
}

/// Creates idem's history, and moves idem's rows (its versions, with their checksums) out
/// of the `_sqlx_migrations` the search path finds, where idem wrote them before it had a
/// history of its own: into idem's history when idem's tables are where it is, so those
/// migrations are not run again. A history that is only a move's marker (see
/// `leave_marker`) is emptied when no tables are beside it: the installation starts anew.
/// Returns the rows taken out.
async fn adopt_history(
    transaction: &mut sqlx::PgConnection,
    tables: &Tables,
) -> Result<u64, sqlx::Error> {
    bookkeeping::raw(&tables.sql(CREATE_HISTORY))
        .execute(&mut *transaction)
        .await?;
    let in_place = table_exists(transaction, tables.claims()).await?;
    if !in_place {
        bookkeeping::query(&tables.sql(
            "DELETE FROM {history} WHERE EXISTS (SELECT 1 FROM {history} WHERE version = $1)",
        ))
        .bind(MOVED_MARKER)
        .execute(&mut *transaction)
        .await?;
    }
    if !table_exists(transaction, "_sqlx_migrations").await? {
        return Ok(0);
    }
    let (versions, checksums): (Vec<i64>, Vec<Vec<u8>>) = MIGRATOR
        .iter()
        .filter(|step| !step.migration_type.is_down_migration())
        .map(|step| (step.version, step.checksum.to_vec()))
        .unzip();
    let taken: i64 = bookkeeping::query_scalar(&tables.sql(
        "WITH idem AS (DELETE FROM _sqlx_migrations \
           WHERE (version, checksum) IN (SELECT * FROM unnest($1::int8[], $2::bytea[])) \
           RETURNING *), \
         kept AS (INSERT INTO {history} \
             (version, description, installed_on, success, checksum, execution_time) \
           SELECT version, description, installed_on, success, checksum, execution_time \
           FROM idem WHERE $3 \
           ON CONFLICT (version) DO NOTHING) \
         SELECT count(*) FROM idem",
    ))
    .bind(&versions)
    .bind(&checksums)
    .bind(in_place)
    .fetch_one(&mut *transaction)
    .await?;
    Ok(u64::try_from(taken).unwrap_or_default())
}

/// Whether `table` (qualified, or found by the search path) exists.
async fn table_exists(
    transaction: &mut sqlx::PgConnection,
    table: &str,
) -> Result<bool, sqlx::Error> {
    bookkeeping::query_scalar(&format!(
        "SELECT to_regclass({}) IS NOT NULL",
        literal(table)
    ))
    .fetch_one(transaction)
    .await
}
