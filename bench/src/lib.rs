//! Shared measurement helpers for the benchmarks in `src/bin/`.

use std::time::Duration;

/// Latency percentiles of a sample set.
#[derive(Debug, Clone, Copy)]
pub struct Percentiles {
    pub p50: Duration,
    pub p99: Duration,
    pub mean: Duration,
}

impl Percentiles {
    /// Sorts `samples` and reads its percentiles.
    pub fn of(samples: &mut [Duration]) -> Percentiles {
        samples.sort_unstable();
        let at = |fraction: f64| {
            let index = ((samples.len() as f64 - 1.0) * fraction).round() as usize;
            samples.get(index).copied().unwrap_or_default()
        };
        let total: Duration = samples.iter().sum();
        Percentiles {
            p50: at(0.50),
            p99: at(0.99),
            mean: total / u32::try_from(samples.len().max(1)).unwrap_or(u32::MAX),
        }
    }
}

/// Microseconds with one decimal, for tables.
pub fn micros(duration: Duration) -> String {
    format!("{:.1} µs", duration.as_secs_f64() * 1e6)
}

/// The body of `OrderCompleted` number `order_id`, the loyalty plugin's input in every
/// benchmark (customers and totals vary with the id).
pub fn order_body(order_id: i64) -> Vec<u8> {
    format!(
        r#"{{"type": "OrderCompleted", "order_id": {order_id}, "customer_id": {}, "total_cents": {}}}"#,
        order_id % 97,
        1000 + order_id * 7 % 9000
    )
    .into_bytes()
}
