//! An OTLP trace receiver for the tests: the collector's protocol, both transports (gRPC with
//! the `TraceService` of the OpenTelemetry protocol definitions, and HTTP/protobuf on
//! `/v1/traces`), keeping every span it was sent.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;

/// The transport a receiver speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Grpc,
    HttpProtobuf,
}

impl Transport {
    /// As `OTEL_EXPORTER_OTLP_PROTOCOL` spells it.
    pub fn protocol(self) -> &'static str {
        match self {
            Transport::Grpc => "grpc",
            Transport::HttpProtobuf => "http/protobuf",
        }
    }
}

/// One span as received: ids in lower-case hex, attributes as text.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub service: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub name: String,
    /// `SpanKind` as the protocol numbers it (3 server, 4 producer, 5 consumer).
    pub kind: i32,
    pub attributes: BTreeMap<String, String>,
    /// 2 for an error status.
    pub status_code: i32,
}

impl ReceivedSpan {
    pub fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes.get(name).map(String::as_str)
    }
}

type Received = Arc<Mutex<Vec<ReceivedSpan>>>;

/// A receiver on a loopback port, until dropped.
pub struct OtlpReceiver {
    pub address: SocketAddr,
    spans: Received,
    server: tokio::task::JoinHandle<()>,
}

impl OtlpReceiver {
    pub async fn start(transport: Transport) -> OtlpReceiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP receiver");
        let address = listener.local_addr().expect("receiver address");
        let spans = Received::default();
        let server = match transport {
            Transport::Grpc => {
                let service = TraceServiceServer::new(Collector(Arc::clone(&spans)));
                let incoming = tokio_stream_of(listener);
                tokio::spawn(async move {
                    let _ = tonic::transport::Server::builder()
                        .add_service(service)
                        .serve_with_incoming(incoming)
                        .await;
                })
            }
            Transport::HttpProtobuf => {
                let received = Arc::clone(&spans);
                let app = axum::Router::new().route(
                    "/v1/traces",
                    axum::routing::post(move |body: axum::body::Bytes| {
                        let received = Arc::clone(&received);
                        async move {
                            match ExportTraceServiceRequest::decode(body) {
                                Ok(request) => {
                                    keep(&received, request);
                                    let answer = ExportTraceServiceResponse::default();
                                    (
                                        axum::http::StatusCode::OK,
                                        [("content-type", "application/x-protobuf")],
                                        answer.encode_to_vec(),
                                    )
                                }
                                Err(_) => (
                                    axum::http::StatusCode::BAD_REQUEST,
                                    [("content-type", "text/plain")],
                                    b"not an ExportTraceServiceRequest".to_vec(),
                                ),
                            }
                        }
                    }),
                );
                tokio::spawn(async move {
                    let _ = axum::serve(listener, app).await;
                })
            }
        };
        OtlpReceiver {
            address,
            spans,
            server,
        }
    }

    /// The base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` takes it.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().expect("spans").clone()
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

struct Collector(Received);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        keep(&self.0, request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn keep(received: &Received, request: ExportTraceServiceRequest) {
    let mut kept = received.lock().expect("spans");
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|resource| &resource.attributes)
            .find(|attribute| attribute.key == "service.name")
            .and_then(|attribute| attribute.value.as_ref())
            .and_then(|value| value.value.as_ref())
            .map(text)
            .unwrap_or_default();
        for span in resource_spans
            .scope_spans
            .into_iter()
            .flat_map(|scope| scope.spans)
        {
            kept.push(ReceivedSpan {
                service: service.clone(),
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent_span_id: hex(&span.parent_span_id),
                name: span.name,
                kind: span.kind,
                attributes: span
                    .attributes
                    .iter()
                    .filter_map(|attribute| {
                        let value = attribute.value.as_ref()?.value.as_ref()?;
                        Some((attribute.key.clone(), text(value)))
                    })
                    .collect(),
                status_code: span.status.map_or(0, |status| status.code),
            });
        }
    }
}

fn text(value: &Value) -> String {
    match value {
        Value::StringValue(text) => text.clone(),
        Value::BoolValue(value) => value.to_string(),
        Value::IntValue(value) => value.to_string(),
        Value::DoubleValue(value) => value.to_string(),
        other => format!("{other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The accepted connections of `listener`, as tonic's server takes them.
fn tokio_stream_of(
    listener: tokio::net::TcpListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| stream);
        Some((accepted, listener))
    })
}
