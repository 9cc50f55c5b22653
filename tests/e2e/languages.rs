//! Plugins in any language: the loyalty consumer in Rust, Python and JavaScript must decide
//! identically (the conformance corpus), and serve a pipeline interchangeably.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use idem_e2e::{REPO_ROOT, TestEnv, order, plugin_path, unacked, wait_for};
use idem_host::config::PluginLimits;
use idem_host::effect::{Effect, FailureKind, Outcome, Value};
use idem_host::message::InboundMessage;
use idem_host::metrics::Metrics;
use idem_host::plugin::cache::Compiled;
use idem_host::plugin::{PluginError, PluginRuntime};

const LOYALTY_PLUGINS: [&str; 3] = ["loyalty", "loyalty-py", "loyalty-js"];

/// A plugin of the suite; a missing non-Rust build fails only the tests that need it.
fn require_plugin(name: &str) -> std::path::PathBuf {
    let path = plugin_path(name);
    assert!(
        path.is_file(),
        "{} is missing: its toolchain was not installed when the plugins were built. \
         Python: pip install componentize-py==0.25.1; JavaScript: (cd plugins/loyalty-js && npm ci); \
         then scripts/build-plugins.sh",
        path.display()
    );
    path
}

/// A decision, failure or skip rendered for comparison with the corpus.
fn render(result: &Result<Outcome, PluginError>) -> serde_json::Value {
    match result {
        Ok(Outcome::Decision(decision)) => serde_json::json!({
            "outcome": "decision",
            "key": decision.key,
            "effects": decision.effects.iter().map(|effect| {
                let Effect::Exec { statement, params } = effect else {
                    return serde_json::json!(format!("{effect:?}"));
                };
                let params: Vec<serde_json::Value> = params.iter().map(|value| match value {
                    Value::Integer(integer) => serde_json::json!(integer),
                    other => serde_json::json!(format!("{other:?}")),
                }).collect();
                serde_json::json!([statement, params])
            }).collect::<Vec<_>>(),
        }),
        Ok(Outcome::Skip { reason }) => serde_json::json!({ "outcome": "skip", "reason": reason }),
        Err(PluginError::Rejected(failure)) => serde_json::json!({
            "outcome": "failure",
            "kind": match failure.kind {
                FailureKind::InvalidInput => "invalid-input",
                FailureKind::Retryable => "retryable",
            },
            "reason": failure.reason,
        }),
        Err(other) => serde_json::json!({ "outcome": "error", "reason": other.to_string() }),
    }
}

fn matches(actual: &serde_json::Value, expected: &serde_json::Value) -> bool {
    match expected["outcome"].as_str() {
        Some("decision") => {
            actual["outcome"] == "decision"
                && actual["key"] == expected["key"]
                && actual["effects"] == expected["effects"]
        }
        Some("skip") | Some("failure") => {
            actual["outcome"] == expected["outcome"]
                && (expected["kind"].is_null() || actual["kind"] == expected["kind"])
                && actual["reason"]
                    .as_str()
                    .zip(expected["reason_contains"].as_str())
                    .is_some_and(|(reason, fragment)| reason.contains(fragment))
        }
        _ => false,
    }
}

fn corpus() -> Vec<(String, Vec<u8>, serde_json::Value)> {
    let text = std::fs::read_to_string(Path::new(REPO_ROOT).join("tests/conformance/loyalty.json"))
        .expect("conformance corpus");
    let corpus: serde_json::Value = serde_json::from_str(&text).expect("corpus is JSON");
    corpus["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|case| {
            let body = match (case["body"].as_str(), case["body_hex"].as_str()) {
                (Some(body), _) => body.as_bytes().to_vec(),
                (None, Some(hex)) => (0..hex.len())
                    .step_by(2)
                    .map(|index| u8::from_str_radix(&hex[index..index + 2], 16).expect("hex"))
                    .collect(),
                (None, None) => panic!("case without body: {case}"),
            };
            (
                case["name"].as_str().expect("name").to_string(),
                body,
                case["expect"].clone(),
            )
        })
        .collect()
}

/// Every loyalty plugin gives the corpus's decision for every message, in a fresh instance
/// per message and in instances reused across messages (`limits.messages_per_instance`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_loyalty_plugin_passes_the_conformance_corpus() {
    let runtime = PluginRuntime::new().expect("runtime");
    let fresh = PluginLimits::default();
    let reused = PluginLimits {
        messages_per_instance: 1000.try_into().expect("non-zero"),
        ..PluginLimits::default()
    };
    let cases = corpus();
    let mut mismatches = Vec::new();
    let mut decisions_by_plugin = Vec::new();
    for plugin_name in LOYALTY_PLUGINS {
        let path = require_plugin(plugin_name);
        let loading_runtime = runtime.clone();
        let plugin = tokio::task::spawn_blocking(move || loading_runtime.load(&path))
            .await
            .expect("join")
            .unwrap_or_else(|error| panic!("{plugin_name}: {error}"));
        let mut decisions = Vec::new();
        for (instances, limits) in [("fresh", &fresh), ("reused", &reused)] {
            // Twice through in reused instances: the second pass meets what the first left.
            let passes = if instances == "fresh" { 1 } else { 2 };
            for pass in 0..passes {
                for (index, (name, body, expected)) in cases.iter().enumerate() {
                    let message = InboundMessage {
                        pipeline: "loyalty".into(),
                        body: body.clone(),
                        ..InboundMessage::default()
                    };
                    let actual = render(&runtime.invoke(&plugin, limits, &message).await);
                    if !matches(&actual, expected) {
                        mismatches.push(format!(
                            "{plugin_name} / {name} ({instances} instances): got {actual}, expected {expected}"
                        ));
                    }
                    match decisions.get(index) {
                        None => decisions.push(actual),
                        Some(first) => assert_eq!(
                            &actual, first,
                            "{plugin_name} decided {name:?} differently in {instances} instances (pass {pass})"
                        ),
                    }
                }
            }
        }
        decisions_by_plugin.push((plugin_name, decisions));
    }
    assert!(
        mismatches.is_empty(),
        "conformance failures:\n{}",
        mismatches.join("\n")
    );
    // Decisions and skips must also agree exactly between languages, reasons included
    // where no JSON parser's wording is involved.
    let (reference_name, reference) = &decisions_by_plugin[0];
    for (plugin_name, decisions) in &decisions_by_plugin[1..] {
        for ((name, _, _), (expected, actual)) in cases.iter().zip(reference.iter().zip(decisions))
        {
            let parser_worded = expected["reason"]
                .as_str()
                .is_some_and(|reason| reason.starts_with("body is not valid JSON"));
            if !parser_worded {
                assert_eq!(
                    actual, expected,
                    "{plugin_name} and {reference_name} differ on {name:?}"
                );
            }
        }
    }
}

/// The demo pipeline on the Python plugin, hot-swapped to the JavaScript one mid-stream,
/// credits 1,000 orders delivered with duplicates exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_then_javascript_serve_the_demo_pipeline_exactly_once() {
    let python = require_plugin("loyalty-py");
    let javascript = require_plugin("loyalty-js");
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
                    .load(&require_plugin(plugin_name))
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
        let decided = render(&runtime.invoke(&cached, &limits, &message).await);
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
