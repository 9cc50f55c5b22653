//! What an on-call engineer is handed: the alert rules in `deploy/prometheus/alerts.yml`
//! (checked and unit-tested by promtool), the Grafana dashboard in `deploy/grafana/idem.json`
//! (every query names a metric idem exports), and a real Prometheus scraping a running host
//! with those rules loaded, which fires on dead letters the host keeps.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use idem_e2e::{TestEnv, free_port, http_exchange, http_request, wait_for};
use idem_host::config::Config;
use idem_host::telemetry::metrics::{Metrics, OutboxSample, SourceSample};

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(path)
}

/// `promtool <args>` in `deploy/prometheus` (scripts/test.sh installs Debian's prometheus),
/// which must succeed; what it printed.
fn promtool(args: &[&str]) -> String {
    idem_e2e::must_run(
        Command::new("promtool")
            .args(args)
            .current_dir(deploy("prometheus")),
    )
}

/// `promtool check rules` accepts the rules, and `promtool test rules` fires each on the
/// series it is written for, with its labels and annotations, and keeps it quiet otherwise.
#[test]
fn the_alert_rules_pass_promtool() {
    let checked = promtool(&["check", "rules", "alerts.yml"]);
    assert!(checked.contains("SUCCESS: 9 rules found"), "{checked}");
    let tested = promtool(&["test", "rules", "alerts.test.yml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// The series names a host exposes: every family idem registers (each recorded once, as the
/// exposition leaves out families without a series), with the suffixes the exposition gives
/// counters and histograms.
fn exported_series() -> BTreeSet<String> {
    let metrics = Metrics::new();
    let second = Duration::from_secs(1);
    metrics.message_settled("p", "applied", second);
    metrics.plugin_called("p", second);
    metrics.transaction_finished("p", second);
    metrics.database_retried("p", "40001");
    metrics.plugin_reloaded("p", "applied");
    metrics.claims_deleted("p", 1);
    metrics.outbox_delivered("d", "delivered");
    metrics.pipeline_paused("p", false);
    metrics.pipeline_operator_paused("p", false);
    metrics.source_sampled(
        "p",
        SourceSample {
            waiting: 1,
            unacknowledged: Some(1),
            dead_letters: 1,
            oldest_age: Some(second),
        },
    );
    metrics.outbox_sampled("default", OutboxSample::default());
    metrics.claims_sampled("p", 1, second, second);
    let text = metrics.encode();
    let mut series = BTreeSet::new();
    for line in text.lines() {
        let Some(declared) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = declared.split_once(' ').expect("# TYPE name kind");
        match kind {
            "counter" => {
                series.insert(format!("{name}_total"));
            }
            "histogram" => {
                for suffix in ["_bucket", "_sum", "_count"] {
                    series.insert(format!("{name}{suffix}"));
                }
            }
            _ => {
                series.insert(name.to_string());
            }
        }
    }
    series
}

/// Every `idem_…` name in `text`.
fn named_metrics(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(start) = rest.find("idem_") {
        let name: String = rest[start..]
            .chars()
            .take_while(|character| character.is_ascii_alphanumeric() || *character == '_')
            .collect();
        rest = &rest[start + name.len()..];
        names.insert(name);
    }
    names
}

/// Every query of the dashboard and every rule's expression names only metrics idem
/// exports, and between them they use every sampled gauge.
#[test]
fn every_query_names_a_metric_idem_exports() {
    let exported = exported_series();
    assert!(exported.contains("idem_messages_total"), "{exported:?}");
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(deploy("grafana/idem.json")).expect("the dashboard"),
    )
    .expect("the dashboard is JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            queries.push(target["expr"].as_str().expect("an expr").to_string());
        }
    }
    queries.push(
        dashboard["templating"]["list"][1]["definition"]
            .as_str()
            .expect("the pipeline variable")
            .to_string(),
    );
    let rules = std::fs::read_to_string(deploy("prometheus/alerts.yml")).expect("the rules");
    let rule_expressions: String = rules
        .lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .filter(|line| !line.contains("description:") && !line.contains("summary:"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut used = BTreeSet::new();
    for (origin, text) in queries
        .iter()
        .map(|query| ("the dashboard", query.as_str()))
        .chain([("alerts.yml", rule_expressions.as_str())])
    {
        for name in named_metrics(text) {
            assert!(
                exported.contains(&name),
                "{origin} names {name}, which idem does not export ({exported:?})"
            );
            used.insert(name);
        }
    }
    for gauge in [
        "idem_source_waiting_messages",
        "idem_source_unacknowledged_messages",
        "idem_source_oldest_unsettled_age_seconds",
        "idem_dead_letter_messages",
        "idem_outbox_rows",
        "idem_outbox_oldest_pending_age_seconds",
        "idem_claims",
        "idem_claims_oldest_age_seconds",
        "idem_pipeline_paused",
    ] {
        assert!(used.contains(gauge), "nothing shows {gauge}");
    }
}

/// A Prometheus server of the test's own, killed when dropped.
struct Prometheus {
    child: Child,
    port: u16,
    directory: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

impl Prometheus {
    /// Scrapes the host at `target` every second with the shipped rules loaded.
    fn start(name: &str, target: u16) -> Prometheus {
        let directory = std::env::temp_dir().join(format!("{name}-prometheus"));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir_all(&directory).expect("prometheus directory");
        let config = directory.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global: {{ scrape_interval: 1s, evaluation_interval: 1s }}\n\
                 rule_files: [\"{}\"]\n\
                 scrape_configs:\n  - job_name: idem\n    static_configs: [{{ targets: [\"127.0.0.1:{target}\"] }}]\n",
                deploy("prometheus/alerts.yml").display()
            ),
        )
        .expect("write prometheus.yml");
        let port = free_port();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                directory.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus runs (scripts/test.sh installs Debian's prometheus)");
        Prometheus {
            child,
            port,
            directory,
        }
    }

    /// The `data` of an API answer at `path`, or `Null` while it does not answer.
    async fn api(&self, path: &str) -> serde_json::Value {
        if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            return serde_json::Value::Null;
        }
        let (_, head, body) = http_exchange(self.port, "GET", path, &[], None).await;
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunked(&body)
        } else {
            body
        };
        serde_json::from_str::<serde_json::Value>(&body).unwrap_or_default()["data"].clone()
    }

    /// The result of the instant `query`.
    async fn query(&self, query: &str) -> serde_json::Value {
        let encoded: String = query
            .bytes()
            .map(|byte| match byte {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => (byte as char).to_string(),
                _ => format!("%{byte:02X}"),
            })
            .collect();
        self.api(&format!("/api/v1/query?query={encoded}")).await["result"].clone()
    }
}

/// Debian's Prometheus scrapes a host (OpenMetrics text) with the shipped rules loaded, on
/// the metrics listener (`[http] metrics_listen`, all interfaces, no token) while the admin
/// API wants its token: the sampled gauges arrive without anyone opening the console, every
/// rule evaluates without error, and three messages the plugin refuses make
/// `IdemDeadLettersGrowing` fire for their pipeline. The metrics listener serves the probes
/// and nothing of the admin API or the console.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_a_host_and_fires_on_dead_letters() {
    let env = TestEnv::new("alerting").await;
    let (port, metrics_port) = (free_port(), free_port());
    let token = "a".repeat(32);
    let text = format!(
        "{}\n[http]\nlisten = \"127.0.0.1:{port}\"\nadmin_token = \"{token}\"\nmetrics_listen = \"0.0.0.0:{metrics_port}\"\n",
        env.config_text("chaos", "max_attempts = 1")
    );
    let config = Config::from_toml(Path::new("/tmp/idem-alerting.toml"), &text).expect("config");
    let host = env.start_host(config);
    wait_for("the host ready", Duration::from_secs(60), || async {
        tokio::net::TcpStream::connect(("127.0.0.1", metrics_port))
            .await
            .is_ok()
            && http_request(metrics_port, "GET", "/readyz", None).await.0 == 200
    })
    .await;
    assert_eq!(
        http_request(metrics_port, "GET", "/healthz", None).await.0,
        200
    );
    for path in ["/admin/status", "/"] {
        let (status, body) = http_request(metrics_port, "GET", path, None).await;
        assert_eq!(status, 404, "{path} on the metrics listener: {body}");
    }
    assert_eq!(
        http_request(port, "GET", "/admin/status", None).await.0,
        401
    );
    assert_eq!(http_request(port, "GET", "/metrics", None).await.0, 200);
    let prometheus = Prometheus::start(&env.database, metrics_port);
    wait_for("the host scraped", Duration::from_secs(60), || async {
        prometheus
            .query("up{job=\"idem\"} == 1")
            .await
            .as_array()
            .is_some_and(|up| up.len() == 1)
    })
    .await;
    wait_for(
        "the sampled gauges scraped",
        Duration::from_secs(60),
        || async {
            let waiting = prometheus
                .query("idem_source_waiting_messages{pipeline=\"loyalty\"}")
                .await;
            let claims = prometheus.query("idem_claims{pipeline=\"loyalty\"}").await;
            let outbox = prometheus
                .query("idem_outbox_rows{database=\"default\",state=\"parked\"}")
                .await;
            [waiting, claims, outbox]
                .iter()
                .all(|result| result.as_array().is_some_and(|series| series.len() == 1))
        },
    )
    .await;
    for _ in 0..3 {
        env.publish(br#"{"action": "invalid"}"#).await;
    }
    let fired = wait_for_value(
        "IdemDeadLettersGrowing to fire",
        Duration::from_secs(90),
        || async {
            let alerts = prometheus.api("/api/v1/alerts").await;
            alerts["alerts"].as_array().and_then(|alerts| {
                alerts
                    .iter()
                    .find(|alert| {
                        alert["labels"]["alertname"] == "IdemDeadLettersGrowing"
                            && alert["state"] == "firing"
                            && alert["value"] == "3e+00"
                    })
                    .cloned()
            })
        },
    )
    .await;
    assert_eq!(fired["labels"]["pipeline"], "loyalty", "{fired}");
    let rules = prometheus.api("/api/v1/rules").await;
    let rules: Vec<&serde_json::Value> = rules["groups"][0]["rules"]
        .as_array()
        .expect("the rules loaded")
        .iter()
        .collect();
    assert_eq!(rules.len(), 9, "{rules:?}");
    for rule in rules {
        assert_eq!(rule["health"], "ok", "{rule}");
    }
    drop(prometheus);
    host.stop().await.expect("host stops");
    env.cleanup().await;
}

/// A chunked HTTP/1.1 body (Prometheus chunks its longer answers) put together.
fn dechunked(body: &str) -> String {
    let mut whole = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 || after.len() < size {
            break;
        }
        whole.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    whole
}

/// Polls `probe` until it gives a value, for at most `limit`.
async fn wait_for_value<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    limit: Duration,
    mut probe: impl FnMut() -> F,
) -> T {
    let started = std::time::Instant::now();
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
