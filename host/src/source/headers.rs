//! Every header the host writes on a message it sets aside or sends again (`x-idem-*`), on
//! either source, what counts as one, and the text a reason header holds.
//!
//! A producer can set `x-idem-*` headers too, and the broker can dead-letter its message
//! without the host (a quorum queue's delivery limit). So nothing of a dead letter's identity
//! rests on them (a RabbitMQ dead letter is named by a digest of all it holds), a copy the
//! host dead-letters keeps none of a producer's diagnostics ([`is_kept_on_a_dead_letter`]),
//! and the host reads its headers by their exact names only.

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
/// Kafka: the topic, partition and offset a dead letter was consumed from.
pub const TOPIC: &str = "x-idem-topic";
pub const PARTITION: &str = "x-idem-partition";
pub const OFFSET: &str = "x-idem-offset";
/// Kafka: on a marker the host appends to a dead-letter topic, which a topic cannot delete
/// one record of, the dead letter (`<partition>:<offset>`) replayed or discarded.
pub const SETTLED: &str = "x-idem-settled";

/// Whether header `name` is one of the host's diagnostics of the last failure (`x-idem-*`),
/// which a replay leaves out.
pub fn is_diagnostic(name: &str) -> bool {
    name.get(..PREFIX.len())
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case(PREFIX))
}

/// What the host records of a message's history and its copies carry on: its attempt, its
/// replays, the producer's message id (JetStream) and the properties a copy could not keep
/// (RabbitMQ). A producer that sets one changes only its own message's count.
const CARRIED: [&str; 5] = [ATTEMPT, REPLAYS, MESSAGE_ID, EXPIRATION, USER_ID];

/// Whether a dead letter the host makes of a message keeps its header `name`: every header
/// but the `x-idem-*` ones (in any case) that are not [`CARRIED`], so what it records of the
/// failure is only its own.
pub fn is_kept_on_a_dead_letter(name: &str) -> bool {
    !is_diagnostic(name) || CARRIED.contains(&name)
}

/// Longest reason kept in a header, in bytes.
const REASON_BYTES: usize = 4096;

/// `text` on one line: every control character (line breaks, tabs) becomes a space.
pub fn one_line(text: &str) -> String {
    text.chars()
        .map(|character| {
            if character.is_control() {
                ' '
            } else {
                character
            }
        })
        .collect()
}

/// A reason as a dead letter's header carries it: one line (which NATS headers require), at
/// most `REASON_BYTES` bytes, cut on a character boundary.
pub fn reason_text(reason: &str) -> String {
    let line = one_line(reason);
    if line.len() <= REASON_BYTES {
        return line;
    }
    let mut cut = REASON_BYTES;
    while !line.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &line[..cut])
}

/// Why a message was set aside and where it came from: what every dead letter carries, on
/// every source, as text. Its time ([`REJECTED_AT`]) goes beside them in each broker's own
/// type (RabbitMQ has a timestamp).
pub struct Rejection<'a> {
    pub error_kind: &'a str,
    pub reason: &'a str,
    pub pipeline: &'a str,
    /// The queue, stream or topic the message was consumed from.
    pub queue: &'a str,
}

impl Rejection<'_> {
    /// The reason headers, each with its value: the reason as [`reason_text`] writes it.
    pub fn headers(&self) -> [(&'static str, String); 4] {
        [
            (REASON, reason_text(self.reason)),
            (ERROR_KIND, self.error_kind.to_string()),
            (PIPELINE, self.pipeline.to_string()),
            (QUEUE, self.queue.to_string()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reason_is_one_line_cut_on_a_character_boundary() {
        assert_eq!(reason_text("short"), "short");
        assert_eq!(reason_text("line one\nline two\r"), "line one line two ");
        let long = reason_text(&"é".repeat(3_000));
        assert!(long.ends_with('…'), "{long}");
        assert!(long.len() <= REASON_BYTES + '…'.len_utf8());
        assert!(
            long.trim_end_matches('…')
                .chars()
                .all(|character| character == 'é')
        );
    }
}
