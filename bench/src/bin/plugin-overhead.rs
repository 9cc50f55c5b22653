//! Per-message plugin overhead: instantiate a fresh sandbox and call the loyalty plugin,
//! against a native Rust baseline computing the same decision in the same run.
//!
//! Run with `bench/plugin-overhead.sh` (release build).

use std::path::Path;
use std::time::{Duration, Instant};

use idem_bench::{Percentiles, micros};
use idem_host::config::PluginLimits;
use idem_host::effect::Outcome;
use idem_host::message::InboundMessage;
use idem_host::sandbox::PluginRuntime;
use idem_host::sandbox::pool::PoolSize;

const WARMUP: usize = 1_000;
const MESSAGES: usize = 20_000;

/// The loyalty plugin's logic, natively: the floor of what any sandbox can cost.
fn native_decision(body: &[u8]) -> Option<Outcome> {
    let event: serde_json::Value = serde_json::from_slice(body).ok()?;
    Some(Outcome::Decision(idem_bench::loyalty_decision(
        event.get("order_id")?.as_i64()?,
        event.get("customer_id")?.as_i64()?,
        event.get("total_cents")?.as_i64()?,
    )))
}

/// Each plugin is measured for this many messages, or this long, whichever comes first.
const TIME_BUDGET: Duration = Duration::from_secs(8);

struct Measured {
    path: String,
    size: u64,
    compile: Duration,
    messages: usize,
    call: Percentiles,
    /// Where the call's time went: making the sandbox, the plugin's `handle`, taking it down.
    phases: [Percentiles; 3],
    memory_bytes: usize,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut paths: Vec<String> = std::env::args().skip(1).collect();
    if paths.is_empty() {
        paths.push("plugins/dist/loyalty.wasm".to_string());
    }
    // The same plugins with instances allocated on demand and from wasmtime's pool (what
    // `idem run` uses), measured in the same run.
    let on_demand = PluginRuntime::new().expect("plugin runtime");
    let pooled = PluginRuntime::build(
        idem_host::sandbox::cache::default_directory(),
        Some(PoolSize {
            instances: 8,
            memory_bytes: 256 << 20,
        }),
    )
    .expect("pooled plugin runtime");
    // The deadline is the benchmark's business, not the sandbox default's: a slow language
    // must be measured, not rejected.
    let limits = PluginLimits {
        deadline_ms: std::num::NonZeroU32::new(10_000).expect("non-zero"),
        memory_mib: std::num::NonZeroU32::new(256).expect("non-zero"),
        ..PluginLimits::default()
    };
    // Opt-in reuse (`limits.messages_per_instance`): one instance serves 1,000 messages.
    let reused = PluginLimits {
        messages_per_instance: std::num::NonZeroU32::new(1_000).expect("non-zero"),
        ..limits
    };
    let messages: Vec<InboundMessage> = (0..(WARMUP + MESSAGES) as i64)
        .map(|order_id| InboundMessage {
            pipeline: "loyalty".into(),
            body: idem_bench::order_body(order_id),
            ..InboundMessage::default()
        })
        .collect();

    let mut measured = Vec::new();
    for path in &paths {
        for (label, runtime, limits) in [
            ("on demand", &on_demand, &limits),
            ("pooled", &pooled, &limits),
            ("reused x1000", &pooled, &reused),
        ] {
            let mut plugin = measure(runtime, limits, path, &messages).await;
            plugin.path = format!(
                "{} ({label})",
                plugin.path.trim_start_matches("plugins/dist/")
            );
            measured.push(plugin);
        }
    }
    let native = measure_native(&messages);

    println!(
        "plugin overhead: sandbox + call per message (a fresh instance on demand or from the pool, or an instance serving 1,000 messages), up to {MESSAGES} messages or {}s per plugin after warm-up",
        TIME_BUDGET.as_secs()
    );
    println!(
        "{:<34} {:>9} {:>11} {:>8} {:>10} {:>10} {:>10} {:>12}",
        "", "size", "compile", "calls", "p50", "p99", "mean", "memory/call"
    );
    for plugin in &measured {
        println!(
            "{:<34} {:>6} KiB {:>8.1} ms {:>8} {:>10} {:>10} {:>10} {:>8} KiB",
            plugin.path,
            plugin.size / 1024,
            plugin.compile.as_secs_f64() * 1e3,
            plugin.messages,
            micros(plugin.call.p50),
            micros(plugin.call.p99),
            micros(plugin.call.mean),
            plugin.memory_bytes / 1024,
        );
    }
    println!(
        "{:<34} {:>9} {:>11} {:>8} {:>10} {:>10} {:>10} {:>12}",
        "baseline: native Rust",
        "-",
        "-",
        MESSAGES,
        micros(native.p50),
        micros(native.p99),
        micros(native.mean),
        "-"
    );
    println!(
        "where the time goes, p50: {:<23} {:>12} {:>10} {:>10}",
        "", "instantiate", "handle", "teardown"
    );
    for plugin in &measured {
        let [instantiate, handle, teardown] = &plugin.phases;
        println!(
            "{:<50} {:>12} {:>10} {:>10}",
            plugin.path,
            micros(instantiate.p50),
            micros(handle.p50),
            micros(teardown.p50)
        );
    }
    for plugin in &measured {
        println!(
            "{}: sandbox overhead at p50 {} ({:.1}x native)",
            plugin.path,
            micros(plugin.call.p50.saturating_sub(native.p50)),
            plugin.call.p50.as_secs_f64() / native.p50.as_secs_f64().max(1e-9)
        );
    }
}

async fn measure(
    runtime: &PluginRuntime,
    limits: &PluginLimits,
    path: &str,
    messages: &[InboundMessage],
) -> Measured {
    let compile_started = Instant::now();
    let plugin = runtime
        .load(Path::new(path))
        .unwrap_or_else(|error| panic!("{path}: {error} (run scripts/build-plugins.sh)"));
    let compile = compile_started.elapsed();
    let size = std::fs::metadata(path).map_or(0, |metadata| metadata.len());
    let mut samples = Vec::with_capacity(MESSAGES);
    let mut phases: [Vec<Duration>; 3] = Default::default();
    let mut memory_bytes = 0;
    let mut measuring_since = None;
    for (index, message) in messages.iter().enumerate() {
        let started = Instant::now();
        let (outcome, stats) = runtime.invoke_measured(&plugin, limits, message).await;
        let elapsed = started.elapsed();
        assert_eq!(
            outcome.ok(),
            native_decision(&message.body),
            "{path} and the native baseline disagree"
        );
        memory_bytes = memory_bytes.max(stats.memory_bytes);
        if index < WARMUP {
            continue;
        }
        samples.push(elapsed);
        for (phase, took) in
            phases
                .iter_mut()
                .zip([stats.instantiate, stats.handle, stats.teardown])
        {
            phase.push(took);
        }
        let since = *measuring_since.get_or_insert_with(Instant::now);
        if since.elapsed() > TIME_BUDGET {
            break;
        }
    }
    Measured {
        path: path.to_string(),
        size,
        compile,
        messages: samples.len(),
        call: Percentiles::of(&mut samples),
        phases: phases.map(|mut phase| Percentiles::of(&mut phase)),
        memory_bytes,
    }
}

fn measure_native(messages: &[InboundMessage]) -> Percentiles {
    let mut samples = Vec::with_capacity(MESSAGES);
    for (index, message) in messages.iter().enumerate() {
        let started = Instant::now();
        let outcome = std::hint::black_box(native_decision(std::hint::black_box(&message.body)));
        let elapsed = started.elapsed();
        drop(outcome);
        if index >= WARMUP {
            samples.push(elapsed);
        }
    }
    Percentiles::of(&mut samples)
}
