//! The one-flight transaction (`apply_in_one_flight`) against a real server, stopped at each
//! of its steps: a cancel (`pg_cancel_backend`) or a killed session
//! (`pg_terminate_backend`) while `BEGIN`, the claim, an effect or `COMMIT` runs leaves
//! nothing behind, neither effects without their claim nor a claim without its effects;
//! the same message then applies once, and again is a duplicate that writes nothing.
//!
//! Each step is held long enough to be hit: `BEGIN` behind a `pg_sleep` (the flight's own
//! opening, with the sleep before it, so a cancel there leaves no transaction open and
//! everything behind it runs outside one), the claim behind another transaction's
//! uncommitted claim of the same key, an effect in `pg_sleep`, `COMMIT` in a deferred
//! constraint trigger that sleeps.

use std::path::Path;
use std::time::{Duration, Instant};

use tokio_postgres::{Client, NoTls};

use crate::config::Config;
use crate::effect::{Decision, Effect, Value};
use crate::store::database::{self, Database};
use crate::store::statement::StatementCatalog;

use super::single::{apply_in_one_flight, one_flight};
use super::tests::admin_url;
use super::work::{Claiming, Work};
use super::*;

const CONSUMER: &str = "flight";

/// A database of the test's own, with idem's tables, an effects table and its stalls.
struct Scratch {
    name: String,
    url: String,
    admin: Client,
    /// The test's own connection to the scratch database (not a session).
    client: Client,
    config: Config,
    database: Database,
}

async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .expect("PostgreSQL (scripts/services.sh starts it)");
    tokio::spawn(connection);
    client
}

impl Scratch {
    async fn new(label: &str, pooling: &str) -> Scratch {
        let name = format!(
            "idem_u_{label}_{}_{:08x}",
            std::process::id(),
            rand::random::<u32>()
        );
        let admin = connect(&admin_url()).await;
        admin
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await
            .expect("create the scratch database");
        let url = match admin_url().rsplit_once('/') {
            Some((server, _)) => format!("{server}/{name}"),
            None => panic!("an admin URL with a database"),
        };
        let text = format!(
            r#"
[database]
url = "{url}"
max_connections = 2
pooling = "{pooling}"

[amqp]
url = "amqp://127.0.0.1"

[pipelines.flight]
queue = "flight"
plugin = "flight.wasm"
consumer = "{CONSUMER}"

[pipelines.flight.statements]
first = "INSERT INTO flight_effects (message_key, step) VALUES ($1, 1)"
second = "INSERT INTO flight_effects (message_key, step) SELECT $1, 2 FROM pg_sleep($2)"
"#
        );
        let config = Config::from_toml(Path::new("/tmp/flight.toml"), &text).expect("config");
        let database = database::open(&config.database).await.expect("open");
        database::migrate(&database.pool, &config.database, Default::default())
            .await
            .expect("migrate");
        let client = connect(&url).await;
        client
            .batch_execute(
                "CREATE TABLE flight_effects (message_key text NOT NULL, step int NOT NULL);
                 CREATE TABLE flight_stall (commit_sleep float8 NOT NULL);
                 INSERT INTO flight_stall VALUES (0);
                 CREATE FUNCTION flight_commit_stall() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN PERFORM pg_sleep((SELECT commit_sleep FROM flight_stall)); RETURN NULL; END $$;
                 CREATE CONSTRAINT TRIGGER flight_commit_stall AFTER INSERT ON flight_effects
                   DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION flight_commit_stall();",
            )
            .await
            .expect("effects table");
        Scratch {
            name,
            url,
            admin,
            client,
            config,
            database,
        }
    }

    /// The claims and effect rows of `key`.
    async fn rows(&self, key: &str) -> (i64, i64) {
        let row = self
            .client
            .query_one(
                "SELECT (SELECT count(*) FROM processed_messages WHERE message_key = $1), \
                        (SELECT count(*) FROM flight_effects WHERE message_key = $1)",
                &[&key],
            )
            .await
            .expect("count");
        (row.get(0), row.get(1))
    }

    async fn drop(self) {
        self.database.sessions.close_idle();
        self.database.pool.close().await;
        drop(self.client);
        self.admin
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                self.name
            ))
            .await
            .expect("drop the scratch database");
    }
}

/// Where the flight is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stall {
    Begin,
    Claim,
    Effect,
    Commit,
}

/// What happens to the session while it is held.
#[derive(Debug, Clone, Copy)]
enum Blow {
    Cancel,
    Kill,
}

/// `key`'s decision: two effects, the second sleeping `effect_sleep` seconds.
fn decision(key: &str, effect_sleep: f64) -> Decision {
    let text = |value: &str| Value::Text(value.to_string());
    Decision {
        key: key.to_string(),
        effects: vec![
            Effect::Exec {
                statement: "first".to_string(),
                params: vec![text(key)],
            },
            Effect::Exec {
                statement: "second".to_string(),
                params: vec![text(key), Value::Float(effect_sleep)],
            },
        ],
    }
}

/// Runs `key`'s transaction in one flight on a session of `scratch`, with `begin_prefix`
/// before the flight's own opening, while `during` runs beside it with the session's pid.
async fn one_flight_with<F, Fut>(
    scratch: &Scratch,
    key: &str,
    effect_sleep: f64,
    begin_prefix: &str,
    during: F,
) -> Result<ClaimOutcome, LedgerError>
where
    F: FnOnce(i32) -> Fut,
    Fut: Future<Output = ()>,
{
    let pipeline = &scratch.config.pipelines[0];
    let catalog = StatementCatalog::from_config(pipeline);
    let decision = decision(key, effect_sleep);
    let plan = Plan::build(pipeline, &catalog, &decision, "digest", false).expect("plan");
    let sessions = &scratch.database.sessions;
    let mut session = acquire(sessions).await.expect("session");
    let pid: i32 = session
        .client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    let work = Work::prepare(&mut session, sessions.tables(), &plan, Claiming::Aborting)
        .await
        .expect("prepare");
    let begin = format!(
        "{begin_prefix}{}",
        begin_sql(&pipeline.transaction, &session)
    );
    let (outcome, ()) = tokio::join!(
        apply_in_one_flight(&mut session, &work, &begin),
        during(pid)
    );
    drop(work);
    release(session, Ok(outcome), pipeline.transaction.timeout)
}

/// Waits until backend `pid` waits on `event_type` (`Timeout` for a sleep, `Lock`), then
/// cancels or kills it.
async fn strike(admin: &Client, pid: i32, event_type: &str, blow: Blow) {
    let started = Instant::now();
    loop {
        let waiting: bool = admin
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = $2)",
                &[&pid, &event_type],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        if waiting {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the session never waited on {event_type}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let function = match blow {
        Blow::Cancel => "pg_cancel_backend",
        Blow::Kill => "pg_terminate_backend",
    };
    let struck: bool = admin
        .query_one(&format!("SELECT {function}($1)"), &[&pid])
        .await
        .expect("strike")
        .get(0);
    assert!(struck, "{function} found no backend {pid}");
}

#[tokio::test]
async fn a_cancel_or_a_kill_at_any_step_of_one_flight_leaves_nothing() {
    let scratch = Scratch::new("flight", "session").await;
    for stall in [Stall::Begin, Stall::Claim, Stall::Effect, Stall::Commit] {
        for blow in [Blow::Cancel, Blow::Kill] {
            let key = format!("{stall:?}-{blow:?}").to_lowercase();
            let holder = connect(&scratch.url).await;
            if stall == Stall::Claim {
                holder
                    .batch_execute(&format!(
                        "BEGIN; INSERT INTO processed_messages (consumer, message_key, plugin_digest) \
                         VALUES ('{CONSUMER}', '{key}', 'holder')"
                    ))
                    .await
                    .expect("hold the key");
            }
            let commit_sleep = if stall == Stall::Commit { 30.0 } else { 0.0 };
            scratch
                .client
                .execute(
                    "UPDATE flight_stall SET commit_sleep = $1",
                    &[&commit_sleep],
                )
                .await
                .expect("commit stall");
            let (prefix, effect_sleep, event) = match stall {
                Stall::Begin => ("SELECT pg_sleep(30); ", 0.0, "Timeout"),
                Stall::Claim => ("", 0.0, "Lock"),
                Stall::Effect => ("", 30.0, "Timeout"),
                Stall::Commit => ("", 0.0, "Timeout"),
            };
            let result = one_flight_with(&scratch, &key, effect_sleep, prefix, |pid| {
                strike(&scratch.admin, pid, event, blow)
            })
            .await;
            assert!(
                matches!(result, Err(LedgerError::Transient { .. })),
                "{key}: {result:?}"
            );
            holder.batch_execute("ROLLBACK").await.ok();
            scratch
                .client
                .execute("UPDATE flight_stall SET commit_sleep = 0", &[])
                .await
                .expect("no stall");
            assert_eq!(scratch.rows(&key).await, (0, 0), "{key}: left behind");
            let again = one_flight_with(&scratch, &key, 0.0, "", |_| async {}).await;
            assert_eq!(again.expect("applies"), ClaimOutcome::Applied, "{key}");
            assert_eq!(scratch.rows(&key).await, (1, 2), "{key}: applied once");
            let repeat = one_flight_with(&scratch, &key, 0.0, "", |_| async {}).await;
            assert_eq!(repeat.expect("duplicate"), ClaimOutcome::Duplicate, "{key}");
            assert_eq!(scratch.rows(&key).await, (1, 2), "{key}: a duplicate wrote");
        }
    }
    scratch.drop().await;
}

/// What the guard is for: on a session that may write outside a transaction (behind a
/// transaction pooler, where no session setting lasts), the same flight with its `BEGIN`
/// cancelled commits the effects alone, without their claim. `one_flight` never sends it
/// there.
#[tokio::test]
async fn without_the_guard_a_cancelled_begin_commits_the_effects_alone() {
    let scratch = Scratch::new("unguarded", "transaction").await;
    let key = "unguarded";
    let result = one_flight_with(&scratch, key, 0.0, "SELECT pg_sleep(30); ", |pid| {
        strike(&scratch.admin, pid, "Timeout", Blow::Cancel)
    })
    .await;
    assert!(result.is_err(), "{result:?}");
    assert_eq!(
        scratch.rows(key).await,
        (0, 2),
        "the hazard the guard prevents did not show"
    );
    let plan_of = decision(key, 0.0);
    let pipeline = &scratch.config.pipelines[0];
    let catalog = StatementCatalog::from_config(pipeline);
    let plan = Plan::build(pipeline, &catalog, &plan_of, "digest", false).expect("plan");
    let session = acquire(&scratch.database.sessions).await.expect("session");
    assert!(
        !one_flight(&session, &plan),
        "one flight behind a transaction pooler"
    );
    drop(session);
    scratch.drop().await;
}
