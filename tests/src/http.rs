//! Plain HTTP/1.1 for tests: requests to a host's listener; outbox destinations on loopback
//! and the key a delivery carries.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};

/// Serves `router` on a free loopback port for the rest of the test; its port.
pub async fn serve_locally(router: axum::Router) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let port = listener.local_addr().expect("address").port();
    tokio::spawn(async move { axum::serve(listener, router).await });
    port
}

/// What a recording destination received: the headers of every delivery, by idempotency
/// key, in the order they came.
pub type Deliveries = Arc<Mutex<BTreeMap<String, Vec<HeaderMap>>>>;

/// An outbox HTTP destination that accepts every `POST /receipts` and records its headers;
/// its port and what it received.
pub async fn recording_destination() -> (u16, Deliveries) {
    async fn receive(State(seen): State<Deliveries>, headers: HeaderMap) -> StatusCode {
        let key = idempotency_key(&headers).unwrap_or_default().to_string();
        seen.lock()
            .expect("deliveries")
            .entry(key)
            .or_default()
            .push(headers);
        StatusCode::OK
    }
    let seen = Deliveries::default();
    let router = axum::Router::new()
        .route("/receipts", axum::routing::post(receive))
        .with_state(Arc::clone(&seen));
    (serve_locally(router).await, seen)
}

/// The `Idempotency-Key` an outbox delivery carried, if any.
pub fn idempotency_key(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
}

/// A minimal HTTP/1.1 request to 127.0.0.1:`port`; returns the status code and the body.
pub async fn http_request(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> (u16, String) {
    let authorization = token.map(|token| format!("Bearer {token}"));
    let headers: Vec<(&str, &str)> = authorization
        .as_deref()
        .map(|value| ("Authorization", value))
        .into_iter()
        .collect();
    http_send(port, method, path, &headers, None).await
}

/// An HTTP/1.1 request to 127.0.0.1:`port` with extra `headers` and a JSON `body`; returns
/// the status code and the body.
pub async fn http_send(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    json: Option<&str>,
) -> (u16, String) {
    let (status, _, body) = http_exchange(port, method, path, headers, json).await;
    (status, body)
}

/// [`http_send`], returning the answer's head (status line and headers) too. A `Host` among
/// `headers` replaces the default (`127.0.0.1:<port>`).
pub async fn http_exchange(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    json: Option<&str>,
) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the host's HTTP endpoint");
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    if !headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("host"))
    {
        head.push_str(&format!("Host: 127.0.0.1:{port}\r\n"));
    }
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if json.is_some() {
        head.push_str("Content-Type: application/json\r\n");
    }
    let body = json.unwrap_or("");
    let request = format!(
        "{head}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send request");
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .await
        .expect("read response");
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (status, head.to_string(), body.to_string())
}
