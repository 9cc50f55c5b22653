//! Exactly-once while the schema changes under a running host: a migration that widens a
//! column, with the host's sessions terminated (a deploy, a pooler restart or a failover
//! does the same), loses no effect of an acked message, dead-letters nothing and does not
//! pause; a change no value can bind to pauses the pipeline naming the statement, the
//! parameter and both types, and nothing is lost when it is undone.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use idem_e2e::{TestEnv, order, plugin_path, unacked, wait_for};
use idem_host::message::InboundMessage;
use idem_host::pipeline::Pipeline;
use idem_host::pipeline::process::{Disposition, Settled, handle_delivery};

const ORDERS: i64 = 3000;

/// Ends every session the host has open on the test's database.
async fn terminate_host_sessions(env: &TestEnv) -> i64 {
    env.count(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'idem' \
         AND pid <> pg_backend_pid()",
    )
    .await
}

/// The issue's loyalty run: `point_ledger.points` starts as `integer`; while the host
/// credits 3,000 orders (and 300 duplicate deliveries), a DBA widens it to `bigint` and the
/// host's sessions are terminated. Every order must end with its claim, its ledger row and
/// its credit, the queue empty and nothing dead-lettered.
async fn widening_under_load(name: &str, extra: &str) {
    let env = TestEnv::new(name).await;
    sqlx::raw_sql("ALTER TABLE point_ledger ALTER COLUMN points TYPE integer")
        .execute(&env.pool)
        .await
        .expect("narrow the column before the host starts");
    let host = env.start_host(env.config("loyalty", extra));
    let publisher = {
        let queue = env.queue.clone();
        tokio::spawn(async move {
            let (_connection, channel) = idem_e2e::connect_channel().await;
            for order_id in 1..=ORDERS {
                idem_e2e::publish(&channel, &queue, &order(order_id, order_id % 40, 1500)).await;
                if order_id % 10 == 0 {
                    idem_e2e::publish(&channel, &queue, &order(order_id, order_id % 40, 1500))
                        .await;
                }
            }
        })
    };
    wait_for("300 credits", Duration::from_secs(120), || async {
        env.count("SELECT count(*) FROM point_ledger").await >= 300
    })
    .await;
    sqlx::raw_sql("ALTER TABLE point_ledger ALTER COLUMN points TYPE bigint")
        .execute(&env.pool)
        .await
        .expect("widen the column");
    let credited = env.count("SELECT count(*) FROM point_ledger").await;
    assert!(
        credited < ORDERS,
        "the run finished before the migration; nothing was tested"
    );
    assert!(
        terminate_host_sessions(&env).await > 0,
        "no host session ended"
    );
    publisher.await.expect("publisher");
    wait_for("every order claimed", Duration::from_secs(180), || async {
        env.count("SELECT count(*) FROM processed_messages WHERE consumer = 'loyalty'")
            .await
            == ORDERS
    })
    .await;
    wait_for("the queue to drain", Duration::from_secs(60), || async {
        env.ready(&env.queue).await == 0 && unacked(&env.queue) == 0
    })
    .await;
    host.stop().await.expect("host stops");
    assert_eq!(
        env.count("SELECT count(*) FROM point_ledger").await,
        ORDERS,
        "acked messages lost their ledger row"
    );
    env.assert_loyalty_consistent().await;
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0, "dead letters");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_widening_migration_under_load_loses_nothing() {
    widening_under_load("widen", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_widening_migration_under_load_loses_nothing_in_batches() {
    widening_under_load("widenbatch", "[pipelines.loyalty.batch]\nsize = 64").await;
}

/// A table with one column of each type a migration commonly widens, written by the chaos
/// plugin's `echo` (the message names the statement and its values).
const TYPED_PIPELINE: &str = r#"
[pipelines.typed.statements]
record = "INSERT INTO typed (k, i, f, v, t) VALUES ($1, $2, $3, $4, $5)"
"#;

async fn typed_pipeline(env: &TestEnv) -> Pipeline {
    sqlx::raw_sql(
        "CREATE TABLE typed (k text PRIMARY KEY, i int4, f float4, v varchar(20), t timestamp)",
    )
    .execute(&env.pool)
    .await
    .expect("typed table");
    env.pipeline_from(&format!(
        "[pipelines.typed]\nqueue = \"{}\"\nplugin = \"{}\"\n{TYPED_PIPELINE}",
        env.queue,
        plugin_path("chaos").display()
    ))
    .await
    .expect("pipeline starts")
}

fn typed_message(key: &str, integer: i64, text: &str) -> InboundMessage {
    let body = serde_json::json!({
        "key": key,
        "effects": [{
            "statement": "record",
            "params": [key, integer, 1.5, text, {"timestamp": 1_700_000_000_000_000_i64}],
        }]
    });
    InboundMessage {
        pipeline: "typed".into(),
        body: body.to_string().into_bytes(),
        ..InboundMessage::default()
    }
}

/// int4→int8, float4→float8, varchar(20)→text and timestamp→timestamptz, then the host's
/// sessions terminated: the next messages apply, and values only the wider types take
/// (an integer past int4, text past 20 characters) apply too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn widened_types_bind_on_the_sessions_that_see_them() {
    let env = TestEnv::new("widetypes").await;
    let pipeline = typed_pipeline(&env).await;
    let shutdown = CancellationToken::new();
    let deliver = |message: InboundMessage| {
        let pipeline = &pipeline;
        let shutdown = &shutdown;
        async move { handle_delivery(pipeline, &message, 1, shutdown).await }
    };
    assert_eq!(
        deliver(typed_message("before", 7, "short")).await,
        Disposition::Ack(Settled::Applied)
    );
    sqlx::raw_sql(
        "ALTER TABLE typed ALTER COLUMN i TYPE int8, ALTER COLUMN f TYPE float8, \
         ALTER COLUMN v TYPE text, ALTER COLUMN t TYPE timestamptz",
    )
    .execute(&env.pool)
    .await
    .expect("widen every column");
    terminate_host_sessions(&env).await;
    for (key, integer, text) in [
        ("after", 8, "short"),
        ("big", 1_i64 << 40, "short"),
        ("long", 9, &"x".repeat(100)[..]),
    ] {
        assert_eq!(
            deliver(typed_message(key, integer, text)).await,
            Disposition::Ack(Settled::Applied),
            "{key}"
        );
    }
    assert!(pipeline.paused().is_none());
    assert_eq!(
        env.count("SELECT count(*) FROM typed WHERE f = 1.5").await,
        4
    );
    assert_eq!(
        env.count(
            "SELECT count(*) FROM typed WHERE k <> 'before' AND t = to_timestamp(1700000000)"
        )
        .await,
        3
    );
    assert_eq!(
        env.count("SELECT i FROM typed WHERE k = 'big'").await,
        1_i64 << 40
    );
    env.cleanup().await;
}

/// A column changed to a type the plugin's values cannot bind to (int4 to jsonb) pauses the
/// pipeline, naming the statement, the parameter and both types; the message stays unacked
/// and nothing is written. Changing it back resumes the pipeline and the message applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incompatible_change_pauses_naming_both_types() {
    let env = TestEnv::new("badtype").await;
    let pipeline = Arc::new(typed_pipeline(&env).await);
    let shutdown = CancellationToken::new();
    assert_eq!(
        handle_delivery(&pipeline, &typed_message("first", 1, "a"), 1, &shutdown).await,
        Disposition::Ack(Settled::Applied)
    );
    sqlx::raw_sql("ALTER TABLE typed ALTER COLUMN i TYPE jsonb USING to_jsonb(i)")
        .execute(&env.pool)
        .await
        .expect("change the column's type");
    terminate_host_sessions(&env).await;
    let delivery = {
        let pipeline = Arc::clone(&pipeline);
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            handle_delivery(&pipeline, &typed_message("second", 2, "b"), 1, &shutdown).await
        })
    };
    wait_for("the pipeline to pause", Duration::from_secs(30), || async {
        pipeline.paused().is_some()
    })
    .await;
    let paused = pipeline.paused().expect("paused");
    assert_eq!(paused.statement, "record", "{paused}");
    assert_eq!(paused.sqlstate, "42804", "{paused}");
    for fragment in ["$2", "jsonb", "int4"] {
        assert!(
            paused.reason.contains(fragment),
            "{paused} lacks {fragment}"
        );
    }
    assert_eq!(env.count("SELECT count(*) FROM typed").await, 1);

    sqlx::raw_sql("ALTER TABLE typed ALTER COLUMN i TYPE int4 USING (i #>> '{}')::int4")
        .execute(&env.pool)
        .await
        .expect("change the column back");
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(30), delivery)
            .await
            .expect("the paused message applies once the column is back")
            .expect("delivery"),
        Disposition::Ack(Settled::Applied)
    );
    assert!(pipeline.paused().is_none());
    assert_eq!(env.count("SELECT count(*) FROM typed").await, 2);
    env.cleanup().await;
}

/// Waits (at most `within`) for `orders` ledger rows, stops the host, and checks that none was
/// dead-lettered and none applied twice.
async fn every_order_applied_once(
    env: TestEnv,
    host: idem_e2e::Host,
    orders: i64,
    within: Duration,
) {
    wait_for("every order applied", within, || async {
        env.count("SELECT count(*) FROM point_ledger").await == orders
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0, "dead letters");
    assert_eq!(
        env.count("SELECT count(DISTINCT order_id) FROM point_ledger")
            .await,
        orders,
        "an order applied twice"
    );
    env.cleanup().await;
}

/// A pipeline paused by a configuration fault (its ledger table renamed away under load)
/// holds no more than the one message that keeps trying: what it had prefetched, and what
/// its other workers held, go back to the queue within seconds, for healthy hosts. Renamed
/// back, the pipeline resumes and every order applies once.
async fn a_fault_pause_gives_back(name: &str, extra: &str) {
    let env = TestEnv::new(name).await;
    let host = env.start_host(env.config("loyalty", extra));
    for order_id in 0..10 {
        env.publish(&order(order_id, order_id % 5, 100)).await;
    }
    wait_for("the first orders", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 10
    })
    .await;
    sqlx::raw_sql("ALTER TABLE point_ledger RENAME TO point_ledger_away")
        .execute(&env.pool)
        .await
        .expect("rename the ledger away");
    const MORE: i64 = 200;
    for order_id in 10..10 + MORE {
        env.publish(&order(order_id, order_id % 5, 100)).await;
    }
    // Prefetch is 64: without giving back, 64 stay unacknowledged with the paused host.
    wait_for(
        "the paused host to hold one message at most",
        Duration::from_secs(30),
        || async { unacked(&env.queue) <= 1 && env.ready(&env.queue).await >= MORE as u32 - 1 },
    )
    .await;
    sqlx::raw_sql("ALTER TABLE point_ledger_away RENAME TO point_ledger")
        .execute(&env.pool)
        .await
        .expect("rename the ledger back");
    every_order_applied_once(env, host, 10 + MORE, Duration::from_secs(90)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_pause_gives_back_what_it_holds() {
    a_fault_pause_gives_back("fault_gives_back", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_pause_gives_back_what_it_holds_in_batches() {
    a_fault_pause_gives_back(
        "fault_gives_back_batch",
        "[pipelines.loyalty.batch]\nsize = 16",
    )
    .await;
}

/// The transaction that kept trying while a configuration fault paused the pipeline (the
/// ledger refusing writes, as a revoked privilege does: 42501) gives up (its claim waits on a
/// lock past `statement_timeout`, `timeouts = 1`), so its message goes back with the others.
/// The fault is then mended: the next message the consumer takes alone to find out commits,
/// which ends the pause, and every order applies. (The pause used to end only with the
/// transaction that caused it, so the pipeline took one message per half-minute release
/// cycle for ever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_whose_trying_transaction_gave_up_ends_with_the_next_commit() {
    let env = TestEnv::new("pause_probe_gave_up").await;
    let extra = "[pipelines.loyalty.transaction]\nstatement_timeout = \"300ms\"\ntimeouts = 1";
    let host = env.start_host(env.config("loyalty", extra));
    env.publish(&order(0, 0, 100)).await;
    wait_for("the first order", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 1
    })
    .await;
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_ledger() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN RAISE EXCEPTION 'permission denied for table point_ledger' \
         USING ERRCODE = '42501'; END $$; \
         CREATE TRIGGER refuse_ledger BEFORE INSERT ON point_ledger \
         FOR EACH ROW EXECUTE FUNCTION refuse_ledger()",
    )
    .execute(&env.pool)
    .await
    .expect("refuse the ledger's writes");
    const MORE: i64 = 60;
    for order_id in 1..=MORE {
        env.publish(&order(order_id, order_id % 5, 100)).await;
    }
    wait_for("the pipeline paused", Duration::from_secs(30), || async {
        unacked(&env.queue) == 1 && env.ready(&env.queue).await == MORE as u32 - 1
    })
    .await;
    // The mend waits, uncommitted, behind a lock that the trying transaction's claim meets.
    let mut mend = env.pool.begin().await.expect("begin the mend");
    sqlx::raw_sql(
        "LOCK TABLE processed_messages IN ACCESS EXCLUSIVE MODE; \
         DROP TRIGGER refuse_ledger ON point_ledger",
    )
    .execute(&mut *mend)
    .await
    .expect("lock the claims and mend the ledger");
    wait_for(
        "the trying transaction to give its message back",
        Duration::from_secs(30),
        || async { unacked(&env.queue) == 0 },
    )
    .await;
    mend.commit().await.expect("commit the mend");
    every_order_applied_once(env, host, 1 + MORE, Duration::from_secs(75)).await;
}

/// A message whose own statement always outlasts `statement_timeout` (order 7's ledger row
/// sleeps 1 s, the timeout is 200 ms), in batches of 16: the batch goes one message at a
/// time, every other order applies, and after `transaction.timeouts` timed-out tries order 7
/// stops holding its worker: dead-lettered as `transaction-timeout` with `on_timeout =
/// "dead-letter"`, back to the end of the queue by default.
async fn a_message_that_always_times_out(name: &str, on_timeout: &str) {
    let env = TestEnv::new(name).await;
    env.slow_ledger("NEW.order_id = 7", 1.0).await;
    let extra = format!(
        "[pipelines.loyalty.batch]\nsize = 16\n\n[pipelines.loyalty.transaction]\n\
         statement_timeout = \"200ms\"\ntimeouts = 3\n{on_timeout}"
    );
    let host = env.start_host(env.config("loyalty", &extra));
    for order_id in 0..40 {
        env.publish(&order(order_id, order_id % 5, 100)).await;
    }
    wait_for(
        "every other order applied",
        Duration::from_secs(90),
        || async {
            env.count("SELECT count(*) FROM point_ledger WHERE order_id <> 7")
                .await
                == 39
        },
    )
    .await;
    if on_timeout.contains("dead-letter") {
        wait_for("order 7 dead-lettered", Duration::from_secs(60), || async {
            env.ready(&env.dead_letter_queue).await == 1
        })
        .await;
        let letters = env.drain(&env.dead_letter_queue).await;
        let (_, headers) = &letters[0];
        assert!(
            headers
                .iter()
                .any(|(name, value)| name == "x-idem-error-kind" && value == "transaction-timeout"),
            "{headers:?}"
        );
    }
    host.stop().await.expect("host stops cleanly");
    assert_eq!(
        env.count("SELECT count(*) FROM point_ledger WHERE order_id = 7")
            .await,
        0
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_always_times_out_holds_nothing_and_goes_back() {
    a_message_that_always_times_out("always_times_out", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_always_times_out_is_dead_lettered_on_request() {
    a_message_that_always_times_out("always_times_out_dl", "on_timeout = \"dead-letter\"").await;
}
