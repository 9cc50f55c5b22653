//! Statements sent before their replies (a flight), and what came back (a landing): each
//! reply read in order, the first failure classified by whose fault it is, nothing sent
//! after a statement the client refused.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use futures::future::maybe_done;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row};

use crate::store::fault::{self, Fault, Origin};
use crate::store::session::{Prepared, Session, SessionError};

use super::LedgerError;

/// Statements sent together: every request leaves before the first reply is read, and the
/// server runs them in order, so a flight costs one round trip however many statements it
/// holds. Each statement is synced on its own: after one fails, the rest of the transaction
/// fails with it (25P02), and a `COMMIT` at the end rolls back. The flight's error is its
/// first.
pub(super) struct Flight<'f> {
    client: &'f Client,
    steps: Vec<Step<'f>>,
}

pub(super) struct Step<'f> {
    label: &'f str,
    origin: Origin,
    reply: Pin<Box<dyn Future<Output = Result<Reply, tokio_postgres::Error>> + Send + 'f>>,
}

/// A statement's reply.
#[derive(Debug)]
pub(super) enum Reply {
    /// Rows changed.
    Rows(u64),
    /// Rows returned.
    Returned(Vec<Row>),
}

impl Reply {
    pub(super) fn rows(&self) -> u64 {
        match self {
            Reply::Rows(rows) => *rows,
            Reply::Returned(rows) => rows.len() as u64,
        }
    }

    pub(super) fn returned(&self) -> &[Row] {
        match self {
            Reply::Rows(_) => &[],
            Reply::Returned(rows) => rows,
        }
    }
}

impl<'f> Flight<'f> {
    pub(super) fn new(client: &'f Client) -> Flight<'f> {
        Flight {
            client,
            steps: Vec::new(),
        }
    }

    /// The session's client the flight goes out on.
    pub(super) fn client(&self) -> &'f Client {
        self.client
    }

    /// How many statements the flight holds so far: the index the next one will land at.
    pub(super) fn len(&self) -> usize {
        self.steps.len()
    }

    pub(super) fn push(
        &mut self,
        label: &'f str,
        origin: Origin,
        reply: impl Future<Output = Result<Reply, tokio_postgres::Error>> + Send + 'f,
    ) {
        self.steps.push(Step {
            label,
            origin,
            reply: Box::pin(reply),
        });
    }

    /// Statements with no parameters (one or several, `;`-separated), as one simple query.
    pub(super) fn simple(&mut self, sql: &'f str, label: &'f str) {
        let client = self.client;
        self.push(label, Origin::Host, async move {
            client.batch_execute(sql).await.map(|()| Reply::Rows(0))
        });
    }

    pub(super) fn execute(
        &mut self,
        statement: &'f Prepared<'f>,
        values: impl AsRef<[&'f (dyn ToSql + Sync)]> + Send + 'f,
        label: &'f str,
        origin: Origin,
    ) {
        let client = self.client;
        self.push(label, origin, async move {
            match statement {
                Prepared::Named(statement) => client
                    .execute(statement, values.as_ref())
                    .await
                    .map(Reply::Rows),
                Prepared::Unnamed { sql, types } => {
                    let typed = values.as_ref().iter().copied().zip(types.iter().cloned());
                    let rows = client.query_typed_raw(sql, typed).await?;
                    let mut rows = std::pin::pin!(rows);
                    while futures::TryStreamExt::try_next(&mut rows).await?.is_some() {}
                    Ok(Reply::Rows(rows.rows_affected().unwrap_or(0)))
                }
            }
        });
    }

    pub(super) fn query(
        &mut self,
        statement: &'f Prepared<'f>,
        values: &'f [&'f (dyn ToSql + Sync)],
        label: &'f str,
    ) {
        let client = self.client;
        self.push(label, Origin::Host, async move {
            match statement {
                Prepared::Named(statement) => client.query(statement, values).await,
                Prepared::Unnamed { sql, types } => {
                    let typed: Vec<_> = values.iter().copied().zip(types.iter().cloned()).collect();
                    client.query_typed(sql, &typed).await
                }
            }
            .map(Reply::Returned)
        });
    }

    /// `COMMIT`: its checks (deferred constraints, serialization) are the effects'.
    pub(super) fn commit(&mut self) {
        self.simple("COMMIT", "commit");
        if let Some(step) = self.steps.last_mut() {
            step.origin = Origin::Effect;
        }
    }

    /// Sends every statement, in order, then waits for every reply; the flight's error is its
    /// first (see `land`).
    pub(super) async fn send(self) -> Result<Vec<Reply>, LedgerError> {
        let mut replies = Vec::with_capacity(self.steps.len());
        for landing in self.land().await {
            if let Some(reply) = landing.into_result() {
                replies.push(reply?);
            }
        }
        Ok(replies)
    }

    /// Sends every statement, in order, then waits for every reply, and tells what became of
    /// each. A statement that fails before it leaves (the driver refused a value, the
    /// connection is gone) stops the flight there: nothing after it is sent (its `reply` is
    /// `None`), `COMMIT` least of all, since the server, which never saw the failure, would
    /// commit the statements before it without it.
    pub(super) async fn land(self) -> Vec<Landing<'f>> {
        let (labels, mut replies): (Vec<_>, Vec<_>) = self
            .steps
            .into_iter()
            .map(|step| ((step.label, step.origin), maybe_done(step.reply)))
            .unzip();
        // A statement's request leaves at its reply's first poll: poll each once, in order,
        // so they leave in the flight's order before any reply is awaited.
        let sent = futures::future::poll_fn(|context| {
            for (index, reply) in replies.iter_mut().enumerate() {
                let _ = Pin::new(&mut *reply).poll(context);
                if matches!(Pin::new(&mut *reply).output_mut(), Some(Err(_))) {
                    return Poll::Ready(index + 1);
                }
            }
            Poll::Ready(replies.len())
        })
        .await;
        let mut landed = Vec::with_capacity(replies.len());
        for (index, ((label, origin), mut reply)) in labels.into_iter().zip(replies).enumerate() {
            // The statements after a refused one were never polled, so never sent.
            let reply = if index < sent {
                (&mut reply).await;
                let output = Pin::new(&mut reply).take_output();
                Some(output.expect("a finished reply holds its output"))
            } else {
                None
            };
            landed.push(Landing {
                label,
                origin,
                reply,
            });
        }
        landed
    }
}

/// What became of one statement of a flight.
pub(super) struct Landing<'f> {
    label: &'f str,
    origin: Origin,
    /// Its reply, or `None`: never sent.
    reply: Option<Result<Reply, tokio_postgres::Error>>,
}

impl Landing<'_> {
    /// Whether its statement was sent and succeeded.
    pub(super) fn succeeded(&self) -> bool {
        matches!(self.reply, Some(Ok(_)))
    }

    pub(super) fn failed(&self) -> bool {
        matches!(self.reply, Some(Err(_)))
    }

    /// A unique violation: from a claim, the key was claimed already.
    pub(super) fn is_taken_key(&self) -> bool {
        matches!(&self.reply, Some(Err(error)) if error.code() == Some(&SqlState::UNIQUE_VIOLATION))
    }

    /// Its reply, or its failure sorted by whose fault it is; `None`: never sent.
    pub(super) fn into_result(self) -> Option<Result<Reply, LedgerError>> {
        let (label, origin) = (self.label, self.origin);
        self.reply
            .map(|reply| reply.map_err(|source| classify(source.into(), label, origin)))
    }
}

/// What a flight ending with `COMMIT` leaves: when it failed, `COMMIT` may never have left
/// (see `Flight::send`), so the transaction is rolled back, which does nothing if `COMMIT`
/// ended it already; if even that fails, the session stays marked inside a transaction and
/// is closed, never reused.
pub(super) async fn committed(
    session: &mut Session,
    sent: Result<Vec<Reply>, LedgerError>,
) -> Result<(), LedgerError> {
    match sent {
        Ok(_) => {
            session.set_in_transaction(false);
            Ok(())
        }
        Err(error) => {
            let _ = session.rollback().await;
            Err(error)
        }
    }
}

/// Maps a failure of the host's own statement `statement` to its error.
pub(super) fn host_error(statement: &'static str) -> impl Fn(SessionError) -> LedgerError {
    move |source| classify(source, statement, Origin::Host)
}

/// Sorts a failure by whose fault it is (see `fault`).
pub(super) fn classify(source: SessionError, statement: &str, origin: Origin) -> LedgerError {
    match fault::classify(&source, origin) {
        Fault::Transient => LedgerError::Transient { source },
        Fault::Message => LedgerError::Effect {
            statement: statement.to_string(),
            source,
        },
        Fault::Config => LedgerError::Config {
            statement: statement.to_string(),
            source,
        },
    }
}
