//! The nemesis: the faults it draws from, with their weights, and how each is injected.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{TestEnv, free_port, idem_binary};

use super::check::sql_count;
use super::hosts::HostSlot;

/// The faults the nemesis draws from, each with its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fault {
    KillHost,
    PauseHost,
    TerminateBackends,
    CancelBackends,
    RestartPostgres,
    Migration,
    RestartBroker,
    HotSwap,
    ConsoleRead,
    DeadLetterRead,
    DeadLetterReplay,
    /// The rolling change of `[database] schema` (once): `idem migrate` with the schema set,
    /// run while the hosts work, under a role named like the schema, then the hosts restarted
    /// one by one with the new config.
    SchemaMove,
    /// A third host through a PgBouncer in transaction pooling while its config says
    /// `pooling = "none"` (the default): it must refuse its transactions, naming the setting,
    /// and lose or double nothing.
    WrongPooler,
    /// A third member of the Kafka group (that pipeline alone) joins, or, when it is in,
    /// leaves with SIGTERM: a rebalance under load either way.
    GroupMember,
}

const CATALOGUE: [(Fault, u32); 14] = [
    (Fault::KillHost, 3),
    (Fault::PauseHost, 2),
    (Fault::TerminateBackends, 3),
    (Fault::CancelBackends, 2),
    (Fault::RestartPostgres, 1),
    (Fault::Migration, 2),
    (Fault::RestartBroker, 1),
    (Fault::HotSwap, 2),
    (Fault::ConsoleRead, 2),
    (Fault::DeadLetterRead, 2),
    (Fault::DeadLetterReplay, 1),
    (Fault::SchemaMove, 1),
    (Fault::WrongPooler, 1),
    (Fault::GroupMember, 2),
];

/// Schema changes a DBA makes under load; each runs once, in this order. Every generated
/// message satisfies the CHECK.
const MIGRATIONS: [&str; 4] = [
    "ALTER TABLE point_ledger ADD COLUMN soak_note text",
    "ALTER TABLE point_ledger ALTER COLUMN points TYPE bigint",
    "ALTER TABLE point_ledger ADD CONSTRAINT soak_points_bounded CHECK (points < 1000000) NOT VALID",
    "CREATE INDEX CONCURRENTLY IF NOT EXISTS soak_ledger_customer ON point_ledger (customer_id)",
];

/// Draws a fault by `seed` every 1 to 3.5 s for `duration` and injects it; the timeline,
/// each line stamped with the time since `started`.
pub(super) async fn unleash(
    seed: u64,
    duration: Duration,
    started: Instant,
    hosts: &mut [HostSlot],
    member: &mut HostSlot,
    env: &TestEnv,
) -> Vec<String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut timeline = Vec::new();
    let mut migrations = MIGRATIONS.iter();
    let total_weight: u32 = CATALOGUE.iter().map(|(_, weight)| weight).sum();
    let faults_end = Instant::now() + duration;
    while Instant::now() < faults_end {
        let pause = rng.random_range(1_000..3_500);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let mut pick = rng.random_range(0..total_weight);
        let fault = CATALOGUE
            .iter()
            .find(|(_, weight)| {
                if pick < *weight {
                    true
                } else {
                    pick -= weight;
                    false
                }
            })
            .map(|(fault, _)| *fault)
            .expect("a fault");
        let target = rng.random_range(0..hosts.len());
        let amount = rng.random_range(500..3_000u64);
        let what = inject(fault, target, amount, hosts, member, env, &mut migrations).await;
        let line = format!("{:>7.1}s  {what}", started.elapsed().as_secs_f64());
        eprintln!("soak: {line}");
        timeline.push(line);
    }
    timeline
}

/// Injects `fault` (on host `target` where it names one, for `amount` milliseconds where it
/// lasts); returns the timeline's words for it.
async fn inject(
    fault: Fault,
    target: usize,
    amount: u64,
    hosts: &mut [HostSlot],
    member: &mut HostSlot,
    env: &TestEnv,
    migrations: &mut std::slice::Iter<'_, &str>,
) -> String {
    match fault {
        Fault::KillHost => {
            hosts[target].kill();
            tokio::time::sleep(Duration::from_millis(amount / 4)).await;
            hosts[target].start();
            format!("SIGKILL host {target}, restarted after {} ms", amount / 4)
        }
        Fault::PauseHost => {
            hosts[target].signal("-STOP");
            tokio::time::sleep(Duration::from_millis(amount)).await;
            hosts[target].signal("-CONT");
            format!("SIGSTOP host {target} for {amount} ms")
        }
        Fault::TerminateBackends => {
            let ended = sql_count(
                env,
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = current_database() AND application_name = 'idem' \
                 AND pid <> pg_backend_pid()",
            )
            .await;
            format!("pg_terminate_backend on the hosts' sessions ({ended:?})")
        }
        Fault::CancelBackends => {
            let mut cancelled = 0;
            let until = Instant::now() + Duration::from_millis(amount);
            while Instant::now() < until {
                cancelled += sql_count(
                    env,
                    "SELECT count(pg_cancel_backend(pid)) FROM pg_stat_activity \
                     WHERE datname = current_database() AND application_name = 'idem' \
                     AND state = 'active' AND pid <> pg_backend_pid()",
                )
                .await
                .unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            format!("pg_cancel_backend on active queries for {amount} ms ({cancelled} cancels)")
        }
        Fault::RestartPostgres => {
            let status = crate::restart_postgres("fast");
            format!("PostgreSQL restarted (fast): {status}")
        }
        Fault::Migration => match migrations.next() {
            Some(sql) => {
                let outcome = match sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
                    .execute(&env.pool)
                    .await
                {
                    Ok(_) => "done".to_string(),
                    Err(error) => format!("failed: {error}"),
                };
                format!("migration `{sql}`: {outcome}")
            }
            None => "migration: none left".to_string(),
        },
        Fault::RestartBroker => {
            let stopped = Command::new("rabbitmqctl")
                .arg("stop_app")
                .stdout(Stdio::null())
                .status();
            tokio::time::sleep(Duration::from_millis(amount / 2)).await;
            let started = Command::new("rabbitmqctl")
                .arg("start_app")
                .stdout(Stdio::null())
                .status();
            format!(
                "RabbitMQ application restarted ({} ms down): {}",
                amount / 2,
                stopped.is_ok_and(|status| status.success())
                    && started.is_ok_and(|status| status.success())
            )
        }
        Fault::SchemaMove => move_schema(hosts, member).await,
        Fault::GroupMember => {
            if member.is_running() {
                let clean = member.stop();
                format!("the third Kafka group member leaves (clean stop {clean})")
            } else {
                member.start();
                "a third member joins the Kafka group".to_string()
            }
        }
        Fault::WrongPooler => wrong_pooler(&hosts[target], amount).await,
        Fault::HotSwap => {
            hosts[target].signal("-HUP");
            format!("hot swap (SIGHUP) on host {target}")
        }
        Fault::ConsoleRead => {
            let port = hosts[target].http_port;
            let read = tokio::time::timeout(
                Duration::from_secs(10),
                tokio::spawn(crate::http_send(
                    port,
                    "POST",
                    "/admin/dead-letters/loyalty/list",
                    &[],
                    Some("{}"),
                )),
            )
            .await;
            let status = match read {
                Ok(Ok((status, _))) => status.to_string(),
                _ => "no answer".into(),
            };
            format!("console read of loyalty's dead letters on host {target}: {status}")
        }
        Fault::DeadLetterRead | Fault::DeadLetterReplay => {
            let pipeline = ["loyalty", "natural", "receipts", "kafka"][(amount % 4) as usize];
            let args: &[&str] = if fault == Fault::DeadLetterRead {
                &["dlq", "list"]
            } else {
                &["dlq", "replay"]
            };
            let config = hosts[target].config.clone();
            let outcome = tokio::task::spawn_blocking(move || {
                Command::new(idem_binary())
                    .args(args)
                    .args(["--pipeline", pipeline, "--config"])
                    .arg(config)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
            })
            .await;
            let ok = matches!(outcome, Ok(Ok(status)) if status.success());
            format!(
                "idem {} --pipeline {pipeline}: exit ok {ok}",
                args.join(" ")
            )
        }
    }
}

/// The rolling change of `[database] schema`, once: `idem migrate` with the moved config while
/// the hosts run on the old one (their unqualified names reach the moved tables through
/// `"$user"`, the role being named like the schema), then each host restarted on the moved
/// config in turn. Not done when the migration fails (PostgreSQL away): a later draw tries
/// again.
async fn move_schema(hosts: &mut [HostSlot], member: &mut HostSlot) -> String {
    if hosts.iter().any(|host| host.config == host.moved_config) {
        return "schema move: done already".into();
    }
    let config = hosts[0].moved_config.clone();
    let migrated = tokio::task::spawn_blocking(move || {
        Command::new(idem_binary())
            .args(["migrate", "--config"])
            .arg(config)
            .output()
    })
    .await;
    let Ok(Ok(output)) = migrated else {
        return "schema move: idem migrate did not run".into();
    };
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let said = said.split_whitespace().collect::<Vec<_>>().join(" ");
    if !output.status.success() {
        return format!("schema move: idem migrate failed ({said})");
    }
    let mut clean = true;
    for host in hosts.iter_mut() {
        clean &= host.stop();
        host.config = host.moved_config.clone();
        host.start();
    }
    member.config = member.moved_config.clone();
    if member.is_running() {
        clean &= member.stop();
        member.start();
    }
    format!("schema move: {said}; hosts restarted on the moved config (clean stops {clean})")
}

/// A host like `like`'s, through a PgBouncer in transaction pooling but configured for
/// none, run for `3 × amount` ms, then stopped.
async fn wrong_pooler(like: &HostSlot, amount: u64) -> String {
    let text = std::fs::read_to_string(&like.config).expect("a host's config");
    let database = text
        .lines()
        .find_map(|line| line.strip_prefix("url = \"postgres://"))
        .and_then(|rest| rest.split_once('/'))
        .and_then(|(_, rest)| rest.split(['?', '"']).next())
        .expect("the database URL")
        .to_string();
    let pooler =
        crate::pgbouncer::PgBouncer::start(&format!("{database}-pooler"), "transaction", 4);
    let text = text
        .lines()
        .map(|line| {
            if line.starts_with("url = \"postgres://") {
                format!("url = \"{}\"", pooler.url(&database))
            } else if line.starts_with("listen = ") {
                format!("listen = \"127.0.0.1:{}\"", free_port())
            } else {
                line.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let directory = like.log.parent().expect("the soak directory");
    let config = directory.join("pooled.toml");
    std::fs::write(&config, text).expect("write config");
    let mut host = HostSlot {
        config: config.clone(),
        moved_config: config,
        http_port: 0,
        process: None,
        log: directory.join("pooled.log"),
    };
    host.start();
    tokio::time::sleep(Duration::from_millis(3 * amount)).await;
    let clean = host.stop();
    let log = std::fs::read_to_string(&host.log).unwrap_or_default();
    let named = ["pooling = \\\"transaction\\\"", "pooling = \"transaction\""]
        .iter()
        .any(|hint| log.contains(hint));
    format!(
        "a host through a transaction pooler configured for none, for {} ms: the setting named {named}, clean stop {clean}",
        3 * amount
    )
}
