//! Plugin test cases: messages, each with the outcome a plugin must give for it. `idem test`
//! runs a case file against a plugin; `idem try` prints an outcome in the same JSON form a
//! case expects, so a decision can be pasted into a case as it stands.
//!
//! ```json
//! { "cases": [
//!   { "name": "valid order",
//!     "json": { "order_id": 9912, "customer_id": 7, "total_cents": 5000 },
//!     "headers": { "tenant": "eu" }, "subject": "orders", "redelivered": false,
//!     "expect": { "outcome": "decision", "key": "order-completed:9912",
//!                 "effects": [ ["credit_balance", [7, 50]] ] } },
//!   { "name": "refund", "body": "{\"type\": \"RefundIssued\"}",
//!     "expect": { "outcome": "skip", "reason_contains": "RefundIssued" } },
//!   { "name": "not JSON", "body_hex": "fffe",
//!     "expect": { "outcome": "failure", "kind": "invalid-input", "reason_contains": "JSON" } }
//! ] }
//! ```
//!
//! A message may also give `message_id`, `delivery_count`, `attributes` (a map of source
//! attributes), and, for RabbitMQ, `routing_key` (the subject) and `exchange`; what it leaves
//! out is what a plain publish to the pipeline's queue carries.
//!
//! A statement parameter is written as JSON: `null`, `true`, `7` (integer), `7.5` (float),
//! `"text"`, or tagged: `{"json": …}`, `{"bytes_hex": "00ff"}`,
//! `{"timestamp": "2026-12-04T10:00:00Z"}` (or microseconds since the epoch).

mod json;
mod trial;

pub use json::outcome_json;
pub use trial::{Origin, Trial, fit};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value as Json;

use crate::effect::{FailureKind, Outcome};
use crate::message::InboundMessage;
use crate::sandbox::PluginError;

use json::{decode_hex, effect_json, parse_effect};

/// A case file that cannot be used: nothing runs.
#[derive(Debug, thiserror::Error)]
pub enum CaseFileError {
    #[error("cannot read cases {path:?}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid cases {path:?}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// One message and the outcome expected for it.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    body: Vec<u8>,
    headers: Vec<(String, String)>,
    /// The subject, or RabbitMQ's routing key (`routing_key` in a case file).
    subject: Option<String>,
    message_id: Option<String>,
    redelivered: bool,
    delivery_count: Option<u32>,
    /// Source attributes; RabbitMQ's `exchange` and `routing_key` shorthands land here.
    attributes: BTreeMap<String, String>,
    expect: Expected,
}

#[derive(Debug, Clone)]
enum Expected {
    /// `effects: None` checks the key only.
    Decision {
        key: String,
        effects: Option<Vec<Json>>,
    },
    Skip(ReasonMatch),
    Failure {
        kind: Option<FailureKind>,
        reason: ReasonMatch,
    },
    /// The plugin traps or breaks a limit.
    Error(ReasonMatch),
}

#[derive(Debug, Clone, Default)]
struct ReasonMatch {
    exact: Option<String>,
    contains: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    #[allow(dead_code)]
    description: Option<String>,
    cases: Vec<RawCase>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCase {
    name: String,
    body: Option<String>,
    json: Option<Json>,
    body_hex: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    subject: Option<String>,
    /// RabbitMQ shorthand: the subject, and the `routing-key` attribute.
    routing_key: Option<String>,
    /// RabbitMQ shorthand: the `exchange` attribute.
    exchange: Option<String>,
    message_id: Option<String>,
    #[serde(default)]
    redelivered: bool,
    delivery_count: Option<u32>,
    #[serde(default)]
    attributes: BTreeMap<String, String>,
    expect: RawExpect,
}

#[derive(Deserialize)]
#[serde(tag = "outcome", rename_all = "kebab-case", deny_unknown_fields)]
enum RawExpect {
    Decision {
        key: String,
        effects: Option<Vec<Json>>,
    },
    Skip {
        reason: Option<String>,
        reason_contains: Option<String>,
    },
    Failure {
        kind: Option<RawKind>,
        reason: Option<String>,
        reason_contains: Option<String>,
    },
    Error {
        reason: Option<String>,
        reason_contains: Option<String>,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
enum RawKind {
    InvalidInput,
    Retryable,
}

/// Reads and checks a case file: every expected effect must be well formed and every case
/// named once, so a typo is reported before any plugin runs.
pub fn load(path: &Path) -> Result<Vec<Case>, CaseFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| CaseFileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text).map_err(|message| CaseFileError::Invalid {
        path: path.to_path_buf(),
        message,
    })
}

/// Parses case-file text (see [`load`]).
pub fn parse(text: &str) -> Result<Vec<Case>, String> {
    let file: RawFile = serde_json::from_str(text).map_err(|error| error.to_string())?;
    let mut seen = std::collections::HashSet::new();
    file.cases
        .into_iter()
        .enumerate()
        .map(|(index, raw)| {
            let name = raw.name.clone();
            if !seen.insert(name.clone()) {
                return Err(format!(
                    "case {} ({name:?}): another case has this name",
                    index + 1
                ));
            }
            Case::from_raw(raw)
                .map_err(|problem| format!("case {} ({name:?}): {problem}", index + 1))
        })
        .collect()
}

impl Case {
    fn from_raw(raw: RawCase) -> Result<Case, String> {
        let body = match (raw.body, raw.json, raw.body_hex) {
            (Some(body), None, None) => body.into_bytes(),
            (None, Some(json), None) => json.to_string().into_bytes(),
            (None, None, Some(hex)) => {
                decode_hex(&hex).map_err(|problem| format!("body_hex: {problem}"))?
            }
            _ => return Err("give the message as exactly one of body, json or body_hex".into()),
        };
        let reason = |exact, contains| ReasonMatch { exact, contains };
        let expect = match raw.expect {
            RawExpect::Decision { key, effects } => {
                let effects = effects
                    .map(|effects| {
                        effects
                            .iter()
                            .enumerate()
                            .map(|(index, effect)| {
                                parse_effect(effect)
                                    .map(|effect| effect_json(&effect))
                                    .map_err(|problem| {
                                        format!("expect.effects[{index}]: {problem}")
                                    })
                            })
                            .collect::<Result<Vec<_>, _>>()
                    })
                    .transpose()?;
                Expected::Decision { key, effects }
            }
            RawExpect::Skip {
                reason: exact,
                reason_contains,
            } => Expected::Skip(reason(exact, reason_contains)),
            RawExpect::Failure {
                kind,
                reason: exact,
                reason_contains,
            } => Expected::Failure {
                kind: kind.map(|kind| match kind {
                    RawKind::InvalidInput => FailureKind::InvalidInput,
                    RawKind::Retryable => FailureKind::Retryable,
                }),
                reason: reason(exact, reason_contains),
            },
            RawExpect::Error {
                reason: exact,
                reason_contains,
            } => Expected::Error(reason(exact, reason_contains)),
        };
        if raw.subject.is_some() && raw.routing_key.is_some() {
            return Err(format!(
                "case {:?}: give `subject` or its RabbitMQ name `routing_key`, not both",
                raw.name
            ));
        }
        let mut attributes = raw.attributes;
        if let Some(exchange) = raw.exchange {
            attributes.insert("exchange".into(), exchange);
        }
        if let Some(routing_key) = &raw.routing_key {
            attributes.insert("routing-key".into(), routing_key.clone());
        }
        Ok(Case {
            name: raw.name,
            body,
            headers: raw.headers.into_iter().collect(),
            subject: raw.subject.or(raw.routing_key),
            message_id: raw.message_id,
            redelivered: raw.redelivered,
            delivery_count: raw.delivery_count,
            attributes,
            expect,
        })
    }

    /// The delivery this case describes, as `origin`'s pipeline would receive it. What the
    /// case leaves out is what a plain publish to the pipeline's queue carries: the queue's
    /// name as subject (RabbitMQ's default exchange routes by it).
    pub fn message(&self, origin: &Origin<'_>) -> InboundMessage {
        let subject = self.subject.as_deref().unwrap_or(origin.queue);
        let mut message = origin.message(self.body.clone(), subject);
        let mut attributes: BTreeMap<String, String> = message.attributes.into_iter().collect();
        attributes.extend(self.attributes.clone());
        message.attributes = attributes.into_iter().collect();
        message.headers = self.headers.clone();
        message.message_id = self.message_id.clone();
        message.redelivered = self.redelivered;
        message.delivery_count = self.delivery_count;
        message
    }

    /// Every way `actual` differs from what the case expects, one line each naming the field;
    /// empty when it matches.
    pub fn differences(&self, actual: &Result<Outcome, PluginError>) -> Vec<String> {
        let mut differences = Vec::new();
        match (&self.expect, actual) {
            (Expected::Decision { key, effects }, Ok(Outcome::Decision(decision))) => {
                if *key != decision.key {
                    differences.push(format!("key: expected {key:?}, got {:?}", decision.key));
                }
                if let Some(expected) = effects {
                    let actual: Vec<Json> = decision.effects.iter().map(effect_json).collect();
                    effect_differences(expected, &actual, &mut differences);
                }
            }
            (Expected::Skip(reason), Ok(Outcome::Skip { reason: actual })) => {
                reason.difference(actual, &mut differences);
            }
            (Expected::Failure { kind, reason }, Err(PluginError::Rejected(failure))) => {
                if let Some(kind) = kind
                    && *kind != failure.kind
                {
                    differences.push(format!(
                        "kind: expected {}, got {} (reason: {:?})",
                        kind.as_str(),
                        failure.kind.as_str(),
                        failure.reason
                    ));
                }
                reason.difference(&failure.reason, &mut differences);
            }
            (Expected::Error(reason), Err(error)) if !matches!(error, PluginError::Rejected(_)) => {
                reason.difference(&error.to_string(), &mut differences);
            }
            (expected, actual) => differences.push(format!(
                "outcome: expected {}, got {}",
                expected.outcome(),
                summary(actual)
            )),
        }
        differences
    }
}

impl Expected {
    fn outcome(&self) -> &'static str {
        match self {
            Expected::Decision { .. } => "decision",
            Expected::Skip(_) => "skip",
            Expected::Failure { .. } => "failure",
            Expected::Error(_) => "error",
        }
    }
}

impl ReasonMatch {
    fn difference(&self, actual: &str, differences: &mut Vec<String>) {
        if let Some(exact) = &self.exact
            && exact != actual
        {
            differences.push(format!("reason: expected {exact:?}, got {actual:?}"));
        }
        if let Some(fragment) = &self.contains
            && !actual.contains(fragment.as_str())
        {
            differences.push(format!(
                "reason: expected it to contain {fragment:?}, got {actual:?}"
            ));
        }
    }
}

/// One line naming an outcome and what it carries.
fn summary(actual: &Result<Outcome, PluginError>) -> String {
    match actual {
        Ok(Outcome::Decision(decision)) => format!(
            "decision (key {:?}, {} effect(s))",
            decision.key,
            decision.effects.len()
        ),
        Ok(Outcome::Skip { reason }) => format!("skip ({reason:?})"),
        Err(PluginError::Rejected(failure)) => {
            format!("failure ({}: {:?})", failure.kind.as_str(), failure.reason)
        }
        Err(error) => format!("error ({error})"),
    }
}

/// Effects compared one by one; an exec's parameters are named `$n` as in its SQL.
fn effect_differences(expected: &[Json], actual: &[Json], differences: &mut Vec<String>) {
    if expected.len() != actual.len() {
        differences.push(format!(
            "effects: expected {} effect(s), got {}",
            expected.len(),
            actual.len()
        ));
    }
    for (index, pair) in expected.iter().zip(actual).enumerate() {
        let (expected, actual) = pair;
        if expected == actual {
            continue;
        }
        let exec = |effect: &Json| {
            effect.as_array().and_then(|pair| {
                Some((
                    pair.first()?.as_str()?.to_string(),
                    pair.get(1)?.as_array()?.clone(),
                ))
            })
        };
        match (exec(expected), exec(actual)) {
            (Some((statement, expected_params)), Some((actual_statement, actual_params)))
                if statement == actual_statement
                    && expected_params.len() == actual_params.len() =>
            {
                for (position, (expected, actual)) in
                    expected_params.iter().zip(&actual_params).enumerate()
                {
                    if expected != actual {
                        differences.push(format!(
                            "effects[{index}] ({statement}) ${}: expected {expected}, got {actual}",
                            position + 1
                        ));
                    }
                }
            }
            _ => differences.push(format!(
                "effects[{index}]: expected {expected}, got {actual}"
            )),
        }
    }
    for (index, extra) in actual.iter().enumerate().skip(expected.len()) {
        differences.push(format!("effects[{index}]: not expected, got {extra}"));
    }
    for (index, missing) in expected.iter().enumerate().skip(actual.len()) {
        differences.push(format!("effects[{index}]: expected {missing}, got none"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::effect::{Decision, Effect, Failure, OutboxMessage, Value};

    fn decision(key: &str, effects: Vec<Effect>) -> Result<Outcome, PluginError> {
        Ok(Outcome::Decision(Decision {
            key: key.into(),
            effects,
        }))
    }

    fn exec(statement: &str, params: Vec<Value>) -> Effect {
        Effect::Exec {
            statement: statement.into(),
            params,
        }
    }

    const ORDERS: Origin<'static> = Origin {
        pipeline: "loyalty",
        source: "rabbitmq",
        queue: "orders",
    };

    #[test]
    fn source_fields_and_rabbitmq_shorthands_reach_the_message() {
        let case = one(
            r#"{"cases": [{"name": "routed", "body": "{}", "routing_key": "orders.eu",
                "exchange": "events", "delivery_count": 3, "attributes": {"stream-sequence": "9"},
                "expect": {"outcome": "skip"}}]}"#,
        );
        let message = case.message(&ORDERS);
        assert_eq!(message.subject, "orders.eu");
        assert_eq!(message.attribute("routing-key"), Some("orders.eu"));
        assert_eq!(message.attribute("exchange"), Some("events"));
        assert_eq!(message.attribute("stream-sequence"), Some("9"));
        assert_eq!(message.delivery_count, Some(3));
        let both = parse(
            r#"{"cases": [{"name": "twice", "body": "{}", "subject": "a", "routing_key": "b",
                "expect": {"outcome": "skip"}}]}"#,
        );
        assert!(
            both.is_err_and(|error| error.contains("not both")),
            "subject and routing_key together must be refused"
        );
    }

    fn one(text: &str) -> Case {
        let mut cases = parse(text).unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(cases.len(), 1);
        cases.remove(0)
    }

    #[test]
    fn a_decision_is_compared_field_by_field() {
        let case = one(r#"{"cases": [{"name": "valid", "json": {"order_id": 1},
                "expect": {"outcome": "decision", "key": "order:1",
                           "effects": [["credit", [7, 50]], ["note", [{"json": {"a": [1, 2]}}, null, 1.5, "x"]]]}}]}"#);
        assert_eq!(case.message(&ORDERS).body, br#"{"order_id":1}"#);
        let json_param = Value::Json("{ \"a\" : [1,2] }".into());
        let matching = decision(
            "order:1",
            vec![
                exec("credit", vec![Value::Integer(7), Value::Integer(50)]),
                exec(
                    "note",
                    vec![
                        json_param.clone(),
                        Value::Null,
                        Value::Float(1.5),
                        Value::Text("x".into()),
                    ],
                ),
            ],
        );
        assert_eq!(case.differences(&matching), Vec::<String>::new());
        let off = decision(
            "order:2",
            vec![
                exec("credit", vec![Value::Integer(7), Value::Integer(5)]),
                exec(
                    "note",
                    vec![
                        json_param,
                        Value::Null,
                        Value::Integer(1),
                        Value::Text("x".into()),
                    ],
                ),
                exec("extra", vec![]),
            ],
        );
        assert_eq!(
            case.differences(&off),
            vec![
                "key: expected \"order:1\", got \"order:2\"",
                "effects: expected 2 effect(s), got 3",
                "effects[0] (credit) $2: expected 50, got 5",
                "effects[1] (note) $3: expected 1.5, got 1",
                "effects[2]: not expected, got [\"extra\",[]]",
            ]
        );
    }

    #[test]
    fn skips_failures_and_errors_match_on_kind_and_reason() {
        let case = one(
            r#"{"cases": [{"name": "bad", "body": "{", "headers": {"tenant": "eu"}, "redelivered": true,
                "expect": {"outcome": "failure", "kind": "invalid-input", "reason_contains": "not valid JSON"}}]}"#,
        );
        let message = case.message(&ORDERS);
        assert_eq!(
            message.headers,
            vec![("tenant".to_string(), "eu".to_string())]
        );
        assert!(message.redelivered);
        assert_eq!(message.source, "rabbitmq");
        assert_eq!(message.queue, "orders");
        assert_eq!(message.subject, "orders");
        assert_eq!(message.attribute("routing-key"), Some("orders"));
        assert_eq!(message.attribute("exchange"), Some(""));
        let rejected = |kind, reason: &str| {
            Err(PluginError::Rejected(Failure {
                kind,
                reason: reason.into(),
            }))
        };
        assert!(
            case.differences(&rejected(
                FailureKind::InvalidInput,
                "body is not valid JSON"
            ))
            .is_empty()
        );
        assert_eq!(
            case.differences(&rejected(FailureKind::Retryable, "database busy")),
            vec![
                "kind: expected invalid-input, got retryable (reason: \"database busy\")",
                "reason: expected it to contain \"not valid JSON\", got \"database busy\"",
            ]
        );
        assert_eq!(
            case.differences(&decision("k", vec![])),
            vec!["outcome: expected failure, got decision (key \"k\", 0 effect(s))"]
        );
        let skip = one(
            r#"{"cases": [{"name": "s", "body": "", "expect": {"outcome": "skip", "reason": "not mine"}}]}"#,
        );
        assert!(
            skip.differences(&Ok(Outcome::Skip {
                reason: "not mine".into()
            }))
            .is_empty()
        );
        assert_eq!(
            skip.differences(&Ok(Outcome::Skip {
                reason: "other".into()
            })),
            vec!["reason: expected \"not mine\", got \"other\""]
        );
    }

    #[test]
    fn every_value_round_trips_through_its_json_form() {
        let values = vec![
            Value::Null,
            Value::Boolean(true),
            Value::Integer(i64::MIN),
            Value::Float(-2.5),
            Value::Float(f64::INFINITY),
            Value::Text("café".into()),
            Value::Json("{\"a\":1}".into()),
            Value::Bytes(vec![0, 255, 16]),
            Value::Timestamp(1_700_000_000_123_456),
        ];
        let effect = exec("all", values);
        let rendered = effect_json(&effect);
        assert_eq!(parse_effect(&rendered), Ok(effect));
        let outbox = Effect::Outbox(OutboxMessage {
            destination: "billing".into(),
            payload: vec![0xff, 0x00],
            headers: vec![("a".into(), "b".into())],
            key: Some("k".into()),
        });
        assert_eq!(parse_effect(&effect_json(&outbox)), Ok(outbox));
    }

    #[test]
    fn mistakes_in_a_case_file_are_named() {
        for (text, fragment) in [
            (
                r#"{"cases": [{"name": "a", "expect": {"outcome": "skip"}}]}"#,
                "case 1 (\"a\"): give the message as exactly one of body, json or body_hex",
            ),
            (
                r#"{"cases": [{"name": "a", "body": "", "expect": {"outcome": "skip", "reason_contain": "x"}}]}"#,
                "unknown field `reason_contain`",
            ),
            (
                r#"{"cases": [{"name": "a", "body": "", "expect": {"outcome": "failure", "kind": "fatal"}}]}"#,
                "unknown variant `fatal`",
            ),
            (
                r#"{"cases": [{"name": "a", "body": "", "expect": {"outcome": "decision", "key": "k", "effects": [["s", [[1]]]]}}]}"#,
                "case 1 (\"a\"): expect.effects[0]: $1: [1] is not a parameter",
            ),
            (
                r#"{"cases": [{"name": "a", "body": "", "expect": {"outcome": "decision", "key": "k", "effects": [["s", [18446744073709551615]]]}}]}"#,
                "past the largest integer",
            ),
            (
                r#"{"cases": [{"name": "a", "body_hex": "0g", "expect": {"outcome": "skip"}}]}"#,
                "body_hex: \"0g\" is not hex",
            ),
            (
                r#"{"cases": [{"name": "a", "body": "", "expect": {"outcome": "skip"}}, {"name": "a", "body": "", "expect": {"outcome": "skip"}}]}"#,
                "case 2 (\"a\"): another case has this name",
            ),
        ] {
            let error = parse(text).expect_err(text);
            assert!(error.contains(fragment), "{error:?} lacks {fragment:?}");
        }
    }
}
