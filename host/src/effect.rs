//! What a plugin decides, as host-side data: no generated types, no SQL.

/// A plugin's verdict on a message it understood.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Claim `key`, then apply the effects in order, all in one transaction.
    Decision(Decision),
    /// Not for this consumer: ack with no claim and no effect.
    Skip { reason: String },
}

/// Longest idempotency key accepted, the decision's and an outbox row's: longer keys would
/// not fit the claims' and the outbox's btree indexes.
pub const MAX_KEY_BYTES: usize = 1024;

#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub key: String,
    pub effects: Vec<Effect>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Run a named statement of the pipeline with these parameters.
    Exec {
        statement: String,
        params: Vec<Value>,
    },
    /// Write a message to the outbox, delivered by the relay after the commit.
    Outbox(OutboxMessage),
}

/// A message for an outbox destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    pub destination: String,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, String)>,
    /// The destination's idempotency key; the decision's key when `None`.
    pub key: Option<String>,
}

/// A typed statement parameter, converted to the statement's declared type when bound.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Boolean(bool),
    Integer(i64),
    Float(f64),
    Text(String),
    /// JSON document text.
    Json(String),
    Bytes(Vec<u8>),
    /// Microseconds since the Unix epoch, UTC.
    Timestamp(i64),
}

/// Why a plugin refused a message, in its own words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    pub reason: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Can never succeed: dead-letter.
    InvalidInput,
    /// May succeed later: retry a bounded number of times.
    Retryable,
}

impl Value {
    /// The WIT name of the variant, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Boolean(_) => "boolean",
            Value::Integer(_) => "integer",
            Value::Float(_) => "float",
            Value::Text(_) => "text",
            Value::Json(_) => "json",
            Value::Bytes(_) => "bytes",
            Value::Timestamp(_) => "timestamp",
        }
    }

    /// Approximate bytes this value carries, for the decision size limit.
    pub fn size(&self) -> usize {
        match self {
            Value::Text(text) | Value::Json(text) => text.len(),
            Value::Bytes(bytes) => bytes.len(),
            _ => 8,
        }
    }
}

impl Decision {
    /// Approximate bytes this decision carries, for the decision size limit.
    pub fn size(&self) -> usize {
        self.key.len()
            + self
                .effects
                .iter()
                .map(|effect| match effect {
                    Effect::Exec { statement, params } => {
                        statement.len() + params.iter().map(Value::size).sum::<usize>()
                    }
                    Effect::Outbox(message) => {
                        message.destination.len()
                            + message.payload.len()
                            + message
                                .headers
                                .iter()
                                .map(|(name, value)| name.len() + value.len())
                                .sum::<usize>()
                            + message.key.as_ref().map_or(0, String::len)
                    }
                })
                .sum::<usize>()
    }
}

impl Decision {
    /// Where the decision carries a NUL character, which PostgreSQL refuses in text (22021):
    /// the key, a text or JSON parameter, or an outbox field. `None` when there is none.
    pub fn nul_position(&self) -> Option<String> {
        let has_nul = |text: &str| text.contains('\0');
        if has_nul(&self.key) {
            return Some("the idempotency key".to_string());
        }
        for (position, effect) in self.effects.iter().enumerate() {
            match effect {
                Effect::Exec { statement, params } => {
                    let nul_param = params.iter().position(|value| {
                        matches!(value, Value::Text(text) | Value::Json(text) if has_nul(text))
                    });
                    if let Some(param) = nul_param {
                        return Some(format!(
                            "effect {position} ({statement:?}), parameter ${}",
                            param + 1
                        ));
                    }
                }
                Effect::Outbox(message) => {
                    let in_headers = message
                        .headers
                        .iter()
                        .any(|(name, value)| has_nul(name) || has_nul(value));
                    if has_nul(&message.destination)
                        || in_headers
                        || message.key.as_deref().is_some_and(has_nul)
                    {
                        return Some(format!("effect {position} (outbox)"));
                    }
                }
            }
        }
        None
    }
}

impl FailureKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::InvalidInput => "invalid-input",
            FailureKind::Retryable => "retryable",
        }
    }
}
