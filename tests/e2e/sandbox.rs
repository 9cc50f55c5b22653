//! Plugins are user code: a runaway plugin loses its own message and nothing else.

use std::time::{Duration, Instant};

use idem_e2e::{TestEnv, order, pipeline_table, plugin_path, unacked, wait_for};

/// An infinite loop, a 1 GiB allocation, unbounded growth and a trap in one pipeline each
/// dead-letter their message within the deadline, while a healthy pipeline in the same host
/// credits 1,000 orders correctly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runaway_plugins_are_dead_lettered_while_a_healthy_pipeline_serves() {
    let env = TestEnv::new("runaway").await;
    let (chaos_queue, chaos_dead_letters) = env.extra_queues("chaos").await;
    let config_text = format!(
        "{}{}{}",
        env.config_header(),
        pipeline_table(
            "loyalty",
            &env.queue,
            &env.dead_letter_queue,
            &plugin_path("loyalty"),
            ""
        ),
        pipeline_table(
            "chaos",
            &chaos_queue,
            &chaos_dead_letters,
            &plugin_path("chaos"),
            "[pipelines.chaos.limits]\ndeadline_ms = 500\nmemory_mib = 64",
        ),
    );
    // The host runs as its own process, so its peak memory is its own, not the test
    // binary's (other tests compile large plugins in this process).
    let config_path = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(&config_path, &config_text).expect("write config");
    let mut host = idem_e2e::spawn_idem(&config_path, &[]);

    // The infinite loop alone first, to time it against its 500 ms deadline.
    let published = Instant::now();
    idem_e2e::publish(&env.channel, &chaos_queue, br#"{"action": "loop"}"#).await;
    wait_for(
        "the looping message to be dead-lettered",
        Duration::from_secs(20),
        || async { env.ready(&chaos_dead_letters).await == 1 },
    )
    .await;
    let loop_elapsed = published.elapsed();
    assert!(
        loop_elapsed < Duration::from_millis(2_500),
        "the looping plugin took {loop_elapsed:?} to be stopped (deadline 500 ms)"
    );

    let loyalty = {
        let queue = env.queue.clone();
        tokio::spawn(async move {
            let (_connection, channel) = idem_e2e::connect_channel().await;
            for order_id in 1..=1000 {
                idem_e2e::publish(
                    &channel,
                    &queue,
                    &order(order_id, order_id % 10, 1000 + order_id),
                )
                .await;
            }
        })
    };
    for action in ["alloc-1g", "alloc", "trap", "loop"] {
        idem_e2e::publish(
            &env.channel,
            &chaos_queue,
            format!("{{\"action\": \"{action}\"}}").as_bytes(),
        )
        .await;
    }
    loyalty.await.expect("publisher");

    wait_for("1,000 ledger rows", Duration::from_secs(120), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 1000
    })
    .await;
    wait_for(
        "five chaos dead letters",
        Duration::from_secs(30),
        || async { env.ready(&chaos_dead_letters).await == 5 },
    )
    .await;
    wait_for("both queues to drain", Duration::from_secs(30), || async {
        env.ready(&env.queue).await == 0
            && env.ready(&chaos_queue).await == 0
            && unacked(&env.queue) == 0
            && unacked(&chaos_queue) == 0
    })
    .await;
    assert!(
        host.try_wait().expect("host status").is_none(),
        "the host stopped"
    );
    // A 1 GiB allocation that had been allowed would have shown in the peak.
    let peak = idem_e2e::peak_rss_mib(host.id());
    let status = host.terminate();
    assert!(
        status.success(),
        "the host should exit 0 on SIGTERM, got {status}"
    );

    let dead = env.drain(&chaos_dead_letters).await;
    let kinds: Vec<(String, String)> = dead
        .iter()
        .map(|(body, headers)| {
            let kind = headers
                .iter()
                .find(|(name, _)| name == "x-idem-error-kind")
                .map(|(_, kind)| kind.clone())
                .unwrap_or_default();
            (body.clone(), kind)
        })
        .collect();
    let kind_of = |action: &str| -> Vec<&str> {
        kinds
            .iter()
            .filter(|(body, _)| body.contains(&format!("\"{action}\"")))
            .map(|(_, kind)| kind.as_str())
            .collect()
    };
    assert_eq!(
        kind_of("loop"),
        ["plugin-deadline", "plugin-deadline"],
        "{kinds:?}"
    );
    assert_eq!(kind_of("alloc-1g"), ["plugin-memory"], "{kinds:?}");
    assert_eq!(kind_of("alloc"), ["plugin-memory"], "{kinds:?}");
    assert_eq!(kind_of("trap"), ["plugin-trap"], "{kinds:?}");
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0);
    env.assert_loyalty_consistent().await;
    assert!(
        peak < 900,
        "peak RSS {peak} MiB: a plugin's allocation escaped its limit"
    );
    env.cleanup().await;
}

/// A component whose core module declares three memories (64 KiB + 40 MiB + 40 MiB): each is
/// under a 64 MiB `memory_mib`, together they are over it. The limit bounds the instance's
/// memories together, so the call fails as `plugin-memory`; with room for all three it runs.
#[tokio::test]
async fn memory_limit_bounds_all_memories_of_an_instance_together() {
    use idem_host::config::PluginLimits;
    use idem_host::message::InboundMessage;
    use idem_host::sandbox::{PluginError, PluginRuntime};

    let component = component_from_wat(
        r#"(module
             (memory (export "memory") 1)
             (memory $second 640)
             (memory $third 640)
             (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32) i32.const 1024)
             (func (export "idem:plugin/handler@0.3.0#handle")
               ;; The message flattens to more than 16 values, so it is passed by pointer.
               (param i32) (result i32)
               unreachable))"#,
    );
    let runtime = PluginRuntime::new().expect("runtime");
    let plugin = runtime
        .load_bytes(std::path::Path::new("three-memories.wasm"), &component)
        .expect("the component fits the plugin world");
    let message = InboundMessage {
        pipeline: "memories".into(),
        body: b"{}".to_vec(),
        ..InboundMessage::default()
    };
    let limits = |memory_mib: u32| PluginLimits {
        memory_mib: memory_mib.try_into().expect("non-zero"),
        ..PluginLimits::default()
    };
    match runtime.invoke(&plugin, &limits(64), &message).await {
        Err(PluginError::MemoryExceeded { limit_mib: 64 }) => {}
        other => panic!("three memories of 80 MiB in all ran under a 64 MiB limit: {other:?}"),
    }
    // With room for all three, the instance is created and the call reaches its body (a trap).
    match runtime.invoke(&plugin, &limits(96), &message).await {
        Err(PluginError::Trap { .. }) => {}
        other => panic!("expected the body's trap under a 96 MiB limit: {other:?}"),
    }
}

/// A component implementing the plugin world from a core module in WAT.
fn component_from_wat(text: &str) -> Vec<u8> {
    component_for_contract(text, idem_host::sandbox::contract::current())
}

/// [`component_from_wat`] built against the contract as if its version were `version`.
pub(crate) fn component_for_contract(text: &str, version: &str) -> Vec<u8> {
    let mut module = wat::parse_str(text).expect("core module");
    let mut resolve = wit_parser::Resolve::default();
    let wit = idem_host::sandbox::WORLD_WIT.replace(
        &format!("idem:plugin@{}", idem_host::sandbox::contract::current()),
        &format!("idem:plugin@{version}"),
    );
    let package = resolve
        .push_str("world.wit", &wit)
        .expect("the plugin contract");
    let world = resolve
        .select_world(&[package], Some("plugin"))
        .expect("the plugin world");
    wit_component::embed_component_metadata(
        &mut module,
        &resolve,
        world,
        wit_component::StringEncoding::UTF8,
    )
    .expect("embed the contract");
    wit_component::ComponentEncoder::default()
        .module(&module)
        .expect("module")
        .validate(true)
        .encode()
        .expect("component")
}

/// Every message gets a fresh instance, also when instances come from the pool and reuse its
/// slots: a plugin that marks its memory and a global on each call never finds the mark of an
/// earlier call (it would trap with `unreachable`; a clean call ends with its divide by zero).
#[tokio::test]
async fn no_state_survives_from_one_message_to_the_next() {
    use idem_host::config::PluginLimits;
    use idem_host::message::InboundMessage;
    use idem_host::sandbox::pool::PoolSize;
    use idem_host::sandbox::{PluginError, PluginRuntime};

    idem_e2e::init_logging();
    let component = component_from_wat(
        r#"(module
             (memory (export "memory") 1)
             (global $called (mut i32) (i32.const 0))
             (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32) i32.const 1024)
             (func (export "idem:plugin/handler@0.3.0#handle")
               ;; The message flattens to more than 16 values, so it is passed by pointer.
               (param i32) (result i32)
               (if (i32.or (i32.load (i32.const 64)) (global.get $called))
                 (then unreachable))
               (i32.store (i32.const 64) (i32.const 1))
               (global.set $called (i32.const 1))
               ;; Run for a few epoch ticks, so concurrent calls overlap.
               (global.set $called (i32.const 5000000))
               (loop $spin
                 (global.set $called (i32.sub (global.get $called) (i32.const 1)))
                 (br_if $spin (global.get $called)))
               (global.set $called (i32.const 1))
               (i32.div_u (i32.const 1) (i32.const 0))))"#,
    );
    let message = InboundMessage {
        pipeline: "state".into(),
        body: b"{}".to_vec(),
        ..InboundMessage::default()
    };
    let pooled = PoolSize {
        instances: 2,
        memory_bytes: 64 << 20,
    };
    for (allocation, pool) in [("on demand", None), ("pooled", Some(pooled))] {
        let runtime = PluginRuntime::build(None, pool).expect("runtime");
        let plugin = runtime
            .load_bytes(std::path::Path::new("marks-its-state.wasm"), &component)
            .expect("the component fits the plugin world");
        for call in 1..=20 {
            match runtime
                .invoke(&plugin, &PluginLimits::default(), &message)
                .await
            {
                Err(PluginError::Trap { reason }) if reason.contains("divide by zero") => {}
                other => panic!("{allocation}, call {call}: state from an earlier call: {other:?}"),
            }
        }
    }
    // More calls at once than the pool has slots: the extra ones wait for a slot; none fails.
    let runtime = PluginRuntime::build(
        None,
        Some(PoolSize {
            instances: 1,
            ..pooled
        }),
    )
    .expect("runtime");
    let plugin = runtime
        .load_bytes(std::path::Path::new("marks-its-state.wasm"), &component)
        .expect("the component fits the plugin world");
    let limits = PluginLimits::default();
    let calls = (0..8).map(|_| runtime.invoke(&plugin, &limits, &message));
    for called in futures::future::join_all(calls).await {
        assert!(
            matches!(&called, Err(PluginError::Trap { reason }) if reason.contains("divide by zero")),
            "a call found no free slot: {called:?}"
        );
    }
}

/// With `limits.messages_per_instance = 3`, an instance serves at most three messages, a
/// failure retires it, and a hot swap starts the new build afresh; with the default (1)
/// every message, sequential or concurrent, meets a fresh instance. The chaos plugin's
/// `count` action reports how many calls its instance has served.
#[tokio::test]
async fn reused_instances_serve_a_bounded_number_of_messages_and_never_survive_a_failure() {
    use idem_host::config::PluginLimits;
    use idem_host::effect::Outcome;
    use idem_host::message::InboundMessage;
    use idem_host::sandbox::pool::PoolSize;
    use idem_host::sandbox::{PluginError, PluginRuntime};

    idem_e2e::init_logging();
    let message = |action: &str| InboundMessage {
        pipeline: "reuse".into(),
        body: format!(r#"{{"action": "{action}"}}"#).into_bytes(),
        ..InboundMessage::default()
    };
    let count = message("count");
    let runtime = PluginRuntime::build(
        None,
        Some(PoolSize {
            instances: 4,
            memory_bytes: 64 << 20,
        }),
    )
    .expect("runtime");
    let plugin = runtime.load(&plugin_path("chaos")).expect("chaos plugin");
    async fn served(
        runtime: &PluginRuntime,
        plugin: &idem_host::sandbox::LoadedPlugin,
        limits: &PluginLimits,
        message: &InboundMessage,
    ) -> String {
        match runtime.invoke(plugin, limits, message).await {
            Ok(Outcome::Skip { reason }) => reason,
            other => panic!("count: {other:?}"),
        }
    }

    let fresh = PluginLimits::default();
    for _ in 0..5 {
        assert_eq!(served(&runtime, &plugin, &fresh, &count).await, "call 1");
    }
    let concurrent = (0..4).map(|_| served(&runtime, &plugin, &fresh, &count));
    for reason in futures::future::join_all(concurrent).await {
        assert_eq!(reason, "call 1", "state leaked between concurrent messages");
    }

    let reuse = PluginLimits {
        messages_per_instance: 3.try_into().expect("non-zero"),
        ..PluginLimits::default()
    };
    let mut seen = Vec::new();
    for _ in 0..7 {
        seen.push(served(&runtime, &plugin, &reuse, &count).await);
    }
    assert_eq!(
        seen,
        [
            "call 1", "call 2", "call 3", "call 1", "call 2", "call 3", "call 1"
        ]
    );
    // A failure (here the plugin's own rejection) retires the instance that served it.
    match runtime.invoke(&plugin, &reuse, &message("invalid")).await {
        Err(PluginError::Rejected(failure)) => assert!(failure.reason.contains("asked to fail")),
        other => panic!("invalid: {other:?}"),
    }
    assert_eq!(served(&runtime, &plugin, &reuse, &count).await, "call 1");
    // A trap too; the message is tried once more in a fresh instance, which traps as well.
    match runtime.invoke(&plugin, &reuse, &message("trap")).await {
        Err(PluginError::Trap { .. }) => {}
        other => panic!("trap: {other:?}"),
    }
    assert_eq!(served(&runtime, &plugin, &reuse, &count).await, "call 1");
    assert_eq!(served(&runtime, &plugin, &reuse, &count).await, "call 2");
    // A retired build (replaced by a hot swap) keeps no instance for its next call.
    plugin.retire();
    assert_eq!(served(&runtime, &plugin, &reuse, &count).await, "call 1");
    assert_eq!(served(&runtime, &plugin, &reuse, &count).await, "call 1");
}
