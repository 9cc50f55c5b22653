//! A pipeline's dead letters as an operator sees them, on either source: listed, shown, and
//! replayed by selection (`idem dlq list/show/replay`, `idem replay`).
//!
//! Each source keeps its dead letters its own way (a RabbitMQ queue, a JetStream stream) and
//! reads them in `rabbitmq::dead_letters` and `jetstream::dead_letters`, which
//! `source::pass_dead_letters` chooses between; what a dead letter is, which ones a command
//! selects and what a pass does with them is decided here, once. This file names no source
//! kind.
//!
//! Architecture invariant: a pass never loses a dead letter. Looking leaves every message where
//! it was, in its order; a replayed message is stored on the pipeline's queue or stream (the
//! broker confirmed it) before it is removed from the dead letters, so a failure between the
//! two replays it twice at worst, and the claim makes the second copy a duplicate.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use serde_json::json;

use super::headers::{self, one_line};
use crate::message::InboundMessage;

/// The dead letters one pass reads at most, whatever it selects: a pass that matches nothing
/// in a huge dead-letter queue ends, and says where it stopped.
pub const SCAN_MESSAGES: u64 = 100_000;

/// Which dead letters a command acts on; every given filter must match.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// The error kind (`x-idem-error-kind`), exactly.
    pub kind: Option<String>,
    /// A fragment of the reason (`x-idem-reason`).
    pub reason: Option<String>,
    /// Dead-lettered at most this long ago.
    pub since: Option<Duration>,
    /// Only these dead letters (their [`DeadLetter::id`]s), as a page listed them.
    pub ids: Option<BTreeSet<String>>,
    /// Act on at most this many matching messages.
    pub limit: Option<u64>,
}

impl Selection {
    /// Whether nothing narrows it: every dead letter.
    pub fn is_everything(&self) -> bool {
        self.kind.is_none()
            && self.reason.is_none()
            && self.since.is_none()
            && self.ids.is_none()
            && self.limit.is_none()
    }
}

/// One dead letter as it is kept.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// 1 for the pipeline's oldest dead letter when the pass began.
    pub position: u64,
    /// What names this dead letter from one pass to the next, while positions may shift: its
    /// sequence in the dead-letter stream, or on a queue a digest of all it holds.
    pub id: String,
    /// The delivery as the plugin saw it, with every header (the `x-idem-*` ones included).
    pub message: InboundMessage,
    /// The error kind the host recorded, e.g. `invalid-input` or `retries-exhausted`.
    pub kind: Option<String>,
    pub reason: Option<String>,
    /// How long ago it was dead-lettered, when the host recorded it.
    pub age: Option<Duration>,
    /// How many times it was replayed before.
    pub replays: u64,
}

impl DeadLetter {
    /// The dead letter at `position`, named `id`, holding `message`, with what the host
    /// recorded in its headers when it dead-lettered it.
    pub(super) fn recorded(position: u64, id: String, message: InboundMessage) -> DeadLetter {
        // By its exact name: a producer's `X-Idem-Reason` is not the host's.
        let header = |name: &str| {
            message
                .headers
                .iter()
                .find(|(key, _)| key == name)
                .map(|(_, value)| value.clone())
        };
        let number = |name: &str| header(name).and_then(|text| text.trim().parse::<u64>().ok());
        // A producer may set the header too: a time past what the clock holds is no age.
        let age = number(headers::REJECTED_AT)
            .and_then(|seconds| SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(seconds)))
            .map(|rejected| {
                SystemTime::now()
                    .duration_since(rejected)
                    .unwrap_or_default()
            });
        DeadLetter {
            position,
            id,
            kind: header(headers::ERROR_KIND),
            reason: header(headers::REASON),
            age,
            replays: number(headers::REPLAYS).unwrap_or(0),
            message,
        }
    }
}

impl DeadLetter {
    /// The dead letter as `idem dlq list --json` and the console show it: the body whole when
    /// `whole_body`, else a preview of `PREVIEW_CHARS` characters; hex when it is not UTF-8.
    pub fn json(&self, whole_body: bool) -> serde_json::Value {
        let body = &self.message.body;
        let body = match std::str::from_utf8(body) {
            Ok(text) if whole_body => json!({ "text": text }),
            Ok(text) => json!({ "preview": cut_line(text, PREVIEW_CHARS) }),
            Err(_) => json!({ "hex": hex::encode(body) }),
        };
        json!({
            "position": self.position,
            "id": self.id,
            "age_seconds": self.age.map(|age| age.as_secs()),
            "kind": self.kind,
            "reason": self.reason,
            "replays": self.replays,
            "message_id": self.message.message_id,
            "subject": self.message.subject,
            "headers": self.message.headers.iter().map(|(name, value)| json!([name, value])).collect::<Vec<_>>(),
            "body": body,
            "body_bytes": self.message.body.len(),
        })
    }
}

/// Longest body preview in a list of dead letters, in characters.
pub const PREVIEW_CHARS: usize = 60;

/// `text` on one line (`headers::one_line`), cut to `max` characters with an ellipsis.
pub fn cut_line(text: &str, max: usize) -> String {
    let flat = one_line(text);
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// Dead letters of one error kind and reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub kind: Option<String>,
    pub reason: Option<String>,
    /// How many dead letters it holds.
    pub count: usize,
    /// The ids of its dead letters, oldest first.
    pub ids: Vec<String>,
    /// The age of its youngest dead letter.
    pub newest: Option<Duration>,
}

/// `letters` grouped by error kind and reason, the largest group first (then by kind and
/// reason), as an operator triages them.
pub fn groups(letters: &[DeadLetter]) -> Vec<Group> {
    let mut by_cause: BTreeMap<(Option<&str>, Option<&str>), Group> = BTreeMap::new();
    for letter in letters {
        let group = by_cause
            .entry((letter.kind.as_deref(), letter.reason.as_deref()))
            .or_insert_with(|| Group {
                kind: letter.kind.clone(),
                reason: letter.reason.clone(),
                count: 0,
                ids: Vec::new(),
                newest: None,
            });
        group.count += 1;
        if !group.ids.contains(&letter.id) {
            group.ids.push(letter.id.clone());
        }
        group.newest = match (group.newest, letter.age) {
            (Some(newest), Some(age)) => Some(newest.min(age)),
            (newest, age) => newest.or(age),
        };
    }
    let mut groups: Vec<Group> = by_cause.into_values().collect();
    groups.sort_by_key(|group| std::cmp::Reverse(group.count));
    groups
}

impl Selection {
    fn matches(&self, letter: &DeadLetter) -> bool {
        self.ids.as_ref().is_none_or(|ids| ids.contains(&letter.id))
            && self
                .kind
                .as_ref()
                .is_none_or(|kind| letter.kind.as_deref() == Some(kind.as_str()))
            && self.reason.as_ref().is_none_or(|fragment| {
                letter
                    .reason
                    .as_deref()
                    .is_some_and(|reason| reason.contains(fragment.as_str()))
            })
            && self
                .since
                .is_none_or(|since| letter.age.is_some_and(|age| age <= since))
    }

    /// Whether `selected` messages are as many as the command asked for.
    fn is_full(&self, selected: u64) -> bool {
        self.limit.is_some_and(|limit| selected >= limit)
    }
}

/// What every kind's pass does with the dead letters it meets, oldest first: numbers them,
/// picks those the selection matches until it has as many as asked for, and shows each picked
/// one to the caller. What becomes of a picked one (left, replayed, discarded) is the kind's.
pub(super) struct Walk<'a, F: FnMut(&DeadLetter)> {
    selection: &'a Selection,
    seen: F,
    met: u64,
    selected: u64,
}

impl<'a, F: FnMut(&DeadLetter)> Walk<'a, F> {
    pub(super) fn new(selection: &'a Selection, seen: F) -> Self {
        Walk {
            selection,
            seen,
            met: 0,
            selected: 0,
        }
    }

    /// Whether the selection has as many as it asked for.
    pub(super) fn is_done(&self) -> bool {
        self.selection.is_full(self.selected)
    }

    /// How many dead letters the pass met.
    pub(super) fn met(&self) -> u64 {
        self.met
    }

    /// How many the selection picked.
    pub(super) fn selected(&self) -> u64 {
        self.selected
    }

    /// The position the next dead letter met has.
    pub(super) fn next_position(&self) -> u64 {
        self.met + 1
    }

    /// Meets `letter` (at [`Walk::next_position`]); whether the selection picks it, in which
    /// case the caller was shown it.
    pub(super) fn take(&mut self, letter: &DeadLetter) -> bool {
        self.met += 1;
        if !self.selection.matches(letter) {
            return false;
        }
        self.selected += 1;
        (self.seen)(letter);
        true
    }

    /// Meets the dead letter named `id` holding `message`; it, when the selection picks it.
    pub(super) fn meet(&mut self, id: String, message: InboundMessage) -> Option<DeadLetter> {
        let letter = DeadLetter::recorded(self.next_position(), id, message);
        self.take(&letter).then_some(letter)
    }
}

/// What a pass does with each selected message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Look only: every message stays where it was.
    Look,
    /// Move the selected messages back to the pipeline's queue or stream, headers as they
    /// came from the producer (without the host's `x-idem-*` diagnostics) and the replay
    /// counted in `x-idem-replays`: retries start over in the pipeline.
    Replay,
    /// Remove the selected messages for good (after an archive kept them, or because they
    /// will never be replayed).
    Discard,
}

/// Waits until no other pass of this process reads `dead_letter` (a queue or a subject), and
/// holds the turn until the returned guard drops.
///
/// A pass over a RabbitMQ queue holds what it read (unacked) until it gives it back, so a
/// second pass at the same time would find those messages missing and list too few (two
/// operators on the console, or the view and its pipeline choice firing together). Passes of
/// different processes (`idem dlq` beside a running host) still meet; the broker offers no
/// lock that would not also stop the consumer.
pub(super) async fn turn(dead_letter: &str) -> tokio::sync::OwnedMutexGuard<()> {
    static TURNS: std::sync::LazyLock<
        std::sync::Mutex<BTreeMap<String, std::sync::Arc<tokio::sync::Mutex<()>>>>,
    > = std::sync::LazyLock::new(Default::default);
    let turn = {
        let mut turns = TURNS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Forget the turns nobody holds or waits for, so the map stays as small as the
        // passes running.
        turns.retain(|_, turn| std::sync::Arc::strong_count(turn) > 1);
        turns.entry(dead_letter.to_string()).or_default().clone()
    };
    turn.lock_owned().await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A producer's `x-idem-rejected-at` past what the clock holds (a dead letter published
    /// straight to the dead-letter queue) gives no age, and does not bring `idem dlq list`
    /// down.
    #[test]
    fn a_rejection_time_out_of_range_has_no_age() {
        for seconds in ["10000000000000000000", "18446744073709551615"] {
            let message = InboundMessage {
                headers: vec![(headers::REJECTED_AT.to_string(), seconds.to_string())],
                ..InboundMessage::default()
            };
            let letter = DeadLetter::recorded(1, "id".into(), message);
            assert_eq!(letter.age, None, "{seconds}");
        }
    }
}
