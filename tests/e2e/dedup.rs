//! The guide's Verification section, through the host's own message path
//! (`process::handle_delivery`): plugin, claim and effects in one transaction.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Connection as _;
use tokio_util::sync::CancellationToken;

use idem_e2e::{TestEnv, order};
use idem_host::message::InboundMessage;
use idem_host::pipeline::Pipeline;
use idem_host::pipeline::process::{Disposition, Settled, handle_delivery};

async fn loyalty_pipeline(env: &TestEnv) -> Pipeline {
    env.pipeline("loyalty", "").await
}

fn message(body: Vec<u8>) -> InboundMessage {
    InboundMessage {
        pipeline: "loyalty".into(),
        body,
        ..InboundMessage::default()
    }
}

async fn balance(env: &TestEnv, customer_id: i64) -> i64 {
    sqlx::query_scalar::<_, i64>("SELECT points FROM balances WHERE customer_id = $1")
        .bind(customer_id)
        .fetch_optional(&env.pool)
        .await
        .expect("balance query")
        .unwrap_or(0)
}

#[tokio::test]
async fn redelivery_applies_once() {
    let env = TestEnv::new("redelivery").await;
    let pipeline = loyalty_pipeline(&env).await;
    let shutdown = CancellationToken::new();
    let delivery = message(order(9912, 7, 5000));

    let first = handle_delivery(&pipeline, &delivery, 1, &shutdown).await;
    let second = handle_delivery(&pipeline, &delivery, 1, &shutdown).await;

    assert_eq!(first, Disposition::Ack(Settled::Applied));
    assert_eq!(second, Disposition::Ack(Settled::Duplicate));
    assert_eq!(balance(&env, 7).await, 50);
    env.assert_loyalty_consistent().await;
    env.cleanup().await;
}

#[tokio::test]
async fn concurrent_duplicates_apply_once() {
    let env = TestEnv::new("concurrent").await;
    let pipeline = Arc::new(loyalty_pipeline(&env).await);
    let shutdown = CancellationToken::new();
    let delivery = message(order(9913, 8, 1000));

    let mut tasks = Vec::new();
    for _ in 0..8 {
        let pipeline = Arc::clone(&pipeline);
        let delivery = delivery.clone();
        let shutdown = shutdown.clone();
        tasks.push(tokio::spawn(async move {
            handle_delivery(&pipeline, &delivery, 1, &shutdown).await
        }));
    }
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.expect("task"));
    }

    let applied = results
        .iter()
        .filter(|result| **result == Disposition::Ack(Settled::Applied))
        .count();
    let duplicates = results
        .iter()
        .filter(|result| **result == Disposition::Ack(Settled::Duplicate))
        .count();
    assert_eq!((applied, duplicates), (1, 7), "{results:?}");
    assert_eq!(balance(&env, 8).await, 10);
    env.assert_loyalty_consistent().await;
    env.cleanup().await;
}

/// The guide's Step 3, last line: if the first claimer rolls back, the waiting duplicate applies.
#[tokio::test]
async fn rolled_back_claim_lets_waiting_duplicate_apply() {
    let env = TestEnv::new("rollback").await;
    let pipeline = Arc::new(loyalty_pipeline(&env).await);
    let shutdown = CancellationToken::new();

    let mut first = sqlx::PgConnection::connect(&env.database_url)
        .await
        .expect("connect");
    let mut first_transaction = first.begin().await.expect("begin");
    sqlx::query("INSERT INTO processed_messages (consumer, message_key) VALUES ('loyalty', 'order-completed:9914')")
        .execute(&mut *first_transaction)
        .await
        .expect("first claim");

    let waiting = {
        let pipeline = Arc::clone(&pipeline);
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            handle_delivery(&pipeline, &message(order(9914, 9, 2500)), 1, &shutdown).await
        })
    };
    // The duplicate must block on the uncommitted claim, not decide early.
    idem_e2e::wait_for("the duplicate to wait on the claim's lock", Duration::from_secs(10), || async {
        env.count("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO processed_messages%'")
            .await
            == 1
    })
    .await;
    assert!(
        !waiting.is_finished(),
        "the duplicate decided before the first transaction ended"
    );

    first_transaction.rollback().await.expect("rollback");
    let result = waiting.await.expect("task");

    assert_eq!(result, Disposition::Ack(Settled::Applied));
    assert_eq!(balance(&env, 9).await, 25);
    env.assert_loyalty_consistent().await;
    env.cleanup().await;
}

/// An effect that fails in SQL takes its claim down with it: nothing half-applied remains.
#[tokio::test]
async fn failing_effect_rolls_back_its_claim() {
    let env = TestEnv::new("sqlfail").await;
    let pipeline = env.pipeline("chaos", "").await;
    let shutdown = CancellationToken::new();
    // The second effect violates point_ledger's CHECK (points >= 0) after the first credited.
    let body = serde_json::json!({
        "key": "order-completed:1",
        "effects": [
            {"statement": "credit_balance", "params": [5, 100]},
            {"statement": "record_ledger", "params": [5, 1, -100]},
        ]
    });

    let result = handle_delivery(
        &pipeline,
        &message(body.to_string().into_bytes()),
        1,
        &shutdown,
    )
    .await;

    let Disposition::DeadLetter { error_kind, reason } = result else {
        panic!("expected a dead-letter, got {result:?}");
    };
    assert_eq!(error_kind, "sql");
    assert!(
        reason.contains("record_ledger") && reason.contains("23514"),
        "{reason}"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages").await,
        0
    );
    assert_eq!(balance(&env, 5).await, 0);
    env.cleanup().await;
}

/// Effects that do not fit their statement are refused before any transaction opens.
#[tokio::test]
async fn mistyped_effects_are_rejected_with_the_statement_named() {
    let env = TestEnv::new("mistyped").await;
    let pipeline = env.pipeline("chaos", "").await;
    let shutdown = CancellationToken::new();
    let cases = [
        (
            serde_json::json!({"key": "k1", "effects": [{"statement": "drop_tables", "params": []}]}),
            "unknown statement \"drop_tables\"",
        ),
        (
            serde_json::json!({"key": "k2", "effects": [{"statement": "credit_balance", "params": [1]}]}),
            "takes 2 parameters, the effect gave 1",
        ),
        (
            serde_json::json!({"key": "k3", "effects": [{"statement": "credit_balance", "params": ["1", 2]}]}),
            "parameter $1: expected integer (int8), the effect gave text",
        ),
    ];
    for (body, expected) in cases {
        let result = handle_delivery(
            &pipeline,
            &message(body.to_string().into_bytes()),
            1,
            &shutdown,
        )
        .await;
        let Disposition::DeadLetter { error_kind, reason } = result else {
            panic!("expected a dead-letter for {body}, got {result:?}");
        };
        assert_eq!(error_kind, "invalid-effect");
        assert!(reason.contains(expected), "{reason:?} lacks {expected:?}");
    }
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages").await,
        0
    );
    env.cleanup().await;
}
