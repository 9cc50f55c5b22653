// A browser for tests/e2e/console.rs: Debian's Chromium driven by playwright-core (no
// browser download). The Rust test keeps the scenario and the assertions; this reads one JSON
// command per line on stdin and answers each with one JSON line on stdout:
//
//   {"goto": url}                        -> {"ok": true, "ms": load time}
//   {"click": selector}                  -> {"ok": true}
//   {"fill": selector, "value": text}    -> {"ok": true}
//   {"wait": js expression, "timeout": ms} -> {"ok": true, "value": …} once it is truthy
//   {"eval": js expression}              -> {"ok": true, "value": …}
//   {"screenshot": path}                 -> {"ok": true}
//   {"requests": true}                   -> {"ok": true, "value": [every URL the page fetched]}
//   {"serve": url, "html": text}         -> {"ok": true}; a later goto(url) gets this page
//                                           without asking the network (another site's page)
//
// Every name under .idem-test resolves to 127.0.0.1: a page "on another site" or "rebound to
// this address" whose requests reach the host under test. The browser's own guard for requests
// from public pages to local addresses (Local/Private Network Access) is off, as in a browser
// that lacks it: the tests check the host's defences, not Chromium's.
//
// A failure answers {"ok": false, "error": …}. Page errors are kept and returned by
// {"errors": true}. The browser closes when stdin ends.
import { createInterface } from "node:readline";
import { chromium } from "playwright-core";

const executablePath = process.env.CHROMIUM ?? "/usr/bin/chromium";
const browser = await chromium.launch({
  executablePath,
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--host-resolver-rules=MAP *.idem-test 127.0.0.1",
    "--disable-features=LocalNetworkAccessChecks,BlockInsecurePrivateNetworkRequests,PrivateNetworkAccessSendPreflights"],
});
const context = await browser.newContext({ viewport: { width: 1400, height: 900 } });
const page = await context.newPage();
const errors = [];
const requests = [];
page.on("pageerror", (error) => errors.push(String(error)));
page.on("console", (message) => { if (message.type() === "error") errors.push(message.text()); });
page.on("request", (request) => requests.push(request.url()));

async function run(command) {
  if (command.goto) {
    const started = Date.now();
    await page.goto(command.goto, { waitUntil: "load" });
    return { ms: Date.now() - started };
  }
  if (command.click) return void await page.click(command.click, { timeout: command.timeout ?? 10000 });
  if (command.fill) return void await page.fill(command.fill, command.value, { timeout: command.timeout ?? 10000 });
  if (command.wait) {
    // Polled with evaluate (the debugger's own evaluation): waitForFunction evaluates a string
    // inside the page, which the console's Content-Security-Policy rightly forbids.
    const deadline = Date.now() + (command.timeout ?? 15000);
    let value;
    while (!(value = await page.evaluate(command.wait))) {
      if (Date.now() > deadline) throw new Error(`still false after ${command.timeout ?? 15000} ms: ${command.wait}`);
      await new Promise((resolve) => setTimeout(resolve, 200));
    }
    return { value };
  }
  if (command.eval) return { value: await page.evaluate(command.eval) };
  if (command.screenshot) return void await page.screenshot({ path: command.screenshot, fullPage: true });
  if (command.requests) return { value: requests };
  if (command.serve) {
    const html = command.html;
    return void await context.route(command.serve, (route) => route.fulfill({ status: 200, contentType: "text/html", body: html }));
  }
  if (command.errors) return { value: errors };
  throw new Error(`unknown command ${JSON.stringify(command)}`);
}

const lines = createInterface({ input: process.stdin });
for await (const line of lines) {
  if (!line.trim()) continue;
  let answer;
  try {
    answer = { ok: true, ...(await run(JSON.parse(line)) ?? {}) };
  } catch (error) {
    answer = { ok: false, error: String(error) };
  }
  process.stdout.write(`${JSON.stringify(answer)}\n`);
}
await browser.close();
