//! The checker: waits until the hosts settled, then proves per key one claim exactly when
//! its effects are there once, no good message among the dead letters, nothing left in the
//! sources, every outbox row delivered.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::jetstream::TestStream;
use crate::{TestEnv, unacked};

use super::endpoint::Endpoint;
use super::kafka::SoakTopic;
use super::produce::Produced;

/// `sql`'s one number, or `None` while the database is away.
pub(super) async fn sql_count(env: &TestEnv, sql: &str) -> Option<i64> {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
        .fetch_one(&env.pool)
        .await
        .ok()
}

/// `sql`'s one number, retried while the database is away (2 minutes at most).
pub(super) async fn count(env: &TestEnv, sql: &str) -> i64 {
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        match sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
            .fetch_one(&env.pool)
            .await
        {
            Ok(count) => return count,
            Err(error) if Instant::now() > until => panic!("{sql}: {error}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// What the soak's hosts consume and deliver to, as the checker reads them.
pub(super) struct Sources<'a> {
    pub(super) env: &'a TestEnv,
    pub(super) stream: &'a TestStream,
    pub(super) kafka: &'a SoakTopic,
    pub(super) endpoint: &'a Arc<Mutex<Endpoint>>,
}

/// Why the hosts did not settle, with the state they were left in.
pub(super) enum Unsettled {
    /// The Kafka pipeline moved nothing for [`KAFKA_STALL`] while records wait past the
    /// group's commit (tansu's group coordinator can leave a group without an assignment
    /// after a member's death; see `kafka.rs`).
    KafkaStalled(String),
    /// Not everything settled within the time allowed.
    TimedOut(String),
}

/// How long the Kafka pipeline may move nothing, with records waiting, before it counts as
/// stalled.
pub(super) const KAFKA_STALL: Duration = Duration::from_secs(60);

/// Waits until every order is applied by every pipeline, every receipt delivered, and the
/// sources hold nothing; `Err` says what is missing after the time allowed, or that the Kafka
/// group stalled.
pub(super) async fn settle(sources: &Sources<'_>, orders: i64) -> Result<(), Unsettled> {
    let Sources {
        env,
        stream,
        kafka,
        endpoint,
    } = *sources;
    let until = Instant::now() + Duration::from_secs(300);
    let mut kafka_progress = (None, Instant::now());
    loop {
        let loyalty = count(env, "SELECT count(*) FROM point_ledger").await;
        // A JetStream message the host could not finish on its last delivery is settled as
        // a dead letter (`deliveries-exhausted`; the checker holds it to that).
        let exhausted = stream
            .dead_letters()
            .await
            .iter()
            .filter(|(_, headers)| {
                headers.iter().any(|(name, value)| {
                    name == "x-idem-error-kind" && value == "deliveries-exhausted"
                })
            })
            .count() as i64;
        let natural = count(env, "SELECT count(*) FROM natural_ledger").await + exhausted;
        let receipts = count(env, "SELECT count(*) FROM receipts").await;
        let delivered = endpoint.lock().expect("endpoint").accepted.len() as i64;
        let queued = env.ready(&env.queue).await as u64 + unacked(&env.queue);
        let consumer = stream.consumer_counts("idem-natural").await;
        let credited = count(env, "SELECT count(*) FROM kafka_ledger").await;
        let uncommitted = kafka.uncommitted(&kafka.ends());
        let state = format!(
            "loyalty {loyalty}, natural {natural}, receipts {receipts}, kafka {credited}, delivered {delivered} of {orders}; loyalty queue holds {queued}; stream consumer {consumer:?}; Kafka records past the group's commit {uncommitted:?}"
        );
        if loyalty >= orders
            && credited >= orders
            && uncommitted.values().all(|records| *records == 0)
            && natural >= orders
            && receipts >= orders
            && delivered >= orders
            && queued == 0
            && consumer == Some((0, 0))
        {
            return Ok(());
        }
        let waiting: i64 = uncommitted.values().sum();
        let kafka_now = Some((credited, waiting));
        if kafka_now != kafka_progress.0 {
            kafka_progress = (kafka_now, Instant::now());
        } else if waiting > 0 && kafka_progress.1.elapsed() > KAFKA_STALL {
            return Err(Unsettled::KafkaStalled(state));
        }
        if Instant::now() > until {
            return Err(Unsettled::TimedOut(state));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The checker. Appends each violation to `failures` and the counts to `counts`.
pub(super) async fn check(
    sources: &Sources<'_>,
    idem_tables: &str,
    produced: &Produced,
    failures: &mut Vec<String>,
    counts: &mut String,
) {
    let Sources {
        env,
        stream,
        kafka,
        endpoint,
    } = *sources;
    let orders = produced.orders;
    let expected: BTreeSet<i64> = (1..=orders).collect();
    let rows = |sql: String| async move {
        sqlx::query_as::<_, (String, i64)>(sqlx::AssertSqlSafe(sql.clone()))
            .fetch_all(&env.pool)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"))
    };

    // Ledger claims: one claim exactly when the order's ledger row is there once.
    let claims: BTreeMap<String, i64> = rows(format!(
        "SELECT message_key, count(*)::int8 FROM {idem_tables}processed_messages WHERE consumer = 'loyalty' GROUP BY 1",
    ))
    .await
    .into_iter()
    .collect();
    let ledger: BTreeMap<String, i64> = rows(
        "SELECT 'order-completed:' || order_id, count(*)::int8 FROM point_ledger GROUP BY 1".into(),
    )
    .await
    .into_iter()
    .collect();
    per_key(
        "loyalty",
        &expected,
        |id| format!("order-completed:{id}"),
        &claims,
        &ledger,
        failures,
    );
    let natural: BTreeMap<String, i64> = rows(
        "SELECT 'order-completed:' || order_id, count(*)::int8 FROM natural_ledger GROUP BY 1"
            .into(),
    )
    .await
    .into_iter()
    .collect();
    // A good message on its last delivery that the host could not finish (a kill spends
    // deliveries) is dead-lettered as `deliveries-exhausted`, never abandoned: expected
    // there, and not applied.
    let natural_letters = stream.dead_letters().await;
    let exhausted: BTreeSet<i64> = natural_letters
        .iter()
        .filter(|(_, headers)| {
            headers
                .iter()
                .any(|(name, value)| name == "x-idem-error-kind" && value == "deliveries-exhausted")
        })
        .filter_map(|(body, _)| {
            serde_json::from_slice::<serde_json::Value>(body)
                .ok()?
                .get("order_id")?
                .as_i64()
        })
        .collect();
    let applied_and_exhausted = exhausted
        .iter()
        .filter(|id| natural.contains_key(&format!("order-completed:{id}")))
        .count();
    if applied_and_exhausted > 0 {
        failures.push(format!(
            "natural: {applied_and_exhausted} orders both applied and dead-lettered as deliveries-exhausted"
        ));
    }
    let natural_expected: BTreeSet<i64> = expected.difference(&exhausted).copied().collect();
    per_key(
        "natural",
        &natural_expected,
        |id| format!("order-completed:{id}"),
        &natural,
        &natural,
        failures,
    );
    let receipt_claims: BTreeMap<String, i64> = rows(format!(
        "SELECT message_key, count(*)::int8 FROM {idem_tables}processed_messages WHERE consumer = 'receipts' GROUP BY 1",
    ))
    .await
    .into_iter()
    .collect();
    let receipts: BTreeMap<String, i64> =
        rows("SELECT 'receipt:' || order_id, count(*)::int8 FROM receipts GROUP BY 1".into())
            .await
            .into_iter()
            .collect();
    per_key(
        "receipts",
        &expected,
        |id| format!("receipt:{id}"),
        &receipt_claims,
        &receipts,
        failures,
    );
    let kafka_counts = check_kafka(env, idem_tables, kafka, &expected, failures).await;
    for (table, sums) in [
        ("balances", "point_ledger"),
        ("natural_balances", "natural_ledger"),
        ("kafka_balances", "kafka_ledger"),
    ] {
        let mismatched = count(
            env,
            &format!(
                "SELECT count(*) FROM {table} b FULL JOIN \
                 (SELECT customer_id, sum(points) AS points FROM {sums} GROUP BY customer_id) l \
                 USING (customer_id) WHERE b.points IS DISTINCT FROM l.points"
            ),
        )
        .await;
        if mismatched > 0 {
            failures.push(format!(
                "{table}: {mismatched} customers' balances differ from {sums}"
            ));
        }
    }

    // The outbox: every receipt delivered, none parked or pending.
    let undelivered = count(
        env,
        &format!("SELECT count(*) FROM {idem_tables}idem_outbox WHERE delivered_at IS NULL"),
    )
    .await;
    let accepted = endpoint.lock().expect("endpoint").accepted.clone();
    let missing: Vec<i64> = expected
        .iter()
        .copied()
        .filter(|id| !accepted.contains_key(&format!("receipt:{id}")))
        .collect();
    let foreign = accepted
        .keys()
        .filter(|key| {
            key.strip_prefix("receipt:")
                .and_then(|id| id.parse::<i64>().ok())
                .is_none_or(|id| !expected.contains(&id))
        })
        .count();
    let redelivered: u32 = accepted.values().map(|times| times - 1).sum();
    if undelivered > 0 || !missing.is_empty() || foreign > 0 {
        failures.push(format!(
            "outbox: {undelivered} rows undelivered, {} receipts never delivered (first {:?}), {foreign} unknown keys",
            missing.len(),
            missing.iter().take(5).collect::<Vec<_>>()
        ));
    }

    // Dead letters: only the malformed messages, each of them, on every source.
    let mut dead = BTreeMap::new();
    for (pipeline, queue) in [
        ("loyalty", env.dead_letter_queue.clone()),
        ("receipts", format!("{}-receipts.dead-letter", env.queue)),
    ] {
        let bodies: Vec<Vec<u8>> = env
            .drain(&queue)
            .await
            .into_iter()
            .map(|(body, _)| body.into_bytes())
            .collect();
        dead.insert(pipeline, bodies);
    }
    let natural_dead = natural_letters
        .into_iter()
        .filter(|(_, headers)| {
            let named = |wanted: &str, expected: &str| {
                headers
                    .iter()
                    .any(|(name, value)| name == wanted && value == expected)
            };
            named("x-idem-pipeline", "natural")
                && !named("x-idem-error-kind", "deliveries-exhausted")
        })
        .map(|(body, _)| body)
        .collect();
    dead.insert("natural", natural_dead);
    dead.insert("kafka", kafka.dead_letters());
    for (pipeline, bodies) in &dead {
        let good = bodies
            .iter()
            .filter(|body| !produced.bad.contains(*body))
            .count();
        let distinct: BTreeSet<&Vec<u8>> = bodies.iter().collect();
        let absent = produced
            .bad
            .iter()
            .filter(|bad| !distinct.contains(bad))
            .count();
        if good > 0 || absent > 0 {
            failures.push(format!(
                "{pipeline}: {good} good messages among the dead letters, {absent} malformed ones missing from them"
            ));
        }
    }

    // Nothing left in the sources.
    for queue in [env.queue.clone(), format!("{}-receipts", env.queue)] {
        let left = env.ready(&queue).await as u64 + unacked(&queue);
        if left > 0 {
            failures.push(format!("{queue}: {left} messages left (ready or unacked)"));
        }
    }
    let consumer = stream.consumer_counts("idem-natural").await;
    if consumer != Some((0, 0)) {
        failures.push(format!(
            "stream consumer idem-natural: pending and unacknowledged {consumer:?}"
        ));
    }

    let _ = writeln!(
        counts,
        "published {} deliveries ({orders} orders per source, {} malformed per source); \
         claims loyalty {} / receipts {}; rows point_ledger {} natural_ledger {} receipts {}; \
         dead letters loyalty {} natural {} (+{} deliveries-exhausted) receipts {} kafka {}; {kafka_counts}; receipts delivered {} (+{redelivered} repeats with the same key)",
        produced.deliveries,
        produced.bad.len(),
        claims.len(),
        receipt_claims.len(),
        ledger.values().sum::<i64>(),
        natural.values().sum::<i64>(),
        receipts.values().sum::<i64>(),
        dead["loyalty"].len(),
        dead["natural"].len(),
        exhausted.len(),
        dead["receipts"].len(),
        dead["kafka"].len(),
        accepted.len(),
    );
}

/// The Kafka pipeline's own checks: per key, one claim exactly when its ledger row is there
/// once; each customer's orders applied in the order produced (they share a partition, and
/// `ordering = "key"` applies one key's messages one at a time in offset order); the group
/// committed every partition to its end, never past it; the database floor never past the end
/// (behind it only re-reads what the claims hold). Returns the counts' words.
async fn check_kafka(
    env: &TestEnv,
    idem_tables: &str,
    kafka: &SoakTopic,
    expected: &BTreeSet<i64>,
    failures: &mut Vec<String>,
) -> String {
    let claims: BTreeMap<String, i64> = sqlx::query_as::<_, (String, i64)>(sqlx::AssertSqlSafe(
        format!(
            "SELECT message_key, count(*)::int8 FROM {idem_tables}processed_messages WHERE consumer = 'kafka' GROUP BY 1"
        ),
    ))
    .fetch_all(&env.pool)
    .await
    .expect("the Kafka pipeline's claims")
    .into_iter()
    .collect();
    let applied: Vec<(i64, i64)> =
        sqlx::query_as("SELECT customer_id, order_id FROM kafka_ledger ORDER BY applied")
            .fetch_all(&env.pool)
            .await
            .expect("the Kafka pipeline's ledger");
    let mut ledger = BTreeMap::<String, i64>::new();
    let mut by_customer = BTreeMap::<i64, Vec<i64>>::new();
    for (customer, order_id) in &applied {
        *ledger
            .entry(format!("order-completed:{order_id}"))
            .or_default() += 1;
        by_customer.entry(*customer).or_default().push(*order_id);
    }
    per_key(
        "kafka",
        expected,
        |id| format!("order-completed:{id}"),
        &claims,
        &ledger,
        failures,
    );
    let reordered: Vec<(i64, Vec<i64>)> = by_customer
        .into_iter()
        .filter(|(_, orders)| orders.windows(2).any(|pair| pair[0] >= pair[1]))
        .collect();
    if let Some((customer, orders)) = reordered.first() {
        failures.push(format!(
            "kafka: {} customers' orders applied out of the order produced (customer {customer}: {orders:?})",
            reordered.len()
        ));
    }
    let ends = kafka.ends();
    let uncommitted = kafka.uncommitted(&ends);
    if uncommitted.values().any(|records| *records != 0) {
        failures.push(format!(
            "kafka: the group's commits are not at each partition's end (records past the commit, per partition: {uncommitted:?})"
        ));
    }
    let floors: BTreeMap<i32, i64> = sqlx::query_as::<_, (i32, i64)>(sqlx::AssertSqlSafe(format!(
        "SELECT partition, next_offset FROM {idem_tables}idem_offsets WHERE consumer = 'kafka' AND topic = $1"
    )))
    .bind(&kafka.topic)
    .fetch_all(&env.pool)
    .await
    .expect("the Kafka pipeline's floors")
    .into_iter()
    .collect();
    let past: Vec<(i32, i64)> = floors
        .iter()
        .filter(|(partition, floor)| **floor > ends.get(partition).copied().unwrap_or(0))
        .map(|(partition, floor)| (*partition, *floor))
        .collect();
    if !past.is_empty() {
        failures.push(format!(
            "kafka: database floors past their partition's end {past:?} (ends {ends:?})"
        ));
    }
    format!(
        "kafka claims {}, rows {}, partition ends {ends:?}, database floors {floors:?}",
        claims.len(),
        applied.len()
    )
}

/// For each expected key: one claim exactly when its effect row is there once; and no claim
/// or row for a key never published.
fn per_key(
    pipeline: &str,
    expected: &BTreeSet<i64>,
    key_of: impl Fn(i64) -> String,
    claims: &BTreeMap<String, i64>,
    effects: &BTreeMap<String, i64>,
    failures: &mut Vec<String>,
) {
    let mut lost = Vec::new();
    let mut doubled = Vec::new();
    let mut orphan_claims = Vec::new();
    let mut unclaimed = Vec::new();
    for id in expected {
        let key = key_of(*id);
        let claim = claims.get(&key).copied().unwrap_or(0);
        let rows = effects.get(&key).copied().unwrap_or(0);
        match (claim, rows) {
            (1, 1) => {}
            (0, 0) => lost.push(*id),
            (_, 0) => orphan_claims.push(*id),
            (0, _) => unclaimed.push(*id),
            _ => doubled.push(*id),
        }
    }
    let expected_keys: BTreeSet<String> = expected.iter().map(|id| key_of(*id)).collect();
    let unexpected = claims
        .keys()
        .chain(effects.keys())
        .filter(|key| !expected_keys.contains(*key))
        .count();
    let first = |ids: &[i64]| ids.iter().take(5).copied().collect::<Vec<_>>();
    if !lost.is_empty()
        || !doubled.is_empty()
        || !orphan_claims.is_empty()
        || !unclaimed.is_empty()
        || unexpected > 0
    {
        failures.push(format!(
            "{pipeline}: {} lost (first {:?}), {} doubled (first {:?}), {} claims without their effects (first {:?}), {} effects without their claim (first {:?}), {unexpected} unexpected keys",
            lost.len(),
            first(&lost),
            doubled.len(),
            first(&doubled),
            orphan_claims.len(),
            first(&orphan_claims),
            unclaimed.len(),
            first(&unclaimed),
        ));
    }
}
