//! JSON log lines, flat: one object per event with `timestamp`, `level`, `target`, `message`,
//! the event's fields and those of every span it happened in (the innermost winning), at the
//! top level, so a log pipeline reads `trace_id`, `span_id`, `pipeline` or `idem.key` without
//! unnesting. A message's span carries `trace_id` (and `span_id` when traces are exported),
//! so its log lines join its trace.

use std::fmt;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// The event format of `--log-format json` (with `JsonFields` for the spans' fields).
pub struct FlatJson;

impl<S> FormatEvent<S, JsonFields> for FlatJson
where
    S: Subscriber + for<'lookup> LookupSpan<'lookup>,
{
    fn format_event(
        &self,
        context: &FmtContext<'_, S, JsonFields>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        let metadata = event.metadata();
        let mut line = Map::new();
        line.insert("timestamp".into(), timestamp.into());
        line.insert("level".into(), metadata.level().as_str().into());
        line.insert("target".into(), metadata.target().into());
        if let Some(scope) = context.event_scope() {
            for span in scope.from_root() {
                let extensions = span.extensions();
                let Some(fields) = extensions.get::<FormattedFields<JsonFields>>() else {
                    continue;
                };
                if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(&fields.fields) {
                    line.extend(fields.into_iter().filter(|(name, _)| shown(name)));
                }
                line.insert("span".into(), span.name().into());
            }
        }
        event.record(&mut Fields(&mut line));
        let text = serde_json::to_string(&line).map_err(|_| fmt::Error)?;
        writeln!(writer, "{text}")
    }
}

/// Whether a span field is shown: not the `otel.*` fields that steer the exported span.
fn shown(name: &str) -> bool {
    !name.starts_with("otel.")
}

/// Writes an event's fields into the line.
struct Fields<'line>(&'line mut Map<String, Value>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0.insert(field.name().into(), value.to_string().into());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().into(), format!("{value:?}").into());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::prelude::*;

    use super::*;

    /// What the layer writes, kept.
    #[derive(Clone, Default)]
    struct Written(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Written {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// An event in a message's span: one flat object, the span's fields (recorded late too)
    /// beside the event's, `otel.*` left out.
    #[test]
    fn an_event_is_one_flat_object_with_its_spans_fields() {
        let written = Written::default();
        let writer = written.clone();
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .fmt_fields(JsonFields::new())
                .event_format(FlatJson)
                .with_writer(move || writer.clone()),
        );
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "message",
                otel.kind = "consumer",
                pipeline = "loyalty",
                trace_id = "0af7651916cd43dd8448eb211c80319c",
                idem.key = tracing::field::Empty,
            );
            span.record("idem.key", "order:1");
            let _entered = span.enter();
            tracing::info!(retry_in_ms = 200u64, "Applied \"quoted\".");
        });
        let text = String::from_utf8(written.0.lock().expect("lock").clone()).expect("UTF-8");
        assert_eq!(text.lines().count(), 1, "{text}");
        let line: Value = serde_json::from_str(&text).expect("one JSON object");
        assert_eq!(line["message"], "Applied \"quoted\".", "{line}");
        assert_eq!(line["level"], "INFO", "{line}");
        assert_eq!(line["retry_in_ms"], 200, "{line}");
        assert_eq!(line["pipeline"], "loyalty", "{line}");
        assert_eq!(
            line["trace_id"], "0af7651916cd43dd8448eb211c80319c",
            "{line}"
        );
        assert_eq!(line["idem.key"], "order:1", "{line}");
        assert_eq!(line["span"], "message", "{line}");
        assert!(line.get("otel.kind").is_none(), "{line}");
        assert!(line.get("fields").is_none(), "{line}");
        assert!(
            line["timestamp"]
                .as_str()
                .is_some_and(|at| at.contains('T')),
            "{line}"
        );
    }
}
