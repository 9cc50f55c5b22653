//! One message's transaction: on a session that keeps its settings, in one flight (BEGIN,
//! the opening, the claim, the effects, the outbox rows and COMMIT sent before any reply);
//! otherwise statement by statement.

use crate::config::TransactionConfig;
use crate::failpoint::Failpoint;
use crate::store::session::Session;
use crate::store::tables::Tables;

use super::flight::{Flight, Landing, Reply, committed};
use super::plan::{ClaimStrategy, Plan};
use super::work::{Claiming, Work};
use super::{ClaimOutcome, LedgerError, begin_sql, open, rollback};

/// Whether `plan`'s whole transaction leaves in one flight on `session`: `BEGIN`, a claim that
/// aborts the transaction if the key is taken (`Claiming::Aborting`), the effects, the outbox
/// rows and `COMMIT`, one round trip. Only where it is safe and pays:
/// - the session writes nothing outside a transaction block (not behind a transaction
///   pooler), so if `BEGIN` fails the statements behind it write nothing;
/// - the claim is a single unpartitioned ledger row (a partitioned claim or a natural one
///   learns of a duplicate from a row count, which nothing in the flight can read);
/// - the message was not delivered before: a redelivery is likely a duplicate, and a
///   duplicate here costs an error in the server's log for the claim and for each statement
///   behind it, so it asks first.
pub(super) fn one_flight(session: &Session, plan: &Plan<'_>) -> bool {
    session.writes_only_in_transactions()
        && matches!(
            plan.claim,
            ClaimStrategy::Ledger {
                partitioned: false,
                ..
            }
        )
        && !plan.redelivered
}

pub(super) async fn apply_on(
    session: &mut Session,
    tables: &Tables,
    settings: &TransactionConfig,
    plan: &Plan<'_>,
) -> Result<ClaimOutcome, LedgerError> {
    let one_flight = one_flight(session, plan);
    let claiming = if one_flight {
        Claiming::Aborting
    } else {
        Claiming::Asking
    };
    let work = Work::prepare(session, tables, plan, claiming).await?;
    let begin = begin_sql(settings, session);
    if one_flight {
        return apply_in_one_flight(session, &work, &begin).await;
    }
    let pipelined = work.may_follow_begin(session.writes_only_in_transactions());
    session.set_in_transaction(true);
    let client = session.client();
    let sent = match open(Flight::new(client), &begin, pipelined).await {
        Ok(mut first) => {
            work.decide(&mut first);
            first.send().await
        }
        Err(error) => Err(error),
    };
    let decided = match sent {
        Ok(replies) => work.outcome(&replies),
        Err(error) => {
            rollback(session).await?;
            return Err(error);
        }
    };
    if decided != ClaimOutcome::Applied {
        // A duplicate or stale message commits nothing.
        rollback(session).await?;
        return Ok(decided);
    }
    Failpoint::BeforeCommit.hit();
    let mut second = Flight::new(client);
    work.finish(&mut second);
    second.commit();
    let sent = second.send().await;
    committed(session, sent)
        .await
        .map(|()| ClaimOutcome::Applied)
}

/// The whole transaction in one flight (see `one_flight`). A taken key fails the claim with
/// 23505: the transaction is aborted, every statement behind the claim fails with it, and
/// `COMMIT` rolls it back; the message is a duplicate. Any other failure is the flight's
/// error, as in two flights. A `COMMIT` that answered ended the transaction, committed or
/// rolled back; one that did not (never sent, or no reply) leaves it to `ROLLBACK`.
pub(super) async fn apply_in_one_flight(
    session: &mut Session,
    work: &Work<'_>,
    begin: &str,
) -> Result<ClaimOutcome, LedgerError> {
    Failpoint::BeforeCommit.hit();
    session.set_in_transaction(true);
    let mut flight = Flight::new(session.client());
    flight.simple(begin, "begin");
    let claim = flight.len();
    work.decide(&mut flight);
    work.finish(&mut flight);
    flight.commit();
    let landed = flight.land().await;
    let ended = landed.last().is_some_and(Landing::succeeded);
    let outcome = match landed.iter().position(Landing::failed) {
        None => {
            let replies: Vec<Reply> = landed
                .into_iter()
                .take(claim + 1)
                .filter_map(|landing| landing.into_result().and_then(Result::ok))
                .collect();
            Ok(work.outcome(&replies))
        }
        Some(step) if step == claim && landed[step].is_taken_key() => Ok(ClaimOutcome::Duplicate),
        Some(step) => Err(landed
            .into_iter()
            .nth(step)
            .and_then(|landing| landing.into_result()?.err())
            .expect("the failed step holds its error")),
    };
    if ended {
        session.set_in_transaction(false);
    } else {
        // Until it succeeds, the session counts as inside a transaction, and is closed.
        let _ = session.rollback().await;
    }
    outcome
}
