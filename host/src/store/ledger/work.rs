//! A transaction's statements in order, on one session: the claim as its strategy says,
//! then each effect bound to its prepared statement, then the outbox rows.

use tokio_postgres::types::ToSql;

use crate::store::binding::{BoundValue, values_as_params};
use crate::store::fault::Origin;
use crate::store::session::{Prepared, Session};
use crate::store::statement::BoundEffect;
use crate::store::tables::{self, Tables, quote_identifier};

use super::flight::{Flight, Reply, classify, host_error};
use super::plan::{ClaimStrategy, Plan};
use super::plan::{PARTITIONED_LOCK_SQL, PARTITIONED_LOCK_TYPES};
use super::{ClaimOutcome, LedgerError};

/// How a message's ledger claim learns that the key is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Claiming {
    /// Taken already, with every claim of its batch in one statement.
    InBulk,
    /// A taken key changes no row (`ON CONFLICT DO NOTHING`); the effects wait for the count.
    Asking,
    /// A taken key raises 23505 and aborts the transaction, so the effects may follow the
    /// claim in its flight (`one_flight`).
    Aborting,
}

/// One message's statements prepared on the session, with their values.
pub(super) struct Work<'p> {
    plan: &'p Plan<'p>,
    /// The partition lock and the claim, with their values (ledger claims, unless taken in
    /// bulk).
    claim: Option<(
        Option<Prepared<'static>>,
        Prepared<'p>,
        [&'p (dyn ToSql + Sync); 3],
    )>,
    role: Option<String>,
    /// Each effect's statement as this session prepared it, with its values bound again
    /// when the session's parameter types differ from the catalog's (after a migration).
    effects: Vec<(Prepared<'p>, Option<Vec<BoundValue>>)>,
    outbox: Option<Prepared<'p>>,
}

impl<'p> Work<'p> {
    /// The key its message claims.
    pub(super) fn key(&self) -> &'p str {
        self.plan.key
    }

    /// Prepares what `plan` runs (each statement once per session), its ledger claim as
    /// `claiming` says.
    pub(super) async fn prepare(
        session: &mut Session,
        tables: &'p Tables,
        plan: &'p Plan<'p>,
        claiming: Claiming,
    ) -> Result<Work<'p>, LedgerError> {
        let claim = match &plan.claim {
            ClaimStrategy::Ledger {
                consumer,
                plugin_digest,
                partitioned,
            } if claiming != Claiming::InBulk => {
                let lock = if *partitioned {
                    Some(
                        session
                            .statement(PARTITIONED_LOCK_SQL, &PARTITIONED_LOCK_TYPES)
                            .await
                            .map_err(host_error("claim"))?,
                    )
                } else {
                    None
                };
                let sql = match (partitioned, claiming) {
                    (true, _) => &tables.partitioned_claim,
                    (false, Claiming::Aborting) => &tables.aborting_claim,
                    (false, _) => &tables.claim,
                };
                let statement = session
                    .statement(sql, &tables::CLAIM_TYPES)
                    .await
                    .map_err(host_error("claim"))?;
                let values: [&'p (dyn ToSql + Sync); 3] = [consumer, &plan.key, plugin_digest];
                Some((lock, statement, values))
            }
            _ => None,
        };
        let mut effects = Vec::with_capacity(plan.effects.len());
        for effect in &plan.effects {
            effects.push(Work::prepare_effect(session, effect).await?);
        }
        let outbox = if plan.outbox.is_empty() {
            None
        } else {
            Some(
                session
                    .statement(&tables.outbox_insert, &tables::OUTBOX_INSERT_TYPES)
                    .await
                    .map_err(host_error("outbox"))?,
            )
        };
        Ok(Work {
            plan,
            claim,
            role: plan
                .role
                .map(|role| format!("SET LOCAL ROLE {}", quote_identifier(role))),
            effects,
            outbox,
        })
    }

    /// `effect`'s statement on this session, with its values bound for the types the session
    /// declares. Those are the server's types when the statement was prepared: one prepared
    /// before a migration is prepared again when its types differ from the catalog's, and
    /// the values are bound again for the server's types now (the catalog learns them).
    /// Nothing is sent for a value that does not bind (see `BindError`: a configuration
    /// fault, or the message's for a value out of range). Behind a transaction pooler the
    /// statement is unnamed and declares the values' own types: the server converts them to
    /// its types now, or refuses (42804, a configuration fault).
    pub(super) async fn prepare_effect(
        session: &mut Session,
        effect: &BoundEffect<'p>,
    ) -> Result<(Prepared<'p>, Option<Vec<BoundValue>>), LedgerError> {
        if !session.names_statements() {
            let unnamed = Prepared::Unnamed {
                sql: effect.sql,
                types: effect.types(),
            };
            return Ok((unnamed, None));
        }
        let failed = |source| classify(source, effect.statement, Origin::Effect);
        let cached = session.has_prepared(effect.sql);
        let mut statement = session.prepared(effect.sql).await.map_err(failed)?;
        if effect.fits(statement.params()) {
            return Ok((Prepared::Named(statement), None));
        }
        if cached {
            statement = session.prepare_again(effect.sql).await.map_err(failed)?;
        }
        let values = effect
            .for_session(statement.params())
            .map_err(|error| failed(error.into()))?;
        Ok((Prepared::Named(statement), Some(values)))
    }

    /// Whether `decide`'s statements may leave in `BEGIN`'s flight (see `open`): a host claim,
    /// which writes nothing outside the transaction `BEGIN` marks (`inside_open_transaction!`),
    /// or anything on a `guarded` session (`Session::writes_only_in_transactions`).
    pub(super) fn may_follow_begin(&self, guarded: bool) -> bool {
        self.claim.is_some() || guarded
    }

    /// The statements that tell whether the message applies: the ledger claim (after its
    /// partition lock), or the role and the effects a natural or `none` claim reads.
    pub(super) fn decide<'f>(&'f self, flight: &mut Flight<'f>) {
        match (&self.claim, self.plan.claim) {
            (Some((lock, claim, values)), _) => {
                if let Some(lock) = lock {
                    flight.execute(
                        lock,
                        values.get(..2).unwrap_or_default(),
                        "claim",
                        Origin::Host,
                    );
                }
                flight.execute(claim, values, "claim", Origin::Derived);
            }
            (None, ClaimStrategy::Ledger { .. }) => {}
            (None, ClaimStrategy::Natural) => {
                self.set_role(flight);
                self.effects_from(flight, 0, 1);
            }
            (None, ClaimStrategy::None) => {
                self.set_role(flight);
                self.effects_from(flight, 0, self.effects.len());
            }
        }
    }

    /// The outcome the replies to `decide`'s statements (the flight's last ones) tell.
    pub(super) fn outcome(&self, replies: &[Reply]) -> ClaimOutcome {
        let rows = |count: usize| {
            replies
                .iter()
                .rev()
                .take(count)
                .map(Reply::rows)
                .sum::<u64>()
        };
        match (&self.claim, self.plan.claim) {
            (Some(_), _) if rows(1) == 0 => ClaimOutcome::Duplicate,
            (None, ClaimStrategy::Natural) if rows(1) == 0 => ClaimOutcome::Duplicate,
            (None, ClaimStrategy::None) if rows(self.effects.len()) == 0 => {
                // Nothing changed: an older or repeated version. Its outbox messages stay
                // unsent.
                ClaimOutcome::Stale
            }
            _ => ClaimOutcome::Applied,
        }
    }

    /// The rest of the message's work once it is known to apply: the effects `decide` did
    /// not run (under the role), back to the host's role, the outbox rows.
    pub(super) fn finish<'f>(&'f self, flight: &mut Flight<'f>) {
        let ran = match (&self.claim, self.plan.claim) {
            (None, ClaimStrategy::Natural) => 1,
            (None, ClaimStrategy::None) => self.effects.len(),
            _ => {
                self.set_role(flight);
                0
            }
        };
        self.effects_from(flight, ran, self.effects.len());
        if self.role.is_some() {
            // Back to the host's role: for the outbox rows, and the next message of a batch.
            flight.simple("RESET ROLE", "role");
        }
        if let Some(insert) = &self.outbox {
            for row in &self.plan.outbox {
                flight.execute(
                    insert,
                    [
                        &self.plan.consumer as &(dyn ToSql + Sync),
                        &self.plan.key,
                        &row.destination,
                        &row.idempotency_key,
                        &row.payload,
                        &row.headers,
                        &self.plan.traceparent,
                        &self.plan.tracestate,
                    ],
                    "outbox",
                    Origin::Derived,
                );
            }
        }
    }

    pub(super) fn set_role<'f>(&'f self, flight: &mut Flight<'f>) {
        if let Some(role) = &self.role {
            flight.simple(role, "role");
        }
    }

    pub(super) fn effects_from<'f>(&'f self, flight: &mut Flight<'f>, from: usize, to: usize) {
        let calls = self.plan.effects.iter().zip(&self.effects);
        for (effect, (statement, rebound)) in calls.skip(from).take(to - from) {
            let values = match rebound {
                Some(values) => values_as_params(values),
                None => effect.params(),
            };
            flight.execute(statement, values, effect.statement, Origin::Effect);
        }
    }
}
