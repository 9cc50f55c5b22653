//! Production connectivity: TLS to PostgreSQL (sslmode as libpq) and to RabbitMQ (amqps with
//! mutual TLS), and connection refusals no retry can fix (a certificate nobody trusts, an
//! unknown database, a wrong password or vhost) stopping the host with one line naming the
//! setting, instead of a retry loop.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use idem_e2e::tls::{self, Pki, TlsProxy};
use idem_e2e::{TestEnv, amqp_url, idem_binary, order, run_and_check_refuse, wait_for};

/// `?sslmode=require`: every host session is encrypted (the local server has `ssl = on`),
/// and orders are credited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_talks_tls_to_postgres_with_sslmode_require() {
    let env = TestEnv::new("tls_require").await;
    let text = env.config_text_at(
        &format!("{}?sslmode=require", env.database_url),
        "loyalty",
        "",
    );
    assert!(text.contains("sslmode=require"));
    let config =
        idem_host::config::Config::from_toml(Path::new("/tmp/tls.toml"), &text).expect("config");
    let host = env.start_host(config);
    for order_id in 1..=50 {
        env.publish(&order(order_id, order_id % 5, 1_000)).await;
    }
    wait_for("50 credits", Duration::from_secs(30), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 50
    })
    .await;
    let sessions: Vec<(bool, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT s.ssl, s.version, s.cipher FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE a.datname = $1 AND a.application_name = 'idem'",
    )
    .bind(&env.database)
    .fetch_all(&env.pool)
    .await
    .expect("pg_stat_ssl");
    host.stop().await.expect("host stops cleanly");
    assert!(!sessions.is_empty(), "no host session found");
    assert!(
        sessions.iter().all(|(ssl, _, _)| *ssl),
        "a host session is not encrypted: {sessions:?}"
    );
    eprintln!("connectivity: host sessions use {:?}", sessions[0]);
    env.assert_loyalty_consistent().await;
    env.cleanup().await;
}

/// A self-signed CA that signed nothing the servers present.
fn foreign_ca(directory: &Path) -> PathBuf {
    tls::self_signed_ca(directory, "foreign-ca", "idem test foreign CA")
}

/// `sslmode=verify-full` with a CA that did not sign the server's certificate: `idem run`
/// and `idem check` exit non-zero at once, naming the TLS settings.
#[tokio::test]
async fn an_untrusted_server_certificate_stops_the_host() {
    let env = TestEnv::new("tls_verify").await;
    let directory = std::env::temp_dir().join(&env.database);
    std::fs::create_dir_all(&directory).expect("temp dir");
    let ca = foreign_ca(&directory);
    let url = format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        env.database_url,
        ca.display()
    );
    let config = directory.join("pipelines.toml");
    std::fs::write(&config, env.config_text_at(&url, "loyalty", "")).expect("write config");
    run_and_check_refuse(&config, "sslrootcert", "foreign CA");
    let _ = std::fs::remove_dir_all(&directory);
    env.cleanup().await;
}

/// A database that does not exist: `idem run` and `idem check` exit non-zero at once,
/// naming the database name in the URL.
#[tokio::test]
async fn an_unknown_database_stops_the_host() {
    let env = TestEnv::new("unknown_database").await;
    let missing = format!("{}_missing", env.database);
    let config = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(
        &config,
        env.config_text("loyalty", "").replace(
            &env.database_url,
            &env.database_url.replace(&env.database, &missing),
        ),
    )
    .expect("write config");
    run_and_check_refuse(
        &config,
        "database name in [database] url",
        "unknown database",
    );
    let _ = std::fs::remove_file(&config);
    env.cleanup().await;
}

/// The env's config with `[amqp]` replaced by `amqp` (a table, sub-tables after it).
fn with_amqp(env: &TestEnv, amqp: &str) -> String {
    let text = env.config_text("loyalty", "");
    let plain = format!("[amqp]\nurl = \"{}\"\n", amqp_url());
    assert!(text.contains(&plain), "config layout changed: {text}");
    text.replace(&plain, amqp)
}

fn amqps_table(port: u16, ca: &Path, client: Option<&Pki>) -> String {
    let mut table = format!(
        "[amqp]\nurl = \"amqps://guest:guest@localhost:{port}/%2f\"\n\n[amqp.tls]\nca_file = \"{}\"\n",
        ca.display()
    );
    if let Some(pki) = client {
        table.push_str(&format!(
            "cert_file = \"{}\"\nkey_file = \"{}\"\n",
            pki.client_cert.display(),
            pki.client_key.display()
        ));
    }
    table
}

/// A PKI in a directory of its own and an amqps endpoint in front of the local RabbitMQ that
/// requires a client certificate signed by its CA.
async fn mutual_tls_broker(env: &TestEnv) -> (PathBuf, Pki, TlsProxy) {
    let directory = std::env::temp_dir().join(format!("{}-pki", env.database));
    let pki = Pki::new(&directory);
    let proxy = TlsProxy::start(
        "127.0.0.1:5672".parse().expect("address"),
        pki.server_config(true),
    )
    .await;
    (directory, pki, proxy)
}

/// `amqps://` with a private CA and a client certificate, through a TLS endpoint that requires
/// one (a TLS-terminating proxy in front of the local RabbitMQ): `idem check` accepts it, and
/// the host consumes and credits every order over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_consumes_over_amqps_with_mutual_tls() {
    let env = TestEnv::new("amqps").await;
    let (directory, pki, proxy) = mutual_tls_broker(&env).await;
    let text = with_amqp(&env, &amqps_table(proxy.port, &pki.ca, Some(&pki)));
    let config_path = directory.join("pipelines.toml");
    std::fs::write(&config_path, &text).expect("write config");

    let checked = Command::new(idem_binary())
        .args(["check", "--config"])
        .arg(&config_path)
        .stdin(Stdio::null())
        .output()
        .expect("run idem check");
    let printed = String::from_utf8_lossy(&checked.stdout);
    eprintln!("idem check over amqps:\n{printed}");
    assert!(checked.status.success(), "idem check failed: {printed}");
    assert!(
        printed.contains("credentials and vhost accepted"),
        "{printed}"
    );

    let config = idem_host::config::Config::from_toml(&config_path, &text).expect("config");
    let host = env.start_host(config);
    for order_id in 1..=100 {
        env.publish(&order(order_id, order_id % 7, 1_000)).await;
    }
    wait_for(
        "100 credits over amqps",
        Duration::from_secs(60),
        || async { env.count("SELECT count(*) FROM point_ledger").await == 100 },
    )
    .await;
    host.stop().await.expect("host stops cleanly");
    env.assert_loyalty_consistent().await;
    let handshakes = proxy.handshakes();
    tls::assert_every_handshake_presented_a_certificate(&handshakes);
    eprintln!("amqps: negotiated {:?}", handshakes[0].outcome);
    let _ = std::fs::remove_dir_all(&directory);
    env.cleanup().await;
}

/// A CA that did not sign the broker's certificate, or no client certificate where the
/// broker requires one: `idem run` and `idem check` exit non-zero within 10 s naming
/// `[amqp.tls]`, instead of reconnecting forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_certificate_faults_stop_the_host() {
    let env = TestEnv::new("amqps_faults").await;
    let (directory, pki, proxy) = mutual_tls_broker(&env).await;
    let foreign = foreign_ca(&directory);
    for (case, amqp) in [
        ("foreign CA", amqps_table(proxy.port, &foreign, Some(&pki))),
        (
            "no client certificate",
            amqps_table(proxy.port, &pki.ca, None),
        ),
    ] {
        let config_path = directory.join("pipelines.toml");
        std::fs::write(&config_path, with_amqp(&env, &amqp)).expect("write config");
        run_and_check_refuse(&config_path, "[amqp.tls]", case);
    }
    let _ = std::fs::remove_dir_all(&directory);
    env.cleanup().await;
}

/// A URL for the env's database through a PostgreSQL TLS endpoint at `host:port`.
fn tls_database_url(
    env: &TestEnv,
    host: &str,
    port: u16,
    mode: &str,
    pki: &Pki,
    client_certificate: bool,
) -> String {
    let mut url = format!(
        "postgres://postgres@{host}:{port}/{}?sslmode={mode}&sslrootcert={}",
        env.database,
        pki.ca.display()
    );
    if client_certificate {
        url.push_str(&format!(
            "&sslcert={}&sslkey={}",
            pki.client_cert.display(),
            pki.client_key.display()
        ));
    }
    url
}

/// A managed PostgreSQL as teams meet it: a private CA and a client certificate the server
/// requires (a TLS endpoint in front of the local server). `verify-full` with both: the
/// host's sessions and its bookkeeping pool all verify the server and present the
/// certificate, and every order is credited. `verify-full` to an address the certificate
/// does not name, or without the client certificate, stops the host naming the TLS settings.
/// (`verify-ca` to such an address is refused too, by sqlx 0.8's verifier for the bookkeeping
/// pool, which misses rustls's `NotValidForNameContext`; fixed in sqlx 0.9. The sessions'
/// verifier accepts it, as libpq does.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tls_verifies_the_server_and_presents_a_client_certificate() {
    let env = TestEnv::new("pg_mutual_tls").await;
    let directory = std::env::temp_dir().join(format!("{}-pki", env.database));
    let pki = Pki::new(&directory);
    let postgres = "127.0.0.1:5432".parse().expect("address");
    let named = TlsProxy::postgres([127, 0, 0, 1].into(), postgres, pki.server_config(true)).await;
    let unnamed =
        TlsProxy::postgres([127, 0, 0, 2].into(), postgres, pki.server_config(true)).await;

    let url = tls_database_url(&env, "127.0.0.1", named.port, "verify-full", &pki, true);
    let config_path = directory.join("pipelines.toml");
    let text = env.config_text_at(&url, "loyalty", "");
    std::fs::write(&config_path, &text).expect("write config");
    let config = idem_host::config::Config::from_toml(&config_path, &text).expect("config");
    let host = env.start_host(config);
    for order_id in 1..=60 {
        env.publish(&order(order_id, order_id % 6, 1_000)).await;
    }
    wait_for(
        "60 credits over verify-full",
        Duration::from_secs(60),
        || async { env.count("SELECT count(*) FROM point_ledger").await == 60 },
    )
    .await;
    host.stop().await.expect("host stops cleanly");
    env.assert_loyalty_consistent().await;
    let handshakes = named.handshakes();
    // At least the bookkeeping pool's connection and one session.
    assert!(
        handshakes.len() >= 2,
        "expected the pool and the sessions to connect through TLS: {handshakes:?}"
    );
    tls::assert_every_handshake_presented_a_certificate(&handshakes);

    for (case, url) in [
        (
            "a name the certificate does not carry",
            tls_database_url(&env, "127.0.0.2", unnamed.port, "verify-full", &pki, true),
        ),
        (
            "no client certificate",
            tls_database_url(&env, "127.0.0.1", named.port, "verify-full", &pki, false),
        ),
    ] {
        std::fs::write(&config_path, env.config_text_at(&url, "loyalty", ""))
            .expect("write config");
        run_and_check_refuse(&config_path, "sslrootcert, sslcert and sslkey", case);
    }
    let _ = std::fs::remove_dir_all(&directory);
    env.cleanup().await;
}
