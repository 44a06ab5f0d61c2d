// What the tests share: live gateway processes started from OUTBOX_GATEWAY_BIN on the
// database OUTBOX_TEST_DATABASE_URL, each on a free port, and polling with a deadline.
import { spawn } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { createServer } from 'node:net';
import { createServiceClient, status } from '@outbox-gateway/client';

/** Reads a required environment variable; the tests cannot run without it. */
function required(name, what) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} must name ${what} (tests/it/clients/node.rs sets it)`);
  return value;
}

export const gatewayBinary = () => required('OUTBOX_GATEWAY_BIN', 'the outbox-gateway binary');
export const databaseUrl = () => required('OUTBOX_TEST_DATABASE_URL', 'a PostgreSQL database for the tests');

/** Generous bounds for a loaded two-core machine. */
export const WAIT_MS = 90_000;

/** A port nothing listens on right now. */
export function freePort() {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/** A name no other test uses, valid for subscriptions and aggregate types. */
export function unique(prefix) {
  return `${prefix}-${randomUUID().slice(0, 8)}`;
}

/**
 * Polls `check` every 50 ms until it returns a truthy value, and returns that value;
 * fails naming `what` when `timeoutMs` passes first, or at once when `check` throws an
 * error marked `fatal`.
 */
export async function eventually(what, check, timeoutMs = WAIT_MS) {
  const deadline = Date.now() + timeoutMs;
  let last;
  for (;;) {
    try {
      const value = await check();
      if (value) return value;
    } catch (error) {
      if (error.fatal) throw error;
      last = error;
    }
    if (Date.now() > deadline) {
      throw new Error(`timed out after ${timeoutMs} ms waiting until ${what}${last ? `: ${last}` : ''}`);
    }
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

/** Calls unary RPC `method` of a raw client. */
export function call(client, method, request) {
  return new Promise((resolve, reject) =>
    client[method](request, { deadline: Date.now() + 10_000 }, (error, response) =>
      error ? reject(error) : resolve(response),
    ),
  );
}

/** The environment without RUST_LOG, so the gateway logs at its default level. */
function withoutRustLog() {
  const env = { ...process.env };
  delete env.RUST_LOG;
  return env;
}

/** A gateway process serving the test database on a port of its own. */
export class Gateway {
  #child;
  #log = [];

  constructor(port) {
    this.port = port;
    this.endpoint = `http://127.0.0.1:${port}`;
    this.admin = createServiceClient('Admin', this.endpoint);
  }

  /** Starts a gateway on a free port (or `port`) and waits until it answers. */
  static async start(port) {
    const gateway = new Gateway(port ?? (await freePort()));
    await gateway.#spawn();
    return gateway;
  }

  async #spawn() {
    const child = spawn(
      gatewayBinary(),
      [
        'serve',
        '--listen', `127.0.0.1:${this.port}`,
        '--database-url', databaseUrl(),
        '--metrics-listen', 'off',
        '--console-listen', 'off',
        '--shutdown-grace', '2s',
      ],
      { stdio: ['ignore', 'pipe', 'pipe'], env: withoutRustLog() },
    );
    for (const output of [child.stdout, child.stderr]) {
      output.setEncoding('utf8');
      output.on('data', (text) => this.#log.push(text));
    }
    const exited = new Promise((resolve) => child.once('exit', (code, signal) => resolve({ code, signal })));
    this.#child = { process: child, exited };
    let gone;
    exited.then((how) => (gone = how));
    // Serving once an admin call succeeds: listening, database reached, migrated.
    await eventually(`the gateway on port ${this.port} serves`, async () => {
      if (gone) {
        const error = new Error(`the gateway exited (${JSON.stringify(gone)}):\n${this.log()}`);
        throw Object.assign(error, { fatal: true });
      }
      await call(this.admin, 'ListSubscriptions', {});
      return true;
    });
  }

  /** What the process wrote so far, for failure messages. */
  log() {
    return this.#log.join('');
  }

  /** Kills the process with `signal` and waits until it is gone. */
  async kill(signal = 'SIGKILL') {
    const { process: child, exited } = this.#child;
    child.kill(signal);
    await exited;
  }

  /** Starts the gateway again on the same port. */
  async restart() {
    await this.#spawn();
  }

  /** Stops the process and closes the admin client. */
  async stop() {
    this.admin.close();
    if (this.#child.process.exitCode === null && this.#child.process.signalCode === null) {
      await this.kill('SIGTERM');
    }
  }

  /** Creates a subscription starting at the latest event, with `settings` over the defaults. */
  async createSubscription(settings) {
    return call(this.admin, 'CreateSubscription', { subscription: settings });
  }

  /** The subscription's figures (64-bit counts as numbers). */
  async stats(name) {
    const { subscriptions } = await call(this.admin, 'GetStats', { subscription: name });
    const figures = subscriptions[0];
    const number = (key) => Number(figures[key]);
    return {
      lagEvents: number('lagEvents'),
      inFlight: number('inFlight'),
      awaitingRetry: number('awaitingRetry'),
      deliveredTotal: number('deliveredTotal'),
      ackedTotal: number('ackedTotal'),
      deadLettered: number('deadLettered'),
      consumptionRecords: number('consumptionRecords'),
    };
  }
}

export { status };

/** Durations as the proto takes them. */
export const seconds = (s) => ({ seconds: String(Math.floor(s)), nanos: Math.round((s % 1) * 1e9) });

/** `count` events of aggregate type `aggregateType`, payload `{ n }`. */
export function events(aggregateType, count, extra = () => ({})) {
  return Array.from({ length: count }, (_, n) => ({
    aggregateType,
    aggregateId: `a-${n}`,
    eventType: 'test.happened',
    payload: { n },
    ...extra(n),
  }));
}
