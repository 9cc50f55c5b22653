//! Crash windows: the real `idem` binary aborts at a failpoint (as `kill -9` would),
//! then a restarted host finishes the job without losing or doubling the effect.

use std::process::ExitStatus;
use std::time::{Duration, Instant};

use idem_e2e::{TestEnv, order, spawn_idem, unacked, wait_for};

fn wait_exit(child: &mut std::process::Child, timeout: Duration) -> ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait on idem") {
            return status;
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            panic!("idem did not reach its failpoint within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

struct Counts {
    claims: i64,
    ledger_rows: i64,
    points: i64,
}

async fn counts(env: &TestEnv) -> Counts {
    Counts {
        claims: env.count("SELECT count(*) FROM processed_messages").await,
        ledger_rows: env.count("SELECT count(*) FROM point_ledger").await,
        points: env
            .count("SELECT coalesce(sum(points), 0)::int8 FROM balances")
            .await,
    }
}

/// Crashes the binary at `failpoint` on one message, checks the state it left, restarts, checks again.
async fn crash_then_restart(name: &str, failpoint: &str, committed_before_crash: bool) {
    let env = TestEnv::new(name).await;
    let config_path = env.write_config("loyalty", "");
    let mut child = spawn_idem(&config_path, &[("IDEM_FAILPOINT", failpoint)]);
    env.publish(&order(42, 3, 4200)).await;

    let status = wait_exit(&mut child, Duration::from_secs(60));
    assert!(
        !status.success(),
        "idem should have aborted at {failpoint}, got {status}"
    );

    let after_crash = counts(&env).await;
    let expected = if committed_before_crash {
        (1, 1, 42)
    } else {
        (0, 0, 0)
    };
    assert_eq!(
        (
            after_crash.claims,
            after_crash.ledger_rows,
            after_crash.points
        ),
        expected,
        "state after a crash at {failpoint}"
    );
    // The delivery was never acked: the broker has it back.
    wait_for(
        "the unacked message to return",
        Duration::from_secs(30),
        || async { env.ready(&env.queue).await == 1 },
    )
    .await;

    let host = env.start_host(env.config("loyalty", ""));
    wait_for(
        "the redelivery to be settled",
        Duration::from_secs(60),
        || async { env.ready(&env.queue).await == 0 && unacked(&env.queue) == 0 },
    )
    .await;
    host.stop().await.expect("host stops cleanly");

    let after_restart = counts(&env).await;
    assert_eq!(
        (
            after_restart.claims,
            after_restart.ledger_rows,
            after_restart.points
        ),
        (1, 1, 42),
        "state after the restart"
    );
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0);
    env.assert_loyalty_consistent().await;
    let _ = std::fs::remove_file(config_path);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_commit_before_ack_finds_the_claim() {
    crash_then_restart("crash_after_commit", "after-commit", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_before_commit_applies_once_on_redelivery() {
    crash_then_restart("crash_before_commit", "before-commit", false).await;
}

/// The backend pid of a session's connection.
async fn backend_pid(session: &idem_host::store::session::Session) -> i32 {
    session
        .client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pg_backend_pid")
        .get(0)
}

/// The in-process crash window: a message transaction abandoned mid-way (its deadline
/// passed, its future dropped) leaves its session inside a transaction. That session is
/// closed, never handed to the next message: the next one is a new connection outside any
/// transaction, and the server rolls back what the abandoned one wrote. A session returned
/// outside a transaction is reused.
#[tokio::test]
async fn a_session_abandoned_inside_a_transaction_is_never_reused() {
    let env = TestEnv::new("session_abandoned").await;
    sqlx::query("CREATE TABLE abandoned (id int PRIMARY KEY)")
        .execute(&env.pool)
        .await
        .expect("create table");
    let database = env.open_database().await;

    let session = database.sessions.acquire().await.expect("a session");
    let first = backend_pid(&session).await;
    drop(session);
    let mut session = database.sessions.acquire().await.expect("a session");
    assert_eq!(
        backend_pid(&session).await,
        first,
        "an idle session is reused"
    );
    session
        .client()
        .batch_execute("BEGIN READ WRITE; INSERT INTO abandoned VALUES (1)")
        .await
        .expect("begin and insert");
    session.set_in_transaction(true);
    drop(session);

    let session = database.sessions.acquire().await.expect("a session");
    let next = backend_pid(&session).await;
    assert_ne!(next, first, "the abandoned session was handed out again");
    drop(session);
    let state: String = sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
        .bind(next)
        .fetch_one(&env.pool)
        .await
        .expect("the next session's state");
    assert_eq!(state, "idle", "the next session is inside a transaction");
    let gone = format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {first}");
    wait_for(
        "the abandoned connection to close",
        Duration::from_secs(10),
        || async { env.count(&gone).await == 0 },
    )
    .await;
    assert_eq!(
        env.count("SELECT count(*) FROM abandoned").await,
        0,
        "the abandoned transaction's row was kept"
    );
    database.sessions.close_idle();
    database.pool.close().await;
    env.cleanup().await;
}
