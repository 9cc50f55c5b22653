//! The operator console as a client sees it over HTTP: served from the binary with a policy
//! that lets it reach nothing but this host, and gone with `console = false`.

use std::path::Path;
use std::time::Duration;

use idem_e2e::browser::Browser;
use idem_e2e::{
    TestEnv, connect_channel, free_port, http_send, order, pipeline_table, plugin_path, publish,
    wait_for,
};
use idem_host::config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The status and body of `GET path`.
async fn get(port: u16, path: &str) -> (u16, String) {
    http_send(port, "GET", path, &[], None).await
}

/// The response head (status line and headers) of `GET path`, lower-cased.
async fn head_of(port: u16, path: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.expect("read");
    let response = String::from_utf8_lossy(&response).to_lowercase();
    response
        .split_once("\r\n\r\n")
        .map_or(response.clone(), |(head, _)| head.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_served_from_the_binary_and_can_be_turned_off() {
    let env = TestEnv::new("console_assets").await;
    for console in [true, false] {
        let port = free_port();
        let text = format!(
            "{}\n[http]\nlisten = \"127.0.0.1:{port}\"\nconsole = {console}\n",
            env.config_text("loyalty", "")
        );
        let config = Config::from_toml(Path::new("/tmp/idem-console.toml"), &text).expect("config");
        let host = env.start_host(config);
        wait_for("the HTTP endpoint", Duration::from_secs(30), || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await;
        let (status, page) = get(port, "/").await;
        if console {
            assert_eq!(status, 200, "{page}");
            assert!(page.contains("<title>idem console</title>"), "{page}");
            assert!(page.contains("/console.js"), "{page}");
            let head = head_of(port, "/").await;
            assert!(
                head.contains("content-security-policy: default-src 'none'; script-src 'self'")
                    && head.contains("frame-ancestors 'none'"),
                "{head}"
            );
            for asset in ["/console.js", "/console.css"] {
                let (status, body) = get(port, asset).await;
                assert_eq!(status, 200, "{asset}: {body}");
                assert!(!body.is_empty(), "{asset}");
            }
            // Nothing outside this host: no CDN, no remote font, no analytics.
            for (name, body) in [
                ("page", page.clone()),
                ("script", get(port, "/console.js").await.1),
                ("style", get(port, "/console.css").await.1),
            ] {
                assert!(
                    !body.contains("http://")
                        && !body.contains("https://")
                        && !body.contains("//cdn"),
                    "the {name} names another host"
                );
            }
        } else {
            assert_eq!(status, 404, "console = false still serves the page: {page}");
        }
        let (status, _) = get(port, "/admin/status").await;
        assert_eq!(status, 200, "the admin API does not depend on the console");
        // The last minutes, kept by the host: counters, and the queue's depths.
        let started = std::time::Instant::now();
        let history = loop {
            let (_, body) = get(port, "/admin/history").await;
            let history: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            if history["depths"]["loyalty"]["waiting"].is_u64() {
                break history;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "no depths after 30 s: {history}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(history["depths"]["loyalty"]["dead_letters"], 0, "{history}");
        assert!(
            history["samples"][0]["pipelines"]["loyalty"]["applied"].is_u64(),
            "{history}"
        );
        host.stop().await.expect("host stops");
    }
    env.cleanup().await;
}

/// Clicks the one group's replay button, confirms, and waits for the page to say that `count`
/// messages were replayed; the confirmation's question.
async fn replay_the_group(browser: &mut Browser, count: u32) -> String {
    act_on_the_group(browser, "replay", "Replayed", count).await
}

/// Clicks the one group's `action` button, confirms, and waits for the page to say that
/// `count` messages were `done`; the confirmation's question.
async fn act_on_the_group(browser: &mut Browser, action: &str, done: &str, count: u32) -> String {
    browser
        .click(&format!("#dl-groups tbody tr button.{action}-group"))
        .await;
    browser
        .wait("document.querySelector('#confirm').open", 10)
        .await;
    let question = browser
        .eval("document.querySelector('#confirm-text').textContent")
        .await;
    browser.click("#confirm-ok").await;
    browser
        .wait(
            &format!(
                "document.querySelector('#notice').textContent.includes('{done} {count} message(s)')"
            ),
            30,
        )
        .await;
    question.as_str().unwrap_or_default().to_string()
}

/// `text` as a JavaScript string literal.
fn js(text: &str) -> String {
    serde_json::Value::from(text).to_string()
}

/// The console in Debian's Chromium against a real host serving two pipelines, with an admin
/// token: the page loads (and fetches nothing from anywhere else), asks for the token (every
/// read needs it), shows both pipelines consuming with their plugin digests, and the
/// applied-rate chart moves while orders flow; a reload shows the refused build's reason;
/// three malformed orders show as one group under their reason, replayed they come back
/// rejected with the same reason, then are archived; the pipeline is paused and resumed from
/// the page; two dead letters whose cause (a constraint) is then fixed are replayed from the
/// page and applied once. Each view is written to `target/console/`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_a_browser() {
    let mut scene = Scene::start().await;
    let publisher = scene.orders_flow();
    scene.sign_in_and_watch().await;
    scene.a_refused_reload().await;
    let connection = publisher.await.expect("publisher");
    let _ = connection.close(200, "done".into()).await;
    scene.dead_letters_in_groups().await;
    scene.replayed_while_malformed().await;
    scene.archived().await;
    scene.paused_and_resumed().await;
    scene.fixed_and_replayed().await;
    scene.finish().await;
}

/// A host serving `loyalty` (its plugin file in a directory of the test's own, a `CHECK` that
/// refuses big credits) and `chaos`, behind an admin token, and a browser on its console.
struct Scene {
    env: TestEnv,
    host: idem_e2e::Host,
    browser: Option<Browser>,
    directory: std::path::PathBuf,
    slot: std::path::PathBuf,
    digest: String,
    chaos_queue: String,
    chaos_dead_letters: String,
    port: u16,
    url: String,
}

const CONSOLE_TOKEN: &str = "console-token-0123456789abcdef0123";

impl Scene {
    async fn start() -> Scene {
        let env = TestEnv::new("console_browser").await;
        sqlx::query("ALTER TABLE point_ledger ADD CONSTRAINT small_credits CHECK (points < 100)")
            .execute(&env.pool)
            .await
            .expect("add constraint");
        let directory = std::env::temp_dir().join(format!("{}-console", env.database));
        std::fs::create_dir_all(&directory).expect("plugin directory");
        let slot = directory.join("loyalty.wasm");
        std::fs::copy(plugin_path("loyalty"), &slot).expect("copy plugin");
        let digest = {
            use sha2::Digest;
            format!(
                "sha256:{:x}",
                sha2::Sha256::digest(std::fs::read(&slot).expect("plugin"))
            )
        };
        let (chaos_queue, chaos_dead_letters) = env.extra_queues("chaos").await;
        let port = free_port();
        let text = format!(
            "{}{}{}\n[http]\nlisten = \"127.0.0.1:{port}\"\nadmin_token = \"{CONSOLE_TOKEN}\"\n",
            env.config_header(),
            pipeline_table(
                "loyalty",
                &env.queue,
                &env.dead_letter_queue,
                &slot,
                "watch = false"
            ),
            pipeline_table(
                "chaos",
                &chaos_queue,
                &chaos_dead_letters,
                &plugin_path("chaos"),
                "max_attempts = 1"
            ),
        );
        let config = Config::from_toml(&directory.join("pipelines.toml"), &text).expect("config");
        let host = env.start_host(config);
        wait_for("the HTTP endpoint", Duration::from_secs(30), || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await;
        Scene {
            env,
            host,
            browser: None,
            directory,
            slot,
            digest,
            chaos_queue,
            chaos_dead_letters,
            port,
            url: format!("http://127.0.0.1:{port}/"),
        }
    }

    fn browser(&mut self) -> &mut Browser {
        self.browser.as_mut().expect("the browser is open")
    }

    /// 600 orders, one every 25 ms, while the page watches; the connection, when done.
    fn orders_flow(&self) -> tokio::task::JoinHandle<lapin::Connection> {
        let queue = self.env.queue.clone();
        tokio::spawn(async move {
            let (connection, channel) = connect_channel().await;
            for order_id in 1..=600 {
                publish(&channel, &queue, &order(order_id, order_id % 7, 1_000)).await;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            connection
        })
    }

    /// The page loads fast, asks for the token once, shows both pipelines consuming with their
    /// digests and the chart moving; opened again, it draws the host's last minutes at once;
    /// it fetches nothing from anywhere else.
    async fn sign_in_and_watch(&mut self) {
        let url = self.url.clone();
        self.browser = Some(Browser::start().await);
        let browser = self.browser();
        let load_ms = browser.goto(&url).await;
        eprintln!("console: page loaded in {load_ms} ms");
        assert!(load_ms < 3_000, "the page took {load_ms} ms to load");
        browser
            .wait("document.querySelector('#token-dialog').open", 10)
            .await;
        browser.screenshot("token").await;
        browser.fill("#token-input", CONSOLE_TOKEN).await;
        browser.click("#token-ok").await;
        browser
            .wait(
                "[...document.querySelectorAll('#pipeline-table tbody tr')].map(row => row.dataset.state).join() === 'consuming,consuming'",
                30,
            )
            .await;
        let digests = browser
            .eval("Object.fromEntries([...document.querySelectorAll('#pipeline-table tbody tr')].map(row => [row.dataset.pipeline, row.querySelector('.digest').textContent]))")
            .await;
        let digest = self.digest.clone();
        assert_eq!(digests["loyalty"], &digest[..19], "{digests}");
        assert!(
            digests["chaos"]
                .as_str()
                .is_some_and(|shown| shown.starts_with("sha256:")),
            "{digests}"
        );
        let browser = self.browser();
        let rate = browser
            .wait(
                "Number(document.querySelector('canvas[data-pipeline=\"loyalty\"]').dataset.applied) > 0 && document.querySelector('canvas[data-pipeline=\"loyalty\"]').dataset.applied",
                30,
            )
            .await;
        eprintln!("console: applied rate on the chart {rate}/s");
        browser
            .wait(
                "Number(document.querySelector('canvas[data-pipeline=\"loyalty\"]').dataset.samples) >= 6",
                30,
            )
            .await;
        browser
            .wait(
                "document.querySelector('tr[data-pipeline=\"loyalty\"] td.depth').textContent.includes('dead letters')",
                30,
            )
            .await;
        browser.screenshot("pipelines").await;
        browser.goto(&url).await;
        let seeded = browser
            .wait(
                "Number(document.querySelector('canvas[data-pipeline=\"loyalty\"]')?.dataset.samples) >= 3 && document.querySelector('canvas[data-pipeline=\"loyalty\"]').dataset.samples",
                5,
            )
            .await;
        eprintln!("console: {seeded} samples drawn right after loading");
        let foreign: Vec<String> = browser
            .requests()
            .await
            .into_iter()
            .filter(|requested| !requested.starts_with(&url))
            .collect();
        assert!(foreign.is_empty(), "the page fetched {foreign:?}");
    }

    /// A reload, with the token the page was given: it shows why the build is refused.
    async fn a_refused_reload(&mut self) {
        std::fs::write(&self.slot, b"\0asm this is not a component").expect("break the plugin");
        let browser = self.browser();
        browser
            .click("tr[data-pipeline=\"loyalty\"] button.reload")
            .await;
        let refused = browser
            .wait(
                "document.querySelector('#notice').textContent.includes('reload refused') && document.querySelector('#notice').textContent",
                15,
            )
            .await;
        assert!(
            refused
                .as_str()
                .is_some_and(|text| text.contains("not a valid")),
            "{refused}"
        );
        browser
            .wait(
                "document.querySelector('tr[data-pipeline=\"loyalty\"] .error')?.textContent.includes('last reload refused')",
                10,
            )
            .await;
        browser.screenshot("hot-swap").await;
    }

    /// Three malformed orders show as one group under their reason, one of them whole; two
    /// credits too big for the constraint wait on `chaos`.
    async fn dead_letters_in_groups(&mut self) {
        for order_id in [9001, 9002, 9003] {
            self.env.publish(&order(order_id, 1, -5)).await;
        }
        for order_id in [900_001, 900_002] {
            let credit = format!(
                r#"{{"key": "order:{order_id}", "effects": [{{"statement": "record_ledger", "params": [1, {order_id}, 500]}}]}}"#
            );
            publish(&self.env.channel, &self.chaos_queue, credit.as_bytes()).await;
        }
        let (env, chaos_dead_letters) = (&self.env, &self.chaos_dead_letters);
        wait_for("five dead letters", Duration::from_secs(60), || async {
            env.ready(&env.dead_letter_queue).await == 3 && env.ready(chaos_dead_letters).await == 2
        })
        .await;
        let browser = self.browser();
        browser.click("a[data-view=\"dead-letters\"]").await;
        browser.eval(&choose("loyalty")).await;
        browser.wait(&group_of(3, "must not be negative"), 30).await;
        browser.screenshot("dead-letters").await;
        browser.click("#dl-letters tbody tr td:nth-child(5)").await;
        browser
            .wait(
                "!document.querySelector('#dl-detail').hidden && document.querySelector('#dl-detail-body').textContent.includes('-5')",
                15,
            )
            .await;
        browser.screenshot("dead-letter").await;
    }

    /// Replayed while still malformed: back under the same reason, once more replayed.
    async fn replayed_while_malformed(&mut self) {
        let question = replay_the_group(self.browser(), 3).await;
        assert!(
            question.contains("Replay 3 message(s)")
                && question.contains(&format!("to {}", self.env.queue)),
            "{question}"
        );
        let port = self.port;
        let bearer = format!("Bearer {CONSOLE_TOKEN}");
        wait_for(
            "the three back, rejected again",
            Duration::from_secs(60),
            || async {
                let (_, body) = http_send(
                    port,
                    "POST",
                    "/admin/dead-letters/loyalty/list",
                    &[("Authorization", bearer.as_str())],
                    Some("{}"),
                )
                .await;
                let listed: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                listed["letters"].as_array().is_some_and(|letters| {
                    letters.len() == 3
                        && letters.iter().all(|letter| {
                            letter["replays"] == 1
                                && letter["reason"]
                                    .as_str()
                                    .is_some_and(|reason| reason.contains("must not be negative"))
                        })
                })
            },
        )
        .await;
    }

    /// Never to be replayed: archived from the page, whole, then gone from the queue.
    async fn archived(&mut self) {
        let browser = self.browser();
        browser.eval(&choose("loyalty")).await;
        browser.wait(&group_of(3, "must not be negative"), 30).await;
        let question = act_on_the_group(browser, "archive", "Archived", 3).await;
        assert!(question.contains("idem_dead_letters"), "{question}");
        assert_eq!(self.env.ready(&self.env.dead_letter_queue).await, 0);
        assert_eq!(
            self.env
                .count("SELECT count(*) FROM idem_dead_letters WHERE pipeline = 'loyalty' AND convert_from(body, 'UTF8') LIKE '%-5%'")
                .await,
            3
        );
    }

    /// Paused from the page on this host, with a reason it then shows; resumed.
    async fn paused_and_resumed(&mut self) {
        let browser = self.browser();
        browser.click("a[data-view=\"pipelines\"]").await;
        browser
            .click("tr[data-pipeline=\"loyalty\"] button.pause")
            .await;
        browser
            .wait("document.querySelector('#pause-dialog').open", 10)
            .await;
        browser.fill("#pause-reason", "checking the ledger").await;
        browser.screenshot("pause").await;
        browser.click("#pause-ok").await;
        browser
            .wait(
                "document.querySelector('tr[data-pipeline=\"loyalty\"]')?.dataset.state === 'paused-by-operator' && document.querySelector('tr[data-pipeline=\"loyalty\"]').textContent.includes('checking the ledger')",
                15,
            )
            .await;
        browser
            .click("tr[data-pipeline=\"loyalty\"] button.resume")
            .await;
        browser
            .wait("document.querySelector('#confirm').open", 10)
            .await;
        browser.click("#confirm-ok").await;
        browser
            .wait(
                "document.querySelector('tr[data-pipeline=\"loyalty\"]')?.dataset.state === 'consuming'",
                30,
            )
            .await;
    }

    /// The constraint fixed, the two credits replayed from the page: applied once.
    async fn fixed_and_replayed(&mut self) {
        self.browser().click("a[data-view=\"dead-letters\"]").await;
        sqlx::query("ALTER TABLE point_ledger DROP CONSTRAINT small_credits")
            .execute(&self.env.pool)
            .await
            .expect("drop constraint");
        let browser = self.browser();
        browser.eval(&choose("chaos")).await;
        browser.wait(&group_of(2, "small_credits"), 30).await;
        replay_the_group(browser, 2).await;
        let env = &self.env;
        wait_for("the two applied", Duration::from_secs(30), || async {
            env.count("SELECT count(*) FROM point_ledger WHERE order_id > 900000")
                .await
                == 2
        })
        .await;
        assert_eq!(self.env.ready(&self.chaos_dead_letters).await, 0);
    }

    /// The outbox view; no script error on any page; every order applied once.
    async fn finish(mut self) {
        let browser = self.browser();
        browser.click("a[data-view=\"outbox\"]").await;
        browser
            .wait(
                "document.querySelector('#outbox-summary').textContent.includes('pending')",
                15,
            )
            .await;
        browser.screenshot("outbox").await;
        // The refused actions (401, then 422) are logged by Chromium as failed loads; anything
        // else is a script error.
        let errors: Vec<String> = browser
            .errors()
            .await
            .into_iter()
            .filter(|error| !error.starts_with("Failed to load resource"))
            .collect();
        assert!(errors.is_empty(), "script errors: {errors:?}");
        if let Some(browser) = self.browser.take() {
            browser.close().await;
        }
        self.host.stop().await.expect("host stops");
        assert_eq!(
            self.env
                .count("SELECT count(DISTINCT order_id) FROM point_ledger WHERE order_id <= 600")
                .await,
            600
        );
        let _ = std::fs::remove_dir_all(&self.directory);
        self.env.cleanup().await;
    }
}

/// Chooses `pipeline` in the dead-letter view's select.
fn choose(pipeline: &str) -> String {
    format!(
        "(() => {{ const select = document.querySelector('#dl-pipeline'); select.value = {}; select.dispatchEvent(new Event('change')); return true; }})()",
        js(pipeline)
    )
}

/// Whether the dead-letter view shows a group of `count` under a reason holding `reason`.
fn group_of(count: u32, reason: &str) -> String {
    format!(
        "[...document.querySelectorAll('#dl-groups tbody tr')].some(row => row.children[0].textContent === '{count}' && row.children[2].textContent.includes({}))",
        js(reason)
    )
}

/// Another site's page against a host without an admin token (the worst case), in Chromium:
/// an `<img>` at the dead-letter reads, forms posting a reload and a replay, `fetch`es of the
/// status and of a replay. Then a page whose name was rebound to the host's address (DNS
/// rebinding: same origin as far as the browser knows) reads and replays with plain
/// same-origin requests. The host answers neither: nothing is reloaded or replayed, the page
/// reads nothing, and no dead letter was even taken and given back (the broker redelivered
/// none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_pages_read_and_change_nothing() {
    let env = TestEnv::new("console_hostile").await;
    let port = free_port();
    let text = format!(
        "{}\n[http]\nlisten = \"127.0.0.1:{port}\"\n",
        env.config_text("chaos", "max_attempts = 1")
    );
    let config =
        Config::from_toml(Path::new("/tmp/idem-console-hostile.toml"), &text).expect("config");
    let host = env.start_host(config);
    for _ in 0..3 {
        env.publish(br#"{"action": "invalid"}"#).await;
    }
    wait_for("three dead letters", Duration::from_secs(60), || async {
        env.ready(&env.dead_letter_queue).await == 3
    })
    .await;
    let host_url = format!("http://127.0.0.1:{port}");
    // Each attempt's outcome as the page sees it: a status it could read, "opaque" (sent, the
    // answer unreadable) or "blocked" (the browser refused to send or to show it).
    let attempts = r#"
window.results = {};
async function attempt(name, request) {
  try { const response = await request; window.results[name] = response.type === "opaque" ? "opaque" : String(response.status); }
  catch { window.results[name] = "blocked"; }
}
const json = (body) => ({ method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
const plain = (body) => ({ method: "POST", mode: "no-cors", headers: { "Content-Type": "text/plain" }, body: JSON.stringify(body) });
"#;
    let cross_site = format!(
        r#"<!doctype html><title>another site</title>
<iframe name="one"></iframe><iframe name="two"></iframe>
<img src="{host_url}/admin/dead-letters/loyalty/list"><img src="{host_url}/admin/dead-letters/loyalty">
<form id="reload" method="POST" action="{host_url}/admin/reload/loyalty" target="one"></form>
<form id="replay" method="POST" action="{host_url}/admin/dead-letters/loyalty/replay" enctype="text/plain" target="two"><input name='{{"kind": "invalid-input", "x": "' value='"}}'></form>
<script>{attempts}
(async () => {{
  document.getElementById("reload").submit();
  document.getElementById("replay").submit();
  await attempt("status", fetch("{host_url}/admin/status"));
  await attempt("list", fetch("{host_url}/admin/dead-letters/loyalty/list", plain({{}})));
  await attempt("replay", fetch("{host_url}/admin/dead-letters/loyalty/replay", plain({{ kind: "invalid-input" }})));
  await attempt("replay-json", fetch("{host_url}/admin/dead-letters/loyalty/replay", json({{ kind: "invalid-input" }})));
  window.done = true;
}})();
</script>"#
    );
    let rebound = format!(
        r#"<!doctype html><title>rebound</title>
<script>{attempts}
(async () => {{
  await attempt("status", fetch("/admin/status"));
  await attempt("list", fetch("/admin/dead-letters/loyalty/list", json({{}})));
  await attempt("reload", fetch("/admin/reload/loyalty", {{ method: "POST" }}));
  await attempt("replay", fetch("/admin/dead-letters/loyalty/replay", json({{ kind: "invalid-input" }})));
  window.done = true;
}})();
</script>"#
    );
    let mut browser = Browser::start().await;
    let hostile_url = "http://hostile.idem-test/";
    browser.serve(hostile_url, &cross_site).await;
    browser.goto(hostile_url).await;
    let seen = browser.wait("window.done && window.results", 20).await;
    eprintln!("console: another site's page saw {seen}");
    assert_eq!(seen["status"], "blocked", "{seen}");
    for readable in ["list", "replay", "replay-json"] {
        assert!(
            matches!(seen[readable].as_str(), Some("opaque" | "blocked")),
            "another site's page read the answer to {readable}: {seen}"
        );
    }
    let rebound_url = format!("http://rebound.idem-test:{port}/");
    browser.serve(&rebound_url, &rebound).await;
    browser.goto(&rebound_url).await;
    let seen = browser.wait("window.done && window.results", 20).await;
    eprintln!("console: a rebound page saw {seen}");
    for request in ["status", "list", "reload", "replay"] {
        assert_eq!(seen[request], "421", "{request}: {seen}");
    }
    // The forms had time to land.
    tokio::time::sleep(Duration::from_secs(1)).await;
    browser.close().await;

    let (status, body) = get(port, "/admin/status").await;
    assert_eq!(status, 200, "{body}");
    let pipelines: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert!(
        pipelines["pipelines"][0]["last_reload_at"].is_null(),
        "a reload was attempted: {pipelines}"
    );
    assert_eq!(
        env.ready(&env.dead_letter_queue).await,
        3,
        "a dead letter moved"
    );
    for _ in 0..3 {
        let got = env
            .channel
            .basic_get(
                env.dead_letter_queue.as_str().into(),
                lapin::options::BasicGetOptions { no_ack: true },
            )
            .await
            .expect("basic.get")
            .expect("a dead letter");
        assert!(
            !got.delivery.redelivered,
            "a dead letter was taken and given back"
        );
        let replayed = got
            .delivery
            .properties
            .headers()
            .as_ref()
            .is_some_and(|headers| headers.inner().contains_key("x-idem-replays"));
        assert!(!replayed, "a dead letter was replayed");
    }
    host.stop().await.expect("host stops");
    env.cleanup().await;
}
