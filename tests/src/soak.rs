//! The nemesis soak: two `idem run` hosts serve three pipelines (a RabbitMQ queue with ledger
//! claims, a JetStream stream with natural claims, a RabbitMQ queue whose receipts leave
//! through the outbox to an HTTP endpoint) while a seeded scheduler injects faults drawn from
//! a catalogue, in the spirit of Jepsen's nemesis and FoundationDB's simulation testing. Then
//! a checker proves, per key: one claim exactly when every one of its effects is there once,
//! no good message among the dead letters, nothing left unacked, every outbox row delivered.
//!
//! The seed fixes which faults come and in what order; timing is the machine's. The report
//! prints the seed, the fault timeline and the verdict, so a failure is tried again with
//! `scripts/soak.sh --seed N`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::jetstream::TestStream;
use crate::{IdemProcess, TestEnv, free_port, idem_binary, order, plugin_path, unacked};

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

/// The faults the nemesis draws from, each with its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    KillHost,
    PauseHost,
    TerminateBackends,
    CancelBackends,
    RestartPostgres,
    Migration,
    RestartBroker,
    HotSwap,
    ConsoleRead,
    DeadLetterRead,
    DeadLetterReplay,
    /// The rolling change of `[database] schema` (once): `idem migrate` with the schema set,
    /// run while the hosts work, under a role named like the schema, then the hosts restarted
    /// one by one with the new config.
    SchemaMove,
    /// A third host through a PgBouncer in transaction pooling while its config says
    /// `pooling = "none"` (the default): it must refuse its transactions, naming the setting,
    /// and lose or double nothing.
    WrongPooler,
}

const CATALOGUE: [(Fault, u32); 13] = [
    (Fault::KillHost, 3),
    (Fault::PauseHost, 2),
    (Fault::TerminateBackends, 3),
    (Fault::CancelBackends, 2),
    (Fault::RestartPostgres, 1),
    (Fault::Migration, 2),
    (Fault::RestartBroker, 1),
    (Fault::HotSwap, 2),
    (Fault::ConsoleRead, 2),
    (Fault::DeadLetterRead, 2),
    (Fault::DeadLetterReplay, 1),
    (Fault::SchemaMove, 1),
    (Fault::WrongPooler, 1),
];

/// Schema changes a DBA makes under load; each runs once, in this order. Every generated
/// message satisfies the CHECK.
const MIGRATIONS: [&str; 4] = [
    "ALTER TABLE point_ledger ADD COLUMN soak_note text",
    "ALTER TABLE point_ledger ALTER COLUMN points TYPE bigint",
    "ALTER TABLE point_ledger ADD CONSTRAINT soak_points_bounded CHECK (points < 1000000) NOT VALID",
    "CREATE INDEX CONCURRENTLY IF NOT EXISTS soak_ledger_customer ON point_ledger (customer_id)",
];

fn customer(order_id: i64) -> i64 {
    order_id % 41
}

fn total(order_id: i64) -> i64 {
    100 + (order_id * 61) % 30_000
}

/// The body of the `n`th malformed message (never valid JSON).
fn bad_body(n: i64) -> Vec<u8> {
    format!("soak-malformed-{n} {{").into_bytes()
}

/// The outbox endpoint: every idempotency key it accepted, with how many times.
#[derive(Default)]
struct Endpoint {
    accepted: BTreeMap<String, u32>,
}

async fn receive(State(endpoint): State<Arc<Mutex<Endpoint>>>, headers: HeaderMap) -> StatusCode {
    let Some(key) = crate::idempotency_key(&headers) else {
        return StatusCode::BAD_REQUEST;
    };
    *endpoint
        .lock()
        .expect("endpoint")
        .accepted
        .entry(key.to_string())
        .or_default() += 1;
    StatusCode::OK
}

/// One `idem run` host and the config it runs with.
struct HostSlot {
    config: PathBuf,
    /// Its config once idem's tables moved into the schema named like the hosts' role.
    moved_config: PathBuf,
    http_port: u16,
    process: Option<IdemProcess>,
    log: PathBuf,
}

impl HostSlot {
    fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("host log");
        let mut command = Command::new(idem_binary());
        command
            .args(["run", "--config"])
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .env("RUST_LOG", "idem_host=info,warn");
        self.process = Some(IdemProcess::spawn(&mut command));
    }

    fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|process| process.id())
    }

    fn kill(&mut self) {
        if let Some(mut process) = self.process.take() {
            let _ = process.kill();
            let _ = process.wait();
        }
    }

    fn signal(&self, signal: &str) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill")
                .args([signal, &pid.to_string()])
                .status();
        }
    }

    /// SIGTERM and a clean exit; `false` if it did not exit 0.
    fn stop(&mut self) -> bool {
        match self.process.take() {
            Some(process) => process.terminate().success(),
            None => true,
        }
    }
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
    // The hosts log in as a role named like the schema idem's tables move to (the README's
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
    let mut hosts: Vec<HostSlot> = (0..2)
        .map(|index| {
            let http_port = free_port();
            let config = directory.join(format!("host{index}.toml"));
            let moved_config = directory.join(format!("host{index}-moved.toml"));
            let text = config_text(
                &env,
                &stream,
                &receipts_queue,
                &receipts_dead_letters,
                endpoint_port,
                http_port,
            );
            let header = env.config_header();
            let text = text.replacen(&header, &as_role(&header, &role), 1);
            let moved = text.replacen(
                "[database]\n",
                &format!("[database]\nschema = \"{role}\"\n"),
                1,
            );
            std::fs::write(&config, text).expect("write config");
            std::fs::write(&moved_config, moved).expect("write config");
            HostSlot {
                config,
                moved_config,
                http_port,
                process: None,
                log: directory.join(format!("host{index}.log")),
            }
        })
        .collect();
    for host in &mut hosts {
        host.start();
    }

    let bad_every = 97;
    let producer = tokio::spawn(produce(
        env.queue.clone(),
        receipts_queue.clone(),
        stream.context.clone(),
        stream.subject.clone(),
        profile.orders,
        bad_every,
        profile.duration,
    ));

    let mut rng = StdRng::seed_from_u64(profile.seed);
    let mut timeline = Vec::new();
    let mut migrations = MIGRATIONS.iter();
    let total_weight: u32 = CATALOGUE.iter().map(|(_, weight)| weight).sum();
    let faults_end = Instant::now() + profile.duration;
    while Instant::now() < faults_end {
        let pause = rng.random_range(1_000..3_500);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let mut pick = rng.random_range(0..total_weight);
        let fault = CATALOGUE
            .iter()
            .find(|(_, weight)| {
                if pick < *weight {
                    true
                } else {
                    pick -= weight;
                    false
                }
            })
            .map(|(fault, _)| *fault)
            .expect("a fault");
        let target = rng.random_range(0..hosts.len());
        let amount = rng.random_range(500..3_000u64);
        let what = inject(fault, target, amount, &mut hosts, &env, &mut migrations).await;
        let line = format!("{:>7.1}s  {what}", started.elapsed().as_secs_f64());
        eprintln!("soak: {line}");
        timeline.push(line);
    }
    // Every host back, running, for the end of the run.
    for host in &mut hosts {
        host.signal("-CONT");
        if host
            .process
            .as_mut()
            .is_none_or(|process| matches!(process.try_wait(), Ok(Some(_))))
        {
            host.kill();
            host.start();
        }
    }
    let produced = producer.await.expect("producer");
    eprintln!(
        "soak: faults over at {:.1}s; waiting for the hosts to settle",
        started.elapsed().as_secs_f64()
    );
    let settled = settle(&env, &stream, &endpoint, profile.orders).await;
    let mut stopped_cleanly = true;
    for host in &mut hosts {
        stopped_cleanly &= host.stop();
    }

    let mut failures = Vec::new();
    if let Err(what) = settled {
        failures.push(format!("not settled within the time allowed: {what}"));
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
        &env,
        &idem_tables,
        &stream,
        &endpoint,
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

/// `header` (the `[database]` and `[amqp]` tables) with the database URL's user `role`.
fn as_role(header: &str, role: &str) -> String {
    header
        .lines()
        .map(|line| match line.strip_prefix("url = \"postgres://") {
            Some(rest) => {
                let host = rest.split_once('@').map_or(rest, |(_, host)| host);
                format!("url = \"postgres://{role}@{host}")
            }
            None => line.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
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

/// What the producer published: every order reached each source at least once (confirmed),
/// and these malformed bodies.
struct Produced {
    /// Distinct orders, `1..=orders`, to each source.
    orders: i64,
    bad: BTreeSet<Vec<u8>>,
    deliveries: u64,
}

/// Publishes `orders` orders to the loyalty queue, the receipts queue and the stream, spread
/// over `duration`, with duplicates (every 7th order again) and a malformed message after
/// every `bad_every`th order. Each publish is retried until the broker confirms it, through
/// broker restarts.
async fn produce(
    queue: String,
    receipts_queue: String,
    stream: async_nats::jetstream::Context,
    subject: String,
    orders: i64,
    bad_every: i64,
    duration: Duration,
) -> Produced {
    let mut rabbit = RabbitPublisher::to(&crate::amqp_url());
    let mut produced = Produced {
        orders,
        bad: BTreeSet::new(),
        deliveries: 0,
    };
    let pace = duration.div_f64(orders as f64 * 1.1);
    let mut bodies = Vec::new();
    for order_id in 1..=orders {
        let started = Instant::now();
        bodies.clear();
        bodies.push(order(order_id, customer(order_id), total(order_id)));
        if order_id % 7 == 0 {
            bodies.push(order(order_id, customer(order_id), total(order_id)));
        }
        if order_id % bad_every == 0 {
            let bad = bad_body(order_id / bad_every);
            produced.bad.insert(bad.clone());
            bodies.push(bad);
        }
        // Every 11th order carries a hostile producer's headers: data, never a fault.
        let hostile = order_id % 11 == 0;
        for body in &bodies {
            rabbit.publish(&queue, body).await;
            rabbit
                .publish_with(&receipts_queue, body, hostile.then(hostile_headers))
                .await;
            while !stored_on_stream(&stream, &subject, body, hostile).await {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            produced.deliveries += 3;
        }
        if let Some(rest) = pace.checked_sub(started.elapsed()) {
            tokio::time::sleep(rest).await;
        }
    }
    produced
}

/// Headers a hostile producer sets: a `tracestate` with a NUL and one of 10 KB beside a
/// valid `traceparent`, an attempt past any number, a control character in a header.
fn hostile_headers() -> FieldTable {
    let mut headers = FieldTable::default();
    for (name, value) in [
        (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string(),
        ),
        ("tracestate", "k=v\0".to_string()),
        ("x-idem-attempt", "99999999999999999999999".to_string()),
        ("x-idem-rejected-at", "18446744073709551615".to_string()),
        ("x-note", format!("\u{1}{}", "x".repeat(10 * 1024))),
    ] {
        headers.insert(
            ShortString::from(name),
            AMQPValue::LongString(LongString::from(value.into_bytes())),
        );
    }
    headers
}

/// Publishes `body` to `subject` (with a hostile producer's headers when `hostile`); whether
/// the stream confirmed it stored it.
async fn stored_on_stream(
    context: &async_nats::jetstream::Context,
    subject: &str,
    body: &[u8],
    hostile: bool,
) -> bool {
    let mut headers = async_nats::HeaderMap::new();
    if hostile {
        headers.insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        );
        headers.insert(
            "tracestate",
            format!("k={}\u{1}", "v".repeat(10 * 1024)).as_str(),
        );
        headers.insert("x-idem-attempt", "-1");
    }
    let stored = async {
        context
            .publish_with_headers(
                subject.to_string(),
                headers,
                bytes::Bytes::copy_from_slice(body),
            )
            .await?
            .await
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(10), stored).await,
        Ok(Ok(_))
    )
}

/// A publisher to RabbitMQ that reconnects after a broker restart (or a node's death).
pub struct RabbitPublisher {
    url: String,
    connection: Option<(Connection, Channel)>,
}

impl RabbitPublisher {
    /// A publisher to the broker at `url`, connecting at its first publish.
    pub fn to(url: &str) -> RabbitPublisher {
        RabbitPublisher {
            url: url.to_string(),
            connection: None,
        }
    }

    /// Publishes `body` to `queue` persistently and waits for the confirm, retrying (on a
    /// new connection) until the broker confirms it.
    pub async fn publish(&mut self, queue: &str, body: &[u8]) {
        self.publish_with(queue, body, None).await;
    }

    /// [`RabbitPublisher::publish`] with `headers`.
    pub async fn publish_with(&mut self, queue: &str, body: &[u8], headers: Option<FieldTable>) {
        loop {
            if self
                .connection
                .as_ref()
                .is_none_or(|(_, channel)| !channel.status().connected())
            {
                self.connection = match tokio::time::timeout(
                    Duration::from_secs(5),
                    crate::try_connect_channel_to(&self.url),
                )
                .await
                {
                    Ok(Ok(connected)) => Some(connected),
                    _ => {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                };
            }
            let Some((_, channel)) = &self.connection else {
                continue;
            };
            let confirmed = async {
                channel
                    .basic_publish(
                        ShortString::from(""),
                        ShortString::from(queue),
                        BasicPublishOptions::default(),
                        body,
                        match &headers {
                            Some(headers) => BasicProperties::default()
                                .with_delivery_mode(2)
                                .with_headers(headers.clone()),
                            None => BasicProperties::default().with_delivery_mode(2),
                        },
                    )
                    .await?
                    .await
            };
            match tokio::time::timeout(Duration::from_secs(10), confirmed).await {
                Ok(Ok(confirmation)) if confirmation.is_ack() => return,
                _ => {
                    self.connection = None;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

/// Injects `fault` (on host `target` where it names one, for `amount` milliseconds where it
/// lasts); returns the timeline's words for it.
async fn inject(
    fault: Fault,
    target: usize,
    amount: u64,
    hosts: &mut [HostSlot],
    env: &TestEnv,
    migrations: &mut std::slice::Iter<'_, &str>,
) -> String {
    match fault {
        Fault::KillHost => {
            hosts[target].kill();
            tokio::time::sleep(Duration::from_millis(amount / 4)).await;
            hosts[target].start();
            format!("SIGKILL host {target}, restarted after {} ms", amount / 4)
        }
        Fault::PauseHost => {
            hosts[target].signal("-STOP");
            tokio::time::sleep(Duration::from_millis(amount)).await;
            hosts[target].signal("-CONT");
            format!("SIGSTOP host {target} for {amount} ms")
        }
        Fault::TerminateBackends => {
            let ended = sql_count(
                env,
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = current_database() AND application_name = 'idem' \
                 AND pid <> pg_backend_pid()",
            )
            .await;
            format!("pg_terminate_backend on the hosts' sessions ({ended:?})")
        }
        Fault::CancelBackends => {
            let mut cancelled = 0;
            let until = Instant::now() + Duration::from_millis(amount);
            while Instant::now() < until {
                cancelled += sql_count(
                    env,
                    "SELECT count(pg_cancel_backend(pid)) FROM pg_stat_activity \
                     WHERE datname = current_database() AND application_name = 'idem' \
                     AND state = 'active' AND pid <> pg_backend_pid()",
                )
                .await
                .unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            format!("pg_cancel_backend on active queries for {amount} ms ({cancelled} cancels)")
        }
        Fault::RestartPostgres => {
            let status = crate::restart_postgres("fast");
            format!("PostgreSQL restarted (fast): {status}")
        }
        Fault::Migration => match migrations.next() {
            Some(sql) => {
                let outcome = match sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
                    .execute(&env.pool)
                    .await
                {
                    Ok(_) => "done".to_string(),
                    Err(error) => format!("failed: {error}"),
                };
                format!("migration `{sql}`: {outcome}")
            }
            None => "migration: none left".to_string(),
        },
        Fault::RestartBroker => {
            let stopped = Command::new("rabbitmqctl")
                .arg("stop_app")
                .stdout(Stdio::null())
                .status();
            tokio::time::sleep(Duration::from_millis(amount / 2)).await;
            let started = Command::new("rabbitmqctl")
                .arg("start_app")
                .stdout(Stdio::null())
                .status();
            format!(
                "RabbitMQ application restarted ({} ms down): {}",
                amount / 2,
                stopped.is_ok_and(|status| status.success())
                    && started.is_ok_and(|status| status.success())
            )
        }
        Fault::SchemaMove => move_schema(hosts).await,
        Fault::WrongPooler => wrong_pooler(&hosts[target], amount).await,
        Fault::HotSwap => {
            hosts[target].signal("-HUP");
            format!("hot swap (SIGHUP) on host {target}")
        }
        Fault::ConsoleRead => {
            let port = hosts[target].http_port;
            let read = tokio::time::timeout(
                Duration::from_secs(10),
                tokio::spawn(crate::http_send(
                    port,
                    "POST",
                    "/admin/dead-letters/loyalty/list",
                    &[],
                    Some("{}"),
                )),
            )
            .await;
            let status = match read {
                Ok(Ok((status, _))) => status.to_string(),
                _ => "no answer".into(),
            };
            format!("console read of loyalty's dead letters on host {target}: {status}")
        }
        Fault::DeadLetterRead | Fault::DeadLetterReplay => {
            let pipeline = ["loyalty", "natural", "receipts"][(amount % 3) as usize];
            let args: &[&str] = if fault == Fault::DeadLetterRead {
                &["dlq", "list"]
            } else {
                &["dlq", "replay"]
            };
            let config = hosts[target].config.clone();
            let outcome = tokio::task::spawn_blocking(move || {
                Command::new(idem_binary())
                    .args(args)
                    .args(["--pipeline", pipeline, "--config"])
                    .arg(config)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
            })
            .await;
            let ok = matches!(outcome, Ok(Ok(status)) if status.success());
            format!(
                "idem {} --pipeline {pipeline}: exit ok {ok}",
                args.join(" ")
            )
        }
    }
}

/// The rolling change of `[database] schema`, once: `idem migrate` with the moved config while
/// the hosts run on the old one (their unqualified names reach the moved tables through
/// `"$user"`, the role being named like the schema), then each host restarted on the moved
/// config in turn. Not done when the migration fails (PostgreSQL away): a later draw tries
/// again.
async fn move_schema(hosts: &mut [HostSlot]) -> String {
    if hosts.iter().any(|host| host.config == host.moved_config) {
        return "schema move: done already".into();
    }
    let config = hosts[0].moved_config.clone();
    let migrated = tokio::task::spawn_blocking(move || {
        Command::new(idem_binary())
            .args(["migrate", "--config"])
            .arg(config)
            .output()
    })
    .await;
    let Ok(Ok(output)) = migrated else {
        return "schema move: idem migrate did not run".into();
    };
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let said = said.split_whitespace().collect::<Vec<_>>().join(" ");
    if !output.status.success() {
        return format!("schema move: idem migrate failed ({said})");
    }
    let mut clean = true;
    for host in hosts.iter_mut() {
        clean &= host.stop();
        host.config = host.moved_config.clone();
        host.start();
    }
    format!("schema move: {said}; hosts restarted on the moved config (clean stops {clean})")
}

/// A host like `like`'s, through a PgBouncer in transaction pooling but configured for
/// none, run for `3 × amount` ms, then stopped.
async fn wrong_pooler(like: &HostSlot, amount: u64) -> String {
    let text = std::fs::read_to_string(&like.config).expect("a host's config");
    let database = text
        .lines()
        .find_map(|line| line.strip_prefix("url = \"postgres://"))
        .and_then(|rest| rest.split_once('/'))
        .and_then(|(_, rest)| rest.split(['?', '"']).next())
        .expect("the database URL")
        .to_string();
    let pooler =
        crate::pgbouncer::PgBouncer::start(&format!("{database}-pooler"), "transaction", 4);
    let text = text
        .lines()
        .map(|line| {
            if line.starts_with("url = \"postgres://") {
                format!("url = \"{}\"", pooler.url(&database))
            } else if line.starts_with("listen = ") {
                format!("listen = \"127.0.0.1:{}\"", free_port())
            } else {
                line.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let directory = like.log.parent().expect("the soak directory");
    let config = directory.join("pooled.toml");
    std::fs::write(&config, text).expect("write config");
    let mut host = HostSlot {
        config: config.clone(),
        moved_config: config,
        http_port: 0,
        process: None,
        log: directory.join("pooled.log"),
    };
    host.start();
    tokio::time::sleep(Duration::from_millis(3 * amount)).await;
    let clean = host.stop();
    let log = std::fs::read_to_string(&host.log).unwrap_or_default();
    let named = ["pooling = \\\"transaction\\\"", "pooling = \"transaction\""]
        .iter()
        .any(|hint| log.contains(hint));
    format!(
        "a host through a transaction pooler configured for none, for {} ms: the setting named {named}, clean stop {clean}",
        3 * amount
    )
}

/// `sql`'s one number, or `None` while the database is away.
async fn sql_count(env: &TestEnv, sql: &str) -> Option<i64> {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
        .fetch_one(&env.pool)
        .await
        .ok()
}

/// `sql`'s one number, retried while the database is away (2 minutes at most).
async fn count(env: &TestEnv, sql: &str) -> i64 {
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        match sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
            .fetch_one(&env.pool)
            .await
        {
            Ok(count) => return count,
            Err(error) if Instant::now() > until => panic!("{sql}: {error}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// Waits until every order is applied by every pipeline, every receipt delivered, and the
/// sources hold nothing; `Err` says what is missing after the time allowed.
async fn settle(
    env: &TestEnv,
    stream: &TestStream,
    endpoint: &Arc<Mutex<Endpoint>>,
    orders: i64,
) -> Result<(), String> {
    let until = Instant::now() + Duration::from_secs(300);
    loop {
        let loyalty = count(env, "SELECT count(*) FROM point_ledger").await;
        // A JetStream message the host could not finish on its last delivery is settled as
        // a dead letter (`deliveries-exhausted`; the checker holds it to that).
        let exhausted = stream
            .dead_letters()
            .await
            .iter()
            .filter(|(_, headers)| {
                headers.iter().any(|(name, value)| {
                    name == "x-idem-error-kind" && value == "deliveries-exhausted"
                })
            })
            .count() as i64;
        let natural = count(env, "SELECT count(*) FROM natural_ledger").await + exhausted;
        let receipts = count(env, "SELECT count(*) FROM receipts").await;
        let delivered = endpoint.lock().expect("endpoint").accepted.len() as i64;
        let queued = env.ready(&env.queue).await as u64 + unacked(&env.queue);
        let consumer = stream.consumer_counts("idem-natural").await;
        let state = format!(
            "loyalty {loyalty}, natural {natural}, receipts {receipts}, delivered {delivered} of {orders}; loyalty queue holds {queued}; stream consumer {consumer:?}"
        );
        if loyalty >= orders
            && natural >= orders
            && receipts >= orders
            && delivered >= orders
            && queued == 0
            && consumer == Some((0, 0))
        {
            return Ok(());
        }
        if Instant::now() > until {
            return Err(state);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The checker. Appends each violation to `failures` and the counts to `counts`.
async fn check(
    env: &TestEnv,
    idem_tables: &str,
    stream: &TestStream,
    endpoint: &Arc<Mutex<Endpoint>>,
    produced: &Produced,
    failures: &mut Vec<String>,
    counts: &mut String,
) {
    let orders = produced.orders;
    let expected: BTreeSet<i64> = (1..=orders).collect();
    let rows = |sql: String| async move {
        sqlx::query_as::<_, (String, i64)>(sqlx::AssertSqlSafe(sql.clone()))
            .fetch_all(&env.pool)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"))
    };

    // Ledger claims: one claim exactly when the order's ledger row is there once.
    let claims: BTreeMap<String, i64> = rows(format!(
        "SELECT message_key, count(*)::int8 FROM {idem_tables}processed_messages WHERE consumer = 'loyalty' GROUP BY 1",
    ))
    .await
    .into_iter()
    .collect();
    let ledger: BTreeMap<String, i64> = rows(
        "SELECT 'order-completed:' || order_id, count(*)::int8 FROM point_ledger GROUP BY 1".into(),
    )
    .await
    .into_iter()
    .collect();
    per_key(
        "loyalty",
        &expected,
        |id| format!("order-completed:{id}"),
        &claims,
        &ledger,
        failures,
    );
    let natural: BTreeMap<String, i64> = rows(
        "SELECT 'order-completed:' || order_id, count(*)::int8 FROM natural_ledger GROUP BY 1"
            .into(),
    )
    .await
    .into_iter()
    .collect();
    // A good message on its last delivery that the host could not finish (a kill spends
    // deliveries) is dead-lettered as `deliveries-exhausted`, never abandoned: expected
    // there, and not applied.
    let natural_letters = stream.dead_letters().await;
    let exhausted: BTreeSet<i64> = natural_letters
        .iter()
        .filter(|(_, headers)| {
            headers
                .iter()
                .any(|(name, value)| name == "x-idem-error-kind" && value == "deliveries-exhausted")
        })
        .filter_map(|(body, _)| {
            serde_json::from_slice::<serde_json::Value>(body)
                .ok()?
                .get("order_id")?
                .as_i64()
        })
        .collect();
    let applied_and_exhausted = exhausted
        .iter()
        .filter(|id| natural.contains_key(&format!("order-completed:{id}")))
        .count();
    if applied_and_exhausted > 0 {
        failures.push(format!(
            "natural: {applied_and_exhausted} orders both applied and dead-lettered as deliveries-exhausted"
        ));
    }
    let natural_expected: BTreeSet<i64> = expected.difference(&exhausted).copied().collect();
    per_key(
        "natural",
        &natural_expected,
        |id| format!("order-completed:{id}"),
        &natural,
        &natural,
        failures,
    );
    let receipt_claims: BTreeMap<String, i64> = rows(format!(
        "SELECT message_key, count(*)::int8 FROM {idem_tables}processed_messages WHERE consumer = 'receipts' GROUP BY 1",
    ))
    .await
    .into_iter()
    .collect();
    let receipts: BTreeMap<String, i64> =
        rows("SELECT 'receipt:' || order_id, count(*)::int8 FROM receipts GROUP BY 1".into())
            .await
            .into_iter()
            .collect();
    per_key(
        "receipts",
        &expected,
        |id| format!("receipt:{id}"),
        &receipt_claims,
        &receipts,
        failures,
    );
    for (table, sums) in [
        ("balances", "point_ledger"),
        ("natural_balances", "natural_ledger"),
    ] {
        let mismatched = count(
            env,
            &format!(
                "SELECT count(*) FROM {table} b FULL JOIN \
                 (SELECT customer_id, sum(points) AS points FROM {sums} GROUP BY customer_id) l \
                 USING (customer_id) WHERE b.points IS DISTINCT FROM l.points"
            ),
        )
        .await;
        if mismatched > 0 {
            failures.push(format!(
                "{table}: {mismatched} customers' balances differ from {sums}"
            ));
        }
    }

    // The outbox: every receipt delivered, none parked or pending.
    let undelivered = count(
        env,
        &format!("SELECT count(*) FROM {idem_tables}idem_outbox WHERE delivered_at IS NULL"),
    )
    .await;
    let accepted = endpoint.lock().expect("endpoint").accepted.clone();
    let missing: Vec<i64> = expected
        .iter()
        .copied()
        .filter(|id| !accepted.contains_key(&format!("receipt:{id}")))
        .collect();
    let foreign = accepted
        .keys()
        .filter(|key| {
            key.strip_prefix("receipt:")
                .and_then(|id| id.parse::<i64>().ok())
                .is_none_or(|id| !expected.contains(&id))
        })
        .count();
    let redelivered: u32 = accepted.values().map(|times| times - 1).sum();
    if undelivered > 0 || !missing.is_empty() || foreign > 0 {
        failures.push(format!(
            "outbox: {undelivered} rows undelivered, {} receipts never delivered (first {:?}), {foreign} unknown keys",
            missing.len(),
            missing.iter().take(5).collect::<Vec<_>>()
        ));
    }

    // Dead letters: only the malformed messages, each of them, on every source.
    let mut dead = BTreeMap::new();
    for (pipeline, queue) in [
        ("loyalty", env.dead_letter_queue.clone()),
        ("receipts", format!("{}-receipts.dead-letter", env.queue)),
    ] {
        let bodies: Vec<Vec<u8>> = env
            .drain(&queue)
            .await
            .into_iter()
            .map(|(body, _)| body.into_bytes())
            .collect();
        dead.insert(pipeline, bodies);
    }
    let natural_dead = natural_letters
        .into_iter()
        .filter(|(_, headers)| {
            let named = |wanted: &str, expected: &str| {
                headers
                    .iter()
                    .any(|(name, value)| name == wanted && value == expected)
            };
            named("x-idem-pipeline", "natural")
                && !named("x-idem-error-kind", "deliveries-exhausted")
        })
        .map(|(body, _)| body)
        .collect();
    dead.insert("natural", natural_dead);
    for (pipeline, bodies) in &dead {
        let good = bodies
            .iter()
            .filter(|body| !produced.bad.contains(*body))
            .count();
        let distinct: BTreeSet<&Vec<u8>> = bodies.iter().collect();
        let absent = produced
            .bad
            .iter()
            .filter(|bad| !distinct.contains(bad))
            .count();
        if good > 0 || absent > 0 {
            failures.push(format!(
                "{pipeline}: {good} good messages among the dead letters, {absent} malformed ones missing from them"
            ));
        }
    }

    // Nothing left in the sources.
    for queue in [env.queue.clone(), format!("{}-receipts", env.queue)] {
        let left = env.ready(&queue).await as u64 + unacked(&queue);
        if left > 0 {
            failures.push(format!("{queue}: {left} messages left (ready or unacked)"));
        }
    }
    let consumer = stream.consumer_counts("idem-natural").await;
    if consumer != Some((0, 0)) {
        failures.push(format!(
            "stream consumer idem-natural: pending and unacknowledged {consumer:?}"
        ));
    }

    let _ = writeln!(
        counts,
        "published {} deliveries ({orders} orders per source, {} malformed per source); \
         claims loyalty {} / receipts {}; rows point_ledger {} natural_ledger {} receipts {}; \
         dead letters loyalty {} natural {} (+{} deliveries-exhausted) receipts {}; receipts delivered {} (+{redelivered} repeats with the same key)",
        produced.deliveries,
        produced.bad.len(),
        claims.len(),
        receipt_claims.len(),
        ledger.values().sum::<i64>(),
        natural.values().sum::<i64>(),
        receipts.values().sum::<i64>(),
        dead["loyalty"].len(),
        dead["natural"].len(),
        exhausted.len(),
        dead["receipts"].len(),
        accepted.len(),
    );
}

/// For each expected key: one claim exactly when its effect row is there once; and no claim
/// or row for a key never published.
fn per_key(
    pipeline: &str,
    expected: &BTreeSet<i64>,
    key_of: impl Fn(i64) -> String,
    claims: &BTreeMap<String, i64>,
    effects: &BTreeMap<String, i64>,
    failures: &mut Vec<String>,
) {
    let mut lost = Vec::new();
    let mut doubled = Vec::new();
    let mut orphan_claims = Vec::new();
    let mut unclaimed = Vec::new();
    for id in expected {
        let key = key_of(*id);
        let claim = claims.get(&key).copied().unwrap_or(0);
        let rows = effects.get(&key).copied().unwrap_or(0);
        match (claim, rows) {
            (1, 1) => {}
            (0, 0) => lost.push(*id),
            (_, 0) => orphan_claims.push(*id),
            (0, _) => unclaimed.push(*id),
            _ => doubled.push(*id),
        }
    }
    let expected_keys: BTreeSet<String> = expected.iter().map(|id| key_of(*id)).collect();
    let unexpected = claims
        .keys()
        .chain(effects.keys())
        .filter(|key| !expected_keys.contains(*key))
        .count();
    let first = |ids: &[i64]| ids.iter().take(5).copied().collect::<Vec<_>>();
    if !lost.is_empty()
        || !doubled.is_empty()
        || !orphan_claims.is_empty()
        || !unclaimed.is_empty()
        || unexpected > 0
    {
        failures.push(format!(
            "{pipeline}: {} lost (first {:?}), {} doubled (first {:?}), {} claims without their effects (first {:?}), {} effects without their claim (first {:?}), {unexpected} unexpected keys",
            lost.len(),
            first(&lost),
            doubled.len(),
            first(&doubled),
            orphan_claims.len(),
            first(&orphan_claims),
            unclaimed.len(),
            first(&unclaimed),
        ));
    }
}
