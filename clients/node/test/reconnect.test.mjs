// A gateway killed (SIGKILL) and restarted in the middle of a run: the subscriber
// reconnects by itself and no event is lost.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { Publisher, Subscriber } from '@outbox-gateway/client';
import { Gateway, eventually, events, unique } from './helpers.mjs';

test('a gateway killed and restarted mid-run loses nothing; the subscriber reconnects', async (t) => {
  const gateway = await Gateway.start();
  t.after(() => gateway.stop());
  const name = unique('node-restart');
  await gateway.createSubscription({ name, aggregateTypes: [name] });
  const publisher = new Publisher(gateway.endpoint);
  t.after(() => publisher.close());
  const before = await publisher.publish(events(name, 20));

  const subscriber = new Subscriber(gateway.endpoint, name);
  t.after(() => subscriber.close());
  const handled = new Set();
  let holding = 0;
  let release;
  const held = new Promise((resolve) => (release = resolve));
  const controller = new AbortController();
  const run = subscriber.run(
    async (delivery) => {
      // Five go through; the next handlers are still running when the gateway dies.
      if (handled.size >= 5 && !handled.has(delivery.event.id)) {
        holding += 1;
        await held;
      }
      handled.add(delivery.event.id);
    },
    { signal: controller.signal, concurrency: 2 },
  );
  await eventually('handlers are running', () => handled.size >= 5 && holding === 2);

  await gateway.kill('SIGKILL');
  release();
  await gateway.restart();
  // Published after the restart: only a subscriber that reconnected gets these.
  const afterRestart = await publisher.publish(events(name, 20));

  await eventually(
    'every event is handled and acked',
    async () => {
      const stats = await gateway.stats(name);
      return handled.size === 40 && stats.lagEvents === 0;
    },
    120_000,
  );
  controller.abort();
  await run;
  assert.deepEqual([...handled].sort(), [...before, ...afterRestart].sort());
});
