//! The `[traces]` table: OpenTelemetry traces over OTLP, off unless this table or the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` turns them on (`crate::telemetry::traces` reads the variables, which win).

use schemars::JsonSchema;
use serde::Deserialize;
use toml::Spanned;

use super::ConfigError;
use super::text::{Document, interpolated_option};

/// The `[traces]` table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TracesConfig {
    /// The OTLP collector's base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` (which wins when set):
    /// `http://127.0.0.1:4318` for HTTP/protobuf (spans go to `/v1/traces`),
    /// `http://127.0.0.1:4317` for gRPC.
    #[serde(default, deserialize_with = "interpolated_option")]
    pub otlp_endpoint: Option<String>,
    /// `"http/protobuf"` (default, as the OpenTelemetry specification says) or `"grpc"`;
    /// `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` or `OTEL_EXPORTER_OTLP_PROTOCOL` win when set.
    pub protocol: Option<OtlpProtocol>,
}

/// The OTLP transports idem exports with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
pub enum OtlpProtocol {
    #[serde(rename = "grpc")]
    Grpc,
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

impl OtlpProtocol {
    /// The value as the `OTEL_EXPORTER_OTLP_PROTOCOL` variable spells it; `None` for the
    /// values idem does not export with.
    pub fn parse(value: &str) -> Option<OtlpProtocol> {
        match value.trim() {
            "grpc" => Some(OtlpProtocol::Grpc),
            "http/protobuf" => Some(OtlpProtocol::HttpProtobuf),
            _ => None,
        }
    }
}

impl TracesConfig {
    /// The table as written, checked: the endpoint is an `http` or `https` URL.
    pub(super) fn checked(
        table: Spanned<TracesConfig>,
        document: &Document,
    ) -> Result<TracesConfig, ConfigError> {
        let span = table.span();
        let mut traces = table.into_inner();
        traces.otlp_endpoint = traces.otlp_endpoint.filter(|endpoint| !endpoint.is_empty());
        if let Some(endpoint) = &traces.otlp_endpoint {
            let scheme = url::Url::parse(endpoint).map(|url| url.scheme().to_string());
            if !matches!(scheme.as_deref(), Ok("http" | "https")) {
                return Err(document.at(
                    Some(span),
                    "traces.otlp_endpoint",
                    format!(
                        "{endpoint:?} is not an http:// or https:// URL (\"http://127.0.0.1:4318\")"
                    ),
                ));
            }
        }
        Ok(traces)
    }
}
