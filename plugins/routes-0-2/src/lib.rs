//! A plugin built for `idem:plugin@0.2.0` (the host's copy of that contract, as released),
//! as a team that has not rebuilt since would have it: it records where each message was
//! published (its exchange and routing key, which 0.2.0 named in the message) and logs
//! through the 0.2.0 `log` import. An empty body is invalid input.
//!
//! Statement `record_route`: `INSERT INTO routes (key, exchange, routing_key, body) …`.

wit_bindgen::generate!({
    path: "../../host/contracts/0.2.0",
    world: "plugin",
});

use exports::idem::plugin::handler::Guest;
use idem::plugin::log::{Level, log};
use idem::plugin::types::{Decision, Effect, Exec, Failure, FailureKind, Message, Outcome, Value};

struct Routes;

export!(Routes);

impl Guest for Routes {
    fn handle(message: Message) -> Result<Outcome, Failure> {
        if message.body.is_empty() {
            return Err(Failure {
                kind: FailureKind::InvalidInput,
                reason: "empty body".into(),
            });
        }
        let body = String::from_utf8_lossy(&message.body).into_owned();
        let key = format!("route:{}", message.message_id.as_deref().unwrap_or(&body));
        log(
            Level::Info,
            &format!("{} via {:?} / {:?}", key, message.exchange, message.routing_key),
        );
        Ok(Outcome::Decision(Decision {
            key,
            effects: vec![Effect::Exec(Exec {
                statement: "record_route".into(),
                params: vec![
                    Value::Text(message.exchange),
                    Value::Text(message.routing_key),
                    Value::Text(body),
                ],
            })],
        }))
    }
}
