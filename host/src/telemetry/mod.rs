//! What a host tells about itself: counters, gauges and histograms (`metrics`, on `/metrics`),
//! a span per message parented by the producer's W3C trace context and handed on to the
//! outbox (`traces`), and their OTLP export (`export`, started by `idem run`); the JSON log
//! lines (`logs`).

pub mod export;
pub mod logs;
pub mod metrics;
pub mod traces;
