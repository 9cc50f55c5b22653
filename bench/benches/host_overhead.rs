//! Per-message host overhead outside the database (criterion): decoding a delivery into the
//! plugin's message, a fresh sandbox (from the instance pool, as `idem run`) and a call of the
//! loyalty plugin, and mapping its decision to bound statement arguments. The statements are
//! prepared once against the local PostgreSQL (set IDEM_BENCH_DATABASE_URL), outside the
//! measured path.
//!
//! Run: `cargo bench -p idem-bench --bench host_overhead`

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use idem_host::effect::Outcome;
use idem_host::message::InboundMessage;
use idem_host::sandbox::PluginRuntime;
use idem_host::store::ledger::Plan;

fn host_overhead(criterion: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let admin_url = std::env::var("IDEM_BENCH_ADMIN_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let database_url = std::env::var("IDEM_BENCH_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/idem_bench_micro".into());
    let config = idem_bench::demo_config(&database_url);
    let pipeline = &config.pipelines[0];
    let (_pool, catalog) =
        runtime.block_on(idem_bench::loyalty_database(&admin_url, &config, pipeline));
    // What `idem run` uses for this config: the compiled-component cache and the instance pool.
    let plugin_runtime = PluginRuntime::for_config(&config).expect("plugin runtime");
    let plugin = plugin_runtime
        .load(&pipeline.plugin)
        .expect("loyalty plugin (scripts/build-plugins.sh)");
    let message = InboundMessage {
        pipeline: pipeline.name.clone(),
        body: idem_bench::order_body(9912),
        ..InboundMessage::default()
    };
    let Ok(Outcome::Decision(decision)) =
        runtime.block_on(plugin_runtime.invoke(&plugin, &pipeline.limits, &message))
    else {
        panic!("the loyalty plugin decides on an order");
    };

    let mut group = criterion.benchmark_group("host overhead per message");
    group.bench_function(
        "decode: delivery body and headers into the plugin's message",
        |bench| {
            bench.iter(|| {
                black_box(InboundMessage {
                    pipeline: pipeline.name.clone(),
                    body: black_box(idem_bench::order_body(9912)),
                    headers: vec![("x-idem-attempt".into(), "1".into())],
                    queue: pipeline.queue().to_string(),
                    subject: pipeline.queue().to_string(),
                    ..InboundMessage::default()
                })
            });
        },
    );
    group.bench_function(
        "plugin: fresh pooled instance, instantiate and call",
        |bench| {
            bench.iter(|| {
                runtime
                    .block_on(plugin_runtime.invoke(&plugin, &pipeline.limits, black_box(&message)))
                    .expect("decision")
            });
        },
    );
    // Opt-in reuse: one instance serves up to 1,000 messages (`limits.messages_per_instance`).
    let reused = idem_host::config::PluginLimits {
        messages_per_instance: 1000.try_into().expect("non-zero"),
        ..pipeline.limits
    };
    group.bench_function(
        "plugin: reused instance (messages_per_instance = 1000), call",
        |bench| {
            bench.iter(|| {
                runtime
                    .block_on(plugin_runtime.invoke(&plugin, &reused, black_box(&message)))
                    .expect("decision")
            });
        },
    );
    group.bench_function(
        "effects: check and bind the decision's statements",
        |bench| {
            bench.iter(|| {
                let plan = Plan::build(
                    pipeline,
                    &catalog,
                    black_box(&decision),
                    &plugin.digest,
                    false,
                )
                .expect("plan");
                for effect in &plan.effects {
                    black_box(effect.params());
                }
            });
        },
    );
    group.bench_function("all three", |bench| {
        bench.iter(|| {
            let message = InboundMessage {
                pipeline: pipeline.name.clone(),
                body: black_box(idem_bench::order_body(9912)),
                ..InboundMessage::default()
            };
            let Ok(Outcome::Decision(decision)) =
                runtime.block_on(plugin_runtime.invoke(&plugin, &pipeline.limits, &message))
            else {
                panic!("decision");
            };
            let plan =
                Plan::build(pipeline, &catalog, &decision, &plugin.digest, false).expect("plan");
            for effect in &plan.effects {
                black_box(effect.params());
            }
        });
    });
    group.finish();
}

criterion_group!(benches, host_overhead);
criterion_main!(benches);
