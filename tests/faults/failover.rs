//! A real PostgreSQL HA failover under load: a pg_auto_failover formation of the scenario's
//! own (monitor, primary, secondary, synchronous replication), two hosts on the formation's
//! multi-host URL, a steady producer. First `pg_autoctl perform failover`, then the new
//! primary's machine dies (its keeper and PostgreSQL SIGKILLed) and the monitor promotes the
//! other node. Every order is credited once, nothing is dead-lettered, both hosts stay up.
//! The same again through a PgBouncer on each node (transaction pooling), the URL listing the
//! poolers: a machine that dies takes its pooler with it.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use idem_e2e::auto_failover::Formation;
use idem_e2e::pgbouncer::PgBouncer;
use idem_e2e::soak::RabbitPublisher;
use idem_e2e::{TestEnv, create_database, order, wait_for};
use idem_host::config::Config;

use super::{SERIAL, customer, sized, total};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_failovers_under_load_with_two_hosts() {
    failovers_under_load("fault_failover", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_failovers_through_pgbouncer_under_load_with_two_hosts() {
    failovers_under_load("fault_failover_bouncer", true).await;
}

async fn failovers_under_load(name: &str, through_pgbouncer: bool) {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new(name).await;
    let label = env.database.clone();
    let formation = tokio::task::spawn_blocking(move || Formation::start(&label, 2))
        .await
        .expect("formation started");
    let primary = formation.writable().expect("a primary");
    let (_, first_pool) =
        create_database(&formation.node_url(primary, "postgres"), &env.database).await;
    first_pool.close().await;
    // One pooler per node, as where each runs beside its PostgreSQL.
    let mut bouncers: Vec<Option<PgBouncer>> = if through_pgbouncer {
        (0..2)
            .map(|node| {
                Some(PgBouncer::in_front_of(
                    formation.node_port(node),
                    &format!("{}-{node}", env.database),
                    "transaction",
                    4,
                ))
            })
            .collect()
    } else {
        Vec::new()
    };
    let text = if through_pgbouncer {
        let hosts: Vec<String> = bouncers
            .iter()
            .flatten()
            .map(|bouncer| format!("127.0.0.1:{}", bouncer.port))
            .collect();
        let url = format!(
            "postgres://postgres@{}/{}?sslmode=disable&target_session_attrs=read-write",
            hosts.join(","),
            env.database
        );
        env.config_text_at(&url, "loyalty", "").replacen(
            "[database]\n",
            "[database]\npooling = \"transaction\"\n",
            1,
        )
    } else {
        let url = formation.url(&env.database);
        assert!(url.contains(','), "a multi-host URL: {url}");
        env.config_text_at(&url, "loyalty", "")
    };
    let config =
        Config::from_toml(Path::new("/tmp/idem-fault-failover.toml"), &text).expect("config");
    let hosts = [env.start_host(config.clone()), env.start_host(config)];

    let orders = sized(4_000, 12_000) as i64;
    let published = Arc::new(AtomicI64::new(0));
    let producer = {
        let queue = env.queue.clone();
        let published = Arc::clone(&published);
        tokio::spawn(async move {
            let mut publisher = RabbitPublisher::to(&idem_e2e::amqp_url());
            for order_id in 0..orders {
                let body = order(order_id, customer(order_id), total(order_id));
                publisher.publish(&queue, &body).await;
                published.store(order_id + 1, Ordering::Relaxed);
                if order_id % 20 == 0 {
                    tokio::time::sleep(Duration::from_millis(15)).await;
                }
            }
        })
    };
    // The ledger as whichever node is primary now sees it.
    let applied = || async {
        let Some(node) = formation.writable() else {
            return -1;
        };
        let url = formation.node_url(node, &env.database);
        match sqlx::PgPool::connect(&url).await {
            Ok(pool) => {
                let count = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM point_ledger")
                    .fetch_one(&pool)
                    .await
                    .unwrap_or(-1);
                pool.close().await;
                count
            }
            Err(_) => -1,
        }
    };
    let mut resumed = Vec::new();
    for (step, fraction) in [("perform failover", 3), ("SIGKILL of the primary", 2)] {
        wait_for(
            "orders published and applied before the fault",
            Duration::from_secs(180),
            || async {
                published.load(Ordering::Relaxed) >= orders / fraction
                    && applied().await >= orders / (fraction + 1)
            },
        )
        .await;
        let before = applied().await;
        let old = formation.writable().expect("a primary");
        let started = Instant::now();
        if step == "perform failover" {
            let formation = &formation;
            tokio::task::block_in_place(|| formation.perform_failover());
        } else {
            formation.kill_node(old);
            if let Some(bouncer) = bouncers.get_mut(old) {
                bouncer.take();
            }
        }
        let mut promoted = None;
        let resumed_in_time = tokio::time::timeout(Duration::from_secs(180), async {
            loop {
                if formation.writable().is_some_and(|now| now != old) {
                    promoted.get_or_insert_with(|| started.elapsed());
                    if applied().await > before + 50 {
                        return;
                    }
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
        .await;
        assert!(
            resumed_in_time.is_ok(),
            "{step}: consumption did not resume within 180 s ({before} then {} applied; states {:?})",
            applied().await,
            formation.states()
        );
        let promoted = promoted.unwrap_or_default();
        resumed.push((step, before, promoted, started.elapsed()));
    }
    producer.await.expect("producer");
    wait_for("every order applied", Duration::from_secs(180), || async {
        applied().await == orders
    })
    .await;
    for (step, before, promoted, elapsed) in &resumed {
        println!(
            "failover{}: {step} with {before} of {orders} applied; the other node took writes {:.1} s later, consumption resumed {:.1} s later",
            if through_pgbouncer {
                " through PgBouncer"
            } else {
                ""
            },
            promoted.as_secs_f64(),
            elapsed.as_secs_f64()
        );
    }
    for host in hosts {
        assert!(!host.is_finished(), "a host stopped during the failovers");
        host.stop().await.expect("the host stops cleanly");
    }
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0, "dead-lettered");
    let node = formation.writable().expect("a primary");
    let pool = sqlx::PgPool::connect(&formation.node_url(node, &env.database))
        .await
        .expect("the primary");
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .expect("count")
        }
    };
    assert_eq!(count("SELECT count(*) FROM point_ledger").await, orders);
    assert_eq!(
        count("SELECT count(DISTINCT order_id) FROM point_ledger").await,
        orders
    );
    assert_eq!(
        count("SELECT count(*) FROM processed_messages").await,
        orders
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM balances b FULL JOIN \
             (SELECT customer_id, sum(points) AS points FROM point_ledger GROUP BY customer_id) l \
             USING (customer_id) WHERE b.points IS DISTINCT FROM l.points"
        )
        .await,
        0,
        "balances differ from the ledger"
    );
    pool.close().await;
    drop(bouncers);
    drop(formation);
    env.cleanup().await;
}
