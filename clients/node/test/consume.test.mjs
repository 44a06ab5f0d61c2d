// Subscriber.run against a live gateway: handlers' outcomes settle deliveries (ack,
// retry, dead letter), slow handlers keep their leases, and an abort drains.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { Publisher, Subscriber, HandlerError } from '@outbox-gateway/client';
import { Gateway, call, eventually, events, seconds, unique } from './helpers.mjs';

let gateway;
let publisher;
before(async () => {
  gateway = await Gateway.start();
  publisher = new Publisher(gateway.endpoint);
});
after(async () => {
  publisher?.close();
  await gateway?.stop();
});

/** A subscription of its own aggregate type; returns both names. */
async function subscription(settings = {}) {
  const name = unique('node');
  await gateway.createSubscription({ name, aggregateTypes: [name], ...settings });
  return name;
}

/** Runs `subscriber` with `handler` until the returned `stop()`, which resolves once run does. */
function running(subscriber, handler, options = {}) {
  const controller = new AbortController();
  const errors = [];
  const done = subscriber.run(handler, {
    signal: controller.signal,
    onError: (error) => errors.push(error),
    ...options,
  });
  return {
    done,
    errors,
    stop: async () => {
      controller.abort();
      await done;
    },
  };
}

test('published events are consumed with their fields and acked', async (t) => {
  const name = await subscription();
  const occurredAt = new Date('2024-05-01T12:00:00.123Z');
  const ids = await publisher.publish([
    {
      aggregateType: name,
      aggregateId: 'o-1',
      aggregateVersion: 3,
      eventType: 'order.created',
      payload: { total: 42, items: ['a'] },
      metadata: { tenant: 'acme' },
      occurredAt,
    },
    {
      aggregateType: name,
      aggregateId: 'o-2',
      eventType: 'order.note',
      payload: Buffer.from([0, 1, 2]),
      contentType: 'application/octet-stream',
    },
  ]);
  const subscriber = new Subscriber(gateway.endpoint, name);
  t.after(() => subscriber.close());
  const received = new Map();
  const run = running(subscriber, (delivery) => {
    received.set(delivery.event.id, delivery);
  });
  await eventually('both events arrive', () => received.size === 2);
  await run.stop();

  const first = received.get(ids[0]);
  assert.equal(first.attempt, 1);
  assert.equal(typeof first.ackId, 'string');
  assert.ok(first.ackDeadline instanceof Date);
  assert.deepEqual(
    {
      aggregateType: first.event.aggregateType,
      aggregateId: first.event.aggregateId,
      aggregateVersion: first.event.aggregateVersion,
      eventType: first.event.eventType,
      payload: first.event.payload,
      metadata: first.event.metadata,
      occurredAt: first.event.occurredAt,
      source: first.event.source,
    },
    {
      aggregateType: name,
      aggregateId: 'o-1',
      aggregateVersion: 3,
      eventType: 'order.created',
      payload: { total: 42, items: ['a'] },
      metadata: { tenant: 'acme' },
      occurredAt,
      source: 'default',
    },
  );
  const second = received.get(ids[1]);
  assert.deepEqual(second.event.payload, Buffer.from([0, 1, 2]));
  assert.equal(second.event.aggregateVersion, undefined);
  assert.equal(first.event.transactionId, second.event.transactionId, 'one Publish call');

  const stats = await gateway.stats(name);
  assert.deepEqual([stats.ackedTotal, stats.lagEvents], [2, 0]);
});

test('a handler that throws is retried: attempt 2 succeeds', async (t) => {
  const name = await subscription({ retryBackoffMin: seconds(0.2), retryBackoffMax: seconds(1) });
  const [id] = await publisher.publish(events(name, 1));
  const subscriber = new Subscriber(gateway.endpoint, name);
  t.after(() => subscriber.close());
  const attempts = [];
  const run = running(subscriber, (delivery) => {
    attempts.push(delivery.attempt);
    if (delivery.attempt === 1) throw new Error('first attempt fails');
  });
  await eventually('the retry is acked', async () => (await gateway.stats(name)).ackedTotal === 1);
  await run.stop();
  assert.deepEqual(attempts, [1, 2]);
  const { subscriptions } = await call(gateway.admin, 'GetEvent', { id });
  assert.equal(subscriptions.find((s) => s.subscription === name).state, 'DELIVERY_STATE_ACKED');
});

test('a HandlerError can dead-letter at once, with its reason', async (t) => {
  const name = await subscription();
  const [id] = await publisher.publish(events(name, 1));
  const subscriber = new Subscriber(gateway.endpoint, name);
  t.after(() => subscriber.close());
  const run = running(subscriber, () => {
    throw new HandlerError('cannot ever work', { permanent: true });
  });
  const letters = await eventually('the event is dead-lettered', async () => {
    const { deadLetters } = await call(gateway.admin, 'ListDeadLetters', { subscription: name });
    return deadLetters.length > 0 && deadLetters;
  });
  await run.stop();
  assert.equal(letters[0].event.id, id);
  assert.equal(letters[0].lastError, 'cannot ever work');
});

test('a handler running 3 times the ack deadline keeps its lease: no redelivery', async (t) => {
  const deadline = 3;
  const name = await subscription({ ackDeadline: seconds(deadline) });
  await publisher.publish(events(name, 1));
  const subscriber = new Subscriber(gateway.endpoint, name);
  t.after(() => subscriber.close());
  const calls = [];
  // Room for a redelivery to start while the first handler still runs.
  const run = running(
    subscriber,
    async (delivery) => {
      calls.push(delivery.attempt);
      await new Promise((resolve) => setTimeout(resolve, 3 * deadline * 1000));
    },
    { concurrency: 2 },
  );
  await eventually('the slow handler is acked', async () => (await gateway.stats(name)).ackedTotal === 1);
  await run.stop();
  assert.deepEqual(calls, [1], 'one call, attempt 1');
  const stats = await gateway.stats(name);
  assert.deepEqual([stats.deliveredTotal, stats.ackedTotal, stats.lagEvents], [1, 1, 0]);
  assert.deepEqual(run.errors, [], 'every extension was taken');
});

test('an abort lets running handlers finish and sends their acks before run resolves', async (t) => {
  const name = await subscription();
  const ids = await publisher.publish(events(name, 8));
  const subscriber = new Subscriber(gateway.endpoint, name);
  t.after(() => subscriber.close());
  const started = [];
  const finished = [];
  let open;
  const gate = new Promise((resolve) => (open = resolve));
  const run = running(
    subscriber,
    async (delivery) => {
      started.push(delivery.event.id);
      await gate;
      finished.push(delivery.event.id);
    },
    { concurrency: 3 },
  );
  await eventually('three handlers run', () => started.length === 3);
  const stopped = run.stop();
  let resolved = false;
  stopped.then(() => (resolved = true));
  // Nothing settles while the handlers hold: the run waits for them.
  assert.equal((await gateway.stats(name)).ackedTotal, 0);
  assert.equal(resolved, false);
  open();
  await stopped;
  assert.deepEqual([...finished].sort(), [...started].sort());
  assert.equal(started.length, 3, 'no handler started after the abort');
  // Every ack was applied before run resolved.
  assert.equal((await gateway.stats(name)).ackedTotal, 3);

  // The rest was given back at once: a second run gets exactly the others, first try.
  const rest = new Map();
  const again = running(subscriber, (delivery) => {
    rest.set(delivery.event.id, delivery.attempt);
  });
  await eventually('the other five arrive', async () => (await gateway.stats(name)).ackedTotal === 8);
  await again.stop();
  assert.deepEqual(
    [...rest.keys()].sort(),
    ids.filter((id) => !started.includes(id)).sort(),
  );
});
