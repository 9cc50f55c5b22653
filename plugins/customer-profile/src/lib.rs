//! A read model kept by version-guarded upserts: the example of `claim = "none"`.
//!
//! Input: a `CustomerProfileChanged` event carrying the whole profile and its version,
//! `{"customer_id": 7, "version": 3, "name": "Ada", "email": "ada@example.com"}`.
//! Effect: `upsert_profile`, an `INSERT … ON CONFLICT (customer_id) DO UPDATE … WHERE
//! customer_profiles.version < EXCLUDED.version` named in `pipelines.toml`. A repeated or
//! older delivery changes no row (outcome `stale`), so no claim is needed: the newest
//! version wins whatever order the broker delivers in.

wit_bindgen::generate!({ path: "../../wit", world: "plugin" });

use exports::idem::plugin::handler::Guest;
use idem::plugin::types::{Decision, Effect, Exec, Failure, FailureKind, Message, Outcome, Value};
use serde_json::{Map, Value as Json};

struct CustomerProfile;

export!(CustomerProfile);

impl Guest for CustomerProfile {
    fn handle(message: Message) -> Result<Outcome, Failure> {
        let event = match serde_json::from_slice::<Json>(&message.body) {
            Ok(Json::Object(object)) => object,
            Ok(_) => return Err(invalid("body must be a JSON object".into())),
            Err(error) => return Err(invalid(format!("body is not valid JSON: {error}"))),
        };
        let customer_id = integer_field(&event, "customer_id")?;
        let version = integer_field(&event, "version")?;
        if version < 1 {
            return Err(invalid(format!("field \"version\" must be at least 1, got {version}")));
        }
        let name = text_field(&event, "name")?;
        let email = text_field(&event, "email")?;
        Ok(Outcome::Decision(Decision {
            // With claim = "none" the key only names the event in logs.
            key: format!("customer-profile:{customer_id}:v{version}"),
            effects: vec![Effect::Exec(Exec {
                statement: "upsert_profile".into(),
                params: vec![
                    Value::Integer(customer_id),
                    Value::Integer(version),
                    Value::Text(name),
                    Value::Text(email),
                ],
            })],
        }))
    }
}

fn integer_field(event: &Map<String, Json>, name: &str) -> Result<i64, Failure> {
    match event.get(name) {
        None | Some(Json::Null) => Err(invalid(format!("missing field \"{name}\""))),
        Some(value) => value
            .as_i64()
            .ok_or_else(|| invalid(format!("field \"{name}\" must be an integer"))),
    }
}

fn text_field(event: &Map<String, Json>, name: &str) -> Result<String, Failure> {
    match event.get(name) {
        None | Some(Json::Null) => Err(invalid(format!("missing field \"{name}\""))),
        Some(Json::String(text)) => Ok(text.clone()),
        Some(_) => Err(invalid(format!("field \"{name}\" must be a string"))),
    }
}

fn invalid(reason: String) -> Failure {
    Failure { kind: FailureKind::InvalidInput, reason }
}
