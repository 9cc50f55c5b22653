//! What failed and was kept aside, over HTTP for the console: a pipeline's dead letters
//! (listed and grouped by error kind and reason, one shown whole, a selection replayed) and the
//! outbox rows not delivered (parked ones made pending again); dead letters discarded or
//! archived (`crate::triage`). The same passes as `idem dlq`
//! and `idem outbox` (`source::dead_letters`, `store::outbox`).

use std::collections::BTreeSet;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::json;

use super::{Answer, AppState, failed};
use crate::config::PipelineConfig;
use crate::source::{self, dead_letters, dead_letters::Action, dead_letters::Selection};
use crate::store::outbox;
use crate::triage::{self, ArchiveTo};

/// Most dead letters one list returns; the page says when there are more.
const LIST_LIMIT: u64 = 500;
/// Most outbox rows one list returns.
const OUTBOX_LIMIT: i64 = 500;

/// Which dead letters a list or a replay takes; every given filter must match.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Filter {
    kind: Option<String>,
    reason: Option<String>,
    /// Dead-lettered at most this many seconds ago.
    since_seconds: Option<u64>,
    /// Only these dead letters, by id.
    ids: Option<BTreeSet<String>>,
    limit: Option<u64>,
    /// Replay, discard, archive: say what would move and move nothing.
    #[serde(default)]
    dry_run: bool,
    /// Discard: every dead letter, when no other filter is given.
    #[serde(default)]
    all: bool,
}

impl Filter {
    fn selection(self, default_limit: Option<u64>) -> Selection {
        Selection {
            kind: self.kind,
            reason: self.reason,
            since: self.since_seconds.map(Duration::from_secs),
            ids: self.ids,
            limit: self.limit.or(default_limit),
        }
    }
}

/// `POST /admin/dead-letters/{pipeline}/list` with a JSON filter (`kind`, `reason`,
/// `since_seconds`, `ids`, `limit`; `{}` for all): the dead letters oldest first (body
/// previews), and their groups by error kind and reason.
pub(super) async fn list(
    State(state): State<AppState>,
    Path(name): Path<String>,
    Json(filter): Json<Filter>,
) -> Result<Answer, Answer> {
    let pipeline = &state.pipeline(&name)?.config();
    let limit = filter.limit.unwrap_or(LIST_LIMIT).min(LIST_LIMIT);
    // One more than shown, to know whether there are more.
    let selection = filter.selection(Some(limit + 1));
    let mut letters = Vec::new();
    source::pass_dead_letters(pipeline, &selection, Action::Look, |letter| {
        letters.push(letter.clone())
    })
    .await
    .map_err(|error| failed(StatusCode::BAD_GATEWAY, error))?;
    let more = letters.len() as u64 > limit;
    letters.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    let groups: Vec<serde_json::Value> = dead_letters::groups(&letters)
        .into_iter()
        .map(|group| {
            json!({
                "kind": group.kind,
                "reason": group.reason,
                "count": group.count,
                "ids": group.ids,
                "newest_age_seconds": group.newest.map(|age| age.as_secs()),
            })
        })
        .collect();
    Ok((
        StatusCode::OK,
        Json(json!({
            "pipeline": name,
            "source": pipeline.source_kind(),
            "dead_letter": pipeline.dead_letter(),
            "queue": pipeline.queue(),
            "letters": letters.iter().map(|letter| letter.json(false)).collect::<Vec<_>>(),
            "groups": groups,
            "more": more,
        })),
    ))
}

/// Which dead letter `show` shows.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Shown {
    id: String,
}

/// `POST /admin/dead-letters/{pipeline}/show` with `{"id": …}`: one dead letter whole,
/// headers and body.
pub(super) async fn show(
    State(state): State<AppState>,
    Path(name): Path<String>,
    Json(Shown { id }): Json<Shown>,
) -> Result<Answer, Answer> {
    let pipeline = &state.pipeline(&name)?.config();
    let selection = Selection {
        ids: Some(BTreeSet::from([id.clone()])),
        limit: Some(1),
        ..Selection::default()
    };
    let mut found = None;
    source::pass_dead_letters(pipeline, &selection, Action::Look, |letter| {
        found = Some(letter.json(true))
    })
    .await
    .map_err(|error| failed(StatusCode::BAD_GATEWAY, error))?;
    let letter = found.ok_or_else(|| {
        failed(
            StatusCode::NOT_FOUND,
            format!(
                "{:?} holds no dead letter {id:?} (replayed meanwhile?)",
                pipeline.dead_letter()
            ),
        )
    })?;
    Ok((StatusCode::OK, Json(letter)))
}

/// `POST /admin/dead-letters/{pipeline}/replay` with a JSON filter (`kind`, `reason`,
/// `since_seconds`, `ids`, `limit`, `dry_run`): the selected dead letters back to the
/// pipeline's queue or stream, as `idem dlq replay` does.
pub(super) async fn replay(
    State(state): State<AppState>,
    Path(name): Path<String>,
    Json(filter): Json<Filter>,
) -> Result<Answer, Answer> {
    let pipeline = &state.pipeline(&name)?.config();
    let dry_run = filter.dry_run;
    let ids = pass_selected(pipeline, &filter.selection(None), Action::Replay, dry_run).await?;
    let moved = ids.len();
    if !dry_run {
        tracing::info!(pipeline = %name, moved, "Dead letters replayed from the console.");
    }
    Ok((
        StatusCode::OK,
        Json(json!({
            "replayed": if dry_run { 0 } else { moved },
            "selected": moved,
            "ids": ids,
            "from": pipeline.dead_letter(),
            "to": pipeline.queue(),
            "dry_run": dry_run,
        })),
    ))
}

/// Runs `action` (or, with `dry_run`, only looks) on the dead letters `selection` picks;
/// their ids. Some may have moved before a failure: the error says how many were selected.
async fn pass_selected(
    pipeline: &PipelineConfig,
    selection: &Selection,
    action: Action,
    dry_run: bool,
) -> Result<Vec<String>, Answer> {
    let action = if dry_run { Action::Look } else { action };
    let mut ids = Vec::new();
    let passed = source::pass_dead_letters(pipeline, selection, action, |letter| {
        ids.push(letter.id.clone())
    })
    .await;
    passed.map_err(|error| {
        failed(
            StatusCode::BAD_GATEWAY,
            format!("{error} ({} selected before it stopped)", ids.len()),
        )
    })?;
    Ok(ids)
}

/// `POST /admin/dead-letters/{pipeline}/discard` with a JSON filter (as replay's; `"all":
/// true` when there is none): the selected dead letters removed for good.
pub(super) async fn discard(
    State(state): State<AppState>,
    Path(name): Path<String>,
    Json(filter): Json<Filter>,
) -> Result<Answer, Answer> {
    let pipeline = &state.pipeline(&name)?.config();
    let (all, dry_run) = (filter.all, filter.dry_run);
    let selection = filter.selection(None);
    if selection.is_everything() && !all {
        return Err(failed(
            StatusCode::UNPROCESSABLE_ENTITY,
            "no filter given: select dead letters (kind, reason, since_seconds, ids, limit) or say \"all\": true",
        ));
    }
    let ids = pass_selected(pipeline, &selection, Action::Discard, dry_run).await?;
    let selected = ids.len();
    if !dry_run {
        tracing::warn!(pipeline = %name, discarded = selected, "Dead letters discarded from the console.");
    }
    Ok((
        StatusCode::OK,
        Json(json!({
            "discarded": if dry_run { 0 } else { selected },
            "selected": selected,
            "ids": ids,
            "from": pipeline.dead_letter(),
            "dry_run": dry_run,
        })),
    ))
}

/// `POST /admin/dead-letters/{pipeline}/archive` with a JSON filter (as replay's): the
/// selected dead letters written to the pipeline's database (`idem_dead_letters`), then
/// removed.
pub(super) async fn archive(
    State(state): State<AppState>,
    Path(name): Path<String>,
    Json(filter): Json<Filter>,
) -> Result<Answer, Answer> {
    let pipeline = &state.pipeline(&name)?.config();
    let database = state.databases.named(pipeline.database.as_deref());
    let to = ArchiveTo::Table {
        pool: &database.pool,
        tables: &database.tables,
    };
    let dry_run = filter.dry_run;
    let report = triage::archive_dead_letters(pipeline, &filter.selection(None), to, dry_run)
        .await
        .map_err(|error| failed(StatusCode::BAD_GATEWAY, error))?;
    if !dry_run {
        tracing::warn!(pipeline = %name, archived = report.archived.len(), discarded = report.discarded, "Dead letters archived from the console.");
    }
    Ok((
        StatusCode::OK,
        Json(json!({
            "archived": if dry_run { 0 } else { report.archived.len() },
            "discarded": report.discarded,
            "selected": report.archived.len(),
            "ids": report.archived,
            "from": pipeline.dead_letter(),
            "to": database.tables.archive(),
            "dry_run": dry_run,
        })),
    ))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct OutboxFilter {
    #[serde(default)]
    parked: bool,
}

/// `GET /admin/outbox?parked=true`: rows not delivered, oldest first (only parked ones with
/// `parked`), and the backlog's counts.
pub(super) async fn outbox_rows(
    State(state): State<AppState>,
    Query(filter): Query<OutboxFilter>,
) -> Result<Answer, Answer> {
    let unavailable = |error| failed(StatusCode::SERVICE_UNAVAILABLE, error);
    let (mut pending, mut parked, mut rows) = (0, 0, Vec::new());
    for (name, database) in state.databases.iter() {
        let (pool, tables) = (&database.pool, &database.tables);
        let undelivered = outbox::undelivered(pool, tables, filter.parked, OUTBOX_LIMIT)
            .await
            .map_err(unavailable)?;
        rows.extend(undelivered.iter().map(|row| {
            let mut json = row.json();
            json["database"] = json!(name);
            json
        }));
        let backlog = outbox::backlog(pool, tables).await.map_err(unavailable)?;
        pending += backlog.pending;
        parked += backlog.parked;
    }
    Ok((
        StatusCode::OK,
        Json(json!({ "pending": pending, "parked": parked, "rows": rows })),
    ))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct OutboxRetry {
    destination: Option<String>,
    id: Option<i64>,
    /// The `[databases.<name>]` the row is in (ids are per database); none: every database
    /// without `id`, `[database]` with one.
    database: Option<String>,
}

/// `POST /admin/outbox/retry` with `{"destination": …, "id": …, "database": …}` (all
/// optional): parked rows pending again with a full set of attempts, as `idem outbox retry`
/// does.
pub(super) async fn outbox_retry(
    State(state): State<AppState>,
    Json(retry): Json<OutboxRetry>,
) -> Result<Answer, Answer> {
    if let Some(name) = &retry.database
        && !state
            .databases
            .iter()
            .any(|(opened, _)| opened == Some(name))
    {
        return Err(failed(
            StatusCode::NOT_FOUND,
            format!("no database {name:?} in [databases]"),
        ));
    }
    let mut ids = Vec::new();
    for (name, database) in state.databases.iter() {
        let chosen = match (&retry.database, retry.id) {
            (Some(wanted), _) => name == Some(wanted.as_str()),
            (None, Some(_)) => name.is_none(),
            (None, None) => true,
        };
        if !chosen {
            continue;
        }
        let retried = outbox::retry_parked(
            &database.pool,
            &database.tables,
            retry.destination.as_deref(),
            retry.id,
        )
        .await
        .map_err(|error| failed(StatusCode::SERVICE_UNAVAILABLE, error))?;
        ids.extend(retried);
    }
    Ok((StatusCode::OK, Json(json!({ "retried": ids }))))
}
