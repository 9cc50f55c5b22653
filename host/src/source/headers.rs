//! Every header the host writes on a message it sets aside or sends again (`x-idem-*`), on
//! either source, and what counts as one.

/// The prefix of the headers the host writes.
pub const PREFIX: &str = "x-idem-";
/// Why a message was dead-lettered, on every source.
pub const REASON: &str = "x-idem-reason";
/// The class of the failure (`invalid-input`, `plugin-trap`, `sql`, …).
pub const ERROR_KIND: &str = "x-idem-error-kind";
/// When the message was dead-lettered (Unix seconds).
pub const REJECTED_AT: &str = "x-idem-rejected-at";
/// The pipeline that dead-lettered the message.
pub const PIPELINE: &str = "x-idem-pipeline";
/// The queue or stream the pipeline consumed it from.
pub const QUEUE: &str = "x-idem-queue";
/// How many times a message has been replayed out of the dead letters.
pub const REPLAYS: &str = "x-idem-replays";
/// RabbitMQ: what names a dead letter on its queue for good (random, set when it is
/// dead-lettered): a queue has no sequence numbers, and positions shift as messages leave.
pub const DEAD_LETTER_ID: &str = "x-idem-dead-letter-id";
/// RabbitMQ: how many times a message has been tried (a retry is a copy back to the queue).
pub const ATTEMPT: &str = "x-idem-attempt";
/// RabbitMQ: the original's `expiration`, kept on a copy that must not expire.
pub const EXPIRATION: &str = "x-idem-expiration";
/// RabbitMQ: the original's `user-id`, which the broker checks against the publisher.
pub const USER_ID: &str = "x-idem-user-id";
/// JetStream: the subject a dead letter was consumed from.
pub const SUBJECT: &str = "x-idem-subject";
/// JetStream: the producer's message id (`Nats-Msg-Id`) of a dead letter or a replayed
/// message, whose own `Nats-Msg-Id` is the host's.
pub const MESSAGE_ID: &str = "x-idem-message-id";
/// JetStream: the sequence a dead letter had on the pipeline's stream.
pub const STREAM_SEQUENCE: &str = "x-idem-stream-sequence";

/// Whether header `name` is one of the host's diagnostics of the last failure (`x-idem-*`),
/// which a replay leaves out.
pub fn is_diagnostic(name: &str) -> bool {
    name.get(..PREFIX.len())
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case(PREFIX))
}
