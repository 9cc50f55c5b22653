//! `[pipelines.<name>.transaction]`: the isolation level, the retries of serialization
//! failures and deadlocks, the role effects run under, the server's and the host's time
//! limits, and what a message that keeps timing out becomes.

use std::num::NonZeroU32;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;

use super::text::{duration, duration_schema, interpolated_option};

/// The `[pipelines.<name>.transaction]` table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TransactionConfig {
    #[serde(default)]
    pub isolation: Isolation,
    /// Serialization failures (40001) and deadlocks (40P01) retried before the message is
    /// requeued for a later delivery. Connection errors are retried without limit.
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// A Postgres role the effects run as (`SET LOCAL ROLE`); the claim runs as the host.
    #[serde(default, deserialize_with = "interpolated_option")]
    pub role: Option<String>,
    /// The server cancels any one statement of the transaction after this long
    /// (`SET LOCAL statement_timeout`; 57014, retried). Default 10 s; `0s` turns it off.
    #[serde(default = "default_statement_timeout", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub statement_timeout: Duration,
    /// The server gives up waiting for a lock after this long (`SET LOCAL lock_timeout`;
    /// 55P03, retried). Default 5 s; `0s` turns it off.
    #[serde(default = "default_lock_timeout", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub lock_timeout: Duration,
    /// The host's deadline for the whole transaction, from taking a connection to `COMMIT`'s
    /// answer. Past it the connection is abandoned (closed, never reused) and the transaction
    /// retried on a new one: this is what notices a half-open connection. Default 20 s.
    #[serde(default = "default_transaction_timeout", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub timeout: Duration,
    /// Tries a message may time out in a transaction of its own (a statement cancelled by
    /// `statement_timeout`, or `timeout` passed) before it stops holding its worker; then
    /// `on_timeout` decides. A batch with a timed-out try is applied one message at a time,
    /// so one slow message does not hold the others. Default 5.
    #[serde(default = "default_timeouts")]
    pub timeouts: NonZeroU32,
    /// What becomes of a message that timed out `timeouts` times alone.
    #[serde(default)]
    pub on_timeout: OnTimeout,
}

impl Default for TransactionConfig {
    fn default() -> Self {
        TransactionConfig {
            isolation: Isolation::default(),
            retries: default_retries(),
            role: None,
            statement_timeout: default_statement_timeout(),
            lock_timeout: default_lock_timeout(),
            timeout: default_transaction_timeout(),
            timeouts: default_timeouts(),
            on_timeout: OnTimeout::default(),
        }
    }
}

/// `transaction.on_timeout`: the fate of a message whose transaction kept timing out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum OnTimeout {
    /// Back to the end of the queue (RabbitMQ: a copy, then the original acked; JetStream: a
    /// `Nak`), so the messages behind it go first; it is tried again later.
    #[default]
    Requeue,
    /// Dead-lettered as `transaction-timeout`, with the last error, for an operator.
    DeadLetter,
}

/// Transaction isolation level.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Isolation {
    #[default]
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

fn default_statement_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_lock_timeout() -> Duration {
    Duration::from_secs(5)
}

fn default_timeouts() -> NonZeroU32 {
    NonZeroU32::new(5).expect("five")
}

fn default_transaction_timeout() -> Duration {
    Duration::from_secs(20)
}

fn default_retries() -> u32 {
    10
}
