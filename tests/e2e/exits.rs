//! How every command ends, for a script: the exit status of each kind of outcome (0 done,
//! 2 usage, 3 configuration, 4 a service unreachable, 5 problems found) and the JSON report
//! `--format json` prints on stdout, an error's included.

use std::path::Path;

use idem_e2e::{TestEnv, free_port, idem_output, order};
use serde_json::Value;

/// `idem <args> --format json`: its exit status and the one JSON document on its stdout.
fn idem_json(args: &[&str], config: &Path) -> (i32, Value) {
    let mut args = args.to_vec();
    args.extend(["--format", "json"]);
    let (code, stdout, stderr) = idem_output(&args, config);
    let report = serde_json::from_str(&stdout)
        .unwrap_or_else(|error| panic!("idem {args:?}: not JSON ({error}): {stdout}{stderr}"));
    (code, report)
}

/// A port nobody listens on, and `env`'s database URL on it: PostgreSQL out of reach.
fn out_of_reach(env: &TestEnv) -> (u16, String) {
    let closed = free_port();
    let no_database = env.database_url.replace(":5432/", &format!(":{closed}/"));
    assert_ne!(no_database, env.database_url, "the URL names port 5432");
    (closed, no_database)
}

/// Everything up: `idem status` exits 0 and reports the queue, the claims and the database
/// as numbers. PostgreSQL out of reach: 4, the database unreachable in the report. RabbitMQ
/// out of reach too: still 4, the queue's error in the report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_exits_4_while_a_database_or_broker_is_out_of_reach() {
    let env = TestEnv::new("exit_status").await;
    for order_id in 1..=3 {
        env.publish(&order(order_id, 1, 1000)).await;
    }
    let migrated = env.write_config("loyalty", "");
    let (code, _, stderr) = idem_output(&["migrate"], &migrated);
    assert_eq!(code, 0, "{stderr}");

    let (code, report) = idem_json(&["status"], &migrated);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["exit"], 0, "{report}");
    let pipeline = &report["pipelines"][0];
    assert_eq!(pipeline["name"], "loyalty", "{report}");
    assert_eq!(
        pipeline["source"][0]["name"],
        env.queue.as_str(),
        "{report}"
    );
    assert_eq!(pipeline["source"][0]["ready"], 3, "{report}");
    assert_eq!(pipeline["claims"]["rows"], 0, "{report}");
    assert_eq!(report["databases"][0]["reachable"], true, "{report}");

    let (closed, no_database) = out_of_reach(&env);
    let path = std::env::temp_dir().join(format!("{}-no-db.toml", env.database));
    std::fs::write(&path, env.config_text_at(&no_database, "loyalty", "")).expect("write");
    let (code, stdout, _) = idem_output(&["status"], &path);
    assert_eq!(code, 4, "{stdout}");
    assert!(stdout.contains("unreachable"), "{stdout}");
    let (code, report) = idem_json(&["status"], &path);
    assert_eq!(code, 4, "{report}");
    assert_eq!(report["databases"][0]["reachable"], false, "{report}");

    // RabbitMQ out of reach as well.
    let text = env
        .config_text_at(&no_database, "loyalty", "")
        .replace(":5672", &format!(":{closed}"));
    std::fs::write(&path, text).expect("write");
    let (code, report) = idem_json(&["status"], &path);
    assert_eq!(code, 4, "{report}");
    let queue = &report["pipelines"][0]["source"][0];
    assert!(queue["error"].is_string(), "{report}");
    assert_eq!(queue["refused"], false, "{report}");

    let _ = std::fs::remove_file(path);
    let _ = std::fs::remove_file(migrated);
    env.cleanup().await;
}

/// `idem check`: 0 when ready; 5 when it found a problem to fix (JSON lists it); 4 when the
/// only problem is a database out of reach; 3, with the error as JSON on stdout, when the
/// file itself is invalid; 2 for a pipeline the file does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_exits_by_what_it_found() {
    let env = TestEnv::new("exit_check").await;
    let ready = env.write_config("loyalty", "");
    let (code, _, stderr) = idem_output(&["migrate"], &ready);
    assert_eq!(code, 0, "{stderr}");
    let (code, report) = idem_json(&["check"], &ready);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["ready"], true, "{report}");
    assert!(
        !report["ok"].as_array().expect("ok lines").is_empty(),
        "{report}"
    );

    let path = std::env::temp_dir().join(format!("{}-check.toml", env.database));
    let broken = env
        .config_text("loyalty", "")
        .replace("INSERT INTO point_ledger", "INSERT INTO no_such_table");
    std::fs::write(&path, broken).expect("write");
    let (code, report) = idem_json(&["check"], &path);
    assert_eq!(code, 5, "{report}");
    let problems = report["problems"].as_array().expect("problems");
    assert!(
        problems.iter().any(|problem| {
            problem["problem"]
                .as_str()
                .unwrap_or("")
                .contains("no_such_table")
                && problem["unreachable"] == false
        }),
        "{report}"
    );

    let (_, no_database) = out_of_reach(&env);
    std::fs::write(&path, env.config_text_at(&no_database, "loyalty", "")).expect("write");
    let (code, report) = idem_json(&["check"], &path);
    assert_eq!(code, 4, "{report}");
    assert!(
        report["problems"]
            .as_array()
            .expect("problems")
            .iter()
            .all(|problem| problem["unreachable"] == true),
        "{report}"
    );

    std::fs::write(&path, "[database]\nurl = 5\n").expect("write");
    let (code, report) = idem_json(&["check"], &path);
    assert_eq!(code, 3, "{report}");
    assert_eq!(report["exit"], 3, "{report}");
    assert!(
        report["error"].as_str().unwrap_or("").contains("url"),
        "{report}"
    );

    let (code, _, stderr) = idem_output(&["replay", "--pipeline", "nope"], &ready);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("no pipeline \"nope\""), "{stderr}");

    let _ = std::fs::remove_file(path);
    let _ = std::fs::remove_file(ready);
    env.cleanup().await;
}

/// `idem test --format json`: each case with its differences; 5 when one differs.
/// `idem replay --format json`: what moved. `idem outbox list --format json`: the rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_replay_and_outbox_report_as_json() {
    let env = TestEnv::new("exit_json").await;
    let config = env.write_config("loyalty", "");
    let (code, _, stderr) = idem_output(&["migrate"], &config);
    assert_eq!(code, 0, "{stderr}");

    let cases = std::env::temp_dir().join(format!("{}-cases.json", env.database));
    let case = |name: &str, points: i64| {
        serde_json::json!({
            "name": name,
            "body": "{\"order_id\": 9912, \"customer_id\": 7, \"total_cents\": 5000}",
            "expect": {
                "outcome": "decision",
                "key": "order-completed:9912",
                "effects": [["credit_balance", [7, points]], ["record_ledger", [7, 9912, points]]],
            },
        })
    };
    let file = serde_json::json!({ "cases": [case("right", 50), case("wrong", 51)] });
    std::fs::write(&cases, file.to_string()).expect("write cases");
    let cases_arg = cases.to_str().expect("UTF-8 path");
    let (code, report) = idem_json(&["test", "--offline", "--cases", cases_arg], &config);
    assert_eq!(code, 5, "{report}");
    assert_eq!(report["passed"], 1, "{report}");
    assert_eq!(report["failed"], 1, "{report}");
    assert_eq!(report["cases"][0]["passed"], true, "{report}");
    assert_eq!(report["cases"][1]["name"], "wrong", "{report}");
    assert!(
        !report["cases"][1]["differences"]
            .as_array()
            .expect("differences")
            .is_empty(),
        "{report}"
    );

    for order_id in 1..=2 {
        idem_e2e::publish(
            &env.channel,
            &env.dead_letter_queue,
            &order(order_id, 3, 100),
        )
        .await;
    }
    let (code, report) = idem_json(&["replay", "--pipeline", "loyalty"], &config);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["replayed"], 2, "{report}");
    assert_eq!(
        report["letters"].as_array().map(Vec::len),
        Some(2),
        "{report}"
    );
    assert_eq!(env.ready(&env.queue).await, 2);
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0);

    let (code, report) = idem_json(&["outbox", "list"], &config);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report, serde_json::json!([]), "{report}");

    let _ = std::fs::remove_file(cases);
    let _ = std::fs::remove_file(config);
    env.cleanup().await;
}
