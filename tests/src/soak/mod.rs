//! The nemesis soak: two `idem run` hosts serve four pipelines (a RabbitMQ queue with ledger
//! claims, a JetStream stream with natural claims, a RabbitMQ queue whose receipts leave
//! through the outbox to an HTTP endpoint, a Kafka topic read by both hosts in one consumer
//! group) while a seeded scheduler injects faults drawn from a catalogue, in the spirit of
//! Jepsen's nemesis and FoundationDB's simulation testing. Then a checker proves, per key: one
//! claim exactly when every one of its effects is there once, no good message among the dead
//! letters, nothing left unacked or uncommitted, every outbox row delivered, and each Kafka
//! key's messages applied in the order produced.
//!
//! The seed fixes which faults come and in what order; timing is the machine's. The report
//! prints the seed, the fault timeline and the verdict, so a failure is tried again with
//! `scripts/soak.sh --seed N`.

mod check;
mod endpoint;
mod hosts;
mod kafka;
mod nemesis;
mod produce;

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;

use crate::jetstream::TestStream;
use crate::{TestEnv, free_port, plugin_path};

use check::{KAFKA_STALL, Sources, Unsettled, check, count, settle};
use endpoint::{Endpoint, receive};
use hosts::HostSlot;
use kafka::SoakTopic;
use nemesis::unleash;
use produce::{Targets, produce};

pub use produce::RabbitPublisher;

/// How long a soak runs and how hard.
#[derive(Debug, Clone)]
pub struct Profile {
    pub seed: u64,
    /// How long faults are injected while orders are published.
    pub duration: Duration,
    /// Distinct orders published to each of the three sources.
    pub orders: i64,
}

impl Profile {
    /// The profile `scripts/test.sh` runs: a couple of minutes.
    pub fn short(seed: u64) -> Profile {
        Profile {
            seed,
            duration: Duration::from_secs(75),
            orders: 1_200,
        }
    }

    /// `minutes` of faults, with orders to keep the hosts busy throughout.
    pub fn long(seed: u64, minutes: u64) -> Profile {
        Profile {
            seed,
            duration: Duration::from_secs(minutes * 60),
            orders: (minutes as i64 * 1_500).max(1_200),
        }
    }
}

/// What a soak found.
pub struct Report {
    pub seed: u64,
    pub passed: bool,
    pub text: String,
}

/// Runs one soak and checks its outcome.
pub async fn run(profile: Profile) -> Report {
    let started = Instant::now();
    let env = TestEnv::new(&format!("soak{}", profile.seed % 1_000_000)).await;
    let (receipts_queue, receipts_dead_letters) = env.extra_queues("receipts").await;
    let stream = TestStream::new(&env.queue).await;
    sqlx::raw_sql(
        "ALTER TABLE point_ledger ALTER COLUMN points TYPE integer; \
         CREATE TABLE natural_ledger (customer_id bigint NOT NULL, order_id bigint PRIMARY KEY, points bigint NOT NULL); \
         CREATE TABLE natural_balances (customer_id bigint PRIMARY KEY, points bigint NOT NULL)",
    )
    .execute(&env.pool)
    .await
    .expect("soak tables");
    sqlx::raw_sql(kafka::TABLES)
        .execute(&env.pool)
        .await
        .expect("the Kafka pipeline's tables");
    let kafka = Arc::new(SoakTopic::start(&format!("{}-kafka", env.queue)).await);
    // The hosts log in as a role named like the schema idem's tables move to (the docs'
    // own example of a schema of idem's own), owning the database and its tables.
    let role = env.database.clone();
    own_database(&env, &role).await;

    let endpoint = Arc::new(Mutex::new(Endpoint::default()));
    let endpoint_port = {
        let router = Router::new()
            .route("/receipts", post(receive))
            .with_state(Arc::clone(&endpoint));
        crate::serve_locally(router).await
    };

    // The natural pipeline's consumer is an operator's (`declare = false`), with a low
    // delivery limit: the host serves it by the server's `max_deliver` and `ack_wait`.
    stream
        .operator_consumer("idem-natural", NATURAL_MAX_DELIVER, Duration::from_secs(30))
        .await;

    let directory = std::env::temp_dir().join(&env.database);
    std::fs::create_dir_all(&directory).expect("soak directory");
    let kafka_table = kafka.pipeline_table(&plugin_path("loyalty"));
    let mut hosts: Vec<HostSlot> = (0..2)
        .map(|index| {
            let http_port = free_port();
            let text = config_text(
                &env,
                &stream,
                &receipts_queue,
                &receipts_dead_letters,
                endpoint_port,
                http_port,
            );
            HostSlot::configured(
                &directory,
                &format!("host{index}"),
                &(text + &kafka_table),
                &env.config_header(),
                &role,
                http_port,
            )
        })
        .collect();
    // A third member of the Kafka group (that pipeline alone), which the nemesis brings in
    // and takes out: each time, two rebalances under load.
    let mut member = {
        let http_port = free_port();
        let text = format!(
            "{}\n[http]\nlisten = \"127.0.0.1:{http_port}\"\n{kafka_table}",
            env.config_header()
        );
        HostSlot::configured(
            &directory,
            "member",
            &text,
            &env.config_header(),
            &role,
            http_port,
        )
    };
    for host in &mut hosts {
        host.start();
    }

    let bad_every = 97;
    let producer = tokio::spawn(produce(
        Targets {
            queue: env.queue.clone(),
            receipts_queue: receipts_queue.clone(),
            stream: stream.context.clone(),
            subject: stream.subject.clone(),
            kafka: Arc::clone(&kafka),
        },
        profile.orders,
        bad_every,
        profile.duration,
    ));

    let mut timeline = unleash(
        profile.seed,
        profile.duration,
        started,
        &mut hosts,
        &mut member,
        &env,
    )
    .await;
    // Every host back, running, for the end of the run.
    for host in &mut hosts {
        host.signal("-CONT");
        if !host.is_running() {
            host.kill();
            host.start();
        }
    }
    // The third group member leaves for good: one more rebalance, with the orders still
    // coming.
    let member_left = member.stop();
    let produced = producer.await.expect("producer");
    eprintln!(
        "soak: faults over at {:.1}s; waiting for the hosts to settle",
        started.elapsed().as_secs_f64()
    );
    let sources = Sources {
        env: &env,
        stream: &stream,
        kafka: &kafka,
        endpoint: &endpoint,
    };
    let mut settled = settle(&sources, profile.orders).await;
    let mut stopped_cleanly = true;
    // tansu's group coordinator can keep a dead member as the group's leader for good, so
    // no member is ever assigned (a broker fault, not the hosts': a Kafka broker evicts a
    // silent member after `session.timeout.ms`; see `SoakTopic::regroup`). The hosts move to
    // a new group, which starts at the database floor; the timeline says so, and the checker
    // then holds the pipeline to everything, as ever.
    for _ in 0..2 {
        let Err(Unsettled::KafkaStalled(state)) = &settled else {
            break;
        };
        let group = kafka.regroup();
        let line = format!(
            "{:>7.1}s  the Kafka group moved nothing for {}s ({state}): the hosts move to group {group} (tansu keeps a dead leader)",
            started.elapsed().as_secs_f64(),
            KAFKA_STALL.as_secs()
        );
        eprintln!("soak: {line}");
        timeline.push(line);
        for host in &mut hosts {
            stopped_cleanly &= host.stop();
            host.join_kafka_group(&group);
        }
        member.join_kafka_group(&group);
        for host in &mut hosts {
            host.start();
        }
        settled = settle(&sources, profile.orders).await;
    }
    for host in &mut hosts {
        stopped_cleanly &= host.stop();
    }

    let mut failures = Vec::new();
    match settled {
        Ok(()) => {}
        Err(Unsettled::TimedOut(what)) => {
            failures.push(format!("not settled within the time allowed: {what}"));
        }
        Err(Unsettled::KafkaStalled(what)) => failures.push(format!(
            "the Kafka pipeline moved nothing in a new group either: {what}"
        )),
    }
    if !member_left {
        failures.push("the third Kafka group member did not exit 0 on SIGTERM".into());
    }
    if !stopped_cleanly {
        failures.push("a host did not exit 0 on SIGTERM".into());
    }
    let mut counts = String::new();
    let moved = count(
        &env,
        &format!(
            "SELECT CASE WHEN to_regclass('\"{role}\".processed_messages') IS NULL THEN 0 ELSE 1 END::int8"
        ),
    )
    .await
        == 1;
    let idem_tables = if moved {
        format!("\"{role}\".")
    } else {
        String::new()
    };
    check(
        &sources,
        &idem_tables,
        &produced,
        &mut failures,
        &mut counts,
    )
    .await;

    let passed = failures.is_empty();
    let mut text = String::new();
    let _ = writeln!(
        text,
        "soak seed {} ({:?} of faults, {} orders per source, database {})",
        profile.seed, profile.duration, profile.orders, env.database
    );
    let _ = writeln!(text, "fault timeline ({} faults):", timeline.len());
    for line in &timeline {
        let _ = writeln!(text, "  {line}");
    }
    let _ = write!(text, "{counts}");
    if passed {
        let _ = writeln!(
            text,
            "verdict: PASS in {:.0}s",
            started.elapsed().as_secs_f64()
        );
    } else {
        let _ = writeln!(text, "verdict: FAIL");
        for failure in &failures {
            let _ = writeln!(text, "  {failure}");
        }
        let _ = writeln!(
            text,
            "host logs and configs in {}; run it again with scripts/soak.sh --seed {}",
            directory.display(),
            profile.seed
        );
    }
    if passed {
        stream.cleanup().await;
        env.cleanup().await;
        drop_role(&role).await;
        let _ = std::fs::remove_dir_all(&directory);
    }
    Report {
        seed: profile.seed,
        passed,
        text,
    }
}

/// The deliveries the natural pipeline's consumer allows: low, above its `max_attempts` (5).
const NATURAL_MAX_DELIVER: i64 = 8;

/// Makes `role` (created, able to log in) the owner of `env`'s database and of every table
/// in it, as an application's own role would be.
async fn own_database(env: &TestEnv, role: &str) {
    let database = &env.database;
    for sql in [
        format!("CREATE ROLE \"{role}\" LOGIN"),
        format!("ALTER DATABASE \"{database}\" OWNER TO \"{role}\""),
        format!(
            "DO $$ DECLARE t record; BEGIN \
               FOR t IN SELECT tablename FROM pg_tables WHERE schemaname = 'public' LOOP \
                 EXECUTE format('ALTER TABLE public.%I OWNER TO %I', t.tablename, '{role}'); \
               END LOOP; END $$"
        ),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone()))
            .execute(&env.pool)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"));
    }
}

async fn drop_role(role: &str) {
    use sqlx::Connection as _;
    if let Ok(mut admin) = sqlx::PgConnection::connect(&crate::admin_url()).await {
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP ROLE IF EXISTS \"{role}\""
        )))
        .execute(&mut admin)
        .await;
    }
}

/// The config of one host: the three pipelines, the outbox endpoint, its own HTTP port.
fn config_text(
    env: &TestEnv,
    stream: &TestStream,
    receipts_queue: &str,
    receipts_dead_letters: &str,
    endpoint_port: u16,
    http_port: u16,
) -> String {
    format!(
        r#"{header}
[http]
listen = "127.0.0.1:{http_port}"

[outbox]
poll = "100ms"
max_attempts = 1000

[outbox.destinations.receipts]
kind = "http"
url = "http://127.0.0.1:{endpoint_port}/receipts"
timeout = "5s"

[pipelines.loyalty]
consumer = "loyalty"
plugin = "{loyalty}"
max_attempts = 3
workers = 6
source = {{ kind = "rabbitmq", queue = "{queue}", dead_letter_queue = "{dead_letter_queue}" }}

[pipelines.loyalty.batch]
size = 16

[pipelines.loyalty.statements]
{loyalty_statements}
[pipelines.natural]
consumer = "natural"
plugin = "{loyalty}"
claim = "natural"
claim_statement = "record_ledger"
workers = 4
source = {{ kind = "jetstream", servers = ["{nats}"], stream = "{stream}", subject = "{subject}", dead_letter_subject = "{stream_dead_letter_subject}", dead_letter_stream = "{stream_dead_letters}", declare = false }}

[pipelines.natural.statements]
record_ledger = """
WITH credit AS (
  INSERT INTO natural_ledger (customer_id, order_id, points) VALUES ($1, $2, $3)
  ON CONFLICT (order_id) DO NOTHING
  RETURNING customer_id, points
)
INSERT INTO natural_balances (customer_id, points) SELECT customer_id, points FROM credit
ON CONFLICT (customer_id) DO UPDATE SET points = natural_balances.points + EXCLUDED.points
"""
credit_balance = "SELECT $1::int8, $2::int8"

[pipelines.receipts]
consumer = "receipts"
plugin = "{receipts}"
workers = 4
source = {{ kind = "rabbitmq", queue = "{receipts_queue}", dead_letter_queue = "{receipts_dead_letters}" }}

[pipelines.receipts.statements]
record_receipt = "INSERT INTO receipts (order_id, customer_id, total_cents) VALUES ($1, $2, $3)"
"#,
        header = env.config_header(),
        loyalty = plugin_path("loyalty").display(),
        receipts = plugin_path("receipts").display(),
        queue = env.queue,
        dead_letter_queue = env.dead_letter_queue,
        loyalty_statements = crate::LOYALTY_STATEMENTS,
        nats = stream.url,
        stream = stream.name,
        subject = stream.subject,
        stream_dead_letter_subject = stream.dead_letter_subject,
        stream_dead_letters = stream.dead_letter_stream,
    )
}
