//! Deterministic crash points for the crash-window tests.
//!
//! `IDEM_FAILPOINT=before-commit` (or `after-commit`, `after-ack`) makes the process abort at that
//! instant, as `kill -9` would, so a test can prove the redelivery neither loses nor
//! doubles the effect. Unset in production: the check is one load of a cached value.

use std::sync::OnceLock;

/// The places a crash can be requested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    /// After the claim ran, before `COMMIT` is sent (with the effects, which go in the same
    /// flight).
    BeforeCommit,
    /// After `COMMIT` returned, before the ack is sent.
    AfterCommit,
    /// After the ack was handed to the broker connection.
    AfterAck,
}

impl Failpoint {
    fn name(self) -> &'static str {
        match self {
            Failpoint::BeforeCommit => "before-commit",
            Failpoint::AfterCommit => "after-commit",
            Failpoint::AfterAck => "after-ack",
        }
    }

    /// Aborts the process if `IDEM_FAILPOINT` names this point.
    pub fn hit(self) {
        static ARMED: OnceLock<Option<String>> = OnceLock::new();
        let armed = ARMED.get_or_init(|| std::env::var("IDEM_FAILPOINT").ok());
        if armed.as_deref() == Some(self.name()) {
            eprintln!("idem: failpoint {} hit, aborting", self.name());
            std::process::abort();
        }
    }
}
