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
//! Dead letters that will never be replayed are discarded, or archived first (to the
//! `idem_dead_letters` table, or to a JSON-lines file from the command line), with the same
//! selection as a replay. An archive is written and committed before anything is removed,
//! and only the dead letters it holds are then removed (by id): a failure between the two
//! leaves a dead letter archived and still there, never gone unarchived.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::config::PipelineConfig;
use crate::pipeline::{OperatorPause, Pipeline};
use crate::source::dead_letters::{Action, DeadLetter, Selection};
use crate::source::{self, SourceError};
use crate::store::archive::{self, Archived};
use crate::store::database::{Database, Databases};
use crate::store::pauses::{self, Recorded};
use crate::store::tables::Tables;

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

/// Where archived dead letters go.
#[derive(Debug, Clone, Copy)]
pub enum ArchiveTo<'a> {
    /// Rows of `idem_dead_letters` in this database.
    Table {
        pool: &'a PgPool,
        tables: &'a Tables,
    },
    /// JSON lines appended to this file (`idem dlq list --json`'s form, bodies whole).
    File(&'a Path),
}

#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("cannot write the archive to the database ({0}); nothing was discarded")]
    Table(sqlx::Error),
    #[error("cannot write the archive to {path}: {source}; nothing was discarded")]
    File {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// What an archive did: the dead letters written, and how many of them were then removed
/// (fewer when some were replayed or removed meanwhile by someone else).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchiveReport {
    pub archived: Vec<String>,
    pub discarded: u64,
}

/// Archives the dead letters of `pipeline` that `selection` takes to `to`, then discards
/// them. With `dry_run`, only says which ones would go.
pub async fn archive_dead_letters(
    pipeline: &PipelineConfig,
    selection: &Selection,
    to: ArchiveTo<'_>,
    dry_run: bool,
) -> Result<ArchiveReport, ArchiveError> {
    let mut letters: Vec<DeadLetter> = Vec::new();
    source::pass_dead_letters(pipeline, selection, Action::Look, |letter| {
        letters.push(letter.clone())
    })
    .await?;
    let archived: Vec<String> = letters.iter().map(|letter| letter.id.clone()).collect();
    if dry_run || letters.is_empty() {
        return Ok(ArchiveReport {
            archived,
            discarded: 0,
        });
    }
    match to {
        ArchiveTo::Table { pool, tables } => {
            let rows: Vec<Archived> = letters.iter().map(archived_row).collect();
            archive::write(pool, tables, &pipeline.name, &rows)
                .await
                .map_err(ArchiveError::Table)?;
        }
        ArchiveTo::File(path) => {
            append_lines(path, &letters).map_err(|source| ArchiveError::File {
                path: path.to_path_buf(),
                source,
            })?
        }
    }
    // Exactly the ones archived: by id, however many there are now.
    let kept = Selection {
        ids: Some(archived.iter().cloned().collect::<BTreeSet<String>>()),
        ..Selection::default()
    };
    let discarded = source::pass_dead_letters(pipeline, &kept, Action::Discard, |_| {}).await?;
    Ok(ArchiveReport {
        archived,
        discarded,
    })
}

fn archived_row(letter: &DeadLetter) -> Archived<'_> {
    Archived {
        dead_letter: &letter.id,
        error_kind: letter.kind.as_deref(),
        reason: letter.reason.as_deref(),
        message_id: letter.message.message_id.as_deref(),
        subject: &letter.message.subject,
        headers: &letter.message.headers,
        body: &letter.message.body,
    }
}

/// Appends each letter to `path` as one JSON line, and syncs the file.
fn append_lines(path: &Path, letters: &[DeadLetter]) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let mut text = String::new();
    for letter in letters {
        text.push_str(&letter.json(true).to_string());
        text.push('\n');
    }
    file.write_all(text.as_bytes())?;
    file.sync_all()
}
