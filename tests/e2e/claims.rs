//! Claim strategies and transaction settings (the guide's Steps 4 and 6 gotchas): natural
//! keys, version-guarded upserts, statement validation, serialization retries under
//! SERIALIZABLE, and least privilege with `SET LOCAL ROLE`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rand::seq::SliceRandom;
use tokio_util::sync::CancellationToken;

use idem_e2e::{TestEnv, order, plugin_path, wait_for};
use idem_host::config::Config;
use idem_host::message::InboundMessage;
use idem_host::pipeline::Pipeline;
use idem_host::pipeline::process::{Disposition, Settled, handle_delivery};
use idem_host::sandbox::PluginRuntime;
use idem_host::telemetry::metrics::Metrics;

/// The guide's natural-key form: the ledger row is the claim. The credit is an upsert fed by
/// the insert's RETURNING, so it reports one row exactly when the order is new, even for a
/// customer without a balance yet.
const NATURAL_STATEMENTS: &str = r#"
[pipelines.loyalty.statements]
record_ledger = """
WITH credit AS (
  INSERT INTO point_ledger (customer_id, order_id, points) VALUES ($1, $2, $3)
  ON CONFLICT ON CONSTRAINT one_credit_per_order DO NOTHING
  RETURNING customer_id, points
)
INSERT INTO balances (customer_id, points) SELECT customer_id, points FROM credit
ON CONFLICT (customer_id) DO UPDATE SET points = balances.points + EXCLUDED.points
"""
credit_balance = "SELECT $1::int8, $2::int8"
"#;

const PROFILE_STATEMENTS: &str = r#"
[pipelines.profiles.statements]
upsert_profile = """
INSERT INTO customer_profiles (customer_id, version, name, email) VALUES ($1, $2, $3, $4)
ON CONFLICT (customer_id) DO UPDATE
  SET version = EXCLUDED.version, name = EXCLUDED.name, email = EXCLUDED.email, updated_at = now()
  WHERE customer_profiles.version < EXCLUDED.version
"""
"#;

fn loyalty_message(body: Vec<u8>) -> InboundMessage {
    InboundMessage {
        pipeline: "loyalty".into(),
        body,
        ..InboundMessage::default()
    }
}

/// One delivery applied, every other one a duplicate.
fn assert_applied_once(results: &[Disposition]) {
    assert_eq!(
        count(results, &Disposition::Ack(Settled::Applied)),
        1,
        "{results:?}"
    );
    assert_eq!(
        count(results, &Disposition::Ack(Settled::Duplicate)),
        results.len() - 1,
        "{results:?}"
    );
}

/// A message the broker delivered before.
fn redelivered(body: Vec<u8>) -> InboundMessage {
    InboundMessage {
        redelivered: true,
        ..loyalty_message(body)
    }
}

fn natural_pipeline(env: &TestEnv) -> String {
    format!(
        "[pipelines.loyalty]\nqueue = \"{}\"\nplugin = \"{}\"\nclaim = \"natural\"\nclaim_statement = \"record_ledger\"\n{NATURAL_STATEMENTS}",
        env.queue,
        plugin_path("loyalty").display()
    )
}

async fn deliver_concurrently(
    pipeline: &Arc<Pipeline>,
    message: &InboundMessage,
    times: usize,
) -> Vec<Disposition> {
    let shutdown = CancellationToken::new();
    let mut tasks = Vec::new();
    for _ in 0..times {
        let pipeline = Arc::clone(pipeline);
        let message = message.clone();
        let shutdown = shutdown.clone();
        tasks.push(tokio::spawn(async move {
            handle_delivery(&pipeline, &message, 1, &shutdown).await
        }));
    }
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.expect("delivery task"));
    }
    results
}

fn count(results: &[Disposition], wanted: &Disposition) -> usize {
    results.iter().filter(|result| *result == wanted).count()
}

#[tokio::test]
async fn natural_key_credits_once_without_a_ledger_row() {
    let env = TestEnv::new("natural").await;
    let pipeline = Arc::new(
        env.pipeline_from(&natural_pipeline(&env))
            .await
            .expect("natural pipeline starts"),
    );
    let shutdown = CancellationToken::new();
    let delivery = loyalty_message(order(9912, 7, 5000));

    let mut sequential = Vec::new();
    for _ in 0..5 {
        sequential.push(handle_delivery(&pipeline, &delivery, 1, &shutdown).await);
    }
    let concurrent =
        deliver_concurrently(&pipeline, &loyalty_message(order(9913, 8, 700)), 5).await;

    assert_eq!(sequential[0], Disposition::Ack(Settled::Applied));
    assert_eq!(count(&sequential, &Disposition::Ack(Settled::Duplicate)), 4);
    assert_applied_once(&concurrent);
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages").await,
        0
    );
    assert_eq!(
        env.count("SELECT points FROM balances WHERE customer_id = 7")
            .await,
        50
    );
    assert_eq!(
        env.count("SELECT points FROM balances WHERE customer_id = 8")
            .await,
        7
    );

    // A replay after the host's claims are gone (there are none here, and deleting them all
    // must not matter): the business table's own constraint still refuses the second credit.
    sqlx::query("DELETE FROM processed_messages")
        .execute(&env.pool)
        .await
        .expect("delete claims");
    let replayed = handle_delivery(&pipeline, &delivery, 1, &shutdown).await;
    assert_eq!(replayed, Disposition::Ack(Settled::Duplicate));
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 2);
    assert_eq!(
        env.count("SELECT points FROM balances WHERE customer_id = 7")
            .await,
        50
    );
    env.cleanup().await;
}

#[tokio::test]
async fn natural_claim_statement_must_be_in_the_decision() {
    let env = TestEnv::new("natural_missing").await;
    // The loyalty plugin never calls `mark_seen`: every message must be refused, not applied
    // without a claim.
    let pipeline = env.pipeline_from(&format!(
            "[pipelines.loyalty]\nqueue = \"{}\"\nplugin = \"{}\"\nclaim = \"natural\"\nclaim_statement = \"mark_seen\"\n{}\nmark_seen = \"SELECT $1::text\"\n",
            env.queue,
            plugin_path("loyalty").display(),
            NATURAL_STATEMENTS,
        ),
    )
    .await
    .expect("pipeline starts");
    let disposition = handle_delivery(
        &pipeline,
        &loyalty_message(order(1, 1, 100)),
        1,
        &CancellationToken::new(),
    )
    .await;
    let Disposition::DeadLetter { error_kind, reason } = disposition else {
        panic!("expected a dead-letter, got {disposition:?}");
    };
    assert_eq!(error_kind, "invalid-effect");
    assert!(reason.contains("mark_seen"), "{reason}");
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 0);
    env.cleanup().await;
}

#[tokio::test]
async fn version_guard_keeps_the_newest_version() {
    let env = TestEnv::new("version_guard").await;
    let pipeline_text = format!(
        "[pipelines.profiles]\nqueue = \"{}\"\nplugin = \"{}\"\nclaim = \"none\"\nworkers = 8\n{PROFILE_STATEMENTS}",
        env.queue,
        plugin_path("customer-profile").display()
    );
    let pipeline = env
        .pipeline_from(&pipeline_text)
        .await
        .expect("profiles pipeline starts");
    let profile = |customer_id: i64, version: i64| -> InboundMessage {
        InboundMessage {
            pipeline: "profiles".into(),
            body: format!(
                r#"{{"customer_id": {customer_id}, "version": {version}, "name": "name v{version}", "email": "v{version}@example.com"}}"#
            )
            .into_bytes(),
            ..InboundMessage::default()
        }
    };

    // Versions 1..=50, each delivered twice, in a random order.
    let mut versions: Vec<i64> = (1..=50).chain(1..=50).collect();
    versions.shuffle(&mut rand::rng());
    let shutdown = CancellationToken::new();
    let mut newest = 0;
    for version in &versions {
        let disposition = handle_delivery(&pipeline, &profile(1, *version), 1, &shutdown).await;
        let expected = if *version > newest {
            newest = *version;
            Settled::Applied
        } else {
            Settled::Stale
        };
        assert_eq!(
            disposition,
            Disposition::Ack(expected),
            "version {version} after newest {newest}"
        );
    }
    let (version, name): (i64, String) =
        sqlx::query_as("SELECT version, name FROM customer_profiles WHERE customer_id = 1")
            .fetch_one(&env.pool)
            .await
            .expect("profile row");
    assert_eq!((version, name.as_str()), (50, "name v50"));
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages").await,
        0
    );

    // The same through the broker with 8 workers racing: the newest version still wins.
    let config = Config::from_toml(
        Path::new("/tmp/idem-claims-test.toml"),
        &format!("{}{pipeline_text}", env.config_header()),
    )
    .expect("config");
    let metrics = Arc::new(Metrics::new());
    let host = env.start_host_with_metrics(config, Arc::clone(&metrics));
    let mut versions: Vec<i64> = (1..=50).chain(1..=50).collect();
    versions.shuffle(&mut rand::rng());
    for version in &versions {
        env.publish(&profile(2, *version).body).await;
    }
    wait_for(
        "100 profile deliveries settled",
        Duration::from_secs(60),
        || {
            let metrics = Arc::clone(&metrics);
            async move {
                metrics.messages("profiles", "applied") + metrics.messages("profiles", "stale")
                    == 100
            }
        },
    )
    .await;
    host.stop().await.expect("host stops cleanly");
    let version: i64 =
        sqlx::query_scalar("SELECT version FROM customer_profiles WHERE customer_id = 2")
            .fetch_one(&env.pool)
            .await
            .expect("profile row");
    assert_eq!(version, 50);
    assert!(metrics.messages("profiles", "stale") >= 50);
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0);
    env.cleanup().await;
}

#[tokio::test]
async fn bad_statements_stop_start_up_by_name() {
    let env = TestEnv::new("bad_statements").await;
    let pipeline = |statements: &str| {
        format!(
            "[pipelines.loyalty]\nqueue = \"{}\"\nplugin = \"{}\"\n[pipelines.loyalty.statements]\n{statements}\n",
            env.queue,
            plugin_path("loyalty").display()
        )
    };
    let syntax = env.pipeline_from(&pipeline("credit_balance = \"INSERT INTO balances VALUES ($1, $2\"\nrecord_ledger = \"SELECT $1::int8, $2::int8, $3::int8\""),
    )
    .await
    .err()
    .expect("a syntax error stops start-up");
    assert!(
        syntax.contains("\"loyalty\"") && syntax.contains("credit_balance"),
        "{syntax}"
    );
    assert!(syntax.contains("syntax error"), "{syntax}");

    // $2 is never used, so its type cannot be known: the parameter count is wrong.
    let count = env.pipeline_from(&pipeline("credit_balance = \"SELECT $1::int8, $3::int8\"\nrecord_ledger = \"SELECT $1::int8, $2::int8, $3::int8\""),
    )
    .await
    .err()
    .expect("a gap in the parameters stops start-up");
    assert!(
        count.contains("credit_balance") && count.contains("$2"),
        "{count}"
    );

    let claim = Config::from_toml(
        Path::new("/tmp/idem-claims-test.toml"),
        &format!(
            "{}[pipelines.loyalty]\nqueue = \"q\"\nplugin = \"p.wasm\"\nclaim = \"natural\"\nclaim_statement = \"nope\"\n[pipelines.loyalty.statements]\na = \"SELECT 1\"\n",
            env.config_header()
        ),
    )
    .expect_err("an unknown claim statement is refused")
    .to_string();
    assert!(
        claim.contains("claim_statement") && claim.contains("nope"),
        "{claim}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn serializable_duplicates_retry_to_one_applied() {
    let env = TestEnv::new("serializable").await;
    // The credit sleeps, so the first transaction holds its claim while the other seven
    // insert theirs and wait: each then fails with 40001 and must be retried.
    let pipeline_text = |retries: u32| {
        format!(
            r#"[pipelines.loyalty]
queue = "{}"
plugin = "{}"
[pipelines.loyalty.transaction]
isolation = "serializable"
retries = {retries}
[pipelines.loyalty.statements]
credit_balance = """
INSERT INTO balances (customer_id, points) SELECT $1, $2 FROM pg_sleep(0.3)
ON CONFLICT (customer_id) DO UPDATE SET points = balances.points + EXCLUDED.points
"""
record_ledger = "INSERT INTO point_ledger (customer_id, order_id, points) VALUES ($1, $2, $3)"
"#,
            env.queue,
            plugin_path("loyalty").display()
        )
    };
    let pipeline = Arc::new(
        env.pipeline_from(&pipeline_text(10))
            .await
            .expect("pipeline starts"),
    );
    // First deliveries take one flight, whose claim aborts on a taken key: the losers wait
    // for the winner's claim and find it committed (23505), duplicates at once.
    let results = deliver_concurrently(&pipeline, &loyalty_message(order(76, 7, 900)), 8).await;
    assert_applied_once(&results);
    // Redeliveries ask first (`ON CONFLICT DO NOTHING`), which under SERIALIZABLE fails with
    // 40001 for the losers: retried, they find the claim.
    let results = deliver_concurrently(&pipeline, &redelivered(order(77, 7, 900)), 8).await;
    assert_applied_once(&results);
    let retried = pipeline
        .metrics()
        .database_retries(pipeline.name(), "40001");
    assert!(retried >= 1, "no serialization failure was retried");
    env.assert_loyalty_consistent().await;

    // With no retry budget the losers are requeued (redelivered later), never dead-lettered.
    let strict = Arc::new(
        env.pipeline_from(&pipeline_text(0))
            .await
            .expect("pipeline starts"),
    );
    let results = deliver_concurrently(&strict, &redelivered(order(78, 7, 900)), 8).await;
    assert_eq!(
        count(&results, &Disposition::Ack(Settled::Applied)),
        1,
        "{results:?}"
    );
    assert!(count(&results, &Disposition::Requeue) >= 1, "{results:?}");
    assert!(
        !results
            .iter()
            .any(|result| matches!(result, Disposition::DeadLetter { .. })),
        "{results:?}"
    );
    env.assert_loyalty_consistent().await;
    env.cleanup().await;
}

#[tokio::test]
async fn effects_run_under_the_pipeline_role() {
    let env = TestEnv::new("role").await;
    let role = format!("{}_writer", env.database);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE \"{role}\" NOLOGIN; \
         GRANT INSERT, UPDATE, SELECT ON balances, point_ledger TO \"{role}\"; \
         CREATE TABLE secrets (value text); INSERT INTO secrets VALUES ('keep');"
    )))
    .execute(&env.pool)
    .await
    .expect("create role");
    let pipeline_text = |credit: &str| {
        format!(
            r#"[pipelines.loyalty]
queue = "{}"
plugin = "{}"
[pipelines.loyalty.transaction]
role = "{role}"
[pipelines.loyalty.statements]
credit_balance = """{credit}"""
record_ledger = "INSERT INTO point_ledger (customer_id, order_id, points) VALUES ($1, $2, $3)"
"#,
            env.queue,
            plugin_path("loyalty").display()
        )
    };
    let allowed = env
        .pipeline_from(&pipeline_text(
            "INSERT INTO balances (customer_id, points) VALUES ($1, $2) \
             ON CONFLICT (customer_id) DO UPDATE SET points = balances.points + EXCLUDED.points",
        ))
        .await
        .expect("pipeline starts");
    let shutdown = CancellationToken::new();
    assert_eq!(
        handle_delivery(&allowed, &loyalty_message(order(1, 1, 500)), 1, &shutdown).await,
        Disposition::Ack(Settled::Applied)
    );

    // A statement touching a table the role may not: refused by Postgres (42501), claim
    // rolled back. A configuration fault: the pipeline pauses, the message stays unacked
    // (requeued when the host stops), nothing is dead-lettered.
    let forbidden = Arc::new(
        env.pipeline_from(&pipeline_text(
            "DELETE FROM secrets WHERE $1::int8 IS NOT NULL AND $2::int8 IS NOT NULL",
        ))
        .await
        .expect("pipeline starts"),
    );
    let stopping = CancellationToken::new();
    let delivery = {
        let forbidden = Arc::clone(&forbidden);
        let stopping = stopping.clone();
        tokio::spawn(async move {
            handle_delivery(&forbidden, &loyalty_message(order(2, 1, 500)), 1, &stopping).await
        })
    };
    wait_for("the pipeline to pause", Duration::from_secs(20), || async {
        forbidden.paused().is_some()
    })
    .await;
    let paused = forbidden.paused().expect("paused");
    assert_eq!(paused.sqlstate, "42501", "{paused}");
    assert_eq!(paused.statement, "credit_balance", "{paused}");
    assert!(paused.reason.contains("permission denied"), "{paused}");
    stopping.cancel();
    assert_eq!(delivery.await.expect("delivery"), Disposition::Requeue);
    assert_eq!(env.count("SELECT count(*) FROM secrets").await, 1);
    assert_eq!(
        env.count(
            "SELECT count(*) FROM processed_messages WHERE message_key = 'order-completed:2'"
        )
        .await,
        0
    );

    // A role that does not exist stops start-up by name.
    let missing = env
        .pipeline_from(
            &pipeline_text("SELECT $1::int8, $2::int8").replace(&role, "no_such_role_idem"),
        )
        .await
        .err()
        .expect("an unknown role stops start-up");
    assert!(missing.contains("no_such_role_idem"), "{missing}");
    env.cleanup().await;
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP ROLE IF EXISTS \"{role}\""
    )))
    .execute(
        &sqlx::PgPool::connect(&idem_e2e::admin_url())
            .await
            .expect("admin pool"),
    )
    .await;
}

#[tokio::test]
async fn example_pipelines_start_against_their_schemas() {
    let env = TestEnv::new("examples").await;
    for example in [
        "loyalty-natural",
        "customer-profile",
        "receipts",
        "jetstream",
        "kafka",
    ] {
        let path = Path::new(idem_e2e::REPO_ROOT)
            .join("examples")
            .join(example)
            .join("pipelines.toml");
        let config = Config::load(&path).unwrap_or_else(|error| panic!("{example}: {error}"));
        for pipeline_config in config.pipelines {
            Pipeline::start(
                pipeline_config,
                PluginRuntime::new().expect("plugin runtime"),
                &env.open_database().await,
                Arc::new(Metrics::new()),
                idem_host::relay::RelayWaker::default(),
            )
            .await
            .unwrap_or_else(|error| panic!("{example}: {error}"));
        }
    }
    env.cleanup().await;
}
