//! The OTLP export of the message spans (`idem run` starts it from the `OTEL_*` variables
//! and `[traces]` before logging is set up): the tracer provider and its layer, which takes
//! the host's own spans only.

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::subscriber::Interest;
use tracing::{Level, Metadata, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, Filter};
use tracing_subscriber::registry::LookupSpan;

use crate::config::{OtlpProtocol, TracesConfig};

/// Why traces cannot be exported as configured: the host does not start.
#[derive(Debug, thiserror::Error)]
pub enum TracesError {
    #[error(
        "{variable}={value:?} is not supported: idem exports traces over OTLP with \"grpc\" or \"http/protobuf\""
    )]
    Protocol {
        variable: &'static str,
        value: String,
    },
    #[error(
        "OTEL_TRACES_EXPORTER={0:?} is not supported: idem exports traces with \"otlp\" (or \"none\")"
    )]
    Exporter(String),
    #[error("cannot set up the OTLP trace exporter: {0}")]
    Build(String),
}

/// Exported traces: the tracer provider behind the spans' layer. [`TraceExport::shutdown`]
/// sends what is still batched.
pub struct TraceExport {
    provider: SdkTracerProvider,
    /// Where spans go, for the log line.
    destination: String,
}

impl TraceExport {
    /// Export as the `OTEL_*` variables and `config` say; `None` when off. With gRPC, call
    /// it inside the Tokio runtime the exporter's connection will run on.
    pub fn start(config: Option<&TracesConfig>) -> Result<Option<TraceExport>, TracesError> {
        let var = |name: &str| std::env::var(name).ok().filter(|value| !value.is_empty());
        if var("OTEL_SDK_DISABLED").is_some_and(|value| value.eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let chosen = match var("OTEL_TRACES_EXPORTER") {
            Some(value) if value.eq_ignore_ascii_case("none") => return Ok(None),
            Some(value) if value.eq_ignore_ascii_case("otlp") => true,
            Some(value) => return Err(TracesError::Exporter(value)),
            None => false,
        };
        let env_endpoint = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT"));
        let config_endpoint = config.and_then(|config| config.otlp_endpoint.clone());
        if !chosen && env_endpoint.is_none() && config_endpoint.is_none() {
            return Ok(None);
        }
        let protocol = protocol(config)?;
        // The variables win; the table's endpoint is a base URL, as the variable's.
        let endpoint = config_endpoint.filter(|_| env_endpoint.is_none());
        let built = match protocol {
            OtlpProtocol::Grpc => {
                let builder = opentelemetry_otlp::SpanExporter::builder().with_tonic();
                match &endpoint {
                    Some(endpoint) => builder.with_endpoint(endpoint.clone()).build(),
                    None => builder.build(),
                }
            }
            OtlpProtocol::HttpProtobuf => {
                let builder = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(Protocol::HttpBinary);
                match &endpoint {
                    Some(endpoint) => builder
                        .with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
                        .build(),
                    None => builder.build(),
                }
            }
        };
        let exporter = built.map_err(|error| TracesError::Build(error.to_string()))?;
        let mut resource = Resource::builder();
        let named = var("OTEL_SERVICE_NAME").is_some()
            || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|text| text.contains("service.name="));
        if !named {
            resource = resource.with_service_name("idem");
        }
        let resource = resource
            .with_attribute(opentelemetry::KeyValue::new(
                "service.version",
                env!("CARGO_PKG_VERSION"),
            ))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .build();
        let destination = format!(
            "{} ({})",
            env_endpoint
                .or(endpoint)
                .map(|url| crate::config::redact_url(&url))
                .unwrap_or_else(|| "the default endpoint".into()),
            match protocol {
                OtlpProtocol::Grpc => "grpc",
                OtlpProtocol::HttpProtobuf => "http/protobuf",
            }
        );
        Ok(Some(TraceExport {
            provider,
            destination,
        }))
    }

    /// Where spans go, for the startup line.
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// The layer that turns the host's spans (target `idem_host`, `INFO` and above) into
    /// OpenTelemetry spans; the clients' own spans (lapin, sqlx, the exporter's) stay out.
    ///
    /// The filter is asked at every span, never cached per call site: a per-layer filter
    /// whose answer is cached reads a per-thread verdict that `tracing::enabled!` (sqlx asks
    /// it before each query) can leave behind, and would then miss the relay's spans.
    pub fn layer<S>(&self) -> impl Layer<S> + use<S>
    where
        S: Subscriber + for<'span> LookupSpan<'span>,
    {
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer("idem"))
            .with_filter(HostSpans)
    }

    /// Sends the spans still batched (bounded: a collector that does not answer delays the
    /// exit by at most 5 s). Call it outside the runtime's threads, before it stops.
    pub fn shutdown(self) {
        if let Err(error) = self.provider.shutdown_with_timeout(Duration::from_secs(5)) {
            eprintln!("idem: traces: the last spans were not exported: {error}");
        }
    }
}

/// The trace layer's filter: the host's spans and events at `INFO` and above, asked every
/// time (`Interest::sometimes`) rather than cached per call site.
pub(super) struct HostSpans;

impl HostSpans {
    fn takes(metadata: &Metadata<'_>) -> bool {
        metadata.target().starts_with("idem_host") && *metadata.level() <= Level::INFO
    }
}

impl<S> Filter<S> for HostSpans {
    fn enabled(&self, metadata: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        HostSpans::takes(metadata)
    }

    fn callsite_enabled(&self, metadata: &'static Metadata<'static>) -> Interest {
        if HostSpans::takes(metadata) {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::INFO)
    }
}

/// The protocol: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, then `OTEL_EXPORTER_OTLP_PROTOCOL`,
/// then `[traces] protocol`, then HTTP/protobuf (the specification's default).
pub(super) fn protocol(config: Option<&TracesConfig>) -> Result<OtlpProtocol, TracesError> {
    for variable in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Some(value) = std::env::var(variable)
            .ok()
            .filter(|value| !value.is_empty())
        {
            return OtlpProtocol::parse(&value).ok_or(TracesError::Protocol { variable, value });
        }
    }
    Ok(config
        .and_then(|config| config.protocol)
        .unwrap_or(OtlpProtocol::HttpProtobuf))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::traces::{TraceContext, delivery_span};

    #[test]
    fn a_delivery_span_is_a_child_of_the_message_span_that_wrote_the_row() {
        use tracing_subscriber::prelude::*;
        let export = TraceExport {
            provider: SdkTracerProvider::builder().build(),
            destination: String::new(),
        };
        let logs = tracing_subscriber::fmt::layer()
            .with_writer(std::io::sink)
            .boxed()
            .with_filter(tracing_subscriber::EnvFilter::new("idem_host=debug,warn"));
        let subscriber = tracing_subscriber::registry()
            .with(Some(export.layer()))
            .with(logs);
        tracing::subscriber::with_default(subscriber, || {
            let written = TraceContext {
                traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
                tracestate: Some("vendor=opaque".into()),
            };
            // sqlx asks whether its query log is enabled, at a level only the log layer takes,
            // without logging: the span after it must still be seen by the trace layer.
            let _ = tracing::enabled!(target: "sqlx::query", tracing::Level::WARN);
            let (_span, sent) = delivery_span("receipts", "receipt:1", 1, 1, Some(&written));
            let sent = sent.expect("a context");
            assert!(
                sent.traceparent
                    .starts_with("00-0af7651916cd43dd8448eb211c80319c-"),
                "{sent:?}"
            );
            assert_ne!(sent.traceparent, written.traceparent, "a span of its own");
            assert_eq!(sent.tracestate, written.tracestate);
        });
    }
}
