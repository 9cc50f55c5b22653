//! Per-message plugin overhead: instantiate a fresh sandbox and call the loyalty plugin,
//! against a native Rust baseline computing the same decision in the same run.
//!
//! Run with `bench/plugin-overhead.sh` (release build).

use std::path::Path;
use std::time::{Duration, Instant};

use idem_bench::{Percentiles, micros};
use idem_host::config::PluginLimits;
use idem_host::effect::{Decision, Effect, Outcome, Value};
use idem_host::message::InboundMessage;
use idem_host::plugin::PluginRuntime;

const WARMUP: usize = 1_000;
const MESSAGES: usize = 20_000;

fn body(order_id: i64) -> Vec<u8> {
    format!(
        r#"{{"type": "OrderCompleted", "order_id": {order_id}, "customer_id": {}, "total_cents": {}}}"#,
        order_id % 97,
        1000 + order_id * 7 % 9000
    )
    .into_bytes()
}

/// The loyalty plugin's logic, natively: the floor of what any sandbox can cost.
fn native_decision(body: &[u8]) -> Option<Outcome> {
    let event: serde_json::Value = serde_json::from_slice(body).ok()?;
    let order_id = event.get("order_id")?.as_i64()?;
    let customer_id = event.get("customer_id")?.as_i64()?;
    let points = event.get("total_cents")?.as_i64()? / 100;
    Some(Outcome::Decision(Decision {
        key: format!("order-completed:{order_id}"),
        effects: vec![
            Effect::Exec {
                statement: "credit_balance".into(),
                params: vec![Value::Integer(customer_id), Value::Integer(points)],
            },
            Effect::Exec {
                statement: "record_ledger".into(),
                params: vec![
                    Value::Integer(customer_id),
                    Value::Integer(order_id),
                    Value::Integer(points),
                ],
            },
        ],
    }))
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let plugin_path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "plugins/dist/loyalty.wasm".to_string());
    let runtime = PluginRuntime::new().expect("plugin runtime");
    let compile_started = Instant::now();
    let plugin = runtime
        .load(Path::new(&plugin_path))
        .expect("loyalty plugin loads (run scripts/build-plugins.sh)");
    let compile_time = compile_started.elapsed();
    let size = std::fs::metadata(&plugin_path).map_or(0, |metadata| metadata.len());
    let limits = PluginLimits::default();

    let messages: Vec<InboundMessage> = (0..(WARMUP + MESSAGES) as i64)
        .map(|order_id| InboundMessage {
            pipeline: "loyalty".into(),
            body: body(order_id),
            ..InboundMessage::default()
        })
        .collect();

    let mut plugin_samples = Vec::with_capacity(MESSAGES);
    for (index, message) in messages.iter().enumerate() {
        let started = Instant::now();
        let outcome = runtime.invoke(&plugin, &limits, message).await;
        let elapsed = started.elapsed();
        let native = native_decision(&message.body);
        assert_eq!(outcome.ok(), native, "plugin and baseline disagree");
        if index >= WARMUP {
            plugin_samples.push(elapsed);
        }
    }
    let mut native_samples = Vec::with_capacity(MESSAGES);
    for (index, message) in messages.iter().enumerate() {
        let started = Instant::now();
        let outcome = std::hint::black_box(native_decision(std::hint::black_box(&message.body)));
        let elapsed = started.elapsed();
        drop(outcome);
        if index >= WARMUP {
            native_samples.push(elapsed);
        }
    }

    let plugin_stats = Percentiles::of(&mut plugin_samples);
    let native_stats = Percentiles::of(&mut native_samples);
    let overhead = |plugin: Duration, native: Duration| plugin.saturating_sub(native);
    println!(
        "plugin overhead: {plugin_path} ({} KiB, compiled in {:.1} ms), {MESSAGES} messages after {WARMUP} warm-up",
        size / 1024,
        compile_time.as_secs_f64() * 1e3
    );
    println!("{:<34} {:>10} {:>10} {:>10}", "", "p50", "p99", "mean");
    println!(
        "{:<34} {:>10} {:>10} {:>10}",
        "plugin: fresh instance + call",
        micros(plugin_stats.p50),
        micros(plugin_stats.p99),
        micros(plugin_stats.mean)
    );
    println!(
        "{:<34} {:>10} {:>10} {:>10}",
        "baseline: native Rust decision",
        micros(native_stats.p50),
        micros(native_stats.p99),
        micros(native_stats.mean)
    );
    println!(
        "{:<34} {:>10} {:>10} {:>10}",
        "sandbox overhead (plugin - native)",
        micros(overhead(plugin_stats.p50, native_stats.p50)),
        micros(overhead(plugin_stats.p99, native_stats.p99)),
        micros(overhead(plugin_stats.mean, native_stats.mean))
    );
    println!(
        "ratio plugin/native at p50: {:.1}x",
        plugin_stats.p50.as_secs_f64() / native_stats.p50.as_secs_f64().max(1e-9)
    );
}
