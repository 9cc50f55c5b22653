//! Production connectivity: TLS to PostgreSQL (sslmode as libpq), and connection refusals no
//! retry can fix (a certificate nobody trusts, an unknown database) stopping the host with one
//! line naming the setting, instead of a retry loop.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idem_e2e::{TestEnv, idem_binary, order, wait_for};

/// `?sslmode=require`: every host session is encrypted (the local server has `ssl = on`),
/// and orders are credited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_talks_tls_to_postgres_with_sslmode_require() {
    let env = TestEnv::new("tls_require").await;
    let tls_url = format!("{}?sslmode=require", env.database_url);
    let text = env.config_text("loyalty", "").replace(
        &format!("\"{}\"", env.database_url),
        &format!("\"{tls_url}\""),
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

/// A self-signed CA that signed nothing the server presents.
fn foreign_ca(directory: &Path) -> PathBuf {
    let key = directory.join("foreign-ca.key");
    let certificate = directory.join("foreign-ca.pem");
    let status = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args(["-subj", "/CN=idem test foreign CA", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&certificate)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run openssl (apt-get install openssl)");
    assert!(status.success(), "openssl req failed");
    certificate
}

/// Runs `idem <command> --config <file>`, which must exit non-zero within 10 s; returns its
/// output.
fn must_refuse(command: &str, config: &Path) -> String {
    let started = Instant::now();
    let mut child = Command::new(idem_binary())
        .args([command, "--config"])
        .arg(config)
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
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
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
    std::fs::write(
        &config,
        env.config_text("loyalty", "")
            .replace(&format!("\"{}\"", env.database_url), &format!("\"{url}\"")),
    )
    .expect("write config");
    for command in ["run", "check"] {
        let output = must_refuse(command, &config);
        assert!(output.contains("sslrootcert"), "idem {command}: {output}");
    }
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
    for command in ["run", "check"] {
        let output = must_refuse(command, &config);
        assert!(
            output.contains("database name in [database] url"),
            "idem {command}: {output}"
        );
    }
    let _ = std::fs::remove_file(&config);
    env.cleanup().await;
}
