//! What round trips cost one message's transaction: the loyalty transaction (claim, credit,
//! ledger row) for the same orders, three ways, in one run:
//!
//! - `idem`: the host's own code, `ledger::apply` on its sessions: BEGIN with the timeouts,
//!   the claim, both effects and COMMIT in one flight (a new order, delivered once);
//! - `idem, TLS`: the same over TLS (`sslmode=require`), what a server with `ssl = on` gives
//!   by default (`prefer`): the cost of encryption on loopback;
//! - `tokio-postgres, one by one`: the same five statements on a bare connection, each
//!   waiting for the last: five round trips, the cost of the host without pipelining;
//! - `tokio-postgres, pipelined`: the same flight on a bare connection, hand-written: the
//!   floor for one round trip, so the difference to `idem` is the host's own cost.
//!
//! All but `idem, TLS` talk plain TCP (`sslmode=disable`), so they compare like with like.
//!
//! Run: `cargo run --release -p idem-bench --bin round-trips` (PostgreSQL on 127.0.0.1;
//! IDEM_BENCH_ADMIN_URL and IDEM_BENCH_DATABASE_URL override where; `RTT=0.5ms` puts the
//! measured connections behind a proxy adding 0.5 ms to every round trip, `idem_bench::delay`).

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use idem_bench::{Percentiles, loyalty_decision, order_customer, order_total_cents};
use idem_host::config::PipelineConfig;
use idem_host::store::ledger::{ClaimOutcome, Plan};
use idem_host::store::statement::StatementCatalog;
use tokio_postgres::types::Type;

const ORDERS_PER_RUN: i64 = 6_000;
const CLAIM_SQL: &str = "INSERT INTO processed_messages (consumer, message_key, plugin_digest) \
     VALUES ($1, $2, $3) ON CONFLICT DO NOTHING";
const DIGEST: &str = "sha256:round-trips";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    Idem,
    IdemTls,
    OneByOne,
    Pipelined,
}

impl Way {
    fn label(self) -> &'static str {
        match self {
            Way::Idem => "idem, pipelined, 1",
            Way::IdemTls => "idem, TLS, pipelined, 1",
            Way::OneByOne => "tokio-postgres, one by one, 5",
            Way::Pipelined => "tokio-postgres, pipelined, 1",
        }
    }
}

struct Shared {
    pipeline: PipelineConfig,
    catalog: Arc<StatementCatalog>,
    sessions: idem_host::store::session::SessionPool,
    database_url: String,
    next_order: AtomicI64,
    last_order: i64,
}

#[tokio::main]
async fn main() {
    let admin_url = std::env::var("IDEM_BENCH_ADMIN_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let database_url = std::env::var("IDEM_BENCH_DATABASE_URL").unwrap_or_else(|_| {
        "postgres://postgres@127.0.0.1:5432/idem_bench_round_trips?sslmode=disable".into()
    });
    // RTT=0.5ms: every connection below goes through a proxy adding that to each round trip.
    let rtt = std::env::var("RTT").map_or(Ok(Duration::ZERO), |text| {
        idem_bench::delay::parse_rtt(&text)
    });
    let rtt = rtt.unwrap_or_else(|error| panic!("{error}"));
    let (database_url, probe) = idem_bench::delay::behind_proxy(&database_url, rtt)
        .await
        .unwrap_or_else(|error| panic!("{error}"));
    if let Some(probe) = probe {
        println!(
            "database round trips through a delaying proxy adding {} each; SELECT 1 p50: direct {}, through the proxy {} (the proxy's own cost: {})",
            idem_bench::micros(rtt),
            idem_bench::micros(probe.direct.p50),
            idem_bench::micros(probe.proxied.p50),
            idem_bench::micros(probe.overhead(rtt))
        );
    }
    let config = idem_bench::demo_config(&database_url);
    let tls_config = idem_bench::demo_config(&with_sslmode(&database_url, "require"));
    let pipeline = config.pipelines[0].clone();
    let (pool, catalog) = idem_bench::loyalty_database(&admin_url, &config, &pipeline).await;
    let catalog = Arc::new(catalog);
    println!(
        "one message's transaction (claim, credit, ledger row), {ORDERS_PER_RUN} new orders per row, same database"
    );
    println!(
        "{:<32} {:>11} {:>10} {:>10} {:>10}",
        "", "connections", "msgs/s", "p50", "p99"
    );
    let mut next_first = 1;
    for connections in [1usize, 4] {
        let mut rates = Vec::new();
        for way in [Way::Idem, Way::IdemTls, Way::OneByOne, Way::Pipelined] {
            let config = if way == Way::IdemTls {
                &tls_config
            } else {
                &config
            };
            let shared = Arc::new(Shared {
                pipeline: pipeline.clone(),
                catalog: Arc::clone(&catalog),
                sessions: sessions(config, connections).await,
                database_url: database_url.clone(),
                next_order: AtomicI64::new(next_first),
                last_order: next_first + ORDERS_PER_RUN - 1,
            });
            next_first += ORDERS_PER_RUN;
            let started = Instant::now();
            let tasks: Vec<_> = (0..connections)
                .map(|_| tokio::spawn(run(way, Arc::clone(&shared))))
                .collect();
            let mut samples = Vec::new();
            for task in tasks {
                samples.extend(task.await.expect("worker"));
            }
            let elapsed = started.elapsed();
            let applied: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM point_ledger WHERE order_id BETWEEN $1 AND $2",
            )
            .bind(shared.last_order - ORDERS_PER_RUN + 1)
            .bind(shared.last_order)
            .fetch_one(&pool)
            .await
            .expect("count");
            assert_eq!(
                applied,
                ORDERS_PER_RUN,
                "{}: {applied} ledger rows for {ORDERS_PER_RUN} orders",
                way.label()
            );
            let rate = ORDERS_PER_RUN as f64 / elapsed.as_secs_f64();
            let latency = Percentiles::of(&mut samples);
            println!(
                "{:<32} {:>11} {:>10.0} {:>10} {:>10}",
                way.label(),
                connections,
                rate,
                idem_bench::micros(latency.p50),
                idem_bench::micros(latency.p99)
            );
            rates.push((way, rate));
            shared.sessions.close_idle();
        }
        let rate_of = |wanted: Way| {
            rates
                .iter()
                .find(|(way, _)| *way == wanted)
                .map_or(f64::NAN, |(_, rate)| *rate)
        };
        println!(
            "  {connections} connection(s): idem / one by one {:.2}, idem / bare pipelined {:.2}, bare pipelined / one by one {:.2}, idem TLS / idem {:.2}",
            rate_of(Way::Idem) / rate_of(Way::OneByOne),
            rate_of(Way::Idem) / rate_of(Way::Pipelined),
            rate_of(Way::Pipelined) / rate_of(Way::OneByOne),
            rate_of(Way::IdemTls) / rate_of(Way::Idem),
        );
    }
}

/// `url` with its `sslmode` set to `mode`.
fn with_sslmode(url: &str, mode: &str) -> String {
    let mut url = url::Url::parse(url).expect("a database URL");
    let kept: Vec<(String, String)> = url
        .query_pairs()
        .filter(|(key, _)| key != "sslmode")
        .map(|(key, value)| (key.into_owned(), value.into_owned()))
        .collect();
    url.query_pairs_mut()
        .clear()
        .extend_pairs(kept)
        .append_pair("sslmode", mode);
    url.to_string()
}

/// The host's sessions, at most `connections` of them.
async fn sessions(
    config: &idem_host::config::Config,
    connections: usize,
) -> idem_host::store::session::SessionPool {
    let mut database = config.database.clone();
    database.max_connections = u32::try_from(connections)
        .ok()
        .and_then(std::num::NonZeroU32::new)
        .unwrap_or(std::num::NonZeroU32::MIN);
    idem_host::store::database::open(&database)
        .await
        .expect("the host's sessions open")
        .sessions
}

/// One connection's share of the run: takes orders until there are none left.
async fn run(way: Way, shared: Arc<Shared>) -> Vec<Duration> {
    let mut samples = Vec::new();
    let client = match way {
        Way::Idem | Way::IdemTls => None,
        Way::OneByOne | Way::Pipelined => Some(Client::connect(&shared).await),
    };
    loop {
        let order_id = shared.next_order.fetch_add(1, Ordering::Relaxed);
        if order_id > shared.last_order {
            return samples;
        }
        let started = Instant::now();
        match &client {
            None => {
                let decision = loyalty_decision(
                    order_id,
                    order_customer(order_id),
                    order_total_cents(order_id),
                );
                let plan = Plan::build(&shared.pipeline, &shared.catalog, &decision, DIGEST, false)
                    .expect("plan");
                let outcome = idem_host::store::ledger::apply(
                    &shared.sessions,
                    &shared.pipeline.transaction,
                    &plan,
                )
                .await
                .expect("transaction");
                assert_eq!(outcome, ClaimOutcome::Applied);
            }
            Some(client) => client.apply(way, &shared, order_id).await,
        }
        samples.push(started.elapsed());
    }
}

/// A tokio-postgres connection with the loyalty statements prepared.
struct Client {
    client: tokio_postgres::Client,
    claim: tokio_postgres::Statement,
    credit: tokio_postgres::Statement,
    ledger: tokio_postgres::Statement,
    begin: String,
}

impl Client {
    async fn connect(shared: &Shared) -> Client {
        let (client, connection) =
            tokio_postgres::connect(&shared.database_url, tokio_postgres::NoTls)
                .await
                .expect("tokio-postgres connects");
        tokio::spawn(connection);
        let statement = |name: &str| shared.pipeline.statements[name].clone();
        let claim = client
            .prepare_typed(CLAIM_SQL, &[Type::TEXT, Type::TEXT, Type::TEXT])
            .await
            .expect("claim");
        let credit = client
            .prepare_typed(&statement("credit_balance"), &[Type::INT8, Type::INT8])
            .await
            .expect("credit_balance");
        let ledger = client
            .prepare_typed(
                &statement("record_ledger"),
                &[Type::INT8, Type::INT8, Type::INT8],
            )
            .await
            .expect("record_ledger");
        Client {
            client,
            claim,
            credit,
            ledger,
            begin: idem_host::store::ledger::opening_sql(&shared.pipeline.transaction),
        }
    }

    async fn apply(&self, way: Way, shared: &Shared, order_id: i64) {
        let customer = order_customer(order_id);
        let points = order_total_cents(order_id) / 100;
        let key = format!("order-completed:{order_id}");
        let consumer = shared.pipeline.consumer.as_str();
        let client = &self.client;
        let claim_params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&consumer, &key, &DIGEST];
        let credit_params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&customer, &points];
        let ledger_params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&customer, &order_id, &points];
        if way == Way::OneByOne {
            client.batch_execute(&self.begin).await.expect("begin");
            let claimed = client
                .execute(&self.claim, &claim_params)
                .await
                .expect("claim");
            assert_eq!(claimed, 1, "a new order's claim");
            client
                .execute(&self.credit, &credit_params)
                .await
                .expect("credit");
            client
                .execute(&self.ledger, &ledger_params)
                .await
                .expect("ledger");
            client.batch_execute("COMMIT").await.expect("commit");
            return;
        }
        // Requests go out when each future is first polled, in order; `join!` polls them in
        // order, so the flight is written before any of its answers is read.
        let (begun, claimed, credited, recorded, committed) = futures::join!(
            client.batch_execute(&self.begin),
            client.execute(&self.claim, &claim_params),
            client.execute(&self.credit, &credit_params),
            client.execute(&self.ledger, &ledger_params),
            client.batch_execute("COMMIT")
        );
        begun.expect("begin");
        assert_eq!(claimed.expect("claim"), 1, "a new order's claim");
        credited.expect("credit");
        recorded.expect("ledger");
        committed.expect("commit");
    }
}
