//! The plugin kit as a plugin author meets it: `idem test` on a case file, `idem try` with
//! delivery properties, and effects checked against the pipeline's statements by `idem try`,
//! `idem test --config` and `idem check`.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use idem_e2e::{REPO_ROOT, TestEnv, idem_binary, plugin_path};

const CORPUS: &str = "tests/conformance/loyalty.json";

struct Ran {
    success: bool,
    stdout: String,
    stderr: String,
}

fn idem<I, S>(args: I) -> Ran
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let output = Command::new(idem_binary())
        .args(args)
        .output()
        .expect("run idem");
    Ran {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// `idem test --plugin <plugin> --cases <cases>`.
fn idem_test(plugin: &Path, cases: &Path) -> Ran {
    idem([
        OsStr::new("test"),
        OsStr::new("--plugin"),
        plugin.as_os_str(),
        OsStr::new("--cases"),
        cases.as_os_str(),
    ])
}

/// `idem try --config <config> --pipeline loyalty --message <message>` and `extra` flags.
fn idem_try(config: &Path, message: &Path, extra: &[&str]) -> Ran {
    let mut args = vec![
        OsStr::new("try"),
        OsStr::new("--config"),
        config.as_os_str(),
        OsStr::new("--pipeline"),
        OsStr::new("loyalty"),
        OsStr::new("--message"),
        message.as_os_str(),
    ];
    args.extend(extra.iter().map(OsStr::new));
    idem(args)
}

fn temp_file(env: &TestEnv, name: &str, text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("{}-{name}", env.database));
    std::fs::write(&path, text).expect("write temp file");
    path
}

fn corpus() -> PathBuf {
    Path::new(REPO_ROOT).join(CORPUS)
}

/// A case edited to expect another key and another parameter: `idem test` exits 1 and names
/// the case and each field; the untouched cases still pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_test_names_the_case_and_field_that_differ() {
    let env = TestEnv::new("kit_diff").await;
    let mut corpus: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(corpus()).expect("corpus")).expect("JSON");
    let first = &mut corpus["cases"][0];
    assert_eq!(first["name"], "valid order");
    first["expect"]["key"] = "order-completed:1".into();
    first["expect"]["effects"][1][1][2] = 51.into();
    corpus["cases"][13]["expect"]["reason_contains"] = "no such words".into();
    let edited = temp_file(&env, "cases.json", &corpus.to_string());

    let ran = idem_test(&plugin_path("loyalty"), &edited);
    assert!(!ran.success, "{}", ran.stdout);
    let cases = corpus["cases"].as_array().expect("cases").len();
    for expected in [
        "FAIL valid order\n".to_string(),
        "key: expected \"order-completed:1\", got \"order-completed:9912\"".to_string(),
        "effects[1] (record_ledger) $3: expected 51, got 50".to_string(),
        format!(
            "FAIL {}\n",
            corpus["cases"][13]["name"].as_str().expect("name")
        ),
        "reason: expected it to contain \"no such words\"".to_string(),
        "ok   cents round down\n".to_string(),
        format!("{cases} case(s): {} passed, 2 failed", cases - 2),
    ] {
        assert!(
            ran.stdout.contains(&expected),
            "{expected:?} missing:\n{}",
            ran.stdout
        );
    }

    // A case file with a mistake is refused before anything runs, naming the case.
    first_case_typo(&env);
    let _ = std::fs::remove_file(edited);
    env.cleanup().await;
}

fn first_case_typo(env: &TestEnv) {
    let broken = temp_file(
        env,
        "broken-cases.json",
        r#"{"cases": [{"name": "typo", "body": "{}", "expect": {"outcome": "skip", "reason_contain": "x"}}]}"#,
    );
    let ran = idem_test(&plugin_path("loyalty"), &broken);
    assert!(!ran.success);
    assert!(
        ran.stderr.contains("invalid cases") && ran.stderr.contains("reason_contain"),
        "{}",
        ran.stderr
    );
    let _ = std::fs::remove_file(broken);
}

/// `idem try` hands the plugin the headers, routing key, message id and redelivered flag it
/// is given; `idem test` does the same from a case.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_and_test_pass_delivery_properties_to_the_plugin() {
    let env = TestEnv::new("kit_delivery").await;
    let config = env.write_config("chaos", "");
    let message = temp_file(&env, "describe.json", r#"{"action": "describe"}"#);
    let ran = idem_try(
        &config,
        &message,
        &[
            "--header",
            "tenant=eu",
            "--header",
            "trace=a=b",
            "--routing-key",
            "orders.eu",
            "--message-id",
            "m-1",
            "--redelivered",
        ],
    );
    assert!(ran.success, "{}{}", ran.stdout, ran.stderr);
    let outcome: serde_json::Value = serde_json::from_str(&ran.stdout).expect("JSON outcome");
    assert_eq!(outcome["outcome"], "skip");
    assert_eq!(
        outcome["reason"],
        format!(
            "pipeline=loyalty source=rabbitmq queue={} subject=orders.eu message_id=m-1 redelivered=true delivery_count=- headers=[tenant=eu,trace=a=b] attributes=[exchange=,routing-key=orders.eu]",
            env.queue
        )
    );

    let cases = temp_file(
        &env,
        "delivery-cases.json",
        &serde_json::json!({ "cases": [
            { "name": "defaults", "json": { "action": "describe" },
              "expect": { "outcome": "skip",
                          "reason": format!("pipeline=loyalty source=rabbitmq queue={0} subject={0} message_id=- redelivered=false delivery_count=- headers=[] attributes=[exchange=,routing-key={0}]", env.queue) } },
            { "name": "everything", "json": { "action": "describe" },
              "headers": { "tenant": "eu" }, "routing_key": "r", "exchange": "x",
              "message_id": "m-2", "redelivered": true, "delivery_count": 2,
              "attributes": { "stream-sequence": "7" },
              "expect": { "outcome": "skip",
                          "reason": format!("pipeline=loyalty source=rabbitmq queue={} subject=r message_id=m-2 redelivered=true delivery_count=2 headers=[tenant=eu] attributes=[exchange=x,routing-key=r,stream-sequence=7]", env.queue) } },
        ] })
        .to_string(),
    );
    let ran = idem([
        OsStr::new("test"),
        OsStr::new("--config"),
        config.as_os_str(),
        OsStr::new("--cases"),
        cases.as_os_str(),
    ]);
    assert!(ran.success, "{}{}", ran.stdout, ran.stderr);
    assert!(
        ran.stdout.contains("2 case(s): 2 passed, 0 failed"),
        "{}",
        ran.stdout
    );
    for path in [config, message, cases] {
        let _ = std::fs::remove_file(path);
    }
    env.cleanup().await;
}

/// A decision whose effect names a statement the pipeline lacks, or passes a value of the
/// wrong type, is reported by `idem try` (exit 1), `idem test --config` and `idem check` (a
/// pipeline with `cases`), as `idem run` would reject it: names and parameter counts from
/// the config alone, types once PostgreSQL has prepared the statements.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_that_do_not_fit_the_pipeline_are_reported_before_run() {
    let env = TestEnv::new("kit_fit").await;
    let renamed = env
        .config_text("loyalty", "")
        .replace("credit_balance = ", "credit = ");
    let config = temp_file(&env, "renamed.toml", &renamed);
    let message = temp_file(
        &env,
        "order.json",
        r#"{"order_id": 9912, "customer_id": 7, "total_cents": 5000}"#,
    );
    let tried = idem_try(&config, &message, &[]);
    assert!(!tried.success, "{}", tried.stdout);
    assert!(
        tried.stderr.contains(
            "would be rejected by pipeline \"loyalty\": effect names unknown statement \"credit_balance\" (pipeline \"loyalty\" has: credit, record_ledger)"
        ),
        "{}",
        tried.stderr
    );

    let tested = idem([
        OsStr::new("test"),
        OsStr::new("--config"),
        config.as_os_str(),
        OsStr::new("--cases"),
        corpus().as_os_str(),
    ]);
    assert!(!tested.success);
    assert!(
        tested.stdout.contains("types from PostgreSQL")
            && tested.stdout.contains("FAIL valid order")
            && tested.stdout.contains(
                "would reject this decision: effect names unknown statement \"credit_balance\""
            ),
        "{}",
        tested.stdout
    );

    // `idem check` runs the pipeline's case file, with PostgreSQL and without.
    let with_cases = renamed.replace(
        "prefetch = 64",
        &format!("prefetch = 64\ncases = \"{}\"", corpus().display()),
    );
    let checked_config = temp_file(&env, "with-cases.toml", &with_cases);
    for offline in [false, true] {
        let mut args = vec![
            OsStr::new("check"),
            OsStr::new("--config"),
            checked_config.as_os_str(),
        ];
        if offline {
            args.push(OsStr::new("--offline"));
        }
        let checked = idem(args);
        assert!(!checked.success, "{}", checked.stdout);
        assert!(
            checked.stdout.contains("failed its self-test")
                && checked.stdout.contains("case \"valid order\"")
                && checked
                    .stdout
                    .contains("unknown statement \"credit_balance\""),
            "offline {offline}: {}",
            checked.stdout
        );
    }
    let fitting = temp_file(
        &env,
        "fitting.toml",
        &env.config_text("loyalty", "").replace(
            "prefetch = 64",
            &format!("prefetch = 64\ncases = \"{}\"", corpus().display()),
        ),
    );
    let checked = idem([
        OsStr::new("check"),
        OsStr::new("--config"),
        fitting.as_os_str(),
    ]);
    assert!(checked.success, "{}", checked.stdout);
    assert!(
        checked.stdout.contains("plugin passes its self-test"),
        "{}",
        checked.stdout
    );

    // A value of the wrong type: caught once PostgreSQL declares the parameter's type.
    let typed = temp_file(
        &env,
        "typed.toml",
        &env.config_text("chaos", "").replace(
            "record_ledger = ",
            "stamp = \"SELECT $1::int8\"\nrecord_ledger = ",
        ),
    );
    let echo = temp_file(
        &env,
        "echo.json",
        r#"{"key": "k", "effects": [{"statement": "stamp", "params": ["seven"]}]}"#,
    );
    let try_echo =
        |offline: bool| idem_try(&typed, &echo, if offline { &["--offline"] } else { &[] });
    let online = try_echo(false);
    assert!(!online.success);
    assert!(
        online.stderr.contains(
            "statement \"stamp\" parameter $1: expected integer (int8), the effect gave text"
        ),
        "{}",
        online.stderr
    );
    let offline = try_echo(true);
    assert!(offline.success, "names and counts fit: {}", offline.stderr);

    for path in [config, message, checked_config, fitting, typed, echo] {
        let _ = std::fs::remove_file(path);
    }
    env.cleanup().await;
}

/// From `idem new` to a plugin serving a pipeline, as a plugin author outside this
/// repository would go: new, build, test (passes), a case edited to expect another key
/// (fails, naming the case and the field), then the built plugin and the generated
/// pipeline fragment serving orders delivered twice, each recorded once.
async fn new_build_test_serve(language: &str) {
    let env = TestEnv::new(&format!("kit_new_{language}")).await;
    let started = std::time::Instant::now();
    let workspace = std::env::temp_dir().join(format!("idem-new-{}", env.database));
    let _ = std::fs::remove_dir_all(&workspace);
    std::fs::create_dir_all(&workspace).expect("workspace");
    let name = format!("orders-{language}");
    let project = workspace.join(&name);
    let created = idem([OsStr::new("new"), OsStr::new(language), project.as_os_str()]);
    assert!(created.success, "{}{}", created.stdout, created.stderr);
    for file in [
        "wit/world.wit",
        "cases.json",
        "order.json",
        "pipeline.toml",
        "schema.sql",
        "README.md",
    ] {
        assert!(project.join(file).is_file(), "{file} missing");
    }
    let again = idem([OsStr::new("new"), OsStr::new(language), project.as_os_str()]);
    assert!(
        !again.success && again.stderr.contains("not empty"),
        "{}",
        again.stderr
    );

    let logs = add_a_log_line(language, &project);

    // From the project's parent, naming it relatively: every toolchain runs inside the
    // project, and the output must still land beside its files.
    let built = Command::new(idem_binary())
        .arg("build")
        .arg(&name)
        .current_dir(&workspace)
        .output()
        .expect("idem build");
    assert!(
        built.status.success(),
        "{}{}",
        String::from_utf8_lossy(&built.stdout),
        String::from_utf8_lossy(&built.stderr)
    );
    let wasm = project.join(format!("{name}.wasm"));
    assert!(wasm.is_file());
    let built_in = started.elapsed();

    let cases = project.join("cases.json");
    let tested = idem_test(&wasm, &cases);
    assert!(tested.success, "{}{}", tested.stdout, tested.stderr);
    assert!(
        tested.stdout.contains("6 case(s): 6 passed, 0 failed"),
        "{}",
        tested.stdout
    );

    let original = std::fs::read_to_string(&cases).expect("cases");
    let edited_cases = project.join("edited-cases.json");
    std::fs::write(
        &edited_cases,
        original.replacen(
            "\"key\": \"order-placed:9912\"",
            "\"key\": \"order:9912\"",
            1,
        ),
    )
    .expect("edit cases");
    let failed = idem_test(&wasm, &edited_cases);
    assert!(!failed.success);
    assert!(
        failed
            .stdout
            .contains("FAIL an order is recorded once, under its order id\n")
            && failed
                .stdout
                .contains("key: expected \"order:9912\", got \"order-placed:9912\""),
        "{}",
        failed.stdout
    );

    // The generated schema and pipeline fragment, pointed at this test's database and queues.
    sqlx::raw_sql(sqlx::AssertSqlSafe(
        std::fs::read_to_string(project.join("schema.sql"))
            .expect("schema")
            .to_string(),
    ))
    .execute(&env.pool)
    .await
    .expect("schema applies");
    let fragment = std::fs::read_to_string(project.join("pipeline.toml"))
        .expect("fragment")
        .replace(
            &format!("queue = \"{name}\""),
            &format!(
                "queue = \"{}\"\ndead_letter_queue = \"{}\"",
                env.queue, env.dead_letter_queue
            ),
        );
    let config_path = project.join("pipelines.toml");
    let text = format!("{}\n{fragment}", env.config_header());
    std::fs::write(&config_path, &text).expect("write config");
    let checked = idem([
        OsStr::new("check"),
        OsStr::new("--config"),
        config_path.as_os_str(),
    ]);
    assert!(checked.success, "{}{}", checked.stdout, checked.stderr);
    // The README's `idem try` line, with the project's own message.
    let order = project.join("order.json");
    let tried = idem([
        OsStr::new("try"),
        OsStr::new("--config"),
        config_path.as_os_str(),
        OsStr::new("--pipeline"),
        OsStr::new(&name),
        OsStr::new("--message"),
        order.as_os_str(),
    ]);
    assert!(
        tried.success && tried.stdout.contains("order-placed:9912"),
        "{}{}",
        tried.stdout,
        tried.stderr
    );
    // The warm-up ran the handler while the plugin was built, with its log dropped; served
    // messages still log.
    if logs {
        assert!(
            format!("{}{}", tried.stdout, tried.stderr).contains("recording order 9912"),
            "{}{}",
            tried.stdout,
            tried.stderr
        );
    }
    let host = env.start_host(
        idem_host::config::Config::from_toml(&config_path, &text).expect("the fragment is valid"),
    );
    for order_id in 1..=50_i64 {
        let body = format!(
            r#"{{"type": "OrderPlaced", "order_id": {order_id}, "customer_id": {}, "total_cents": {}}}"#,
            order_id % 7,
            order_id * 100
        );
        env.publish(body.as_bytes()).await;
        if order_id % 5 == 0 {
            env.publish(body.as_bytes()).await;
        }
    }
    idem_e2e::wait_for(
        "50 orders recorded",
        std::time::Duration::from_secs(60),
        || async { env.count("SELECT count(*) FROM placed_orders").await == 50 },
    )
    .await;
    host.stop().await.expect("host stops");
    assert_eq!(
        env.count("SELECT sum(total_cents)::int8 FROM placed_orders")
            .await,
        (1..=50).map(|order_id| order_id * 100).sum::<i64>()
    );
    eprintln!(
        "plugin kit, {language}: built in {:.1} s; new to serving in {:.1} s",
        built_in.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&workspace);
    env.cleanup().await;
}

/// Edits the new Python or JavaScript project's handler to log each order, as a user would;
/// the template's warm-up then runs a handler that logs while the plugin is built. Whether
/// the language's handler was edited.
fn add_a_log_line(language: &str, project: &Path) -> bool {
    let (file, anchor, line, import) = match language {
        "python" => (
            "app.py",
            "        order_id = idem.integer_field(event, \"order_id\")\n",
            "        log.log(log.Level.INFO, f\"recording order {order_id}\")\n",
            (
                "import idem\n",
                "import idem\nfrom wit_world.imports import log\n",
            ),
        ),
        "js" => (
            "plugin.js",
            "    const orderId = integerField(event, \"order_id\");\n",
            "    log(\"info\", `recording order ${orderId}`);\n",
            (" skip, warmUp }", " skip, warmUp, log }"),
        ),
        _ => return false,
    };
    let path = project.join(file);
    let source = std::fs::read_to_string(&path).expect("handler source");
    assert!(
        source.contains(anchor) && source.contains(import.0),
        "the {language} template changed: {source}"
    );
    let edited = source
        .replacen(anchor, &format!("{anchor}{line}"), 1)
        .replacen(import.0, import.1, 1);
    std::fs::write(&path, edited).expect("edit handler");
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_rust_plugin_builds_tests_and_serves() {
    new_build_test_serve("rust").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_python_plugin_builds_tests_and_serves() {
    new_build_test_serve("python").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_javascript_plugin_builds_tests_and_serves() {
    new_build_test_serve("js").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_c_plugin_builds_tests_and_serves() {
    new_build_test_serve("c").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_cpp_plugin_builds_tests_and_serves() {
    new_build_test_serve("cpp").await;
}
