//! What an operator does to a running pipeline besides reloading its plugin: pause and
//! resume it (`POST /admin/pipelines/{name}/pause|resume`, the console, `idem pause|resume`).
//!
//! A pause on one host lasts while that host runs. A recorded pause (`persist`, and always
//! from `idem pause`) is written to the database first (`store::pauses`): every host of the
//! pipeline's consumer reads the records before it consumes and every `WATCH_EVERY` after, so
//! it stops every host and outlives restarts, until a resume clears it.
//!
//! A paused pipeline lets the messages it started settle, then closes its source connection:
//! what it had prefetched goes back to the queue for no one to hold.
//!
//! The pause here is a switch that counts its changes: the poll of the recorded pauses
//! (`follow_recorded_pauses`) reads the switch, then the records, then acts; an operator's
//! pause or resume landing between the two readings wins, instead of being undone by a
//! decision on the older reading until the next poll.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::store::database::{Database, Databases};
use crate::store::pauses::{self, Recorded};

use super::Pipeline;

/// An operator's pause of a pipeline (`POST /admin/pipelines/{name}/pause`, `idem pause`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorPause {
    /// What the operator said, or that nothing was said.
    pub reason: String,
    pub since: SystemTime,
    /// Recorded in the database (`idem_consumers.paused_at`): every host of the pipeline's
    /// consumer honours it, across restarts, until a resume clears it.
    pub persistent: bool,
}

/// The switch: `Some` while an operator has paused the pipeline.
#[derive(Debug)]
pub(crate) struct OperatorSwitch {
    state: watch::Sender<Switched>,
}

#[derive(Debug, Default)]
struct Switched {
    pause: Option<OperatorPause>,
    /// Every pause and resume counts one.
    changes: u64,
}

/// When the switch was read: a decision taken on what was read after it holds only if the
/// switch did not change since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reading {
    changes: u64,
}

/// What following a recorded pause did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Followed {
    /// Paused by the record, as given.
    Paused(OperatorPause),
    Resumed,
    Nothing,
}

impl Default for OperatorSwitch {
    fn default() -> Self {
        OperatorSwitch {
            state: watch::Sender::new(Switched::default()),
        }
    }
}

impl OperatorSwitch {
    /// Pauses (or replaces the pause). Returns whether it was running.
    pub(crate) fn pause(&self, pause: OperatorPause) -> bool {
        let mut newly = false;
        self.state.send_modify(|state| {
            newly = state.pause.is_none();
            state.pause = Some(pause);
            state.changes += 1;
        });
        newly
    }

    /// Resumes; the pause it ended, if there was one.
    pub(crate) fn resume(&self) -> Option<OperatorPause> {
        let mut ended = None;
        self.state.send_if_modified(|state| {
            ended = state.pause.take();
            state.changes += 1;
            ended.is_some()
        });
        ended
    }

    pub(crate) fn current(&self) -> Option<OperatorPause> {
        self.state.borrow().pause.clone()
    }

    pub(crate) fn read(&self) -> Reading {
        Reading {
            changes: self.state.borrow().changes,
        }
    }

    /// Follows the pause recorded in the database (`None`: no record), read after `reading`:
    /// a record pauses the pipeline unless a recorded pause already does; a persistent pause
    /// without its record is resumed; a pause on this host only is left alone. Nothing, when
    /// an operator paused or resumed since `reading` (the next poll decides again).
    pub(crate) fn follow_record(
        &self,
        reading: Reading,
        record: Option<OperatorPause>,
    ) -> Followed {
        let mut followed = Followed::Nothing;
        self.state.send_if_modified(|state| {
            if state.changes != reading.changes {
                return false;
            }
            let persistent = state.pause.as_ref().is_some_and(|pause| pause.persistent);
            match record {
                Some(record) if !persistent => {
                    state.pause = Some(record.clone());
                    followed = Followed::Paused(record);
                }
                None if persistent => {
                    state.pause = None;
                    followed = Followed::Resumed;
                }
                _ => return false,
            }
            state.changes += 1;
            true
        });
        followed
    }

    /// Returns once an operator pauses the pipeline.
    pub(crate) async fn paused(&self) {
        let mut receiver = self.state.subscribe();
        let _ = receiver.wait_for(|state| state.pause.is_some()).await;
    }

    /// Returns once no operator's pause holds the pipeline.
    pub(crate) async fn resumed(&self) {
        let mut receiver = self.state.subscribe();
        let _ = receiver.wait_for(|state| state.pause.is_none()).await;
    }
}

/// How often every host reads the recorded pauses.
pub const WATCH_EVERY: Duration = Duration::from_secs(5);

/// The reason a pause without one is given.
const NO_REASON: &str = "no reason given";

/// Pauses `pipeline`, in `database`; with `persist`, records it for every host first (a
/// record that cannot be written pauses nothing). Returns whether it was running.
pub async fn pause(
    pipeline: &Pipeline,
    database: &Database,
    reason: Option<&str>,
    persist: bool,
) -> Result<bool, sqlx::Error> {
    let reason = reason
        .map(str::trim)
        .filter(|reason| !reason.is_empty())
        .unwrap_or(NO_REASON);
    if persist {
        let config = &pipeline.config;
        pauses::record(
            &database.pool,
            &database.tables,
            &config.consumer,
            config.retention.window,
            reason,
        )
        .await?;
    }
    Ok(pipeline.pause_by_operator(OperatorPause {
        reason: reason.to_string(),
        since: SystemTime::now(),
        persistent: persist,
    }))
}

/// Resumes `pipeline`: clears its consumer's recorded pause, if any (every host resumes),
/// then its pause here. Returns the pause it ended here.
pub async fn resume(
    pipeline: &Pipeline,
    database: &Database,
) -> Result<Option<OperatorPause>, sqlx::Error> {
    pauses::clear(&database.pool, &database.tables, &pipeline.config.consumer).await?;
    Ok(pipeline.resume_by_operator())
}

/// Applies the pauses recorded in every database to its pipelines now (before they
/// consume), then every `WATCH_EVERY` until `shutdown`.
pub async fn follow_recorded_pauses(
    pipelines: Vec<Arc<Pipeline>>,
    databases: Databases,
    shutdown: CancellationToken,
) {
    apply_recorded(&pipelines, &databases).await;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(WATCH_EVERY) => {}
            }
            apply_recorded(&pipelines, &databases).await;
        }
    });
}

/// Pauses the pipelines whose consumer has a recorded pause, and resumes those paused by a
/// record that was cleared. A pause on this host only is left alone.
async fn apply_recorded(pipelines: &[Arc<Pipeline>], databases: &Databases) {
    for (name, database) in databases.iter() {
        // The switches first: an operator's pause or resume after this reading wins over
        // the records read next.
        let here: Vec<_> = pipelines
            .iter()
            .filter(|pipeline| pipeline.config.database.as_deref() == name)
            .map(|pipeline| (pipeline, pipeline.read_operator_pause()))
            .collect();
        let recorded: BTreeMap<String, Recorded> = match pauses::recorded(
            &database.pool,
            &database.tables,
        )
        .await
        {
            Ok(recorded) => recorded,
            Err(error) => {
                warn!(%error, database = %crate::store::database::label(name), "Cannot read the recorded pauses; trying again in 5 s.");
                continue;
            }
        };
        for (pipeline, reading) in &here {
            let record = recorded
                .get(&pipeline.config.consumer)
                .map(|record| OperatorPause {
                    reason: record.reason.clone(),
                    since: record.since,
                    persistent: true,
                });
            pipeline.follow_record(*reading, record);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pause(persistent: bool) -> OperatorPause {
        OperatorPause {
            reason: "bad plugin".into(),
            since: SystemTime::now(),
            persistent,
        }
    }

    #[test]
    fn records_pause_and_resume_what_they_recorded_only() {
        let switch = OperatorSwitch::default();
        let followed = switch.follow_record(switch.read(), Some(pause(true)));
        assert!(matches!(followed, Followed::Paused(ref pause) if pause.persistent));
        assert!(switch.current().is_some_and(|pause| pause.persistent));
        assert_eq!(switch.follow_record(switch.read(), None), Followed::Resumed);
        assert_eq!(switch.current(), None);

        // A pause on this host only is not the records' to end.
        switch.pause(pause(false));
        assert_eq!(switch.follow_record(switch.read(), None), Followed::Nothing);
        assert!(switch.current().is_some());
    }

    #[test]
    fn a_resume_after_the_records_were_read_is_not_undone() {
        let switch = OperatorSwitch::default();
        switch.pause(pause(true));
        // The poll reads the switch, then the records (the pause still recorded) …
        let reading = switch.read();
        let record = Some(pause(true));
        // … and before it acts, an operator resumes (clearing the record, then here).
        assert!(switch.resume().is_some());
        assert_eq!(switch.follow_record(reading, record), Followed::Nothing);
        assert_eq!(switch.current(), None);
    }

    #[test]
    fn a_pause_after_the_records_were_read_is_not_undone() {
        let switch = OperatorSwitch::default();
        // The poll reads the switch, then the records (none yet) …
        let reading = switch.read();
        // … and before it acts, an operator pauses with persist (recorded, then here).
        assert!(switch.pause(pause(true)));
        assert_eq!(switch.follow_record(reading, None), Followed::Nothing);
        assert!(switch.current().is_some_and(|pause| pause.persistent));
    }
}
