//! Plugin contracts across host releases: a plugin built for the previous `idem:plugin`
//! contract keeps running (adapted to the current one) and is named deprecated; one built for
//! a contract the host does not run is refused in one line saying what to do.

use std::time::Duration;

use idem_e2e::{TestEnv, must_run, plugin_path, wait_for};
use idem_host::config::PluginLimits;
use idem_host::effect::{Effect, Outcome, Value};
use idem_host::message::InboundMessage;
use idem_host::sandbox::{PluginError, PluginRuntime, contract};
use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, QueueBindOptions};
use lapin::types::{FieldTable, ShortString};

/// The fixture plugin built for `idem:plugin@0.2.0` (plugins/routes-0-2).
const LEGACY_PLUGIN: &str = "routes-0-2";

/// The 0.2.0 plugin's message is made from the current one: RabbitMQ's exchange and routing
/// key from the attributes, a JetStream subject as the routing key with no exchange; what it
/// returns (a decision, an invalid-input failure) converts as a current plugin's does, in
/// fresh and in reused instances.
#[tokio::test]
async fn a_plugin_built_for_0_2_0_gets_its_message_adapted() {
    idem_e2e::init_logging();
    let runtime = PluginRuntime::new().expect("runtime");
    let path = plugin_path(LEGACY_PLUGIN);
    let plugin = tokio::task::spawn_blocking({
        let runtime = runtime.clone();
        move || runtime.load(&path)
    })
    .await
    .expect("join")
    .expect("a plugin built for idem:plugin@0.2.0 loads");
    assert_eq!(plugin.contract, contract::V0_2_0);
    let rabbitmq = InboundMessage {
        pipeline: "routes".into(),
        source: "rabbitmq".into(),
        queue: "orders".into(),
        subject: "orders.eu".into(),
        body: b"first".to_vec(),
        message_id: Some("m-1".into()),
        attributes: vec![
            ("exchange".into(), "events".into()),
            ("routing-key".into(), "orders.eu".into()),
        ],
        ..InboundMessage::default()
    };
    let jetstream = InboundMessage {
        pipeline: "routes".into(),
        source: "jetstream".into(),
        queue: "ORDERS".into(),
        subject: "orders.us".into(),
        body: b"second".to_vec(),
        delivery_count: Some(1),
        attributes: vec![("stream-sequence".into(), "7".into())],
        ..InboundMessage::default()
    };
    let empty = InboundMessage {
        body: Vec::new(),
        ..rabbitmq.clone()
    };
    let reused = PluginLimits {
        messages_per_instance: 100.try_into().expect("non-zero"),
        ..PluginLimits::default()
    };
    for limits in [PluginLimits::default(), reused] {
        for _ in 0..3 {
            let outcome = runtime.invoke(&plugin, &limits, &rabbitmq).await;
            assert_eq!(
                route(outcome),
                (
                    "route:m-1".into(),
                    ["events", "orders.eu", "first"].map(String::from).to_vec()
                )
            );
            let outcome = runtime.invoke(&plugin, &limits, &jetstream).await;
            assert_eq!(
                route(outcome),
                (
                    "route:second".into(),
                    ["", "orders.us", "second"].map(String::from).to_vec()
                )
            );
            match runtime.invoke(&plugin, &limits, &empty).await {
                Err(PluginError::Rejected(failure)) => {
                    assert_eq!(failure.kind.as_str(), "invalid-input");
                    assert_eq!(failure.reason, "empty body");
                }
                other => panic!("an empty body was not invalid input: {other:?}"),
            }
        }
    }
}

/// The key and the text parameters of the 0.2.0 plugin's one `record_route` effect.
fn route(outcome: Result<Outcome, PluginError>) -> (String, Vec<String>) {
    let Ok(Outcome::Decision(decision)) = outcome else {
        panic!("expected a decision, got {outcome:?}");
    };
    let [Effect::Exec { statement, params }] = decision.effects.as_slice() else {
        panic!("expected one exec effect: {:?}", decision.effects);
    };
    assert_eq!(statement, "record_route");
    let texts = params
        .iter()
        .map(|param| match param {
            Value::Text(text) => text.clone(),
            other => panic!("expected text parameters, got {other:?}"),
        })
        .collect();
    (decision.key, texts)
}

/// A team's plugin built for idem:plugin@0.2.0 serves a RabbitMQ pipeline on this host:
/// messages published through an exchange and straight to the queue are each recorded once
/// (redeliveries of the same message id claimed once) with the exchange and routing key they
/// were published with; its invalid input is dead-lettered; `idem check` names its contract
/// as deprecated, with what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_built_for_0_2_0_serves_a_pipeline() {
    let env = TestEnv::new("contract_0_2_0").await;
    sqlx::query(
        "CREATE TABLE routes (exchange text NOT NULL, routing_key text NOT NULL, body text NOT NULL)",
    )
    .execute(&env.pool)
    .await
    .expect("create routes");
    let config_text = format!(
        r#"{}
[pipelines.routes]
queue = "{}"
consumer = "routes"
plugin = "{}"
dead_letter_queue = "{}"
workers = 4

[pipelines.routes.statements]
record_route = "INSERT INTO routes (exchange, routing_key, body) VALUES ($1, $2, $3)"
"#,
        env.config_header(),
        env.queue,
        plugin_path(LEGACY_PLUGIN).display(),
        env.dead_letter_queue,
    );
    let config_path = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(&config_path, &config_text).expect("write config");
    let checked = must_run(
        std::process::Command::new(idem_e2e::idem_binary())
            .args(["check", "--config"])
            .arg(&config_path),
    );
    for fragment in [
        "idem:plugin@0.2.0 (deprecated: rebuild against idem:plugin@",
        "idem wit --out",
    ] {
        assert!(
            checked.contains(fragment),
            "idem check lacks {fragment:?}:\n{checked}"
        );
    }

    let routing_key = format!("{}.eu", env.queue);
    env.channel
        .queue_bind(
            ShortString::from(env.queue.as_str()),
            ShortString::from("amq.topic"),
            ShortString::from(routing_key.as_str()),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the queue to amq.topic");
    let host = env.start_host(
        idem_host::config::Config::from_toml(&config_path, &config_text).expect("config"),
    );
    // 20 messages through the exchange, each published twice (a producer's retry), 5 straight
    // to the queue, and one the plugin calls invalid.
    for round in 0..2 {
        for index in 0..20 {
            publish(
                &env,
                "amq.topic",
                &routing_key,
                &format!("via-exchange-{index}"),
                &format!("x-{index}"),
            )
            .await;
        }
        if round == 0 {
            for index in 0..5 {
                publish(
                    &env,
                    "",
                    &env.queue,
                    &format!("direct-{index}"),
                    &format!("d-{index}"),
                )
                .await;
            }
            publish(&env, "", &env.queue, "", "empty").await;
        }
    }
    wait_for(
        "every message recorded or dead-lettered",
        Duration::from_secs(60),
        || async {
            env.count("SELECT count(*) FROM routes").await == 25
                && env.ready(&env.dead_letter_queue).await == 1
        },
    )
    .await;
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM routes WHERE exchange = 'amq.topic' AND routing_key = '{routing_key}' AND body LIKE 'via-exchange-%'"
        ))
        .await,
        20
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM routes WHERE exchange = '' AND routing_key = '{}' AND body LIKE 'direct-%'",
            env.queue
        ))
        .await,
        5
    );
    assert_eq!(
        env.count("SELECT count(DISTINCT body) FROM routes").await,
        25
    );
    host.stop().await.expect("host stops cleanly");
    let _ = std::fs::remove_file(&config_path);
    env.cleanup().await;
}

/// Publishes `body` with `message_id` to `exchange` with `routing_key`, confirmed.
async fn publish(env: &TestEnv, exchange: &str, routing_key: &str, body: &str, message_id: &str) {
    let confirm = env
        .channel
        .basic_publish(
            ShortString::from(exchange),
            ShortString::from(routing_key),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body.as_bytes(),
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(ShortString::from(message_id)),
        )
        .await
        .expect("publish")
        .await
        .expect("publish confirm");
    assert!(confirm.is_ack(), "broker refused a test message");
}

/// A plugin built for a contract the host does not run is refused before it is compiled,
/// with one message naming both versions and how to rebuild it; one built for the current
/// contract records it.
#[tokio::test]
async fn a_plugin_for_another_contract_is_refused_naming_both_versions() {
    let body = |version: &str| {
        format!(
            r#"(module
                 (memory (export "memory") 1)
                 (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32) i32.const 1024)
                 (func (export "idem:plugin/handler@{version}#handle") (param i32) (result i32)
                   unreachable))"#
        )
    };
    let runtime = PluginRuntime::new().expect("runtime");
    let current = contract::current();
    let plugin = runtime
        .load_bytes(
            std::path::Path::new("current.wasm"),
            &crate::sandbox::component_for_contract(&body(current), current),
        )
        .expect("a plugin for the current contract loads");
    assert_eq!(plugin.contract, current);
    // Every plugin this repository builds, in each language, names the contract it was built
    // for: the current one, but for the fixture built for the one before.
    let dist = idem_e2e::plugin_path("loyalty");
    let dist = dist.parent().expect("plugins/dist");
    for entry in std::fs::read_dir(dist).expect("plugins/dist") {
        let path = entry.expect("entry").path();
        // `other-world` is the fixture of a component that implements no idem:plugin world.
        if path
            .extension()
            .is_some_and(|extension| extension == "wasm")
            && path.file_stem().is_some_and(|stem| stem != "other-world")
        {
            let bytes = std::fs::read(&path).expect("read plugin");
            let built_for = if path.file_stem().is_some_and(|stem| stem == LEGACY_PLUGIN) {
                contract::V0_2_0
            } else {
                current
            };
            assert_eq!(
                contract::of_component(&bytes).as_deref(),
                Some(built_for),
                "{}",
                path.display()
            );
        }
    }
    // Built for a contract newer than this host's (and likewise for one it no longer runs).
    let newer = crate::sandbox::component_for_contract(&body("0.4.0"), "0.4.0");
    assert_eq!(contract::of_component(&newer).as_deref(), Some("0.4.0"));
    match runtime.load_bytes(std::path::Path::new("newer.wasm"), &newer) {
        Err(error @ PluginError::Contract { .. }) => {
            let message = error.to_string();
            for fragment in [
                "newer.wasm",
                "built for idem:plugin@0.4.0",
                &format!("it runs idem:plugin@{current}, idem:plugin@0.2.0"),
                "idem wit --out",
                "idem build",
            ] {
                assert!(message.contains(fragment), "{message:?} lacks {fragment:?}");
            }
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a plugin for idem:plugin@0.4.0 loaded"),
    }
}
