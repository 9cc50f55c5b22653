//! A headless Chromium for the console tests: `tests/console/driver.mjs` (playwright-core on
//! Debian's `/usr/bin/chromium`; `scripts/test.sh` installs both) run by node, one JSON command
//! per line. The scenario and the assertions stay in Rust.

use std::io::{BufRead, BufReader, Lines, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use serde_json::{Value, json};

/// The driver's process. Its answers are awaited with `block_in_place`: the host under test
/// runs on the same (multi-threaded) runtime and keeps the other worker.
pub struct Browser {
    child: Child,
    /// `None` once closed.
    input: Option<ChildStdin>,
    output: Lines<BufReader<ChildStdout>>,
}

/// Where the console tests write their screenshots (`target/console/`), which docs/operations.md's
/// images in `docs/console/` are copied from.
pub fn screenshot_dir() -> PathBuf {
    let directory = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
        .join("console");
    std::fs::create_dir_all(&directory).expect("screenshot directory");
    directory
}

impl Browser {
    /// Starts Chromium through the driver.
    pub async fn start() -> Browser {
        let driver = Path::new(env!("CARGO_MANIFEST_DIR")).join("console/driver.mjs");
        let mut child = Command::new("node")
            .arg(&driver)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("node runs tests/console/driver.mjs (scripts/test.sh installs its packages)");
        let input = child.stdin.take().expect("driver stdin");
        let output = BufReader::new(child.stdout.take().expect("driver stdout")).lines();
        Browser {
            child,
            input: Some(input),
            output,
        }
    }

    /// Sends `command`; the driver's answer, or a panic with its error.
    pub async fn send(&mut self, command: Value) -> Value {
        let line = format!("{command}\n");
        let answer = tokio::task::block_in_place(|| {
            let input = self.input.as_mut().expect("the browser is open");
            input
                .write_all(line.as_bytes())
                .and_then(|()| input.flush())
                .expect("send to the driver");
            self.output
                .next()
                .unwrap_or_else(|| panic!("the browser driver ended at {command}"))
                .expect("read the driver")
        });
        let answer: Value = serde_json::from_str(&answer).expect("a JSON answer");
        assert_eq!(answer["ok"], true, "{command}: {answer}");
        answer
    }

    /// Makes a later [`Browser::goto`] to `url` load `html`, as if another site served it;
    /// the page's own requests go to the network (`*.idem-test` names are 127.0.0.1).
    pub async fn serve(&mut self, url: &str, html: &str) {
        self.send(json!({ "serve": url, "html": html })).await;
    }

    /// Loads `url`; milliseconds to the page's load event.
    pub async fn goto(&mut self, url: &str) -> u64 {
        self.send(json!({ "goto": url })).await["ms"]
            .as_u64()
            .unwrap_or(0)
    }

    pub async fn click(&mut self, selector: &str) {
        self.send(json!({ "click": selector })).await;
    }

    pub async fn fill(&mut self, selector: &str, value: &str) {
        self.send(json!({ "fill": selector, "value": value })).await;
    }

    /// Waits until the JavaScript `expression` is truthy (at most `seconds`); its value.
    pub async fn wait(&mut self, expression: &str, seconds: u64) -> Value {
        self.send(json!({ "wait": expression, "timeout": seconds * 1000 }))
            .await["value"]
            .clone()
    }

    /// The value of the JavaScript `expression`.
    pub async fn eval(&mut self, expression: &str) -> Value {
        self.send(json!({ "eval": expression })).await["value"].clone()
    }

    /// Writes the whole page to `<screenshot_dir>/<name>.png`.
    pub async fn screenshot(&mut self, name: &str) -> PathBuf {
        let path = screenshot_dir().join(format!("{name}.png"));
        self.send(json!({ "screenshot": path })).await;
        path
    }

    /// Every URL the page requested so far.
    pub async fn requests(&mut self) -> Vec<String> {
        serde_json::from_value(self.send(json!({ "requests": true })).await["value"].clone())
            .expect("a list of URLs")
    }

    /// The page's script errors so far.
    pub async fn errors(&mut self) -> Vec<String> {
        serde_json::from_value(self.send(json!({ "errors": true })).await["value"].clone())
            .expect("a list of errors")
    }

    /// Closes the browser.
    pub async fn close(mut self) {
        self.input = None;
        let _ = tokio::task::block_in_place(|| self.child.wait());
    }
}

impl Drop for Browser {
    /// A test that failed half-way leaves no browser behind.
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}
