//! The loyalty consumer on Kafka topics (a tansu broker of each test's own): every order
//! credited once through duplicates on a partitioned topic, malformed records dead-lettered
//! with their reasons, listed, replayed and discarded through the dead-letter pass, and a
//! host killed mid-stream losing and doubling nothing.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use idem_e2e::kafka::Tansu;
use idem_e2e::{TestEnv, idem_binary, must_run, order, plugin_path, spawn_idem, wait_for};
use idem_host::config::Config;
use idem_host::source::dead_letters::{Action, Selection};
use idem_host::source::{self, headers};

fn config_text(env: &TestEnv, broker: &Tansu, topic: &str, source_extra: &str) -> String {
    format!(
        "{}{}",
        env.config_header(),
        broker.pipeline_table("loyalty", &plugin_path("loyalty"), topic, source_extra, "")
    )
}

/// A test's database and queues, a broker of its own, and a topic of `partitions` on it.
async fn with_topic(name: &str, partitions: i32) -> (TestEnv, Arc<Tansu>, String) {
    let env = TestEnv::new(name).await;
    let broker = Arc::new(Tansu::start());
    let topic = env.queue.clone();
    broker.create_topic(&topic, partitions).await;
    (env, broker, topic)
}

fn parse(text: &str) -> Config {
    Config::from_toml(Path::new("/tmp/idem-kafka-test.toml"), text)
        .unwrap_or_else(|error| panic!("{error}\n{text}"))
}

/// Produces `orders` orders keyed by customer over the topic's partitions, every tenth one
/// twice (a producer retrying), from two producers at once.
async fn produce_orders(broker: &Arc<Tansu>, topic: &str, orders: i64) {
    let producers: Vec<_> = (0..2)
        .map(|producer| {
            let broker = Arc::clone(broker);
            let topic = topic.to_string();
            tokio::spawn(async move {
                for order_id in (producer..orders).step_by(2) {
                    let customer = order_id % 97;
                    let body = order(order_id, customer, 1_000 + order_id);
                    let key = format!("customer-{customer}");
                    broker.produce(&topic, Some(&key), &body, &[]).await;
                    if order_id % 10 == 0 {
                        broker.produce(&topic, Some(&key), &body, &[]).await;
                    }
                }
            })
        })
        .collect();
    for producer in producers {
        producer.await.expect("producer");
    }
}

/// 3,000 orders and 300 duplicates on a 4-partition topic, and three malformed records:
/// every order is credited once; the malformed ones are on the dead-letter topic with their
/// reasons, kinds and where they came from; the dead-letter pass lists them, discards one,
/// replays one (its copy back on the topic, with the replay counted) and then lists one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_topic_with_duplicates_credits_every_order_once() {
    let (env, broker, topic) = with_topic("kafka_loyalty", 4).await;
    let config = parse(&config_text(&env, &broker, &topic, ""));
    let pipeline = config.pipelines[0].clone();
    let host = env.start_host(config);
    const ORDERS: i64 = 3_000;
    broker
        .produce(&topic, Some("bad"), b"not json", &[("trace", "kept")])
        .await;
    produce_orders(&broker, &topic, ORDERS).await;
    broker
        .produce(
            &topic,
            None,
            br#"{"type":"OrderCompleted","order_id":1}"#,
            &[],
        )
        .await;
    broker
        .produce(&topic, Some("bad"), br#"{"type":"OrderCompleted""#, &[])
        .await;
    wait_for("every order credited", Duration::from_secs(180), || async {
        env.count("SELECT count(*) FROM point_ledger").await == ORDERS
    })
    .await;
    let dead_letter_topic = format!("{topic}.dead-letter");
    wait_for("three dead letters", Duration::from_secs(60), || {
        let broker = Arc::clone(&broker);
        let dead_letter_topic = dead_letter_topic.clone();
        async move { broker.read_all(&dead_letter_topic).len() == 3 }
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    env.assert_loyalty_consistent().await;
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages WHERE consumer = 'loyalty'")
            .await,
        ORDERS,
        "one claim per order"
    );

    let letters = broker.read_all(&dead_letter_topic);
    for letter in &letters {
        assert!(letter.header(headers::REASON).is_some(), "{letter:?}");
        assert_eq!(letter.header(headers::TOPIC), Some(topic.as_str()));
        assert!(letter.header(headers::OFFSET).is_some());
        assert_eq!(letter.header(headers::PIPELINE), Some("loyalty"));
    }
    let first = letters
        .iter()
        .find(|letter| letter.payload == b"not json")
        .expect("the first malformed record");
    assert_eq!(first.key.as_deref(), Some(&b"bad"[..]));
    assert_eq!(first.header("trace"), Some("kept"), "producer headers kept");

    let mut listed = Vec::new();
    let everything = Selection::default();
    let count = source::pass_dead_letters(&pipeline, &everything, Action::Look, |letter| {
        listed.push(letter.clone());
    })
    .await
    .expect("list");
    assert_eq!(count, 3);
    assert!(
        listed
            .iter()
            .all(|letter| letter.reason.is_some() && letter.kind.is_some())
    );
    let only = |id: &str| Selection {
        ids: Some([id.to_string()].into()),
        ..Selection::default()
    };
    let discarded =
        source::pass_dead_letters(&pipeline, &only(&listed[0].id), Action::Discard, |_| {})
            .await
            .expect("discard");
    assert_eq!(discarded, 1);
    let replayed =
        source::pass_dead_letters(&pipeline, &only(&listed[1].id), Action::Replay, |_| {})
            .await
            .expect("replay");
    assert_eq!(replayed, 1);
    let left = source::pass_dead_letters(&pipeline, &everything, Action::Look, |_| {})
        .await
        .expect("list again");
    assert_eq!(left, 1, "one discarded and one replayed are not listed");
    let copies: Vec<_> = broker
        .read_all(&topic)
        .into_iter()
        .filter(|record| record.header(headers::REPLAYS) == Some("1"))
        .collect();
    assert_eq!(copies.len(), 1, "the replayed copy is back on the topic");
    assert_eq!(copies[0].payload, listed[1].message.body);
    assert!(
        copies[0].header(headers::REASON).is_none(),
        "the host's diagnostics are left out of a replay"
    );
    env.cleanup().await;
}

/// A host killed (SIGKILL) while it consumes 2,000 orders, then started again: every order
/// is credited once (the committed floor never passed an uncommitted transaction; what was
/// applied after the last commit is a duplicate the claim recognises).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_killed_mid_stream_loses_and_doubles_nothing() {
    let (env, broker, topic) = with_topic("kafka_kill", 4).await;
    let path = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(&path, config_text(&env, &broker, &topic, "")).expect("config");
    const ORDERS: i64 = 2_000;
    produce_orders(&broker, &topic, ORDERS).await;
    let mut first = spawn_idem(&path, &[]);
    wait_for("some orders credited", Duration::from_secs(120), || async {
        env.count("SELECT count(*) FROM point_ledger").await >= ORDERS / 4
    })
    .await;
    first.kill().expect("kill -9");
    first.wait().expect("killed");
    let credited = env.count("SELECT count(*) FROM point_ledger").await;
    assert!(credited < ORDERS, "killed mid-stream ({credited} credited)");
    let second = spawn_idem(&path, &[]);
    wait_for("every order credited", Duration::from_secs(180), || async {
        env.count("SELECT count(*) FROM point_ledger").await == ORDERS
    })
    .await;
    // Nothing more arrives: no order is applied twice after the restart.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, ORDERS);
    assert!(
        second.terminate().success(),
        "the second host stops cleanly"
    );
    env.assert_loyalty_consistent().await;
    // `idem check` and `idem status` read the topic, the group's offsets and the dead letters
    // as `idem run` would, creating nothing.
    let checked = must_run(
        Command::new(idem_binary())
            .args(["check", "--config"])
            .arg(&path),
    );
    assert!(
        checked.contains("4 partitions of") && checked.contains("has committed offsets"),
        "{checked}"
    );
    let status = must_run(
        Command::new(idem_binary())
            .args(["status", "--config"])
            .arg(&path),
    );
    assert!(
        status.contains(&topic) && status.contains("4 partitions"),
        "{status}"
    );
    let _ = std::fs::remove_file(&path);
    env.cleanup().await;
}

/// The chaos plugin's record of `seq` for `key` (customer `key`, a unique order id, `seq` as
/// its points): applied in the order the ledger's `applied` column counts.
fn recorded(key: i64, seq: i64) -> Vec<u8> {
    serde_json::json!({
        "key": format!("seq-{key}-{seq}"),
        "effects": [{"statement": "record_ledger", "params": [key, key * 100_000 + seq, seq]}],
    })
    .to_string()
    .into_bytes()
}

/// Produces the record of `seq` for `key`, keyed `key-<key>`.
async fn produce_recorded(broker: &Tansu, topic: &str, key: i64, seq: i64) {
    broker
        .produce(topic, Some(&format!("key-{key}")), &recorded(key, seq), &[])
        .await;
}

/// A host of the chaos plugin on `topic`, the ledger counting the order rows are applied in.
async fn chaos_host(
    env: &TestEnv,
    broker: &Tansu,
    topic: &str,
    source_extra: &str,
    extra: &str,
) -> idem_e2e::Host {
    sqlx::raw_sql("ALTER TABLE point_ledger ADD COLUMN applied bigserial")
        .execute(&env.pool)
        .await
        .expect("applied column");
    let text = format!(
        "{}{}",
        env.config_header(),
        broker.pipeline_table("loyalty", &plugin_path("chaos"), topic, source_extra, extra)
    );
    env.start_host(parse(&text))
}

/// Per key, the points (sequence numbers) in the order they were applied.
async fn applied_by_key(env: &TestEnv) -> std::collections::BTreeMap<i64, Vec<i64>> {
    let rows: Vec<(i64, i64)> =
        sqlx::query_as("SELECT customer_id, points FROM point_ledger ORDER BY applied")
            .fetch_all(&env.pool)
            .await
            .expect("ledger");
    let mut by_key = std::collections::BTreeMap::<i64, Vec<i64>>::new();
    for (key, seq) in rows {
        by_key.entry(key).or_default().push(seq);
    }
    by_key
}

/// `ordering = "key"` (the default) with 8 workers, batches of 16 and partitions paused at 8
/// messages in flight: 8 keys × 60 sequence numbers over 4 partitions, each key's applied in
/// the order produced, none lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_one_key_are_applied_in_order() {
    let (env, broker, topic) = with_topic("kafka_order", 4).await;
    const KEYS: i64 = 8;
    const SEQS: i64 = 60;
    for seq in 1..=SEQS {
        for key in 0..KEYS {
            produce_recorded(&broker, &topic, key, seq).await;
        }
    }
    // Every seventh record of a key is slow to apply: without ordering, the next ones of its
    // key would overtake it.
    env.slow_ledger("NEW.points % 7 = 0", 0.05).await;
    let host = chaos_host(
        &env,
        &broker,
        &topic,
        // A partition is paused at 8 messages received and not settled, and resumed at 4:
        // what it had fetched and not handed out is fetched again, nothing lost.
        "in_flight_per_partition = 8",
        "batch = { size = 16, linger = \"20ms\" }",
    )
    .await;
    wait_for("every record applied", Duration::from_secs(120), || async {
        env.count("SELECT count(*) FROM point_ledger").await == KEYS * SEQS
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    let expected: Vec<i64> = (1..=SEQS).collect();
    for (key, seqs) in applied_by_key(&env).await {
        assert_eq!(seqs, expected, "key {key} applied out of order");
    }
    env.cleanup().await;
}

/// A message the plugin keeps asking to retry holds its key's later messages (in order) and
/// nothing else: the other keys are all applied before the held key goes on, and the retried
/// message ends as a dead letter once its tries are spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_message_holds_its_key_and_no_other() {
    let (env, broker, topic) = with_topic("kafka_retry", 2).await;
    broker
        .produce(&topic, Some("key-0"), br#"{"action": "retry"}"#, &[])
        .await;
    for seq in 1..=3 {
        produce_recorded(&broker, &topic, 0, seq).await;
    }
    for key in 1..=4 {
        for seq in 1..=20 {
            produce_recorded(&broker, &topic, key, seq).await;
        }
    }
    let host = chaos_host(&env, &broker, &topic, "", "max_attempts = 4").await;
    wait_for("every record applied", Duration::from_secs(120), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 3 + 4 * 20
    })
    .await;
    let dead_letter_topic = format!("{topic}.dead-letter");
    wait_for(
        "the retried message dead-lettered",
        Duration::from_secs(60),
        || async { !broker.read_all(&dead_letter_topic).is_empty() },
    )
    .await;
    host.stop().await.expect("host stops cleanly");
    let rows: Vec<(i64, i64)> =
        sqlx::query_as("SELECT customer_id, applied FROM point_ledger ORDER BY applied")
            .fetch_all(&env.pool)
            .await
            .expect("ledger");
    let first_held = rows
        .iter()
        .filter(|(key, _)| *key == 0)
        .map(|(_, applied)| *applied)
        .min()
        .expect("key 0 applied");
    let last_other = rows
        .iter()
        .filter(|(key, _)| *key != 0)
        .map(|(_, applied)| *applied)
        .max()
        .expect("other keys applied");
    assert!(
        last_other < first_held,
        "the other keys went on while key 0 waited for its retries ({rows:?})"
    );
    assert_eq!(applied_by_key(&env).await[&0], vec![1, 2, 3]);
    let letters = broker.read_all(&dead_letter_topic);
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].key.as_deref(), Some(&b"key-0"[..]));
    env.cleanup().await;
}

/// Two hosts in one group under load, a third joining and the first leaving while orders
/// keep coming: every order is credited once, and each rebalance gives every partition to a
/// member that goes on from the committed floor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_joining_and_leaving_a_group_under_load_lose_and_double_nothing() {
    let (env, broker, topic) = with_topic("kafka_group", 4).await;
    let text = config_text(&env, &broker, &topic, "");
    const ORDERS: i64 = 3_000;
    let producing = {
        let broker = Arc::clone(&broker);
        let topic = topic.clone();
        tokio::spawn(async move {
            for order_id in 0..ORDERS {
                let customer = order_id % 97;
                let key = format!("customer-{customer}");
                broker
                    .produce(
                        &topic,
                        Some(&key),
                        &order(order_id, customer, 1_000 + order_id),
                        &[],
                    )
                    .await;
                if order_id % 100 == 0 {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        })
    };
    let first = env.start_host(parse(&text));
    let second = env.start_host(parse(&text));
    let credited = || async { env.count("SELECT count(*) FROM point_ledger").await };
    wait_for("a quarter credited", Duration::from_secs(120), || async {
        credited().await >= ORDERS / 4
    })
    .await;
    let third = env.start_host(parse(&text));
    wait_for("half credited", Duration::from_secs(120), || async {
        credited().await >= ORDERS / 2
    })
    .await;
    first.stop().await.expect("the first host leaves cleanly");
    producing.await.expect("producer");
    wait_for("every order credited", Duration::from_secs(180), || async {
        credited().await == ORDERS
    })
    .await;
    second.stop().await.expect("second host stops");
    third.stop().await.expect("third host stops");
    env.assert_loyalty_consistent().await;
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages WHERE consumer = 'loyalty'")
            .await,
        ORDERS,
        "one claim per order"
    );
    env.cleanup().await;
}

/// `declare = false` and a topic that does not exist: the host stops at once with one line
/// naming the setting; no retry can create it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_without_declare_stops_the_host_naming_the_setting() {
    let env = TestEnv::new("kafka_missing").await;
    let broker = Tansu::start();
    let text = config_text(&env, &broker, "no-such-topic", "declare = false");
    let error = env.start_host(parse(&text)).refusal().await;
    assert!(
        error.contains("pipelines.loyalty.source.topic") && error.contains("no-such-topic"),
        "{error}"
    );
    env.cleanup().await;
}

/// A new group (no committed offset) with ledger claims starts at the claim window: orders
/// produced before `now − retention.window`, whose claims retention would have deleted, are
/// not applied; the ones inside it are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_group_starts_within_the_claim_window() {
    let (env, broker, topic) = with_topic("kafka_window", 2).await;
    for order_id in 0..50 {
        broker
            .produce(&topic, Some("old"), &order(order_id, 1, 1_000), &[])
            .await;
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    for order_id in 50..100 {
        broker
            .produce(&topic, Some("new"), &order(order_id, 2, 1_000), &[])
            .await;
    }
    let text = format!(
        "{}{}",
        env.config_header(),
        broker.pipeline_table(
            "loyalty",
            &plugin_path("loyalty"),
            &topic,
            "",
            "retention = { window = \"5s\" }"
        )
    );
    let host = env.start_host(parse(&text));
    wait_for(
        "the orders inside the window credited",
        Duration::from_secs(60),
        || async { env.count("SELECT count(*) FROM point_ledger").await == 50 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(
        env.count("SELECT count(*) FROM point_ledger WHERE order_id < 50")
            .await,
        0,
        "nothing older than the window"
    );
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 50);
    env.cleanup().await;
}

/// The group's offsets gone (expired, reset, or the group renamed: here a new group that
/// starts at the earliest) and the claims gone with the window: the consumer resumes at the
/// floor it recorded in the database (`idem_offsets`) as it committed, so nothing it settled
/// is read again (the ledger's own unique key would refuse a second credit, and each repeat
/// would be dead-lettered for it); what was produced since is credited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_whose_offsets_are_gone_resumes_at_the_database_floor() {
    let (env, broker, topic) = with_topic("kafka_floor", 2).await;
    let config = |group: &str| {
        let source = format!("group = \"{group}\"\nstart = \"earliest\"");
        parse(&config_text(&env, &broker, &topic, &source))
    };
    // One record a produce, so tansu's high watermark (its last batch's base offset + 1,
    // which the floor is checked against) is the partition's true end.
    for order_id in 0..60 {
        let key = format!("customer-{}", order_id % 7);
        broker
            .produce(
                &topic,
                Some(&key),
                &order(order_id, order_id % 7, 1_000),
                &[],
            )
            .await;
    }
    let host = env.start_host(config("first"));
    wait_for(
        "the first orders credited",
        Duration::from_secs(90),
        || async { env.count("SELECT count(*) FROM point_ledger").await == 60 },
    )
    .await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(
        env.count(
            "SELECT coalesce(sum(next_offset), 0)::int8 FROM idem_offsets \
             WHERE consumer = 'loyalty'"
        )
        .await,
        60,
        "each partition's floor recorded at its end"
    );
    sqlx::raw_sql("DELETE FROM processed_messages")
        .execute(&env.pool)
        .await
        .expect("forget the claims");
    let host = env.start_host(config("renamed"));
    for order_id in 60..80 {
        let key = format!("customer-{}", order_id % 7);
        broker
            .produce(
                &topic,
                Some(&key),
                &order(order_id, order_id % 7, 1_000),
                &[],
            )
            .await;
    }
    wait_for(
        "the new orders credited",
        Duration::from_secs(90),
        || async {
            env.count("SELECT count(*) FROM point_ledger WHERE order_id >= 60")
                .await
                == 20
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 80);
    let read_again = broker.read_all(&format!("{topic}.dead-letter"));
    assert!(
        read_again.is_empty(),
        "{} orders settled before were read again",
        read_again.len()
    );
    env.cleanup().await;
}

/// A host (its config ending with `config_extra`) on a 2-partition topic of a broker of the
/// test's own, once it has credited 20 orders produced one at a time (so tansu's high
/// watermark is each partition's true end).
async fn twenty_orders_credited(
    name: &str,
    config_extra: &str,
) -> (TestEnv, Tansu, String, idem_e2e::Host) {
    let env = TestEnv::new(name).await;
    let broker = Tansu::start();
    let topic = env.queue.clone();
    broker.create_topic(&topic, 2).await;
    let text = config_text(&env, &broker, &topic, "") + config_extra;
    let host = env.start_host(parse(&text));
    for order_id in 0..20 {
        let key = format!("k{order_id}");
        broker
            .produce(&topic, Some(&key), &order(order_id, 4, 1_000), &[])
            .await;
    }
    wait_for("every order credited", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 20
    })
    .await;
    (env, broker, topic, host)
}

/// `/readyz`, `/metrics` and the broker gone: once the sampler has read the topic, each
/// partition's lag is on `/metrics` (0 when everything is settled: the records are produced
/// one at a time, so tansu's high watermark, its last batch's base offset + 1, is the true end
/// here; with batches it reads low) with the rebalances served. The broker killed, the
/// group's session expires, nothing stays assigned, and `/readyz` says the brokers are
/// unreachable; a broker back on the port makes it ready again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_gone_is_on_readyz_and_each_partition_lag_on_metrics() {
    let port = idem_e2e::free_port();
    let http = format!("\n[http]\nlisten = \"127.0.0.1:{port}\"\n");
    let (env, mut broker, topic, host) = twenty_orders_credited("kafka_ready", &http).await;
    let ready = || async { idem_e2e::http_request(port, "GET", "/readyz", None).await };
    wait_for("ready", Duration::from_secs(30), || async {
        ready().await.0 == 200
    })
    .await;
    let lag = |partition: i32| {
        format!(
            "idem_source_partition_waiting_messages{{pipeline=\"loyalty\",topic=\"{topic}\",partition=\"{partition}\"}} 0"
        )
    };
    wait_for(
        "each partition's lag at 0",
        Duration::from_secs(40),
        || async {
            let (_, metrics) = idem_e2e::http_request(port, "GET", "/metrics", None).await;
            metrics.contains(&lag(0)) && metrics.contains(&lag(1))
        },
    )
    .await;
    let (_, metrics) = idem_e2e::http_request(port, "GET", "/metrics", None).await;
    let rebalances: u64 = metrics
        .lines()
        .find_map(|line| line.strip_prefix("idem_source_rebalances_total{pipeline=\"loyalty\"} "))
        .and_then(|count| count.trim().parse().ok())
        .unwrap_or_else(|| panic!("no rebalance count:\n{metrics}"));
    assert!(rebalances >= 1, "{rebalances}");

    let brokers = broker.brokers();
    broker.kill();
    wait_for(
        "unready: the brokers unreachable",
        Duration::from_secs(60),
        || async {
            let (status, body) = ready().await;
            status == 503 && body.contains("brokers are unreachable")
        },
    )
    .await;
    let broker_port: u16 = brokers
        .rsplit(':')
        .next()
        .and_then(|port| port.parse().ok())
        .expect("the broker's port");
    let _back = Tansu::start_on(broker_port);
    wait_for("ready again", Duration::from_secs(60), || async {
        ready().await.0 == 200
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    env.cleanup().await;
}

/// The broker gone, then the host stopped: the last commit cannot reach a coordinator, and the
/// host still stops within seconds (the commit is waited for, bounded, and said to have
/// failed) instead of waiting for a broker that may never come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_stops_while_its_broker_is_down() {
    let (env, mut broker, _, host) = twenty_orders_credited("kafka_stop_down", "").await;
    broker.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = std::time::Instant::now();
    host.stop().await.expect("host stops cleanly");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "stopping took {:?}",
        started.elapsed()
    );
    env.cleanup().await;
}

/// A broker that requires a SASL login and refuses this one (SCRAM-SHA-512, a user it does
/// not know): the host stops with one line naming `pipelines.loyalty.source.sasl`, instead of
/// retrying a login no retry can fix. (tansu cannot be given a user with memory storage, so
/// a successful login is not tested here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_sasl_login_stops_the_host_naming_sasl() {
    let env = TestEnv::new("kafka_sasl").await;
    let broker = Tansu::start_refusing_logins();
    let sasl =
        "sasl = { mechanism = \"SCRAM-SHA-512\", username = \"idem\", password = \"wrong\" }";
    let text = config_text(&env, &broker, &env.queue.clone(), sasl);
    let error = env.start_host(parse(&text)).refusal().await;
    assert!(error.contains("pipelines.loyalty.source.sasl"), "{error}");
    env.cleanup().await;
}

/// No broker when the host starts: it keeps trying (saying so) instead of stopping, and
/// consumes once a broker listens there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_down_at_start_is_waited_for() {
    let env = TestEnv::new("kafka_down").await;
    let port = idem_e2e::free_port();
    let topic = env.queue.clone();
    let text = format!(
        "{}{}",
        env.config_header(),
        idem_e2e::kafka::pipeline_table(
            &format!("127.0.0.1:{port}"),
            "loyalty",
            &plugin_path("loyalty"),
            &topic,
            "partitions = 2",
            ""
        )
    );
    let host = env.start_host(parse(&text));
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        !host.is_finished(),
        "an unreachable broker is retried, not a stop"
    );
    let broker = Tansu::start_on(port);
    // The host creates the topic (declare) once it reaches the broker.
    for order_id in 0..100 {
        let produced = tokio::time::timeout(
            Duration::from_secs(30),
            broker.produce(&topic, Some("k"), &order(order_id, 3, 1_000), &[]),
        )
        .await;
        assert!(produced.is_ok(), "produce {order_id}");
    }
    wait_for("every order credited", Duration::from_secs(90), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 100
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    env.cleanup().await;
}

/// Brokers reached only over mutual TLS (a TLS-terminating proxy in front of tansu that
/// requires a client certificate): with `tls = { ca_file, cert_file, key_file }` the host
/// consumes every order; trusting another CA instead, it stops with one line naming `tls`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_is_spoken_and_a_wrong_authority_stops_the_host_naming_tls() {
    let env = TestEnv::new("kafka_tls").await;
    let directory = std::env::temp_dir().join(format!("{}-pki", env.database));
    let pki = idem_e2e::tls::Pki::new(&directory);
    let (broker, _proxy) = Tansu::start_behind_tls(&pki).await;
    let topic = env.queue.clone();
    broker.create_topic(&topic, 2).await;
    for order_id in 0..50 {
        broker
            .produce(&topic, Some("k"), &order(order_id, 4, 1_000), &[])
            .await;
    }
    let tls = |ca: &Path| {
        format!(
            "tls = {{ ca_file = \"{}\", cert_file = \"{}\", key_file = \"{}\" }}",
            ca.display(),
            pki.client_cert.display(),
            pki.client_key.display()
        )
    };
    let text = |source_extra: &str| {
        format!(
            "{}{}",
            env.config_header(),
            broker.pipeline_table("loyalty", &plugin_path("loyalty"), &topic, source_extra, "")
        )
    };
    let host = env.start_host(parse(&text(&tls(&pki.ca))));
    wait_for(
        "every order credited over TLS",
        Duration::from_secs(90),
        || async { env.count("SELECT count(*) FROM point_ledger").await == 50 },
    )
    .await;
    host.stop().await.expect("host stops cleanly");

    let other = idem_e2e::tls::self_signed_ca(&directory, "other", "another CA");
    let error = env.start_host(parse(&text(&tls(&other)))).refusal().await;
    assert!(error.contains("pipelines.loyalty.source.tls"), "{error}");
    let _ = std::fs::remove_dir_all(&directory);
    env.cleanup().await;
}
