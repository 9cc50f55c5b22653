//! Dead-letter triage from the command line: `idem dlq list/show/replay` on the dead letters
//! of a RabbitMQ queue and of a JetStream stream, holding messages of three error kinds.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use idem_e2e::jetstream::TestStream;
use idem_e2e::{
    TestEnv, free_port, http_exchange, http_request, http_send, idem_binary, plugin_path, wait_for,
};
use idem_host::config::Config;

fn idem(config: &Path, args: &[&str]) -> (bool, String) {
    let output = Command::new(idem_binary())
        .args(args)
        .args(["--pipeline", "loyalty", "--config"])
        .arg(config)
        .output()
        .expect("run idem");
    (output.status.success(), idem_e2e::said(&output))
}

/// `idem` with `args` on the pipeline, expected to fail: what it said.
fn idem_refused(config: &Path, args: &[&str]) -> String {
    let (ok, said) = idem(config, args);
    assert!(!ok, "idem {args:?} succeeded: {said}");
    said
}

/// The dead letters `idem dlq list --json` shows with `filter`, in order.
fn listed(config: &Path, filter: &[&str]) -> Vec<serde_json::Value> {
    let mut args = vec!["dlq", "list", "--format", "json"];
    args.extend_from_slice(filter);
    let output = Command::new(idem_binary())
        .args(&args)
        .args(["--pipeline", "loyalty", "--config"])
        .arg(config)
        .output()
        .expect("run idem");
    assert!(output.status.success(), "{output:?}");
    serde_json::from_slice(&output.stdout).expect("JSON list")
}

/// The kinds of the dead letters `idem dlq list --json` shows, in order.
fn listed_kinds(config: &Path, filter: &[&str]) -> Vec<String> {
    listed(config, filter)
        .iter()
        .map(|letter| letter["kind"].as_str().unwrap_or("-").to_string())
        .collect()
}

/// The chaos pipeline `loyalty` with one attempt, on a queue or on a stream, and its config
/// file for the command line.
struct Triage {
    env: TestEnv,
    stream: Option<TestStream>,
    config: PathBuf,
}

impl Triage {
    async fn on_queue(name: &str) -> Triage {
        let env = TestEnv::new(name).await;
        let config = env.write_config("chaos", "max_attempts = 1");
        Triage {
            env,
            stream: None,
            config,
        }
    }

    async fn on_stream(name: &str) -> Triage {
        let env = TestEnv::new(name).await;
        let stream = TestStream::new(&env.queue).await;
        let text = format!(
            "{}{}",
            env.config_header(),
            stream.pipeline_table("loyalty", &plugin_path("chaos"), "", "max_attempts = 1")
        );
        let config = std::env::temp_dir().join(format!("{}.toml", env.database));
        std::fs::write(&config, text).expect("write config");
        Triage {
            env,
            stream: Some(stream),
            config,
        }
    }

    fn host_config(&self) -> Config {
        Config::load(&self.config).expect("test config is valid")
    }

    /// Publishes `body`; on a stream with message id `triage-<number>`.
    async fn publish(&self, number: usize, body: &[u8]) {
        match &self.stream {
            Some(stream) => {
                let id = format!("triage-{number}");
                stream.publish(body, Some(&id)).await;
            }
            None => self.env.publish(body).await,
        }
    }

    /// How many dead letters are kept.
    async fn dead_letters(&self) -> usize {
        match &self.stream {
            Some(stream) => stream.dead_letters().await.len(),
            None => self.env.ready(&self.env.dead_letter_queue).await as usize,
        }
    }

    async fn cleanup(self) {
        let _ = std::fs::remove_file(&self.config);
        if let Some(stream) = self.stream {
            stream.cleanup().await;
        }
        self.env.cleanup().await;
    }
}

/// Seven dead letters of three kinds (invalid-input, plugin-trap, sql): `list` shows each
/// with its reason and returns them in order; `--kind` filters; `replay --dry-run` moves
/// nothing; `replay --kind sql` moves only those, which apply once after the cause (a
/// constraint) is removed, while the others stay in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_of_a_queue_are_listed_filtered_and_replayed_by_kind() {
    triage(Triage::on_queue("dlq_triage").await).await;
}

/// The same triage on a JetStream pipeline's dead-letter stream, which is read without taking
/// anything; a replayed message keeps its producer's message id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_of_a_stream_are_listed_filtered_and_replayed_by_kind() {
    triage(Triage::on_stream("js_dlq_triage").await).await;
}

async fn triage(triage: Triage) {
    let env = &triage.env;
    let config = triage.config.clone();
    sqlx::query("ALTER TABLE point_ledger ADD CONSTRAINT small_credits CHECK (points < 100)")
        .execute(&env.pool)
        .await
        .expect("add constraint");
    let host = env.start_host(triage.host_config());
    let big_credit = |order: i64| {
        format!(
            r#"{{"key": "order:{order}", "effects": [{{"statement": "record_ledger", "params": [1, {order}, 500]}}]}}"#
        )
    };
    let bodies = [
        big_credit(1),
        r#"{"action": "invalid"}"#.to_string(),
        r#"{"action": "trap"}"#.to_string(),
        big_credit(2),
        r#"{"action": "invalid"}"#.to_string(),
        big_credit(3),
        r#"{"action": "trap"}"#.to_string(),
    ];
    for (number, body) in bodies.iter().enumerate() {
        triage.publish(number, body.as_bytes()).await;
    }
    wait_for("seven dead letters", Duration::from_secs(60), || async {
        triage.dead_letters().await == 7
    })
    .await;
    // The host consumes one by one in order, but dead-letters concurrently: read the order.
    let everything = listed_kinds(&config, &[]);
    assert_eq!(everything.len(), 7, "{everything:?}");
    let mut sorted = everything.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [
            "invalid-input",
            "invalid-input",
            "plugin-trap",
            "plugin-trap",
            "sql",
            "sql",
            "sql"
        ]
    );

    let (listed, table) = idem(&config, &["dlq", "list"]);
    assert!(listed, "{table}");
    for reason in [
        "chaos plugin asked to fail",
        "plugin trapped",
        "statement \"record_ledger\" failed, claim rolled back",
    ] {
        assert!(table.contains(reason), "{reason:?} missing:\n{table}");
    }
    assert!(table.contains("nothing was moved"), "{table}");
    // Looking moved nothing and kept the order.
    assert_eq!(triage.dead_letters().await, 7);
    assert_eq!(listed_kinds(&config, &[]), everything);
    assert_eq!(
        listed_kinds(&config, &["--kind", "sql"]),
        ["sql", "sql", "sql"]
    );
    assert_eq!(
        listed_kinds(&config, &["--reason", "plugin trapped"]),
        ["plugin-trap", "plugin-trap"]
    );
    assert_eq!(listed_kinds(&config, &["--since", "1h"]).len(), 7);

    let first_sql = everything
        .iter()
        .position(|kind| kind == "sql")
        .expect("an sql dead letter")
        + 1;
    let (shown, detail) = idem(&config, &["dlq", "show", &first_sql.to_string()]);
    assert!(shown, "{detail}");
    assert!(
        detail.contains("kind         sql")
            && detail.contains("small_credits")
            && detail.contains("x-idem-reason")
            && detail.contains("\"record_ledger\""),
        "{detail}"
    );
    if triage.stream.is_some() {
        // The producer's id, not the one the host gave the dead letter.
        assert!(detail.contains("message-id   triage-"), "{detail}");
    }

    let (dry, said) = idem(&config, &["dlq", "replay", "--kind", "sql", "--dry-run"]);
    assert!(dry, "{said}");
    assert!(said.contains("would replay 3 message(s)"), "{said}");
    assert_eq!(triage.dead_letters().await, 7);

    // The cause is fixed; only the sql dead letters go back, and they apply once.
    sqlx::query("ALTER TABLE point_ledger DROP CONSTRAINT small_credits")
        .execute(&env.pool)
        .await
        .expect("drop constraint");
    let (replayed, said) = idem(&config, &["dlq", "replay", "--kind", "sql"]);
    assert!(replayed, "{said}");
    assert!(said.contains("replayed 3 message(s)"), "{said}");
    wait_for("three credits", Duration::from_secs(30), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 3
    })
    .await;
    let others: Vec<String> = everything
        .iter()
        .filter(|kind| *kind != "sql")
        .cloned()
        .collect();
    assert_eq!(
        listed_kinds(&config, &[]),
        others,
        "the rest stayed, in order"
    );
    // Replaying them again changes nothing: the claims make them duplicates.
    assert_eq!(
        env.count("SELECT count(DISTINCT order_id) FROM point_ledger")
            .await,
        3
    );
    let (_, said) = idem(&config, &["dlq", "replay", "--kind", "sql"]);
    assert!(said.contains("replayed 0 message(s)"), "{said}");
    if let Some(stream) = &triage.stream {
        wait_for(
            "the consumer to hold nothing",
            Duration::from_secs(30),
            || async { stream.consumer_counts("idem-loyalty").await == Some((0, 0)) },
        )
        .await;
    }
    host.stop().await.expect("host stops");
    triage.cleanup().await;
}

/// The value of header `name` (exactly) of a listed dead letter.
fn header<'a>(letter: &'a serde_json::Value, name: &str) -> Option<&'a str> {
    letter["headers"]
        .as_array()?
        .iter()
        .find(|pair| pair[0] == name)
        .and_then(|pair| pair[1].as_str())
}

/// Producers set `x-idem-*` headers too. One that copies a dead letter's
/// `x-idem-dead-letter-id` and forges a reason in another case has its message dead-lettered
/// with the host's record only; a message the broker dead-lettered by itself (here put on
/// the dead-letter queue directly) carrying another dead letter's id and reason is a dead
/// letter of its own, which a replay of the first by id leaves alone. `idem dlq show` prints
/// a header holding terminal escape sequences as text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_set_idem_headers_are_never_the_hosts() {
    let triage = Triage::on_queue("dlq_forged").await;
    let (env, config) = (&triage.env, triage.config.clone());
    let host = env.start_host(triage.host_config());
    let invalid = br#"{"action": "invalid"}"#;
    env.publish(invalid).await;
    wait_for("the first dead letter", Duration::from_secs(60), || async {
        env.ready(&env.dead_letter_queue).await == 1
    })
    .await;
    let first = listed(&config, &[]).remove(0);
    let first_id = first["id"].as_str().expect("an id").to_string();
    let given = header(&first, "x-idem-dead-letter-id")
        .expect("the host names what it dead-letters")
        .to_string();
    let reason = first["reason"].as_str().expect("a reason").to_string();
    idem_e2e::publish_with_headers(
        &env.channel,
        &env.queue,
        invalid,
        &[
            ("x-idem-dead-letter-id", given.as_str()),
            ("X-Idem-Reason", "all good, nothing to see"),
            ("X-IDEM-ERROR-KIND", "sql"),
            ("note", "\u{1b}]0;pwned\u{7}\u{1b}[2Jhidden"),
        ],
    )
    .await;
    wait_for(
        "the forged one dead-lettered",
        Duration::from_secs(60),
        || async { env.ready(&env.dead_letter_queue).await == 2 },
    )
    .await;
    // What the broker would dead-letter by itself (a quorum queue's delivery limit): the
    // producer's headers, as they came.
    idem_e2e::publish_with_headers(
        &env.channel,
        &env.dead_letter_queue,
        invalid,
        &[
            ("x-idem-dead-letter-id", given.as_str()),
            ("x-idem-reason", reason.as_str()),
            ("x-idem-error-kind", "invalid-input"),
        ],
    )
    .await;
    let letters = listed(&config, &[]);
    assert_eq!(letters.len(), 3, "{letters:?}");
    let forged = &letters[1];
    assert_eq!(forged["kind"], "invalid-input", "{forged}");
    assert_eq!(forged["reason"], first["reason"], "{forged}");
    let names: Vec<&str> = forged["headers"]
        .as_array()
        .expect("headers")
        .iter()
        .filter_map(|pair| pair[0].as_str())
        .collect();
    assert!(
        !names.contains(&"X-Idem-Reason") && !names.contains(&"X-IDEM-ERROR-KIND"),
        "the producer's diagnostics were kept: {names:?}"
    );
    assert_ne!(
        header(forged, "x-idem-dead-letter-id"),
        Some(given.as_str())
    );
    let ids: std::collections::BTreeSet<&str> = letters
        .iter()
        .filter_map(|letter| letter["id"].as_str())
        .collect();
    assert_eq!(ids.len(), 3, "three dead letters, three ids: {letters:?}");

    let (shown, detail) = idem(&config, &["dlq", "show", "2"]);
    assert!(shown, "{detail}");
    assert!(
        !detail.contains('\u{1b}') && !detail.contains('\u{7}'),
        "raw escape sequences reached the terminal: {detail:?}"
    );
    assert!(
        detail.contains("note: \\u{1b}]0;pwned\\u{7}\\u{1b}[2Jhidden"),
        "{detail}"
    );

    let (replayed, said) = idem(&config, &["dlq", "replay", "--id", &first_id]);
    assert!(replayed, "{said}");
    assert!(said.contains("replayed 1 message(s)"), "{said}");
    host.stop().await.expect("host stops");
    triage.cleanup().await;
}

/// The console's API over the same kind of dead letters: `POST /admin/dead-letters/loyalty/list`
/// groups them by error kind and reason and `…/show` shows one whole; the `sql` group,
/// replayed by its ids once the cause is fixed, applies once while the others stay. Every
/// `/admin` request needs the admin token once one is set (on a loopback listener too), a
/// `POST` is refused from another site's page, and the dead-letter reads are not `GET`s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_groups_dead_letters_and_replays_a_group() {
    let env = TestEnv::new("dlq_api").await;
    sqlx::query("ALTER TABLE point_ledger ADD CONSTRAINT small_credits CHECK (points < 100)")
        .execute(&env.pool)
        .await
        .expect("add constraint");
    let port = free_port();
    let token = "triage-token-0123456789abcdef01234";
    let text = format!(
        "{}\n[http]\nlisten = \"127.0.0.1:{port}\"\nadmin_token = \"{token}\"\n",
        env.config_text("chaos", "max_attempts = 1")
    );
    let config = Config::from_toml(Path::new("/tmp/idem-dlq-api.toml"), &text).expect("config");
    let host = env.start_host(config);
    let big_credit = |order: i64| {
        format!(
            r#"{{"key": "order:{order}", "effects": [{{"statement": "record_ledger", "params": [1, {order}, 500]}}]}}"#
        )
    };
    for body in [
        big_credit(1),
        r#"{"action": "invalid"}"#.to_string(),
        big_credit(2),
        r#"{"action": "invalid"}"#.to_string(),
        r#"{"action": "invalid"}"#.to_string(),
    ] {
        env.publish(body.as_bytes()).await;
    }
    wait_for("five dead letters", Duration::from_secs(60), || async {
        env.ready(&env.dead_letter_queue).await == 5
    })
    .await;

    let bearer = format!("Bearer {token}");
    let authorized = [("Authorization", bearer.as_str())];
    let list = || async {
        let (status, body) = http_send(
            port,
            "POST",
            "/admin/dead-letters/loyalty/list",
            &authorized,
            Some("{}"),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<serde_json::Value>(&body).expect("JSON list")
    };
    // Reads need the token too, on this loopback listener.
    for (method, path, json) in [
        ("GET", "/admin/status", None),
        ("GET", "/admin/history", None),
        ("GET", "/admin/outbox", None),
        ("POST", "/admin/dead-letters/loyalty/list", Some("{}")),
    ] {
        let (status, body) = http_send(port, method, path, &[], json).await;
        assert_eq!(status, 401, "{method} {path} without the token: {body}");
    }
    // A dead-letter read is no GET (a cross-site <img> could send one).
    let (status, body) =
        http_request(port, "GET", "/admin/dead-letters/loyalty/list", Some(token)).await;
    assert_eq!(status, 405, "{body}");
    // Two operators (or the console's view and its pipeline choice) look at once: each sees
    // all five, not what the other pass holds while it reads.
    let (listed, beside) = tokio::join!(list(), list());
    for listed in [&listed, &beside] {
        assert_eq!(
            listed["letters"].as_array().map(Vec::len),
            Some(5),
            "{listed}"
        );
    }
    let group = |kind: &str| {
        listed["groups"]
            .as_array()
            .expect("groups")
            .iter()
            .find(|group| group["kind"] == kind)
            .cloned()
            .unwrap_or_else(|| panic!("no {kind} group in {listed}"))
    };
    assert_eq!(group("invalid-input")["count"], 3, "{listed}");
    assert_eq!(
        group("invalid-input")["reason"],
        "plugin refused the message (invalid-input): chaos plugin asked to fail"
    );
    let sql = group("sql");
    assert_eq!(sql["count"], 2, "{listed}");
    let first = sql["ids"][0].as_str().expect("an id");
    let shown = serde_json::json!({ "id": first }).to_string();
    let (status, detail) = http_send(
        port,
        "POST",
        "/admin/dead-letters/loyalty/show",
        &authorized,
        Some(&shown),
    )
    .await;
    assert_eq!(status, 200, "{detail}");
    assert!(
        detail.contains("x-idem-reason") && detail.contains("record_ledger"),
        "{detail}"
    );
    // Looking moved nothing.
    assert_eq!(env.ready(&env.dead_letter_queue).await, 5);

    sqlx::query("ALTER TABLE point_ledger DROP CONSTRAINT small_credits")
        .execute(&env.pool)
        .await
        .expect("drop constraint");
    let replay = serde_json::json!({ "ids": sql["ids"] }).to_string();
    let path = "/admin/dead-letters/loyalty/replay";
    let own_page = format!("http://127.0.0.1:{port}");
    let (status, body) = http_send(port, "POST", path, &[], Some(&replay)).await;
    assert_eq!(status, 401, "an action without the token: {body}");
    let (status, body) = http_send(
        port,
        "POST",
        path,
        &[
            ("Authorization", bearer.as_str()),
            ("Origin", "http://evil.example"),
        ],
        Some(&replay),
    )
    .await;
    assert_eq!(status, 403, "an action from another site: {body}");
    // A page whose domain was rebound to this address: same origin as far as the browser
    // knows, but addressed to a name this endpoint does not answer to.
    let rebound_host = format!("evil.example:{port}");
    let rebound_origin = format!("http://evil.example:{port}");
    for (method, path, json) in [
        ("GET", "/admin/status", None),
        ("POST", "/admin/dead-letters/loyalty/list", Some("{}")),
        (
            "POST",
            "/admin/dead-letters/loyalty/show",
            Some(shown.as_str()),
        ),
        ("POST", path, Some(replay.as_str())),
    ] {
        let (status, _, body) = http_exchange(
            port,
            method,
            path,
            &[
                ("Host", rebound_host.as_str()),
                ("Origin", rebound_origin.as_str()),
                ("Authorization", bearer.as_str()),
            ],
            json,
        )
        .await;
        assert_eq!(status, 421, "{method} {path} to a rebound name: {body}");
        assert!(body.contains("[http] hosts"), "{body}");
    }
    assert_eq!(env.ready(&env.dead_letter_queue).await, 5, "nothing moved");
    // Every answer carries the security headers.
    let (status, head, _) = http_exchange(port, "GET", "/admin/status", &authorized, None).await;
    assert_eq!(status, 200);
    let head = head.to_ascii_lowercase();
    for header in [
        "x-content-type-options: nosniff",
        "x-frame-options: deny",
        "referrer-policy: no-referrer",
        "cache-control: no-store",
        "content-security-policy: default-src 'none'; frame-ancestors 'none'",
    ] {
        assert!(head.contains(header), "no {header:?} in {head}");
    }
    let (status, body) = http_send(
        port,
        "POST",
        path,
        &[
            ("Authorization", bearer.as_str()),
            ("Origin", own_page.as_str()),
        ],
        Some(&replay),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let replayed: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(replayed["replayed"], 2, "{body}");
    wait_for("two credits", Duration::from_secs(30), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 2
    })
    .await;
    let left = list().await;
    let kinds: Vec<&str> = left["letters"]
        .as_array()
        .expect("letters")
        .iter()
        .map(|letter| letter["kind"].as_str().unwrap_or("-"))
        .collect();
    assert_eq!(kinds, ["invalid-input"; 3], "{left}");
    host.stop().await.expect("host stops");
    env.cleanup().await;
}

/// A quorum dead-letter queue declared by infrastructure code with a low delivery limit
/// (RabbitMQ 4.0 and later give every quorum queue one of 20): looking at it again and again
/// (`idem dlq list`, as the console and an operator do) loses nothing and keeps the order,
/// since the pass renews what it keeps instead of returning it, which would count as a
/// delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn looking_at_a_quorum_dead_letter_queue_destroys_nothing() {
    let env = TestEnv::new("dlq_quorum").await;
    let quorum = idem_e2e::quorum_arguments;
    idem_e2e::redeclare(&env.channel, &env.queue, quorum(None)).await;
    idem_e2e::redeclare(&env.channel, &env.dead_letter_queue, quorum(Some(2))).await;
    for letter in ["first", "second", "third"] {
        idem_e2e::publish(&env.channel, &env.dead_letter_queue, letter.as_bytes()).await;
    }
    let config = env.write_config("chaos", "declare = false\nqueue_type = \"quorum\"");
    for look in 1..=6 {
        let output = Command::new(idem_binary())
            .args(["dlq", "list", "--json", "--pipeline", "loyalty", "--config"])
            .arg(&config)
            .output()
            .expect("run idem");
        assert!(output.status.success(), "{output:?}");
        let letters: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON list");
        let bodies: Vec<&str> = letters
            .as_array()
            .expect("a list")
            .iter()
            .map(|letter| letter["body"]["preview"].as_str().unwrap_or("-"))
            .collect();
        assert_eq!(bodies, ["first", "second", "third"], "look {look}");
    }
    assert_eq!(env.ready(&env.dead_letter_queue).await, 3);
    let _ = std::fs::remove_file(config);
    env.cleanup().await;
}

/// Dead letters that will never be replayed: `idem dlq archive` keeps the selected ones (in a
/// JSON-lines file, or the database's `idem_dead_letters`) before removing them, `idem dlq
/// discard` removes them for good, and a discard without a filter is refused unless `--all`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_of_a_queue_are_archived_and_discarded() {
    archive_and_discard(Triage::on_queue("dlq_archive").await).await;
}

/// The same on a JetStream pipeline's dead-letter stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_of_a_stream_are_archived_and_discarded() {
    archive_and_discard(Triage::on_stream("js_dlq_archive").await).await;
}

async fn archive_and_discard(triage: Triage) {
    let env = &triage.env;
    let config = triage.config.clone();
    let host = env.start_host(triage.host_config());
    for (number, body) in [
        r#"{"action": "invalid"}"#,
        r#"{"action": "trap"}"#,
        r#"{"action": "invalid"}"#,
        r#"{"action": "trap"}"#,
    ]
    .iter()
    .enumerate()
    {
        triage.publish(number, body.as_bytes()).await;
    }
    wait_for("four dead letters", Duration::from_secs(60), || async {
        triage.dead_letters().await == 4
    })
    .await;
    host.stop().await.expect("host stops");

    let said = idem_refused(&config, &["dlq", "discard"]);
    assert!(said.contains("--all"), "{said}");
    let file = std::env::temp_dir().join(format!("{}-archive.jsonl", env.database));
    let _ = std::fs::remove_file(&file);
    let to = file.to_str().expect("a path");
    let (ok, said) = idem(
        &config,
        &[
            "dlq",
            "archive",
            "--kind",
            "plugin-trap",
            "--to",
            to,
            "--dry-run",
        ],
    );
    assert!(ok && said.contains("would archive 2 message(s)"), "{said}");
    assert_eq!(triage.dead_letters().await, 4);
    assert!(!file.exists(), "a dry run wrote the archive");

    let (ok, said) = idem(
        &config,
        &["dlq", "archive", "--kind", "plugin-trap", "--to", to],
    );
    assert!(
        ok && said.contains("archived 2 message(s)") && said.contains("2 removed"),
        "{said}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&file)
        .expect("the archive file")
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    for line in &lines {
        assert_eq!(line["kind"], "plugin-trap", "{line}");
        assert_eq!(line["body"]["text"], r#"{"action": "trap"}"#, "{line}");
    }
    assert_eq!(
        listed_kinds(&config, &[]),
        ["invalid-input", "invalid-input"]
    );

    let (ok, said) = idem(
        &config,
        &["dlq", "archive", "--kind", "invalid-input", "--limit", "1"],
    );
    assert!(ok && said.contains("archived 1 message(s)"), "{said}");
    assert_eq!(
        env.count("SELECT count(*) FROM idem_dead_letters WHERE pipeline = 'loyalty' AND error_kind = 'invalid-input'")
            .await,
        1
    );
    assert_eq!(listed_kinds(&config, &[]), ["invalid-input"]);

    let (ok, said) = idem(&config, &["dlq", "discard", "--kind", "invalid-input"]);
    assert!(ok && said.contains("discarded 1 message(s)"), "{said}");
    assert_eq!(triage.dead_letters().await, 0);
    let _ = std::fs::remove_file(&file);
    triage.cleanup().await;
}
