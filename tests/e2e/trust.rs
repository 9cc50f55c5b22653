//! One trust policy: every TLS client of the host (PostgreSQL, its sessions and its
//! bookkeeping pool; RabbitMQ; NATS; the outbox's HTTPS deliveries) trusts the system's
//! certificate store plus the CA files its settings name, and PostgreSQL's `verify-ca`,
//! `sslrootcert=system` and `require` with a root certificate behave as libpq's.
//!
//! "The system's store" is what OpenSSL would read: a test cannot install a CA on the shared
//! machine, so it points `SSL_CERT_FILE` at a bundle of its own (the machine's bundle plus
//! the test's CA), as `update-ca-certificates` would have made it. Only `idem` child processes
//! see that variable.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;

use idem_e2e::jetstream::{NatsServer, TestStream};
use idem_e2e::tls::{self, HttpsListener, Pki, TlsProxy};
use idem_e2e::{
    TestEnv, amqp_url, free_port, must_refuse_with, order, plugin_path, run_and_check_refuse,
    spawn_idem, wait_for,
};

/// The machine's own bundle of trusted authorities (Debian's), when it has one.
const MACHINE_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// A system store of the test's own at `path`: the machine's bundle plus `extra`.
fn system_store(path: &Path, extra: &[&Path]) -> PathBuf {
    let mut bundle = std::fs::read(MACHINE_BUNDLE).unwrap_or_default();
    for ca in extra {
        bundle.extend(std::fs::read(ca).expect("read CA"));
    }
    std::fs::write(path, bundle).expect("write bundle");
    path.to_path_buf()
}

/// Everything the host talks TLS to, with certificates of the test's private CA (naming
/// `localhost` and `127.0.0.1`): a PostgreSQL endpoint and an amqps endpoint in front of the
/// local servers, a nats-server of its own with a stream, an https endpoint counting receipts
/// by idempotency key.
struct Servers {
    directory: PathBuf,
    pki: Pki,
    /// A CA that signed nothing here.
    foreign: PathBuf,
    postgres: TlsProxy,
    amqps: TlsProxy,
    nats: NatsServer,
    stream: TestStream,
    https_port: u16,
    receipts: Arc<Mutex<Vec<String>>>,
}

impl Servers {
    async fn start(env: &TestEnv) -> Servers {
        let directory = std::env::temp_dir().join(format!("{}-trust", env.database));
        let pki = Pki::new(&directory);
        let foreign = tls::self_signed_ca(&directory, "foreign-ca", "idem test foreign CA");
        let postgres = TlsProxy::postgres(
            [127, 0, 0, 1].into(),
            "127.0.0.1:5432".parse().expect("address"),
            pki.server_config(false),
        )
        .await;
        let amqps = TlsProxy::start(
            "127.0.0.1:5672".parse().expect("address"),
            pki.server_config(false),
        )
        .await;
        let nats_config = directory.join("nats.conf");
        std::fs::write(
            &nats_config,
            format!(
                "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  timeout: 2\n}}\n",
                pki.server_cert.display(),
                pki.server_key.display()
            ),
        )
        .expect("write nats.conf");
        let nats =
            NatsServer::start_with(free_port(), directory.join("nats-store"), Some(nats_config));
        let nats_url = format!("tls://127.0.0.1:{}", nats.port);
        let client = async_nats::ConnectOptions::new()
            .add_root_certificates(pki.ca.clone())
            .require_tls(true)
            .connect(nats_url.as_str())
            .await
            .expect("the test's own NATS client over TLS");
        let stream = TestStream::through(client, &nats_url, &env.queue).await;
        let receipts = Arc::new(Mutex::new(Vec::new()));
        let router = Router::new().route(
            "/receipts",
            post({
                let receipts = Arc::clone(&receipts);
                move |headers: HeaderMap| async move {
                    let key = idem_e2e::idempotency_key(&headers)
                        .unwrap_or_default()
                        .to_string();
                    receipts.lock().expect("receipts").push(key);
                    StatusCode::OK
                }
            }),
        );
        let (listener, https_port, _) = HttpsListener::bind(pki.server_config(false)).await;
        tokio::spawn(async move { axum::serve(listener, router).await });
        Servers {
            directory,
            pki,
            foreign,
            postgres,
            amqps,
            nats,
            stream,
            https_port,
            receipts,
        }
    }

    /// The host's config: receipts from the env's queue (its outbox to the https endpoint),
    /// loyalty from the stream. `database_url` and `amqp` (the `[amqp]` table) say how the
    /// host reaches PostgreSQL and RabbitMQ; `ca_file`, when given, is named by every
    /// client's CA setting.
    fn config(
        &self,
        env: &TestEnv,
        database_url: &str,
        amqp: &str,
        ca_file: Option<&Path>,
    ) -> String {
        let (nats_tls, https_ca) = match ca_file {
            Some(ca) => (
                format!(", tls = {{ ca_file = \"{}\" }}", ca.display()),
                format!("ca_file = \"{}\"\n", ca.display()),
            ),
            None => (String::new(), String::new()),
        };
        format!(
            r#"[database]
url = "{database_url}"
max_connections = 8

{amqp}
[outbox]
poll = "50ms"

[outbox.destinations.receipts]
kind = "http"
url = "https://localhost:{https_port}/receipts"
timeout = "5s"
{https_ca}
[pipelines.receipts]
queue = "{queue}"
plugin = "{receipts}"
dead_letter_queue = "{dead_letter_queue}"

[pipelines.receipts.statements]
record_receipt = "INSERT INTO receipts (order_id, customer_id, total_cents) VALUES ($1, $2, $3)"
{loyalty}"#,
            https_port = self.https_port,
            queue = env.queue,
            dead_letter_queue = env.dead_letter_queue,
            receipts = plugin_path("receipts").display(),
            loyalty = self
                .stream
                .pipeline_table("loyalty", &plugin_path("loyalty"), &nats_tls, ""),
        )
    }

    /// PostgreSQL through the TLS endpoint, by name, with `parameters` after `sslmode`.
    fn database_url(&self, env: &TestEnv, parameters: &str) -> String {
        format!(
            "postgres://postgres@localhost:{}/{}?sslmode=verify-full{parameters}",
            self.postgres.port, env.database
        )
    }

    /// RabbitMQ through the amqps endpoint, with `[amqp.tls] ca_file` when given.
    fn amqps(&self, ca_file: Option<&Path>) -> String {
        let mut table = format!(
            "[amqp]\nurl = \"amqps://guest:guest@localhost:{}/%2f\"\n",
            self.amqps.port
        );
        if let Some(ca) = ca_file {
            table.push_str(&format!("\n[amqp.tls]\nca_file = \"{}\"\n", ca.display()));
        }
        table
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.directory.join(name);
        std::fs::write(&path, text).expect("write config");
        path
    }
}

/// Runs `idem run` on `config` with `SSL_CERT_FILE=store`, publishes orders `orders` to the
/// queue and the stream, and waits until each is recorded, credited and its receipt delivered.
async fn run_with_store(
    env: &TestEnv,
    servers: &Servers,
    config: &Path,
    store: &Path,
    orders: std::ops::RangeInclusive<i64>,
) {
    let store = store.to_str().expect("path");
    let host = spawn_idem(config, &[("SSL_CERT_FILE", store)]);
    let last = *orders.end();
    for order_id in orders {
        let body = order(order_id, order_id % 5, 1_000 + order_id);
        env.publish(&body).await;
        servers.stream.publish(&body, None).await;
    }
    wait_for(
        &format!("{last} orders recorded, credited and their receipts delivered over TLS"),
        Duration::from_secs(60),
        || async {
            env.count("SELECT count(*) FROM receipts").await == last
                && env.count("SELECT count(*) FROM point_ledger").await == last
                && env
                    .count("SELECT count(*) FROM idem_outbox WHERE delivered_at IS NOT NULL")
                    .await
                    == last
        },
    )
    .await;
    let status = host.terminate();
    assert!(status.success(), "idem run exited with {status}");
}

/// A CA that only the system's store holds is trusted by all four clients: the host records,
/// credits and delivers every order through PostgreSQL (`verify-full`), RabbitMQ (`amqps`),
/// NATS (`tls://`) and HTTPS endpoints whose certificates it signed; with a CA file set for
/// each (one that signed nothing here) the system's store is still trusted beside it. The
/// same config with a store that lacks the CA stops `idem check` naming each client's TLS
/// settings, so it was the store that made them trust it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_in_the_system_store_is_trusted_by_every_client() {
    let env = TestEnv::new("trust_store").await;
    let servers = Servers::start(&env).await;
    let with_ca = system_store(&servers.directory.join("with-ca.pem"), &[&servers.pki.ca]);
    let without_ca = system_store(&servers.directory.join("without-ca.pem"), &[]);

    let system_only = servers.write(
        "system-only.toml",
        &servers.config(
            &env,
            &servers.database_url(&env, ""),
            &servers.amqps(None),
            None,
        ),
    );
    run_with_store(&env, &servers, &system_only, &with_ca, 1..=20).await;

    let foreign = &servers.foreign;
    let beside_files = servers.write(
        "beside-files.toml",
        &servers.config(
            &env,
            &servers.database_url(&env, &format!("&sslrootcert={}", foreign.display())),
            &servers.amqps(Some(foreign)),
            Some(foreign),
        ),
    );
    run_with_store(&env, &servers, &beside_files, &with_ca, 21..=40).await;

    let keys = servers.receipts.lock().expect("receipts").clone();
    let distinct: BTreeSet<&String> = keys.iter().collect();
    assert_eq!(distinct.len(), 40, "every receipt delivered: {keys:?}");
    assert!(keys.iter().all(|key| !key.is_empty()));
    for handshake in servers
        .postgres
        .handshakes()
        .iter()
        .chain(servers.amqps.handshakes().iter())
    {
        assert!(handshake.outcome.is_ok(), "{handshake:?}");
    }
    env.assert_loyalty_consistent().await;

    // The same clients, one at a time, with a store that lacks the CA.
    let without = without_ca.to_str().expect("path");
    for (case, database_url, amqp, setting) in [
        (
            "PostgreSQL",
            servers.database_url(&env, ""),
            format!("[amqp]\nurl = \"{}\"\n", amqp_url()),
            "sslrootcert",
        ),
        (
            "RabbitMQ",
            env.database_url.clone(),
            servers.amqps(None),
            "[amqp.tls]",
        ),
        (
            "NATS",
            env.database_url.clone(),
            format!("[amqp]\nurl = \"{}\"\n", amqp_url()),
            "pipelines.loyalty.source.tls",
        ),
    ] {
        let config = servers.write(
            "untrusted.toml",
            &servers.config(&env, &database_url, &amqp, None),
        );
        let output = must_refuse_with("check", &config, &[("SSL_CERT_FILE", without)]);
        assert!(output.contains(setting), "{case}: {output}");
        eprintln!("untrusted {case}: {}", output.trim());
    }
    let Servers {
        directory,
        nats,
        stream,
        ..
    } = servers;
    stream.cleanup().await;
    drop(nats);
    let _ = std::fs::remove_dir_all(&directory);
    env.cleanup().await;
}

/// Runs `idem run` on `config` (with `variables` in its environment) until the orders
/// `orders`, published to the env's queue, are credited; `how` names the connection.
async fn credit(
    env: &TestEnv,
    config: &Path,
    variables: &[(&str, &str)],
    orders: std::ops::RangeInclusive<i64>,
    how: &str,
) {
    let host = spawn_idem(config, variables);
    let last = *orders.end();
    for order_id in orders {
        env.publish(&order(order_id, order_id % 3, 1_000)).await;
    }
    wait_for(
        &format!("credits up to order {last} over {how}"),
        Duration::from_secs(60),
        || async { env.count("SELECT count(*) FROM point_ledger").await == last },
    )
    .await;
    let status = host.terminate();
    assert!(status.success(), "idem run exited with {status}");
}

/// PostgreSQL's TLS modes as libpq has them, on both kinds of the host's connections (its
/// sessions and its bookkeeping pool): `verify-ca` trusts a certificate its CA signed for
/// another name; `sslrootcert=system` is the system's store and `verify-full` (a weaker mode
/// with it is refused); `require` with a root certificate checks the chain (`verify-ca`), so
/// a CA that did not sign the server's certificate is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tls_modes_behave_as_libpq() {
    let env = TestEnv::new("trust_libpq").await;
    let directory = std::env::temp_dir().join(format!("{}-pki", env.database));
    let pki = Pki::new(&directory);
    let postgres = "127.0.0.1:5432".parse().expect("address");
    // 127.0.0.2 is not among the certificate's names.
    let unnamed =
        TlsProxy::postgres([127, 0, 0, 2].into(), postgres, pki.server_config(false)).await;
    let named = TlsProxy::postgres([127, 0, 0, 1].into(), postgres, pki.server_config(false)).await;
    let config_path = directory.join("pipelines.toml");
    let at = |address: &str, port: u16, parameters: &str| {
        let url = format!(
            "postgres://postgres@{address}:{port}/{}?{parameters}",
            env.database
        );
        std::fs::write(&config_path, env.config_text_at(&url, "loyalty", "")).expect("config");
    };

    at(
        "127.0.0.2",
        unnamed.port,
        &format!("sslmode=verify-ca&sslrootcert={}", pki.ca.display()),
    );
    credit(&env, &config_path, &[], 1..=30, "verify-ca").await;
    let handshakes = unnamed.handshakes();
    // At least the bookkeeping pool's connection and one session.
    assert!(handshakes.len() >= 2, "{handshakes:?}");
    assert!(
        handshakes.iter().all(|handshake| handshake.outcome.is_ok()),
        "{handshakes:?}"
    );

    let store = system_store(&directory.join("store.pem"), &[&pki.ca]);
    at("localhost", named.port, "sslrootcert=system");
    let store = store.to_str().expect("path");
    credit(
        &env,
        &config_path,
        &[("SSL_CERT_FILE", store)],
        31..=60,
        "sslrootcert=system",
    )
    .await;
    env.assert_loyalty_consistent().await;

    at(
        "localhost",
        named.port,
        "sslmode=require&sslrootcert=system",
    );
    run_and_check_refuse(&config_path, "sslmode", "sslrootcert=system with require");
    let foreign = tls::self_signed_ca(&directory, "foreign-ca", "idem test foreign CA");
    at(
        "localhost",
        named.port,
        &format!("sslmode=require&sslrootcert={}", foreign.display()),
    );
    run_and_check_refuse(
        &config_path,
        "sslrootcert",
        "require with a foreign root certificate",
    );
    let _ = std::fs::remove_dir_all(&directory);
    env.cleanup().await;
}
