//! Several messages in one transaction: optimistic (one bulk claim, the effects, one commit)
//! and, when one message fails, isolating (a savepoint per message, so the failure is that
//! message's alone).

use std::collections::HashSet;

use tokio_postgres::Client;
use tokio_postgres::types::ToSql;

use crate::config::TransactionConfig;
use crate::failpoint::Failpoint;
use crate::store::session::Session;
use crate::store::tables::{self, Tables};

use super::flight::{Flight, Reply, committed, host_error};
use super::plan::{ClaimStrategy, Plan};
use super::work::{Claiming, Work};
use super::{BatchItem, ClaimOutcome, LedgerError, begin_sql, open, rollback};

/// The ledger claims of a batch, one statement for all: each key once, in key order.
pub(super) struct BulkClaim<'a> {
    consumer: &'a str,
    keys: Vec<&'a str>,
    digests: Vec<&'a str>,
}

impl<'a> BulkClaim<'a> {
    /// The claims of `plans` taken in `order`; a repeat of a key is a duplicate already, in
    /// `items`.
    pub(super) fn of(
        plans: &[&Plan<'a>],
        order: &[usize],
        items: &mut [Option<BatchItem>],
    ) -> Self {
        let mut claim = BulkClaim {
            consumer: "",
            keys: Vec::new(),
            digests: Vec::new(),
        };
        let mut first_of_key = HashSet::new();
        for &index in order {
            let plan = plans[index];
            if let ClaimStrategy::Ledger {
                consumer,
                plugin_digest,
                ..
            } = plan.claim
            {
                if first_of_key.insert(plan.key) {
                    claim.consumer = consumer;
                    claim.keys.push(plan.key);
                    claim.digests.push(plugin_digest);
                } else {
                    items[index] = Some(Ok(ClaimOutcome::Duplicate));
                }
            }
        }
        claim
    }
}

/// The fast path, in two flights: `BEGIN` with all ledger claims in one statement, then
/// every new message's effects with no savepoint, and `COMMIT`. `Ok(None)` when an effect
/// failed for its message's sake: everything was rolled back, and the caller isolates the
/// failure with savepoints.
pub(super) async fn apply_batch_optimistic(
    session: &mut Session,
    tables: &Tables,
    settings: &TransactionConfig,
    plans: &[&Plan<'_>],
) -> Result<Option<Vec<BatchItem>>, LedgerError> {
    let mut order: Vec<usize> = (0..plans.len()).collect();
    order.sort_by(|left, right| plans[*left].key.cmp(plans[*right].key));
    let mut items: Vec<Option<BatchItem>> = (0..plans.len()).map(|_| None).collect();
    let BulkClaim {
        consumer,
        keys: claim_keys,
        digests: claim_digests,
    } = BulkClaim::of(plans, &order, &mut items);
    let bulk_claim = session
        .statement(&tables.bulk_claim, &tables::BULK_CLAIM_TYPES)
        .await
        .map_err(host_error("claim"))?;
    let mut works = Vec::with_capacity(plans.len());
    for &index in &order {
        if items[index].is_none() {
            works.push((
                index,
                Work::prepare(session, tables, plans[index], Claiming::InBulk).await?,
            ));
        }
    }
    let begin = begin_sql(settings, session);
    let claim_params: [&(dyn ToSql + Sync); 3] = [&consumer, &claim_keys, &claim_digests];
    session.set_in_transaction(true);
    let client = session.client();
    let mut first = Flight::new(client);
    first.simple(&begin, "begin");
    first.query(&bulk_claim, &claim_params, "claim");
    let new_keys: HashSet<String> = match first.send().await {
        Ok(replies) => replies
            .last()
            .map(Reply::returned)
            .unwrap_or_default()
            .iter()
            .map(|row| row.get::<_, String>(0))
            .collect(),
        Err(error) => {
            rollback(session).await?;
            return Err(error);
        }
    };
    let mut applying = Vec::with_capacity(works.len());
    for (index, work) in &works {
        if new_keys.contains(work.key()) {
            items[*index] = Some(Ok(ClaimOutcome::Applied));
            applying.push(work);
        } else {
            items[*index] = Some(Ok(ClaimOutcome::Duplicate));
        }
    }
    if applying.is_empty() {
        rollback(session).await?;
    } else {
        Failpoint::BeforeCommit.hit();
        let mut second = Flight::new(client);
        for work in applying {
            work.finish(&mut second);
        }
        second.commit();
        let sent = second.send().await;
        match committed(session, sent).await {
            Ok(()) => {}
            Err(LedgerError::Effect { .. }) => return Ok(None),
            Err(other) => return Err(other),
        }
    }
    Ok(Some(
        items
            .into_iter()
            .map(|item| item.unwrap_or(Ok(ClaimOutcome::Duplicate)))
            .collect(),
    ))
}

/// The savepoint each message of the isolating path runs under.
pub(super) const SAVEPOINT: &str = "SAVEPOINT idem_message";

pub(super) const NEXT_SAVEPOINT: &str = "RELEASE SAVEPOINT idem_message; SAVEPOINT idem_message";

/// Undoes the previous message; its savepoint stays, ready for the next one.
pub(super) const UNDO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT idem_message";

/// The isolating path: a savepoint per message, so a failing, duplicate or stale message
/// rolls back alone. Each message takes two flights (its savepoint with its claim, then its
/// effects); the savepoint's release or undo rides with the next message's first flight.
pub(super) async fn apply_batch_isolating(
    session: &mut Session,
    tables: &Tables,
    settings: &TransactionConfig,
    plans: &[&Plan<'_>],
) -> Result<Vec<BatchItem>, LedgerError> {
    let mut order: Vec<usize> = (0..plans.len()).collect();
    order.sort_by(|left, right| plans[*left].key.cmp(plans[*right].key));
    let mut items: Vec<Option<BatchItem>> = (0..plans.len()).map(|_| None).collect();
    let mut claimed_keys = HashSet::new();
    let mut works = Vec::with_capacity(plans.len());
    for index in order {
        let plan = plans[index];
        if matches!(plan.claim, ClaimStrategy::Ledger { .. }) && !claimed_keys.insert(plan.key) {
            items[index] = Some(Ok(ClaimOutcome::Duplicate));
            continue;
        }
        works.push((
            index,
            Work::prepare(session, tables, plan, Claiming::Asking).await?,
        ));
    }
    let begin = begin_sql(settings, session);
    let guarded = session.writes_only_in_transactions();
    session.set_in_transaction(true);
    match run_isolated(session.client(), &begin, guarded, &works, &mut items).await {
        Ok(isolated) if isolated.applied > 0 => {
            let sent = commit_isolated(session.client(), isolated.undo_last).await;
            committed(session, sent).await?;
        }
        Ok(_) => rollback(session).await?,
        Err(error) => {
            rollback(session).await?;
            return Err(error);
        }
    }
    Ok(items
        .into_iter()
        .map(|item| item.unwrap_or(Ok(ClaimOutcome::Duplicate)))
        .collect())
}

/// Whether the last message of the isolating path kept its writes, or they must be undone
/// before `COMMIT`; and how many messages applied.
pub(super) struct Isolated {
    applied: usize,
    undo_last: bool,
}

/// Runs every message under its savepoint; `Err` for a failure that fails the batch.
/// `guarded`: the session writes only inside transactions (see `open`).
pub(super) async fn run_isolated(
    client: &Client,
    begin: &str,
    guarded: bool,
    works: &[(usize, Work<'_>)],
    items: &mut [Option<BatchItem>],
) -> Result<Isolated, LedgerError> {
    let mut prefix = format!("{begin}; {SAVEPOINT}");
    let mut opened = false;
    let mut applied = 0;
    let mut undo_last = false;
    for (index, work) in works {
        let mut first = if opened {
            let mut first = Flight::new(client);
            first.simple(&prefix, "savepoint");
            first
        } else {
            opened = true;
            open(Flight::new(client), &prefix, work.may_follow_begin(guarded)).await?
        };
        work.decide(&mut first);
        let outcome = match first.send().await {
            Ok(replies) => work.outcome(&replies),
            Err(error @ LedgerError::Effect { .. }) => {
                items[*index] = Some(Err(error));
                prefix = UNDO_SAVEPOINT.to_string();
                undo_last = true;
                continue;
            }
            Err(other) => return Err(other),
        };
        let item = if outcome == ClaimOutcome::Applied {
            let mut second = Flight::new(client);
            work.finish(&mut second);
            second.send().await.map(|_| ClaimOutcome::Applied)
        } else {
            Ok(outcome)
        };
        undo_last = match &item {
            Ok(ClaimOutcome::Applied) => false,
            Ok(_) | Err(LedgerError::Effect { .. }) => true,
            Err(_) => return item.map(|_| Isolated { applied, undo_last }),
        };
        if undo_last {
            prefix = UNDO_SAVEPOINT.to_string();
        } else {
            applied += 1;
            prefix = NEXT_SAVEPOINT.to_string();
        }
        items[*index] = Some(item);
    }
    Ok(Isolated { applied, undo_last })
}

/// Commits a batch that applied something, undoing its last message first if it must.
pub(super) async fn commit_isolated(
    client: &Client,
    undo_last: bool,
) -> Result<Vec<Reply>, LedgerError> {
    let mut last = Flight::new(client);
    if undo_last {
        last.simple(UNDO_SAVEPOINT, "savepoint");
    }
    Failpoint::BeforeCommit.hit();
    last.commit();
    last.send().await
}
