//! The operator's side of dead letters that will never be replayed, beside `idem dlq` and the
//! console's triage (`http::triage`).
//!
//! Dead letters that will never be replayed are discarded, or archived first (to the
//! `idem_dead_letters` table, or to a JSON-lines file from the command line), with the same
//! selection as a replay. An archive is written and committed before anything is removed,
//! and only the dead letters it holds are then removed (by id): a failure between the two
//! leaves a dead letter archived and still there, never gone unarchived.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;

use sqlx::PgPool;

use crate::config::PipelineConfig;
use crate::source::dead_letters::{Action, DeadLetter, Selection};
use crate::source::{self, SourceError};
use crate::store::archive::{self, Archived};
use crate::store::tables::Tables;

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
