//! How a message ends: acked as settled, dead-lettered, retried by the plugin's request or
//! requeued; `process` picks one, the consume loop carries it out.

/// How a message ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Settled: ack it.
    Ack(Settled),
    /// Permanently failed: dead-letter it with the reason, then ack it.
    DeadLetter {
        error_kind: &'static str,
        reason: String,
    },
    /// The plugin asked for another try: republish with `attempt`, then ack.
    Retry { attempt: u32, reason: String },
    /// Not settled (the host is stopping while the database is down, or the transaction
    /// kept conflicting past the retry budget): return it to the queue.
    Requeue,
}

/// The outcomes of a settled message, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    Applied,
    Duplicate,
    /// `claim = "none"`: no effect changed a row (an older or repeated version).
    Stale,
    Skipped,
}

impl Disposition {
    /// The outcome word counted in metrics.
    pub fn outcome(&self) -> &'static str {
        match self {
            Disposition::Ack(settled) => settled.as_str(),
            Disposition::DeadLetter { .. } => "rejected",
            Disposition::Retry { .. } => "retried",
            Disposition::Requeue => "requeued",
        }
    }

    /// Why the message failed, when it is dead-lettered: its error kind and reason.
    pub(super) fn error(&self) -> Option<(&'static str, &str)> {
        match self {
            Disposition::DeadLetter { error_kind, reason } => Some((error_kind, reason)),
            _ => None,
        }
    }
}

impl Settled {
    pub fn as_str(self) -> &'static str {
        match self {
            Settled::Applied => "applied",
            Settled::Duplicate => "duplicate",
            Settled::Stale => "stale",
            Settled::Skipped => "skipped",
        }
    }
}
