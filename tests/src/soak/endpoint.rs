//! The outbox's destination in the soak: an HTTP endpoint counting each idempotency key.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};

/// The outbox endpoint: every idempotency key it accepted, with how many times.
#[derive(Default)]
pub(super) struct Endpoint {
    pub(super) accepted: BTreeMap<String, u32>,
}

pub(super) async fn receive(
    State(endpoint): State<Arc<Mutex<Endpoint>>>,
    headers: HeaderMap,
) -> StatusCode {
    let Some(key) = crate::idempotency_key(&headers) else {
        return StatusCode::BAD_REQUEST;
    };
    *endpoint
        .lock()
        .expect("endpoint")
        .accepted
        .entry(key.to_string())
        .or_default() += 1;
    StatusCode::OK
}
