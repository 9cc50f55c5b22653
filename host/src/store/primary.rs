//! Which host of a multi-host `[database] url` takes writes: found before the bookkeeping pool
//! connects, and again whenever its host stops taking them (a failover: the old primary gone,
//! or back as a standby). The sessions find it by themselves: tokio-postgres tries the hosts in
//! order and, with `target_session_attrs=read-write`, passes over a read-only one.
//!
//! Architecture invariant: with `read_write`, no bookkeeping connection to a read-only host is
//! handed out (`guard_connect`, `guard_reuse`).

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions, Connection, PgPool, Row};
use tracing::{info, warn};

use crate::store::fault;

/// How long one host may take to answer a probe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// How often a multi-host database is asked whether the bookkeeping pool's host still takes
/// writes.
const WATCH_EVERY: Duration = Duration::from_secs(2);

/// The hosts of a `[database] url`, each as sqlx resolved it, in the URL's order.
#[derive(Debug, Clone)]
pub(crate) struct Candidates {
    pub hosts: Vec<PgConnectOptions>,
    /// Only a host that takes writes will do.
    pub read_write: bool,
}

/// The first host, in the URL's order, that answers and (with `read_write`) takes writes. A
/// refusal (credentials, database, TLS: every host would give it) is returned at once.
pub(super) async fn find(candidates: &Candidates) -> Result<PgConnectOptions, sqlx::Error> {
    if candidates.hosts.len() == 1 && !candidates.read_write {
        return Ok(candidates.hosts[0].clone());
    }
    let mut passed = Vec::with_capacity(candidates.hosts.len());
    for options in &candidates.hosts {
        match probe(options, candidates.read_write).await {
            Ok(()) => return Ok(options.clone()),
            Err(error) if fault::refused_setting(&error).is_some() => return Err(error),
            Err(error) => passed.push(format!("{}: {error}", address(options))),
        }
    }
    Err(sqlx::Error::Io(std::io::Error::other(format!(
        "no host takes writes ({})",
        passed.join("; ")
    ))))
}

async fn probe(options: &PgConnectOptions, read_write: bool) -> Result<(), sqlx::Error> {
    let mut connection = tokio::time::timeout(PROBE_TIMEOUT, options.connect())
        .await
        .map_err(|_| {
            sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {PROBE_TIMEOUT:?}"),
            ))
        })??;
    let read_only = read_write && is_read_only(&mut connection).await?;
    let _ = connection.close().await;
    if read_only {
        return Err(takes_no_writes());
    }
    Ok(())
}

fn takes_no_writes() -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::other(
        "the host does not take writes (transaction_read_only = on)",
    ))
}

/// Whether the connection's server takes no writes now (a standby, or
/// `default_transaction_read_only`).
async fn is_read_only(connection: &mut PgConnection) -> Result<bool, sqlx::Error> {
    // No parameters: the simple protocol, one exchange (see `bookkeeping`).
    let row = sqlx::Executor::fetch_one(connection, "SHOW transaction_read_only").await?;
    Ok(row.try_get::<String, _>(0)? == "on")
}

/// Fails a new bookkeeping connection to a host that takes no writes, so the pool tries again
/// (towards the host `watch` finds).
pub(super) async fn guard_connect(connection: &mut PgConnection) -> Result<(), sqlx::Error> {
    if is_read_only(connection).await? {
        return Err(takes_no_writes());
    }
    Ok(())
}

/// Whether a pooled bookkeeping connection may be handed out again: not once its host takes
/// no writes (it is closed instead).
pub(super) async fn guard_reuse(connection: &mut PgConnection) -> Result<bool, sqlx::Error> {
    Ok(!is_read_only(connection).await?)
}

/// Watches, until `pool` closes, whether its host still takes writes, and points the pool at
/// the host that does when it no longer does.
pub(super) fn watch(pool: PgPool, candidates: Candidates) {
    tokio::spawn(async move {
        let closed = pool.close_event();
        tokio::pin!(closed);
        loop {
            tokio::select! {
                () = tokio::time::sleep(WATCH_EVERY) => {}
                () = &mut closed => return,
            }
            // The pool's guards hand out only a connection that takes writes (with
            // `read_write`): one it can hand out means its host still serves.
            if pool.acquire().await.is_ok() {
                continue;
            }
            match find(&candidates).await {
                Ok(options) => {
                    let was = address(&pool.connect_options());
                    let now = address(&options);
                    if was != now {
                        info!(%was, %now, "PostgreSQL's writable host moved; bookkeeping follows.");
                        pool.set_connect_options(options);
                    }
                }
                Err(error) => {
                    warn!(%error, "No host of [database] url takes writes; looking again.");
                }
            }
        }
    });
}

/// `host:port` (or the socket directory) of `options`, for logs and errors.
fn address(options: &PgConnectOptions) -> String {
    match options.get_socket() {
        Some(directory) => directory.display().to_string(),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    }
}
