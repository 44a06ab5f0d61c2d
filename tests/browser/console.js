// Drives Debian's chromium through the web console as an operator would, for
// tests/it/console_browser.rs: sign in, watch a subscription's dead letters appear while
// its consumer rejects events, requeue them by filter, watch them delivered and the
// counts fall to zero, look an event up by id. Saves screenshots along the way and
// prints one JSON line per step.
//
// Environment: CONSOLE_URL, CONSOLE_TOKEN, SUBSCRIPTION, EVENT_TYPE (the filter),
// EXPECTED_DEAD (dead letters to wait for), EVENT_ID (to look up), SCREENSHOTS (a
// directory), CHROMIUM (default /usr/bin/chromium).
"use strict";

const fs = require("fs");
const os = require("os");
const path = require("path");
const { chromium } = require("playwright-core");

function required(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} must be set`);
  return value;
}

const base = required("CONSOLE_URL");
const token = required("CONSOLE_TOKEN");
const subscription = required("SUBSCRIPTION");
const eventType = required("EVENT_TYPE");
const expectedDead = Number(required("EXPECTED_DEAD"));
const eventId = required("EVENT_ID");
const screenshots = required("SCREENSHOTS");
const executablePath = process.env.CHROMIUM || "/usr/bin/chromium";
// Generous: the machine running the tests may be busy.
const WAIT = 90_000;
let lastPage = null;

function step(name, details = {}) {
  console.log(JSON.stringify({ step: name, ...details }));
}

/// The exact value of a figure the console renders as <data data-stat=...>.
async function figure(page, stat) {
  return page.$eval(`[data-stat="${subscription}.${stat}"]`, (element) => Number(element.value));
}

/// Waits, without reloading, until the page's own refresh shows `stat` at least (`atLeast`)
/// or exactly `target`.
async function watch(page, stat, atLeast, target, description) {
  await page
    .waitForFunction(
      ([selector, atLeast, target]) => {
        const element = document.querySelector(selector);
        if (element === null) return false;
        const value = Number(element.value);
        return atLeast ? value >= target : value === target;
      },
      [`[data-stat="${subscription}.${stat}"]`, atLeast, target],
      { timeout: WAIT, polling: 250 }
    )
    .catch(async (error) => {
      const seen = await figure(page, stat).catch(() => "nothing");
      throw new Error(`${description}: ${error.message}; last seen ${seen}`);
    });
}

async function main() {
  const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), "outbox-console-chromium-"));
  const context = await chromium.launchPersistentContext(userDataDir, {
    executablePath,
    headless: true,
    args: [
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
    viewport: { width: 1360, height: 900 },
    deviceScaleFactor: 1,
    locale: "en-GB",
    timezoneId: "Europe/Berlin",
  });
  const violations = [];
  try {
    const page = context.pages()[0] || (await context.newPage());
    page.setDefaultTimeout(WAIT);
    page.on("console", (message) => {
      if (message.type() === "error") violations.push(message.text());
    });
    page.on("pageerror", (error) => violations.push(String(error)));
    page.on("load", async () => {
      lastPage = await page.content().catch(() => null);
    });

    // Signing in: the console sends a stranger to the sign-in page first.
    await page.goto(`${base}/`);
    if (!page.url().includes("/sign-in")) throw new Error(`expected the sign-in page, got ${page.url()}`);
    const tokenField = page.getByLabel("Token");
    await tokenField.fill(token);
    await Promise.all([page.waitForURL(`${base}/`), tokenField.press("Enter")]);
    await page.keyboard.press("Tab");
    const firstFocus = await page.evaluate(() => document.activeElement.textContent.trim());
    if (firstFocus !== "Skip to content") throw new Error(`the first Tab stop is ${JSON.stringify(firstFocus)}`);
    step("signed in");

    // The overview refreshes by itself while the consumer rejects events.
    await watch(page, "dead_lettered", true, expectedDead, "dead letters did not appear on the overview");
    const shownTime = await page.$eval("time[data-relative]", (element) => element.getAttribute("data-ago"));
    if (!/ago|just now/.test(shownTime || "")) throw new Error(`times are not shown relative: ${shownTime}`);
    // One status per subscription, in the words of GetStats and the CLI.
    await page.waitForFunction(
      (name) => {
        const badge = document.querySelector(`tr[data-subscription="${name}"] [data-status]`);
        return badge !== null && badge.getAttribute("data-status") === "dead letters";
      },
      subscription,
      { timeout: WAIT, polling: 250 }
    );
    const firstRow = await page.$eval("tr[data-subscription]", (row) => row.getAttribute("data-subscription"));
    if (firstRow !== subscription) throw new Error(`${firstRow} is listed above ${subscription}, which has dead letters`);
    step("dead letters appeared", { dead_lettered: await figure(page, "dead_lettered") });
    await page.evaluate(() => document.activeElement && document.activeElement.blur());
    await page.screenshot({ path: path.join(screenshots, "console-overview.png"), fullPage: true });

    await Promise.all([
      page.waitForURL(`${base}/subscriptions/${subscription}`),
      page.getByRole("link", { name: subscription, exact: true }).click(),
    ]);
    await page.getByRole("heading", { name: "Dead letters by error" }).waitFor();
    await page.screenshot({ path: path.join(screenshots, "console-subscription.png"), fullPage: true });
    step("subscription page");

    // Requeue every dead letter of the event type: filter, see the count, confirm.
    await page.getByLabel("Event type").fill(eventType);
    await Promise.all([
      page.waitForURL(/event_type=/),
      page.getByRole("button", { name: "Filter", exact: true }).click(),
    ]);
    const matching = await page.$eval("#matching", (element) => Number(element.value));
    if (matching !== expectedDead) throw new Error(`${matching} dead letters match the filter, expected ${expectedDead}`);
    await Promise.all([
      page.waitForURL(/dead-letters$/),
      page.getByRole("button", { name: `Requeue all ${expectedDead} matching` }).click(),
    ]);
    const confirmCount = await page.$eval("#confirm-count", (element) => Number(element.value));
    if (confirmCount !== expectedDead) throw new Error(`the confirmation names ${confirmCount}`);
    await Promise.all([
      page.waitForURL(new RegExp(`/subscriptions/${subscription}\\?`)),
      page.getByRole("button", { name: `Requeue ${expectedDead} dead letters` }).click(),
    ]);
    const notice = page.getByText(`Requeued ${expectedDead} dead letters of ${subscription}.`);
    await notice.waitFor();
    // The page opens at the dead letters the operator acted on; the result shows there too.
    const noticeShown = await notice.evaluate((element) => {
      const box = element.getBoundingClientRect();
      return box.top >= 0 && box.bottom <= window.innerHeight;
    });
    if (!noticeShown) throw new Error("the requeue's result is off screen where the page opened");
    step("requeued by filter", { requeued: confirmCount });

    // The consumer takes them this time: the figures fall to zero by themselves.
    await watch(page, "dead_lettered", false, 0, "dead letters did not fall to zero");
    await watch(page, "lag_events", false, 0, "the lag did not fall to zero");
    step("delivered", { dead_lettered: 0, lag_events: 0 });

    // Look an event up by id from the header's search field.
    await page.locator("#lookup-id").fill(eventId);
    await Promise.all([page.waitForURL(`${base}/events/${eventId}`), page.locator("#lookup-id").press("Enter")]);
    const state = await page
      .locator(`tr[data-subscription="${subscription}"] [data-state]`)
      .getAttribute("data-state");
    if (state !== "acked") throw new Error(`the event is ${state} on ${subscription}`);
    await page.getByRole("heading", { name: "Payload" }).waitFor();
    await page.screenshot({ path: path.join(screenshots, "console-event.png"), fullPage: true });
    step("event looked up", { state });

    // At phone width nothing spills sideways: wide tables scroll inside their box.
    await page.setViewportSize({ width: 390, height: 844 });
    for (const target of ["/", `/subscriptions/${subscription}`, `/events/${eventId}`]) {
      await page.goto(`${base}${target}`);
      const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
      if (overflow > 1) throw new Error(`${target} is ${overflow} px wider than a phone`);
    }
    // The per-event Requeue stays on screen, not past the right edge of a wide table.
    await page.goto(`${base}/events/${eventId}`);
    const requeue = page.locator(`tr[data-subscription="${subscription}"] button`, { hasText: "Requeue" });
    await requeue.scrollIntoViewIfNeeded();
    const box = await requeue.boundingBox();
    const width = await page.evaluate(() => window.innerWidth);
    if (box === null || box.x < 0 || box.x + box.width > width) {
      throw new Error(`Requeue is off screen at phone width: ${JSON.stringify(box)} in ${width} px`);
    }
    await page.goto(`${base}/`);
    await page.screenshot({ path: path.join(screenshots, "console-phone.png"), fullPage: true });
    step("phone width");

    if (violations.length > 0) throw new Error(`the pages reported errors: ${violations.join("; ")}`);
  } finally {
    await context.close();
    fs.rmSync(userDataDir, { recursive: true, force: true });
  }
}

main().catch((error) => {
  if (lastPage) console.error(`last page: ${lastPage}`);
  console.error(error.stack || String(error));
  process.exit(1);
});
