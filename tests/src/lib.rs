//! Test harness: real PostgreSQL and RabbitMQ, isolated per test.
//!
//! Each [`TestEnv`] owns a fresh database (host migrations and the demo schema applied) and
//! uniquely named queues, so tests run in parallel and repeatedly. Endpoints come from
//! `IDEM_TEST_PG_ADMIN_URL` and `AMQP_URL`, defaulting to the local services.

pub mod auto_failover;
pub mod browser;
pub mod jetstream;
pub mod otlp;
pub mod pg_cluster;
pub mod pgbouncer;
pub mod proxy;
pub mod rabbit_cluster;
pub mod soak;
pub mod tls;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection as _, PgConnection, PgPool};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use idem_host::config::Config;
use idem_host::telemetry::metrics::Metrics;
use std::sync::Arc;

/// Where the test plugins were built (`plugins/dist`).
pub const PLUGIN_DIST: &str = env!("IDEM_PLUGIN_DIST");
/// The repository root.
pub const REPO_ROOT: &str = env!("IDEM_REPO_ROOT");

/// The example pipelines' business tables, applied to every test database.
const EXAMPLE_SCHEMAS: [&str; 3] = [
    "examples/loyalty/schema.sql",
    "examples/customer-profile/schema.sql",
    "examples/receipts/schema.sql",
];

/// A plugin built from `plugins/<name>`.
pub fn plugin_path(name: &str) -> PathBuf {
    Path::new(PLUGIN_DIST).join(format!("{name}.wasm"))
}

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
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
}

/// The `idem` binary of this build, for tests that kill or crash the process.
pub fn idem_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // A test runs from target/<profile>/deps/, a binary of this crate from target/<profile>/.
    let binary = exe
        .ancestors()
        .skip(1)
        .take(2)
        .map(|directory| directory.join("idem"))
        .find(|binary| binary.is_file())
        .unwrap_or_else(|| exe.with_file_name("idem"));
    assert!(
        binary.is_file(),
        "{} missing: build it with `cargo build -p idem-host` (cargo test --workspace does)",
        binary.display()
    );
    binary
}

/// An `idem` child process, killed when dropped so a failing test leaves no host behind.
pub struct IdemProcess(Child);

impl IdemProcess {
    /// Starts `command` (an `idem` binary, this build's or an installed one).
    pub fn spawn(command: &mut Command) -> IdemProcess {
        IdemProcess(command.spawn().expect("spawn idem"))
    }

    /// Sends SIGTERM and waits (60 s at most) for the process to exit; returns how it did.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let sent = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(sent.success(), "kill -TERM {}", self.0.id());
        let started = Instant::now();
        loop {
            if let Some(status) = self.0.try_wait().expect("wait idem") {
                return status;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "idem ignored SIGTERM for 60 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl std::ops::Deref for IdemProcess {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for IdemProcess {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for IdemProcess {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// What a finished process printed: its stdout, then its stderr.
pub fn said(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Runs `command`, which must succeed; returns what it printed.
pub fn must_run(command: &mut Command) -> String {
    let output = command
        .output()
        .unwrap_or_else(|error| panic!("run {command:?}: {error}"));
    let text = said(&output);
    assert!(output.status.success(), "{command:?}: {text}");
    text
}

/// Runs `idem <command> --config <path>`, which must succeed; returns its output.
pub fn must_succeed(command: &str, path: &Path) -> String {
    must_run(
        Command::new(idem_binary())
            .args([command, "--config"])
            .arg(path),
    )
}

/// Runs `idem <command> --config <file>`, which must exit non-zero within 10 s; returns its
/// output.
pub fn must_refuse(command: &str, config: &Path) -> String {
    must_refuse_with(command, config, &[])
}

/// [`must_refuse`] with extra environment variables.
pub fn must_refuse_with(command: &str, config: &Path, env: &[(&str, &str)]) -> String {
    let started = Instant::now();
    let mut child = Command::new(idem_binary())
        .args([command, "--config"])
        .arg(config)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idem");
    loop {
        if child.try_wait().expect("wait idem").is_some() {
            break;
        }
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let output = child.wait_with_output().expect("output");
            panic!(
                "idem {command} still running after 10 s (a retry loop?): {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output().expect("output");
    assert!(!output.status.success(), "idem {command} exited 0");
    said(&output)
}

/// `idem run` and `idem check` with `config` both exit non-zero within 10 s, their output
/// naming `setting`: a fault no retry fixes (`case` says which, in the messages).
pub fn run_and_check_refuse(config: &Path, setting: &str, case: &str) {
    for command in ["run", "check"] {
        let output = must_refuse(command, config);
        assert!(output.contains(setting), "{case}: idem {command}: {output}");
        eprintln!("{case}: idem {command}: {}", output.trim());
    }
}

/// Starts `idem run` as a child process with extra environment variables.
pub fn spawn_idem(config: &Path, env: &[(&str, &str)]) -> IdemProcess {
    let mut command = Command::new(idem_binary());
    command
        .args(["run", "--config"])
        .arg(config)
        .stdin(Stdio::null())
        .env("RUST_LOG", "idem_host=debug,warn");
    for (name, value) in env {
        command.env(name, value);
    }
    IdemProcess::spawn(&mut command)
}

/// Restarts the machine's PostgreSQL cluster (`pg_ctlcluster … restart -m <mode>`: `fast`
/// or `immediate`); whether it came back. For fault tests, which run one at a time.
pub fn restart_postgres(mode: &str) -> bool {
    let Some(version) = std::fs::read_dir("/etc/postgresql")
        .ok()
        .and_then(|entries| entries.flatten().next())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
    else {
        return false;
    };
    Command::new("pg_ctlcluster")
        .args([
            "--skip-systemctl-redirect",
            &version,
            "main",
            "restart",
            "-m",
            mode,
        ])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
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

/// The arguments of a quorum queue, with `delivery_limit` when given.
pub fn quorum_arguments(delivery_limit: Option<i64>) -> FieldTable {
    use lapin::types::{AMQPValue, LongString};
    let mut arguments = FieldTable::default();
    arguments.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    if let Some(limit) = delivery_limit {
        arguments.insert(
            ShortString::from("x-delivery-limit"),
            AMQPValue::LongLongInt(limit),
        );
    }
    arguments
}

/// Deletes `queue` and declares it again, durable, with `arguments` (as infrastructure code
/// would, e.g. a quorum queue with a delivery limit).
pub async fn redeclare(channel: &Channel, queue: &str, arguments: FieldTable) {
    channel
        .queue_delete(ShortString::from(queue), QueueDeleteOptions::default())
        .await
        .expect("delete queue");
    declare(channel, queue, arguments).await;
}

/// Declares `queue` durable, classic and without arguments, as a host with the default
/// settings does.
pub async fn declare_durable(channel: &Channel, queue: &str) {
    declare(channel, queue, FieldTable::default()).await;
}

async fn declare(channel: &Channel, queue: &str, arguments: FieldTable) {
    channel
        .queue_declare(
            ShortString::from(queue),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            arguments,
        )
        .await
        .expect("declare test queue");
}

/// A free loopback port for a host's HTTP endpoint.
/// Whether a server of the test's own listens on 127.0.0.1:`port` within `timeout`.
pub(crate) fn listens_within(port: u16, timeout: Duration) -> bool {
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if started.elapsed() >= timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

/// Sets `path`'s Unix permission bits.
pub(crate) fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// Whether the tests run as root (servers that refuse root then run as another user).
pub(crate) fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|output| output.stdout.starts_with(b"0\n"))
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

/// The `Idempotency-Key` an outbox delivery carried, if any.
pub fn idempotency_key(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
}

/// A minimal HTTP/1.1 request to 127.0.0.1:`port`; returns the status code and the body.
pub async fn http_request(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> (u16, String) {
    let authorization = token.map(|token| format!("Bearer {token}"));
    let headers: Vec<(&str, &str)> = authorization
        .as_deref()
        .map(|value| ("Authorization", value))
        .into_iter()
        .collect();
    http_send(port, method, path, &headers, None).await
}

/// An HTTP/1.1 request to 127.0.0.1:`port` with extra `headers` and a JSON `body`; returns
/// the status code and the body.
pub async fn http_send(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    json: Option<&str>,
) -> (u16, String) {
    let (status, _, body) = http_exchange(port, method, path, headers, json).await;
    (status, body)
}

/// [`http_send`], returning the answer's head (status line and headers) too. A `Host` among
/// `headers` replaces the default (`127.0.0.1:<port>`).
pub async fn http_exchange(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    json: Option<&str>,
) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the host's HTTP endpoint");
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    if !headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("host"))
    {
        head.push_str(&format!("Host: 127.0.0.1:{port}\r\n"));
    }
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if json.is_some() {
        head.push_str("Content-Type: application/json\r\n");
    }
    let body = json.unwrap_or("");
    let request = format!(
        "{head}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send request");
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .await
        .expect("read response");
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (status, head.to_string(), body.to_string())
}

/// A new broker connection with a channel in confirm mode; keep the connection while using the channel.
pub async fn connect_channel() -> (Connection, Channel) {
    connect_channel_to(&amqp_url()).await
}

/// Like [`connect_channel`], to the broker at `url`.
pub async fn connect_channel_to(url: &str) -> (Connection, Channel) {
    try_connect_channel_to(url)
        .await
        .expect("RabbitMQ reachable (scripts/services.sh starts it)")
}

/// Like [`connect_channel_to`], with the broker's refusal or absence as an error (a broker
/// restarting under a fault).
pub async fn try_connect_channel_to(url: &str) -> Result<(Connection, Channel), lapin::Error> {
    let connection = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok((connection, channel))
}

pub async fn publish(channel: &Channel, queue: &str, body: &[u8]) {
    publish_with_headers(channel, queue, body, &[]).await;
}

/// [`publish`] with text `headers`, as a producer sets them.
pub async fn publish_with_headers(
    channel: &Channel,
    queue: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) {
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type(ShortString::from("application/json"));
    if !headers.is_empty() {
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert(
                ShortString::from(*name),
                lapin::types::AMQPValue::LongString((*value).into()),
            );
        }
        properties = properties.with_headers(table);
    }
    let confirm = channel
        .basic_publish(
            ShortString::from(""),
            ShortString::from(queue),
            BasicPublishOptions::default(),
            body,
            properties,
        )
        .await
        .expect("publish")
        .await
        .expect("publish confirm");
    assert!(confirm.is_ack(), "broker refused a test message");
}

pub async fn queue_ready(channel: &Channel, queue: &str) -> u32 {
    channel
        .queue_declare(
            ShortString::from(queue),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("queue exists")
        .message_count()
}

/// Deliveries of `queue` that a consumer holds unacked, from `rabbitmqctl` (AMQP cannot tell).
pub fn unacked(queue: &str) -> u64 {
    queue_figure(queue, "messages_unacknowledged")
}

/// Consumers subscribed to `queue`, as the broker sees them.
pub fn consumers(queue: &str) -> u64 {
    queue_figure(queue, "consumers")
}

/// One `rabbitmqctl list_queues` column of `queue`; 0 if the queue does not exist.
fn queue_figure(queue: &str, column: &str) -> u64 {
    let output = Command::new("rabbitmqctl")
        .args([
            "list_queues",
            "--quiet",
            "--no-table-headers",
            "name",
            column,
        ])
        .output()
        .expect("rabbitmqctl runs (it ships with rabbitmq-server)");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_once('\t'))
        .find(|(name, _)| *name == queue)
        .and_then(|(_, count)| count.trim().parse().ok())
        .unwrap_or(0)
}

/// Closes the broker connections whose client-provided name contains `fragment` (idem names
/// its connections `idem <pipeline> on <queue> (pid <pid>)`). Returns how many it closed.
pub fn close_connections_named(fragment: &str) -> u64 {
    let output = Command::new("rabbitmqctl")
        .args([
            "list_connections",
            "--quiet",
            "--no-table-headers",
            "pid",
            "client_properties",
        ])
        .output()
        .expect("rabbitmqctl runs");
    let mut closed = 0;
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Some((pid, properties)) = line.split_once('\t') else {
            continue;
        };
        if !properties.contains(&format!("\"idem loyalty on {fragment} ")) {
            continue;
        }
        let status = Command::new("rabbitmqctl")
            .args(["close_connection", pid.trim(), "idem fault test"])
            .status();
        if matches!(status, Ok(status) if status.success()) {
            closed += 1;
        }
    }
    closed
}

/// Peak resident memory of process `pid`, in MiB.
pub fn peak_rss_mib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with("VmHWM:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib / 1024)
}

/// An `OrderCompleted` body.
pub fn order(order_id: i64, customer_id: i64, total_cents: i64) -> Vec<u8> {
    serde_json::json!({
        "type": "OrderCompleted",
        "order_id": order_id,
        "customer_id": customer_id,
        "total_cents": total_cents,
    })
    .to_string()
    .into_bytes()
}

/// Polls `condition` every 50 ms until it holds or `timeout` passes.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !condition().await {
        assert!(
            started.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn replace_database(url: &str, database: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(base, query)| (base, Some(query)));
    let prefix = base.rsplit_once('/').map_or(base, |(prefix, _)| prefix);
    match query {
        Some(query) => format!("{prefix}/{database}?{query}"),
        None => format!("{prefix}/{database}"),
    }
}

fn amqp_text(value: &lapin::types::AMQPValue) -> String {
    use lapin::types::AMQPValue;
    match value {
        AMQPValue::LongString(text) => String::from_utf8_lossy(text.as_bytes()).into_owned(),
        AMQPValue::LongLongInt(integer) => integer.to_string(),
        other => format!("{other:?}"),
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
