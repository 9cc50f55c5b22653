//! A test's own environment: its database (created from a template of the schema), queues
//! and plugin paths, the config text for its pipelines, and a host run in this process.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use idem_host::config::Config;
use idem_host::telemetry::metrics::Metrics;
use lapin::options::{BasicGetOptions, QueueDeleteOptions};
use lapin::types::ShortString;
use lapin::{Channel, Connection};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection as _, PgConnection, PgPool};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::amqp::{amqp_text, amqp_url, connect_channel, declare_durable, publish, queue_ready};
use crate::{PLUGIN_DIST, REPO_ROOT};

/// The example pipelines' business tables, applied to every test database.
pub(super) const EXAMPLE_SCHEMAS: [&str; 3] = [
    "examples/loyalty/schema.sql",
    "examples/customer-profile/schema.sql",
    "examples/receipts/schema.sql",
];

/// A plugin built from `plugins/<name>`.
pub fn plugin_path(name: &str) -> PathBuf {
    let path = Path::new(PLUGIN_DIST).join(format!("{name}.wasm"));
    assert!(
        path.is_file(),
        "{} is missing: build the plugins with scripts/build-plugins.sh (scripts/test.sh does, \
         then runs the tests); a Python, JavaScript or C plugin also needs its toolchain: \
         pip install componentize-py==0.25.1; apt install nodejs npm; \
         apt install clang lld wasi-libc libclang-rt-14-dev-wasm32",
        path.display()
    );
    path
}

/// A database where the test may create and drop databases.
pub fn admin_url() -> String {
    std::env::var("IDEM_TEST_PG_ADMIN_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Creates `database` on the server of `admin_url`, with idem's tables and the examples'
/// schemas; returns its URL and a pool on it.
pub async fn create_database(admin_url: &str, database: &str) -> (String, PgPool) {
    let mut admin = PgConnection::connect(admin_url)
        .await
        .expect("PostgreSQL reachable (scripts/services.sh starts it)");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE \"{database}\""
    )))
    .execute(&mut admin)
    .await
    .expect("create test database");
    let database_url = replace_database(admin_url, database);
    let pool = PgPoolOptions::new()
        .max_connections(20)
        .connect(&database_url)
        .await
        .expect("connect test database");
    idem_host::store::database::migrate_tables(&pool, &Default::default(), Default::default())
        .await
        .expect("host migrations apply");
    for example in EXAMPLE_SCHEMAS {
        let path = Path::new(REPO_ROOT).join(example);
        let schema = std::fs::read_to_string(&path)
            .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
        sqlx::raw_sql(sqlx::AssertSqlSafe(schema.to_string()))
            .execute(&pool)
            .await
            .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    }
    (database_url, pool)
}

/// The one `bigint` `sql` answers on `pool` (a count, say); panics naming the statement.
pub async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
        .fetch_one(pool)
        .await
        .unwrap_or_else(|error| panic!("{sql}: {error}"))
}

/// One test's private world: a database, queue names, and a broker channel for the test itself.
pub struct TestEnv {
    pub name: String,
    pub database: String,
    pub database_url: String,
    pub pool: PgPool,
    pub queue: String,
    pub dead_letter_queue: String,
    pub channel: Channel,
    extra_queue_names: std::sync::Mutex<Vec<String>>,
    /// A fresh connection once `channel` died (the broker restarted under a fault test).
    reconnected: tokio::sync::Mutex<Option<(Connection, Channel)>>,
    _connection: Connection,
}

impl TestEnv {
    /// Creates the database and queue names for a test called `name`.
    pub async fn new(name: &str) -> TestEnv {
        init_logging();
        let suffix: u32 = rand::random();
        let unique = format!("{name}_{}_{suffix:08x}", std::process::id());
        let database = format!("idem_t_{unique}");
        let (database_url, pool) = create_database(&admin_url(), &database).await;
        let (connection, channel) = connect_channel().await;
        let queue = format!("idem-t-{unique}");
        let dead_letter_queue = format!("{queue}.dead-letter");
        for queue_name in [&queue, &dead_letter_queue] {
            declare_durable(&channel, queue_name).await;
        }
        TestEnv {
            name: name.to_string(),
            database,
            database_url,
            pool,
            queue,
            dead_letter_queue,
            channel,
            extra_queue_names: std::sync::Mutex::new(Vec::new()),
            reconnected: tokio::sync::Mutex::new(None),
            _connection: connection,
        }
    }

    /// The `pipelines.toml` text for the loyalty pipeline with `plugin`, pointed at this env.
    /// `extra` is inserted into the pipeline's table (keys, then sub-tables).
    pub fn config_text(&self, plugin: &str, extra: &str) -> String {
        self.config_text_at(&self.database_url, plugin, extra)
    }

    /// As [`TestEnv::config_text`], with `[database] url` set to `url` (the env's database
    /// by another way: a TLS endpoint, a proxy, a pooler, a list of hosts).
    pub fn config_text_at(&self, url: &str, plugin: &str, extra: &str) -> String {
        format!(
            "{}{}",
            self.config_header_at(url),
            pipeline_table(
                "loyalty",
                &self.queue,
                &self.dead_letter_queue,
                &plugin_path(plugin),
                extra
            )
        )
    }

    /// The `[database]` and `[amqp]` tables for this env.
    pub fn config_header(&self) -> String {
        self.config_header_at(&self.database_url)
    }

    fn config_header_at(&self, url: &str) -> String {
        format!(
            "[database]\nurl = \"{url}\"\nmax_connections = 20\n\n[amqp]\nurl = \"{}\"\n",
            amqp_url()
        )
    }

    /// Declares another queue pair for this test (`<queue>-<suffix>` and its dead-letter queue);
    /// [`TestEnv::cleanup`] deletes them.
    pub async fn extra_queues(&self, suffix: &str) -> (String, String) {
        let queue = format!("{}-{suffix}", self.queue);
        let dead_letter_queue = format!("{queue}.dead-letter");
        for queue_name in [&queue, &dead_letter_queue] {
            declare_durable(&self.channel, queue_name).await;
            self.extra_queue_names
                .lock()
                .expect("queue list")
                .push(queue_name.clone());
        }
        (queue, dead_letter_queue)
    }

    /// A parsed config for the loyalty pipeline with `plugin`.
    pub fn config(&self, plugin: &str, extra: &str) -> Config {
        Config::from_toml(
            Path::new("/tmp/idem-test.toml"),
            &self.config_text(plugin, extra),
        )
        .expect("test config is valid")
    }

    /// The loyalty pipeline with `plugin`, started without a broker, for calling
    /// `process::handle_delivery` directly.
    pub async fn pipeline(&self, plugin: &str, extra: &str) -> idem_host::pipeline::Pipeline {
        self.start_pipeline(&self.config(plugin, extra))
            .await
            .expect("pipeline starts")
    }

    /// The first pipeline of a whole `[pipelines.<name>]` text (this env's `[database]` and
    /// `[amqp]` before it), started without a broker; the refusal as text.
    pub async fn pipeline_from(
        &self,
        pipeline_text: &str,
    ) -> Result<idem_host::pipeline::Pipeline, String> {
        let config = Config::from_toml(
            Path::new("/tmp/idem-pipeline-test.toml"),
            &format!("{}{pipeline_text}", self.config_header()),
        )
        .map_err(|error| error.to_string())?;
        self.start_pipeline(&config).await
    }

    /// `config`'s first pipeline, started without a broker.
    async fn start_pipeline(
        &self,
        config: &Config,
    ) -> Result<idem_host::pipeline::Pipeline, String> {
        idem_host::pipeline::Pipeline::start(
            config.pipelines[0].clone(),
            idem_host::sandbox::PluginRuntime::new().expect("plugin runtime"),
            &self.open_database().await,
            std::sync::Arc::new(idem_host::telemetry::metrics::Metrics::new()),
            idem_host::relay::RelayWaker::default(),
        )
        .await
        .map_err(|error| error.to_string())
    }

    /// The host's sessions and bookkeeping pool for this env's `[database]`, opened as `idem
    /// run` opens them, for starting a pipeline directly.
    pub async fn open_database(&self) -> idem_host::store::database::Database {
        idem_host::store::database::open(&self.config("loyalty", "").database)
            .await
            .expect("the host connects to the test database")
    }

    /// Writes the config to a file, for tests that run the `idem` binary.
    pub fn write_config(&self, plugin: &str, extra: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("{}.toml", self.database));
        std::fs::write(&path, self.config_text(plugin, extra)).expect("write config");
        path
    }

    /// Starts the host in this process; stop it with [`Host::stop`].
    pub fn start_host(&self, config: Config) -> Host {
        self.start_host_with_metrics(config, Arc::new(Metrics::new()))
    }

    /// Starts the host in this process, recording into `metrics`.
    pub fn start_host_with_metrics(&self, config: Config, metrics: Arc<Metrics>) -> Host {
        let token = CancellationToken::new();
        let shutdown = token.clone();
        let task = tokio::spawn(async move {
            idem_host::run_with_metrics(config, metrics, async move { shutdown.cancelled().await })
                .await
                .map_err(|error| error.to_string())
        });
        Host { token, task }
    }

    /// The test's broker channel, reconnected if the broker closed the first one.
    pub async fn live_channel(&self) -> Channel {
        if self.channel.status().connected() {
            return self.channel.clone();
        }
        let mut reconnected = self.reconnected.lock().await;
        if let Some((_, channel)) = reconnected.as_ref()
            && channel.status().connected()
        {
            return channel.clone();
        }
        let (connection, channel) = connect_channel().await;
        *reconnected = Some((connection, channel.clone()));
        channel
    }

    /// Publishes `body` persistently to the test queue and waits for the broker's confirm.
    pub async fn publish(&self, body: &[u8]) {
        publish(&self.live_channel().await, &self.queue, body).await;
    }

    /// Messages ready in `queue` (not counting unacked ones).
    pub async fn ready(&self, queue: &str) -> u32 {
        queue_ready(&self.live_channel().await, queue).await
    }

    /// Takes every message out of `queue`, returning body and headers as text.
    pub async fn drain(&self, queue: &str) -> Vec<(String, Vec<(String, String)>)> {
        let mut drained = Vec::new();
        let channel = self.live_channel().await;
        while let Some(message) = channel
            .basic_get(ShortString::from(queue), BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get")
        {
            let headers = message
                .delivery
                .properties
                .headers()
                .as_ref()
                .map(|table| {
                    table
                        .inner()
                        .iter()
                        .map(|(name, value)| (name.as_str().to_string(), amqp_text(value)))
                        .collect()
                })
                .unwrap_or_default();
            drained.push((
                String::from_utf8_lossy(&message.delivery.data).into_owned(),
                headers,
            ));
        }
        drained
    }

    /// Makes inserts of `point_ledger` rows for which `condition` holds (a PL/pgSQL
    /// expression over `NEW`; `"true"` for every row) take `seconds`: a slow effect.
    pub async fn slow_ledger(&self, condition: &str, seconds: f64) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE FUNCTION slow_credit() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN IF {condition} THEN PERFORM pg_sleep({seconds}); END IF; RETURN NEW; END $$; \
             CREATE TRIGGER slow_credit BEFORE INSERT ON point_ledger \
               FOR EACH ROW EXECUTE FUNCTION slow_credit();"
        )))
        .execute(&self.pool)
        .await
        .expect("slow trigger");
    }

    pub async fn count(&self, sql: &str) -> i64 {
        count(&self.pool, sql).await
    }

    /// Asserts the loyalty invariants: one ledger row per claimed order, balances equal the ledger.
    pub async fn assert_loyalty_consistent(&self) {
        let ledger_rows = self.count("SELECT count(*) FROM point_ledger").await;
        let distinct_orders = self
            .count("SELECT count(DISTINCT order_id) FROM point_ledger")
            .await;
        let claims = self
            .count("SELECT count(*) FROM processed_messages WHERE consumer = 'loyalty'")
            .await;
        assert_eq!(ledger_rows, distinct_orders, "an order was credited twice");
        assert_eq!(claims, ledger_rows, "claims and ledger rows differ");
        let mismatched = self
            .count(
                "SELECT count(*) FROM balances b FULL JOIN \
                 (SELECT customer_id, sum(points) AS points FROM point_ledger GROUP BY customer_id) l \
                 USING (customer_id) WHERE b.points IS DISTINCT FROM l.points",
            )
            .await;
        assert_eq!(mismatched, 0, "balances differ from the ledger sums");
    }

    /// Deletes `queue` (cancelling its consumers, as a broker does) and declares it again.
    pub async fn channel_queue_delete(&self, queue: &str) {
        let channel = self.live_channel().await;
        channel
            .queue_delete(ShortString::from(queue), QueueDeleteOptions::default())
            .await
            .expect("delete queue");
        declare_durable(&channel, queue).await;
    }

    /// Drops the database and deletes the queues. Call at the end of a passing test.
    pub async fn cleanup(self) {
        let mut queues = vec![self.queue.clone(), self.dead_letter_queue.clone()];
        queues.extend(self.extra_queue_names.lock().expect("queue list").drain(..));
        let channel = self.live_channel().await;
        for queue in &queues {
            let _ = channel
                .queue_delete(
                    ShortString::from(queue.as_str()),
                    QueueDeleteOptions::default(),
                )
                .await;
        }
        self.pool.close().await;
        if let Ok(mut admin) = PgConnection::connect(&admin_url()).await {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                self.database
            )))
            .execute(&mut admin)
            .await;
        }
    }
}

/// A host running in this process.
pub struct Host {
    token: CancellationToken,
    task: JoinHandle<Result<(), String>>,
}

impl Host {
    /// Asks the host to drain and stop, and returns how `run` ended.
    pub async fn stop(self) -> Result<(), String> {
        self.token.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .map_err(|_| "host did not stop within 30 s".to_string())?
            .map_err(|error| format!("host task panicked: {error}"))?
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits (at most a minute) for the host to stop by itself, as a refusal no retry can fix
    /// stops it, and returns the line it stopped with.
    pub async fn refusal(self) -> String {
        crate::wait_for(
            "the host to stop by itself",
            Duration::from_secs(60),
            || async { self.task.is_finished() },
        )
        .await;
        self.stop()
            .await
            .expect_err("the host stopped with an error")
    }
}

/// The `[pipelines.<name>]` table of a loyalty-shaped pipeline (the demo's two statements).
pub fn pipeline_table(
    name: &str,
    queue: &str,
    dead_letter_queue: &str,
    plugin: &Path,
    extra: &str,
) -> String {
    format!(
        r#"
[pipelines.{name}]
queue = "{queue}"
consumer = "{name}"
plugin = "{plugin}"
dead_letter_queue = "{dead_letter_queue}"
prefetch = 64
workers = 8
{extra}

[pipelines.{name}.statements]
{LOYALTY_STATEMENTS}"#,
        plugin = plugin.display(),
    )
}

/// The demo's two statements, as a `[pipelines.<name>.statements]` table's body.
pub const LOYALTY_STATEMENTS: &str = r#"credit_balance = """
INSERT INTO balances (customer_id, points) VALUES ($1, $2)
ON CONFLICT (customer_id) DO UPDATE SET points = balances.points + EXCLUDED.points
"""
record_ledger = "INSERT INTO point_ledger (customer_id, order_id, points) VALUES ($1, $2, $3)"
"#;

pub(super) fn replace_database(url: &str, database: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(base, query)| (base, Some(query)));
    let prefix = base.rsplit_once('/').map_or(base, |(prefix, _)| prefix);
    match query {
        Some(query) => format!("{prefix}/{database}?{query}"),
        None => format!("{prefix}/{database}"),
    }
}

/// Logs to the test output (`RUST_LOG`, default warnings).
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}
