// Subscriber.runExactlyOnce against a live gateway and PostgreSQL: each effect is
// recorded once through handler failures, a consumer crash between the effect and the
// commit, and requeues; the gateway settles every delivery without an ack.
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { join } from 'node:path';
import { test } from 'node:test';
import pg from 'pg';
import { Publisher, Subscriber } from '@outbox-gateway/client';
import { Gateway, call, databaseUrl, eventually, events, seconds, unique } from './helpers.mjs';

test('exactly once through failures, a crash before the commit and requeues', async (t) => {
  const gateway = await Gateway.start();
  t.after(() => gateway.stop());
  const pool = new pg.Pool({ connectionString: databaseUrl(), max: 4 });
  t.after(() => pool.end());
  const table = `effects`;
  await pool.query(`CREATE TABLE IF NOT EXISTS ${table} (event_id text, attempt int)`);

  const name = unique('node-once');
  await gateway.createSubscription({
    name,
    aggregateTypes: [name],
    retryBackoffMin: seconds(0.2),
    retryBackoffMax: seconds(1),
  });
  const publisher = new Publisher(gateway.endpoint);
  t.after(() => publisher.close());
  // Event 5 fails its first attempt in this process.
  const ids = await publisher.publish(events(name, 10, (n) => ({ payload: { n, fail: n === 5 } })));
  const effects = async () => {
    const { rows } = await pool.query(
      `SELECT event_id, count(*)::int AS count FROM ${table} WHERE event_id = ANY($1) GROUP BY event_id`,
      [ids],
    );
    return new Map(rows.map((row) => [row.event_id, row.count]));
  };

  // A consumer process that dies after writing the effect of its first event, uncommitted.
  const child = spawn(
    process.execPath,
    [
      join(import.meta.dirname, 'fixtures', 'exactly-once-consumer.mjs'),
      '--endpoint', gateway.endpoint,
      '--subscription', name,
      '--database-url', databaseUrl(),
      '--crash',
    ],
    { stdio: ['ignore', 'inherit', 'inherit'] },
  );
  const exit = await new Promise((resolve) => child.once('exit', (code, signal) => resolve({ code, signal })));
  assert.deepEqual(exit, { code: null, signal: 'SIGKILL' });
  assert.equal((await effects()).size, 0, 'the crashed transaction rolled back');

  // A consumer in this process finishes the work; event 5 fails once.
  const subscriber = new Subscriber(gateway.endpoint, name);
  const calls = [];
  const controller = new AbortController();
  t.after(() => {
    controller.abort();
    subscriber.close();
  });
  const run = subscriber.runExactlyOnce(
    pool,
    async (delivery, client) => {
      calls.push(delivery.event.id);
      await client.query(`INSERT INTO ${table} (event_id, attempt) VALUES ($1, $2)`, [
        delivery.event.id,
        delivery.attempt,
      ]);
      if (delivery.event.payload.fail && !calls.slice(0, -1).includes(delivery.event.id)) {
        throw new Error('the first try of event 5 fails after its write');
      }
    },
    { signal: controller.signal, concurrency: 3 },
  );
  const settled = async () => {
    const stats = await gateway.stats(name);
    return stats.lagEvents === 0 && stats.inFlight === 0 && stats.awaitingRetry === 0 && stats;
  };
  await eventually('every event is consumed', async () => (await effects()).size === 10 && settled());
  assert.equal(calls.filter((id) => id === ids[5]).length, 2, 'event 5 ran twice, committed once');

  // Requeued events come again; outbox_consume knows them, so the handler is skipped.
  const before = await gateway.stats(name);
  for (const id of [ids[0], ids[3], ids[5]]) {
    await call(gateway.admin, 'RequeueEvent', { id, subscription: name });
  }
  const callsBefore = calls.length;
  await eventually('the requeued deliveries are settled', async () => {
    const stats = await settled();
    return stats && stats.deliveredTotal >= before.deliveredTotal + 3;
  });
  controller.abort();
  await run;
  assert.equal(calls.length, callsBefore, 'no handler ran for a requeued event');

  const counts = await effects();
  assert.deepEqual([...counts.keys()].sort(), [...ids].sort());
  assert.ok([...counts.values()].every((count) => count === 1), `effects: ${[...counts]}`);
  const stats = await gateway.stats(name);
  assert.equal(stats.consumptionRecords, 10);
});
