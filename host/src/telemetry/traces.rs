//! OpenTelemetry traces: one span per message, its parent the producer's W3C trace context
//! (`traceparent`/`tracestate` headers of an AMQP or NATS message), its context written with
//! every outbox row and sent on the row's delivery; exported over OTLP when turned on.
//!
//! Export is off by default. The standard variables turn it on and configure it
//! (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or
//! `OTEL_TRACES_EXPORTER=otlp`; `OTEL_EXPORTER_OTLP_PROTOCOL` `grpc` or `http/protobuf`; the
//! headers, timeout, compression, sampler, batch and resource variables), and so does the
//! `[traces]` table, which the variables override. With export off the spans are still
//! logged, and a message's received trace context is handed on unchanged to its outbox rows.

use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::{Span, field};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::message::InboundMessage;

/// The W3C header that carries the trace and parent span ids.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header that carries vendor trace state.
pub const TRACESTATE: &str = "tracestate";
/// The longest `tracestate` kept: the W3C specification's 32 members may be cut to 512
/// bytes by any vendor; longer ones are dropped.
const MAX_TRACESTATE: usize = 512;
/// The longest `traceparent` read: version 00 is 55 bytes, a later version may append
/// fields; anything longer is not one.
const MAX_TRACEPARENT: usize = 512;

/// A W3C trace context as it travels: in message headers, outbox rows and deliveries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    pub traceparent: String,
    pub tracestate: Option<String>,
}

impl TraceContext {
    /// The context a producer put in `headers` (names compared without case), if it is a
    /// valid one (see `parsed`).
    pub fn from_headers(headers: &[(String, String)]) -> Option<TraceContext> {
        let value = |name: &str| {
            headers
                .iter()
                .find(|(key, _)| key.eq_ignore_ascii_case(name))
                .map(|(_, value)| value.as_str())
        };
        TraceContext::parsed(value(TRACEPARENT)?, value(TRACESTATE))
    }

    /// The context `traceparent` and `tracestate` carry, as the W3C specification parses
    /// them: a malformed `traceparent` is ignored (`None`), and a `tracestate` that is
    /// malformed or longer than `MAX_TRACESTATE` bytes is dropped. Never the raw values:
    /// what is kept is written anew from the parsed context, so a producer's bytes (a NUL,
    /// a control character, 64 KB) never reach an outbox row or a delivery's headers.
    pub fn parsed(traceparent: &str, tracestate: Option<&str>) -> Option<TraceContext> {
        if traceparent.len() > MAX_TRACEPARENT {
            return None;
        }
        let received = TraceContext {
            traceparent: traceparent.to_string(),
            tracestate: tracestate
                .filter(|state| state.len() <= MAX_TRACESTATE)
                .map(str::to_string),
        };
        let mut parsed = TraceContext::of(&received.context())?;
        parsed.tracestate = parsed.tracestate.filter(|state| is_valid_tracestate(state));
        Some(parsed)
    }

    /// The headers that carry it.
    pub fn headers(&self) -> Vec<(&'static str, &str)> {
        let mut headers = vec![(TRACEPARENT, self.traceparent.as_str())];
        if let Some(state) = &self.tracestate {
            headers.push((TRACESTATE, state.as_str()));
        }
        headers
    }

    /// As an OpenTelemetry context, to parent a span with.
    fn context(&self) -> opentelemetry::Context {
        TraceContextPropagator::new().extract(self)
    }

    /// The context of `cx`'s span, if it has a valid one.
    fn of(cx: &opentelemetry::Context) -> Option<TraceContext> {
        if !cx.span().span_context().is_valid() {
            return None;
        }
        let mut carried = Carrier::default();
        TraceContextPropagator::new().inject_context(cx, &mut carried);
        Some(TraceContext {
            traceparent: carried.traceparent?,
            tracestate: carried.tracestate.filter(|state| !state.is_empty()),
        })
    }
}

/// Whether `state` is a W3C `tracestate` idem hands on: at most `MAX_TRACESTATE` bytes and 32
/// members, each `key=value` with a key of lower-case letters, digits and `_-*/` (one `@`
/// for a tenant) and a value of printable ASCII but `,` and `=`, not ending in a space.
fn is_valid_tracestate(state: &str) -> bool {
    let key_byte =
        |byte: u8| byte.is_ascii_lowercase() || byte.is_ascii_digit() || b"_-*/@".contains(&byte);
    let value_byte = |byte: u8| (0x20..0x7f).contains(&byte) && byte != b',' && byte != b'=';
    let members: Vec<&str> = state
        .split(',')
        .map(|member| member.trim_matches([' ', '\t']))
        .filter(|member| !member.is_empty())
        .collect();
    state.len() <= MAX_TRACESTATE
        && members.len() <= 32
        && members.iter().all(|member| {
            let Some((key, value)) = member.split_once('=') else {
                return false;
            };
            let first = key.bytes().next();
            first.is_some_and(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit())
                && key.len() <= 256
                && key.bytes().all(key_byte)
                && key.bytes().filter(|byte| *byte == b'@').count() <= 1
                && (1..=256).contains(&value.len())
                && value.bytes().all(value_byte)
                && !value.ends_with(' ')
        })
}

impl Extractor for TraceContext {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            TRACEPARENT => Some(&self.traceparent),
            TRACESTATE => self.tracestate.as_deref(),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT, TRACESTATE]
    }
}

#[derive(Default)]
struct Carrier {
    traceparent: Option<String>,
    tracestate: Option<String>,
}

impl Injector for Carrier {
    fn set(&mut self, key: &str, value: String) {
        match key {
            TRACEPARENT => self.traceparent = Some(value),
            TRACESTATE => self.tracestate = Some(value),
            _ => {}
        }
    }
}

/// One message's span: a consumer span named `process <queue>`, the producer's span its
/// parent, with the message's key, plugin build, transaction timing and outcome recorded as
/// they become known.
pub struct MessageSpan {
    span: Span,
    received: Option<TraceContext>,
}

impl MessageSpan {
    /// The span's log fields are few (name, pipeline, trace and span ids, key, outcome); the
    /// semantic attributes go to the exported span only. `group`: the consumer group the
    /// pipeline reads in (a Kafka group, a JetStream consumer; none on RabbitMQ).
    pub fn start(
        pipeline: &str,
        group: Option<&str>,
        message: &InboundMessage,
        attempt: u32,
    ) -> MessageSpan {
        let span = tracing::info_span!(
            parent: None,
            "message",
            otel.name = %format_args!("process {}", message.queue),
            otel.kind = "consumer",
            otel.status_code = field::Empty,
            otel.status_message = field::Empty,
            pipeline,
            trace_id = field::Empty,
            span_id = field::Empty,
            idem.key = field::Empty,
            idem.outcome = field::Empty,
        );
        let received = TraceContext::from_headers(&message.headers);
        adopt(&span, received.as_ref());
        span.set_attribute("messaging.system", message.source.clone());
        span.set_attribute("messaging.operation.name", "process");
        span.set_attribute("messaging.operation.type", "process");
        span.set_attribute("messaging.destination.name", message.queue.clone());
        if let Some(group) = group {
            span.set_attribute("messaging.consumer.group.name", group.to_string());
        }
        if let Some(id) = &message.message_id {
            span.set_attribute("messaging.message.id", id.clone());
        }
        span.set_attribute("idem.attempt", i64::from(attempt));
        record_ids(&span, received.as_ref());
        MessageSpan { span, received }
    }

    pub fn span(&self) -> &Span {
        &self.span
    }

    /// The plugin decided: the idempotency key and the build that made the decision.
    pub fn decided(&self, key: &str, plugin_digest: &str) {
        self.span.record("idem.key", key);
        self.span
            .set_attribute("idem.plugin.digest", plugin_digest.to_string());
    }

    /// The message's transaction committed (or gave up) after `tries`, the last one taking
    /// `took`.
    pub fn transaction(&self, took: Duration, tries: u32) {
        self.span
            .set_attribute("idem.transaction.duration_ms", took.as_secs_f64() * 1000.0);
        self.span
            .set_attribute("idem.transaction.tries", i64::from(tries));
    }

    /// How the message ended; `error` for a dead letter's error kind and reason.
    pub fn ended(&self, outcome: &str, error: Option<(&'static str, &str)>) {
        self.span.record("idem.outcome", outcome);
        if let Some((kind, reason)) = error {
            self.span.set_attribute("error.type", kind);
            failed(&self.span, reason);
        }
    }

    /// The context the message's outbox rows carry (see [`handed_on`]).
    pub fn handed_on(&self) -> Option<TraceContext> {
        handed_on(&self.span, self.received.as_ref())
    }
}

/// The span of one outbox delivery (`send <destination>`, a producer span), a child of the
/// message span that wrote the row, and the context the delivery sends.
pub fn delivery_span(
    destination: &str,
    key: &str,
    row: i64,
    attempt: i32,
    written: Option<&TraceContext>,
) -> (Span, Option<TraceContext>) {
    let span = tracing::info_span!(
        parent: None,
        "deliver",
        otel.name = %format_args!("send {destination}"),
        otel.kind = "producer",
        otel.status_code = field::Empty,
        otel.status_message = field::Empty,
        destination,
        trace_id = field::Empty,
        span_id = field::Empty,
    );
    adopt(&span, written);
    span.set_attribute("messaging.operation.name", "send");
    span.set_attribute("messaging.operation.type", "send");
    span.set_attribute("idem.outbox.id", row);
    span.set_attribute("idem.outbox.key", key.to_string());
    span.set_attribute("idem.outbox.attempt", i64::from(attempt));
    let sent = handed_on(&span, written);
    record_ids(&span, written);
    (span, sent)
}

/// Records the span's `trace_id` and `span_id` for its log lines: its own when traces are
/// exported, else the trace it was received in (no span id: it has none of its own).
fn record_ids(span: &Span, received: Option<&TraceContext>) {
    let context = span.context();
    let own = context.span().span_context().clone();
    if own.is_valid() {
        span.record("trace_id", field::display(own.trace_id()));
        span.record("span_id", field::display(own.span_id()));
    } else if let Some(received) = received {
        let received = received.context();
        span.record(
            "trace_id",
            field::display(received.span().span_context().trace_id()),
        );
    }
}

/// Marks `span` failed, with `error` as its status message.
pub fn failed(span: &Span, error: &str) {
    span.record("otel.status_code", "error");
    span.record("otel.status_message", error);
}

/// Makes `span` (not yet entered) a child of the producer's span, when there is one.
pub fn adopt(span: &Span, received: Option<&TraceContext>) {
    if let Some(received) = received {
        // Fails only when export is off (no layer) or the span is disabled: nothing to link.
        let _ = span.set_parent(received.context());
    }
}

/// The context to hand on from `span` (an outbox row's, a delivery's headers): the span's
/// own when traces are exported, else the one received, unchanged.
pub fn handed_on(span: &Span, received: Option<&TraceContext>) -> Option<TraceContext> {
    TraceContext::of(&span.context()).or_else(|| received.cloned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect()
    }

    #[test]
    fn a_producers_context_is_read_from_its_headers() {
        let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let read = TraceContext::from_headers(&headers(&[
            ("Traceparent", parent),
            ("tracestate", "congo=t61rcWkgMzE"),
        ]))
        .expect("a valid context");
        assert_eq!(read.traceparent, parent);
        assert_eq!(read.tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
        assert_eq!(
            read.headers(),
            vec![(TRACEPARENT, parent), (TRACESTATE, "congo=t61rcWkgMzE")]
        );
    }

    #[test]
    fn a_malformed_context_is_ignored() {
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "zz-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "\u{1b}[31m",
        ] {
            assert_eq!(
                TraceContext::from_headers(&headers(&[(TRACEPARENT, bad)])),
                None,
                "{bad:?}"
            );
        }
        assert_eq!(TraceContext::from_headers(&[]), None);
    }

    /// A producer's `tracestate` is kept only as the parsed context writes it: a NUL, a
    /// control character, a malformed member or more than 512 bytes drop it (the
    /// `traceparent` stays), and a long `traceparent` is no context at all.
    #[test]
    fn a_hostile_tracestate_is_dropped() {
        let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let long = format!("k={}", "v".repeat(10_000));
        let members: Vec<String> = (0..40).map(|n| format!("vendor{n}=value{n}")).collect();
        let many = members.join(",");
        for bad in ["k=v\0", "k=v\n", "k=\u{1}", "=v", "k=v,=x", long.as_str()] {
            let read =
                TraceContext::from_headers(&headers(&[(TRACEPARENT, parent), (TRACESTATE, bad)]))
                    .expect("the traceparent stays");
            assert_eq!(read.traceparent, parent);
            assert_eq!(read.tracestate, None, "{bad:?}");
        }
        let kept =
            TraceContext::from_headers(&headers(&[(TRACEPARENT, parent), (TRACESTATE, &many)]))
                .expect("a context");
        let state = kept.tracestate.unwrap_or_default();
        assert!(state.len() <= MAX_TRACESTATE, "{state}");
        assert!(state.bytes().all(|byte| (0x20..0x7f).contains(&byte)));
        let padded = format!("{parent}-{}", "0".repeat(100_000));
        assert_eq!(
            TraceContext::from_headers(&headers(&[(TRACEPARENT, &padded)])),
            None
        );
    }

    #[test]
    fn without_export_the_received_context_is_handed_on() {
        let received = TraceContext {
            traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
            tracestate: None,
        };
        let span = tracing::info_span!("message");
        adopt(&span, Some(&received));
        assert_eq!(handed_on(&span, Some(&received)), Some(received));
        assert_eq!(handed_on(&span, None), None);
    }
}
