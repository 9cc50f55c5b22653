//! Every earlier installation shape, migrated by this version, keeps every claim: for each
//! prefix of `host/migrations/` (an installation at each released version, its history in an
//! application's `_sqlx_migrations` as before idem had its own, or in `idem_migrations`),
//! claims, an outbox row, a consumer's window and a pause are written, then `migrate` runs
//! with and without `[database] schema`, as a role named like the schema and as one that is
//! not. Every claim is then where the configuration looks and is honoured (claiming its key
//! again writes nothing); what an older idem would find with the old configuration keeps it
//! from creating empty tables; and this version refuses to create them.

use sqlx::{Executor, PgPool};

use super::{Elsewhere, MIGRATOR, MigrateFailure, migrate_tables};
use crate::store::bookkeeping;
use crate::store::tables::{MARK_OPEN, Tables};

const CONSUMER: &str = "upgrade";
const KEYS: [&str; 3] = ["order:1", "order:2", "order:3"];

fn admin_url() -> String {
    std::env::var("IDEM_TEST_PG_ADMIN_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Where an installation recorded its versions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum History {
    /// An application's `_sqlx_migrations`, beside the application's own row.
    Sqlx,
    /// idem's own `idem_migrations`.
    Idem,
}

/// The installations idem's releases left: the first `applied` migrations, with their
/// history where that release wrote it.
fn shapes() -> Vec<(usize, History)> {
    let count = MIGRATOR.iter().count();
    let mut shapes: Vec<(usize, History)> = (1..=4).map(|k| (k, History::Sqlx)).collect();
    shapes.extend((4..=count).map(|k| (k, History::Idem)));
    shapes
}

/// A database of the case's own, owned by a role of its own, connected as that role.
struct Case {
    admin: PgPool,
    database: String,
    role: String,
    schema: String,
    pool: PgPool,
}

impl Case {
    async fn new(like_schema: bool) -> Case {
        let tag = format!("{}_{:08x}", std::process::id(), rand::random::<u32>());
        let schema = format!("idem_up_{tag}");
        let role = if like_schema {
            schema.clone()
        } else {
            format!("idem_upr_{tag}")
        };
        let database = format!("idem_u_upgrade_{tag}");
        let admin = PgPool::connect(&admin_url()).await.expect("PostgreSQL");
        for statement in [
            format!("CREATE ROLE \"{role}\" LOGIN"),
            format!("CREATE DATABASE \"{database}\" OWNER \"{role}\""),
        ] {
            admin
                .execute(sqlx::AssertSqlSafe(statement))
                .await
                .expect("the case's role and database");
        }
        let url = match admin_url().rsplit_once('/') {
            Some((server, _)) => format!("{server}/{database}"),
            None => panic!("an admin URL with a database"),
        };
        let url = url.replacen("://postgres@", &format!("://{role}@"), 1);
        let pool = PgPool::connect(&url).await.expect("connect as the role");
        Case {
            admin,
            database,
            role,
            schema,
            pool,
        }
    }

    /// The installation of `shape`, in the search path's first schema, with rows.
    async fn install(&self, applied: usize, history: History) {
        let table = match history {
            History::Sqlx => "_sqlx_migrations",
            History::Idem => "idem_migrations",
        };
        self.run(&format!(
            "CREATE TABLE {table} (version bigint PRIMARY KEY, description text NOT NULL, \
             installed_on timestamptz NOT NULL DEFAULT now(), success boolean NOT NULL, \
             checksum bytea NOT NULL, execution_time bigint NOT NULL)"
        ))
        .await;
        if history == History::Sqlx {
            self.run("INSERT INTO _sqlx_migrations VALUES (1, 'the application', now(), true, '\\x00', 1)")
                .await;
        }
        for step in MIGRATOR.iter().take(applied) {
            self.run(step.sql.as_str()).await;
            bookkeeping::query(&format!(
                "INSERT INTO {table} (version, description, success, checksum, execution_time) \
                 VALUES ($1, $2, true, $3, 0)"
            ))
            .bind(step.version)
            .bind(&*step.description)
            .bind(&*step.checksum)
            .execute(&self.pool)
            .await
            .expect("history row");
        }
        for key in KEYS {
            bookkeeping::query(
                "INSERT INTO processed_messages (consumer, message_key) VALUES ($1, $2)",
            )
            .bind(CONSUMER)
            .bind(key)
            .execute(&self.pool)
            .await
            .expect("a claim");
        }
        if applied >= 3 {
            self.run(
                "INSERT INTO idem_outbox (consumer, message_key, destination, idempotency_key, payload) \
                 VALUES ('upgrade', 'order:1', 'receipts', 'receipt:1', '\\x7b7d')",
            )
            .await;
        }
        if applied >= 4 {
            self.run("INSERT INTO idem_consumers (consumer, retention_window) VALUES ('upgrade', '7 days')")
                .await;
        }
        if applied >= 5 {
            self.run("UPDATE idem_consumers SET paused_at = now(), pause_reason = 'operator'")
                .await;
        }
    }

    async fn run(&self, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"));
    }

    async fn count(&self, sql: &str) -> i64 {
        bookkeeping::query_scalar(sql)
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"))
    }

    /// Claims the case's keys again as a message transaction would: every claim must be
    /// taken already. Returns how many were new (rolled back).
    async fn claimed_anew(&self, tables: &Tables) -> u64 {
        let mut transaction = self.pool.begin().await.expect("begin");
        bookkeeping::query(&format!("SELECT {MARK_OPEN}"))
            .execute(&mut *transaction)
            .await
            .expect("mark");
        let mut new = 0;
        for key in KEYS {
            new += bookkeeping::query(&tables.claim)
                .bind(CONSUMER)
                .bind(key)
                .bind("digest")
                .execute(&mut *transaction)
                .await
                .expect("claim")
                .rows_affected();
        }
        transaction.rollback().await.expect("rollback");
        new
    }

    async fn drop(self) {
        self.pool.close().await;
        for statement in [
            format!("DROP DATABASE \"{}\" WITH (FORCE)", self.database),
            format!("DROP ROLE \"{}\"", self.role),
        ] {
            self.admin
                .execute(sqlx::AssertSqlSafe(statement))
                .await
                .expect("drop the case");
        }
    }
}

/// Migrates every shape with `schema`, as a role named like it or not, and checks the claims.
async fn every_shape(schema: bool) {
    for like_schema in [true, false] {
        for (applied, history) in shapes() {
            let case = Case::new(like_schema).await;
            let label = format!(
                "{applied} migrations, history {history:?}, schema {schema}, role named like it {like_schema}"
            );
            case.install(applied, history).await;
            let tables = Tables::new(schema.then_some(case.schema.as_str()));
            let migration = migrate_tables(&case.pool, &tables, Elsewhere::Refuse)
                .await
                .unwrap_or_else(|error| panic!("{label}: {error}"));
            assert_eq!(
                migration.moved_from.is_some(),
                schema,
                "{label}: {migration:?}"
            );
            let claims = format!("SELECT count(*) FROM {}", tables.claims());
            assert_eq!(case.count(&claims).await, 3, "{label}: claims");
            assert_eq!(
                case.claimed_anew(&tables).await,
                0,
                "{label}: a claim forgotten"
            );
            let outbox = format!("SELECT count(*) FROM {}", tables.outbox());
            assert_eq!(
                case.count(&outbox).await,
                i64::from(applied >= 3),
                "{label}: the outbox row"
            );
            let paused = format!(
                "SELECT count(*) FROM {} WHERE paused_at IS NOT NULL",
                tables.consumers()
            );
            assert_eq!(
                case.count(&paused).await,
                i64::from(applied >= 5),
                "{label}: the pause"
            );
            if schema {
                after_the_move(&case, like_schema, &label).await;
            }
            case.drop().await;
        }
    }
}

/// After a move: this version with the old configuration creates nothing where the hosts
/// look (it refuses, naming the schema, unless the role's name leads there), and the history
/// left in the old place holds every version, for an older idem to find.
async fn after_the_move(case: &Case, like_schema: bool, label: &str) {
    let versions = MIGRATOR.iter().count() as i64;
    assert_eq!(
        case.count("SELECT count(*) FROM public.idem_migrations WHERE version > 0")
            .await,
        versions,
        "{label}: the history an older idem finds"
    );
    let old = Tables::new(None);
    match migrate_tables(&case.pool, &old, Elsewhere::Refuse).await {
        Ok(migration) if like_schema => assert_eq!(migration.applied, 0, "{label}"),
        Err(MigrateFailure::Elsewhere(schemas)) if !like_schema => {
            assert_eq!(schemas, vec![case.schema.clone()], "{label}");
        }
        other => panic!("{label}: migrating with the old configuration: {other:?}"),
    }
    assert_eq!(
        case.count("SELECT count(*) FROM pg_class WHERE relname = 'processed_messages'")
            .await,
        1,
        "{label}: a second claims table"
    );
    if like_schema {
        assert_eq!(case.claimed_anew(&old).await, 0, "{label}: the old names");
    }
}

#[tokio::test]
async fn every_earlier_installation_keeps_its_claims_in_place() {
    every_shape(false).await;
}

#[tokio::test]
async fn every_earlier_installation_moves_into_a_schema_with_its_claims() {
    every_shape(true).await;
}

/// An installation with claims in one schema, and a configuration that looks in another:
/// nothing is created until the operator names the schema, or asks for a second
/// installation.
#[tokio::test]
async fn empty_tables_are_not_created_beside_claims_elsewhere() {
    let case = Case::new(false).await;
    case.install(MIGRATOR.iter().count(), History::Idem).await;
    case.run(&format!(
        "CREATE SCHEMA other; ALTER TABLE processed_messages SET SCHEMA other; \
         ALTER TABLE idem_consumers SET SCHEMA other; ALTER TABLE idem_outbox SET SCHEMA other; \
         ALTER TABLE idem_migrations SET SCHEMA other; CREATE SCHEMA \"{}\"",
        case.schema
    ))
    .await;
    let elsewhere = Tables::new(Some(case.schema.as_str()));
    for tables in [Tables::new(None), elsewhere.clone()] {
        match migrate_tables(&case.pool, &tables, Elsewhere::Refuse).await {
            Err(MigrateFailure::Elsewhere(schemas)) => assert_eq!(schemas, ["other"]),
            other => panic!("{tables:?}: {other:?}"),
        }
    }
    assert_eq!(
        case.count("SELECT count(*) FROM pg_class WHERE relname = 'processed_messages'")
            .await,
        1
    );
    let separate = migrate_tables(&case.pool, &elsewhere, Elsewhere::Ignore)
        .await
        .expect("a separate installation");
    assert_eq!(separate.applied, MIGRATOR.iter().count());
    assert_eq!(case.claimed_anew(&Tables::new(Some("other"))).await, 0);
    case.drop().await;
}
