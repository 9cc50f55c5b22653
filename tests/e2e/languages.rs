//! Plugins in any language: the loyalty consumer in Rust, Python, JavaScript and C (each built
//! by `idem build`, through `scripts/build-plugins.sh`) must decide identically (the
//! conformance corpus), and serve a pipeline interchangeably.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use idem_e2e::{REPO_ROOT, TestEnv, idem_binary, order, plugin_path, unacked, wait_for};
use idem_host::cases::{self, Origin, Trial};
use idem_host::config::PluginLimits;
use idem_host::message::InboundMessage;
use idem_host::sandbox::PluginRuntime;
use idem_host::sandbox::cache::Compiled;
use idem_host::telemetry::metrics::Metrics;

const LOYALTY_PLUGINS: [&str; 4] = ["loyalty", "loyalty-py", "loyalty-js", "loyalty-c"];

const CORPUS: &str = "tests/conformance/loyalty.json";

/// Every loyalty plugin passes the conformance corpus through `idem test` (a fresh instance
/// per message), and again in instances reused across messages
/// (`limits.messages_per_instance`), twice through; and the languages agree exactly, reasons
/// included where no JSON parser's wording is involved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_loyalty_plugin_passes_the_conformance_corpus() {
    let corpus = Path::new(REPO_ROOT).join(CORPUS);
    let cases = cases::load(&corpus).expect("conformance corpus");
    let runtime = PluginRuntime::new().expect("runtime");
    let reused = PluginLimits {
        messages_per_instance: 1000.try_into().expect("non-zero"),
        ..PluginLimits::default()
    };
    let mut failures = Vec::new();
    let mut outcomes_by_plugin = Vec::new();
    for plugin_name in LOYALTY_PLUGINS {
        let path = plugin_path(plugin_name);
        let tested = Command::new(idem_binary())
            .args(["test", "--plugin"])
            .arg(&path)
            .arg("--cases")
            .arg(&corpus)
            .output()
            .expect("idem test");
        let report = String::from_utf8_lossy(&tested.stdout).into_owned();
        if !tested.status.success() {
            failures.push(format!("idem test {plugin_name}:\n{report}"));
        }
        assert!(
            report.contains(&format!("{0} case(s): {0} passed, 0 failed", cases.len()))
                || !tested.status.success(),
            "{report}"
        );

        let loading_runtime = runtime.clone();
        let plugin = tokio::task::spawn_blocking(move || loading_runtime.load(&path))
            .await
            .expect("join")
            .unwrap_or_else(|error| panic!("{plugin_name}: {error}"));
        let trial = Trial {
            runtime: &runtime,
            plugin: &plugin,
            limits: &reused,
            origin: Origin {
                pipeline: "loyalty",
                source: "rabbitmq",
                queue: "orders",
            },
            fit: None,
        };
        let mut outcomes = Vec::new();
        for pass in 0..2 {
            for case in &cases {
                let differences = trial.differences(case).await;
                if !differences.is_empty() {
                    failures.push(format!(
                        "{plugin_name} / {} (reused instances, pass {pass}): {}",
                        case.name,
                        differences.join("; ")
                    ));
                }
                let message = case.message(&trial.origin);
                let outcome =
                    cases::outcome_json(&runtime.invoke(&plugin, &reused, &message).await);
                if pass == 0 {
                    outcomes.push(outcome);
                }
            }
        }
        outcomes_by_plugin.push((plugin_name, outcomes));
    }
    assert!(
        failures.is_empty(),
        "conformance failures:\n{}",
        failures.join("\n")
    );
    let (reference_name, reference) = &outcomes_by_plugin[0];
    for (plugin_name, outcomes) in &outcomes_by_plugin[1..] {
        for ((case, expected), actual) in cases.iter().zip(reference).zip(outcomes) {
            let parser_worded = expected["reason"]
                .as_str()
                .is_some_and(|reason| reason.starts_with("body is not valid JSON"));
            if !parser_worded {
                assert_eq!(
                    actual, expected,
                    "{plugin_name} and {reference_name} differ on {:?}",
                    case.name
                );
            }
        }
    }
}

/// The demo pipeline on the Python plugin, hot-swapped to the JavaScript one mid-stream,
/// credits 1,000 orders delivered with duplicates exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_then_javascript_serve_the_demo_pipeline_exactly_once() {
    let python = plugin_path("loyalty-py");
    let javascript = plugin_path("loyalty-js");
    let env = TestEnv::new("languages").await;
    let directory = std::env::temp_dir().join(format!("{}-plugins", env.database));
    std::fs::create_dir_all(&directory).expect("plugin dir");
    let slot = directory.join("loyalty.wasm");
    std::fs::copy(&python, &slot).expect("install Python plugin");
    let config_text = env.config_text("loyalty", "").replace(
        &plugin_path("loyalty").display().to_string(),
        &slot.display().to_string(),
    );
    let config =
        idem_host::config::Config::from_toml(Path::new("/tmp/languages.toml"), &config_text)
            .expect("valid config");
    let metrics = Arc::new(Metrics::new());
    let host = env.start_host_with_metrics(config, Arc::clone(&metrics));

    let total = |order_id: i64| 250 + (order_id * 53) % 5000;
    let publish = |orders: std::ops::RangeInclusive<i64>| {
        let queue = env.queue.clone();
        tokio::spawn(async move {
            let (_connection, channel) = idem_e2e::connect_channel().await;
            for order_id in orders {
                idem_e2e::publish(
                    &channel,
                    &queue,
                    &order(order_id, order_id % 30, total(order_id)),
                )
                .await;
                if order_id % 5 == 0 {
                    // Every fifth order is delivered again.
                    idem_e2e::publish(
                        &channel,
                        &queue,
                        &order(order_id, order_id % 30, total(order_id)),
                    )
                    .await;
                }
            }
        })
    };
    // The first half on Python, the second half on JavaScript.
    publish(1..=500).await.expect("publisher");
    wait_for(
        "the Python plugin to credit 500 orders",
        Duration::from_secs(120),
        || async { env.count("SELECT count(*) FROM point_ledger").await == 500 },
    )
    .await;
    let staging = slot.with_extension("staging");
    std::fs::copy(&javascript, &staging).expect("stage JavaScript plugin");
    std::fs::rename(&staging, &slot).expect("swap to JavaScript");
    wait_for(
        "the swap to JavaScript",
        Duration::from_secs(120),
        || async { metrics.plugin_reloads("loyalty", "applied") == 1 },
    )
    .await;
    publish(501..=1000).await.expect("publisher");
    wait_for("1,000 ledger rows", Duration::from_secs(180), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 1000
    })
    .await;
    wait_for("the queue to drain", Duration::from_secs(60), || async {
        env.ready(&env.queue).await == 0 && unacked(&env.queue) == 0
    })
    .await;
    host.stop().await.expect("host stops");

    env.assert_loyalty_consistent().await;
    let expected_points: i64 = (1..=1000).map(|order_id| total(order_id) / 100).sum();
    assert_eq!(
        env.count("SELECT sum(points)::int8 FROM balances").await,
        expected_points
    );
    assert_eq!(metrics.messages("loyalty", "applied"), 1000);
    assert_eq!(metrics.messages("loyalty", "duplicate"), 200);
    let per_build = env
        .count("SELECT min(claims) FROM (SELECT count(*) AS claims FROM processed_messages GROUP BY plugin_digest) per_build")
        .await;
    assert_eq!(
        per_build, 500,
        "not 500 orders by each of the Python and JavaScript builds"
    );
    assert_eq!(
        env.count("SELECT count(DISTINCT plugin_digest) FROM processed_messages")
            .await,
        2
    );
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0);
    let _ = std::fs::remove_dir_all(directory);
    env.cleanup().await;
}

/// The compiled-component cache: the first load compiles and stores, a new runtime on the
/// same directory loads the stored build (and decides the same), and a damaged file is
/// detected, rebuilt and replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compiled_plugins_are_cached_verified_and_rebuilt() {
    let directory = std::env::temp_dir().join(format!(
        "idem-compile-cache-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let load = |plugin_name: &'static str| {
        let directory = directory.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let runtime = PluginRuntime::build(Some(directory), None).expect("runtime");
                let started = std::time::Instant::now();
                let plugin = runtime
                    .load(&plugin_path(plugin_name))
                    .unwrap_or_else(|error| panic!("{plugin_name}: {error}"));
                (runtime, plugin, started.elapsed())
            })
            .await
            .expect("join")
        }
    };
    let message = InboundMessage {
        pipeline: "loyalty".into(),
        body: br#"{"order_id": 7, "customer_id": 3, "total_cents": 1250}"#.to_vec(),
        ..InboundMessage::default()
    };
    let limits = PluginLimits::default();
    for plugin_name in LOYALTY_PLUGINS {
        let (_, fresh, compile_time) = load(plugin_name).await;
        assert_eq!(fresh.compiled, Compiled::Fresh, "{plugin_name}");
        let (runtime, cached, cached_time) = load(plugin_name).await;
        assert_eq!(cached.compiled, Compiled::Cached, "{plugin_name}");
        assert_eq!(cached.digest, fresh.digest);
        let decided = cases::outcome_json(&runtime.invoke(&cached, &limits, &message).await);
        assert_eq!(decided["outcome"], "decision", "{plugin_name}: {decided}");
        eprintln!(
            "compile cache: {plugin_name} compiled in {compile_time:?}, loaded from the cache in {cached_time:?}"
        );
    }
    let stored: Vec<_> = std::fs::read_dir(&directory)
        .expect("cache directory")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| {
            path.extension()
                .is_some_and(|extension| extension == "cwasm")
        })
        .collect();
    assert_eq!(stored.len(), LOYALTY_PLUGINS.len(), "{stored:?}");
    // Damage the Rust build's file: it is rebuilt, not loaded.
    let (_, rust, _) = load("loyalty").await;
    let damaged = stored
        .iter()
        .find(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| rust.digest.ends_with(name.split('-').next().unwrap_or("?")))
        })
        .expect("the Rust build's file");
    let mut bytes = std::fs::read(damaged).expect("read");
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(damaged, &bytes).expect("damage");
    let (_, rebuilt, _) = load("loyalty").await;
    assert_eq!(
        rebuilt.compiled,
        Compiled::Fresh,
        "a damaged file was loaded"
    );
    let (_, again, _) = load("loyalty").await;
    assert_eq!(
        again.compiled,
        Compiled::Cached,
        "the rebuilt file was not stored"
    );
    let _ = std::fs::remove_dir_all(&directory);
}
