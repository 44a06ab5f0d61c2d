// Publisher against a live gateway: bad input is refused before any call, naming the
// field; refusals carry the gRPC code and the field; ids come back in order.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { GatewayError, InvalidArgumentError, Publisher, Subscriber, status } from '@outbox-gateway/client';
import { Gateway, call, unique } from './helpers.mjs';

let gateway;
before(async () => {
  gateway = await Gateway.start();
});
after(async () => {
  await gateway?.stop();
});

const good = (id) => ({
  id,
  aggregateType: 'order',
  aggregateId: 'o-1',
  eventType: 'order.created',
  payload: { total: 1 },
});

test('bad input is refused before any call, naming the field', async (t) => {
  const publisher = new Publisher(gateway.endpoint);
  t.after(() => publisher.close());
  const cases = [
    [{ aggregateId: '' }, 'events[1].aggregateId'],
    [{ aggregateType: '' }, 'events[1].aggregateType'],
    [{ aggregateId: 42 }, 'events[1].aggregateId'],
    [{ payload: 42 }, 'events[1].payload'],
    [{ payload: null }, 'events[1].payload'],
    [{ payload: undefined }, 'events[1].payload'],
    [{ payload: new Date() }, 'events[1].payload'],
    [{ payload: true }, 'events[1].payload'],
    [{ metadata: { tenant: 7 } }, 'events[1].metadata.tenant'],
    [{ aggregateVersion: 0 }, 'events[1].aggregateVersion'],
    [{ occurredAt: 'yesterday' }, 'events[1].occurredAt'],
  ];
  for (const [change, field] of cases) {
    const id = crypto.randomUUID();
    // The first event is fine: a call would have stored it.
    await assert.rejects(publisher.publish([good(id), { ...good(), ...change }]), (error) => {
      assert.ok(error instanceof InvalidArgumentError, `${field}: ${error}`);
      assert.equal(error.field, field);
      assert.equal(error.code, status.INVALID_ARGUMENT);
      assert.match(error.message, new RegExp(`^${field.replace(/[[\].]/g, '\\$&')}: `));
      return true;
    });
    await assert.rejects(call(gateway.admin, 'GetEvent', { id }), { code: status.NOT_FOUND });
  }
  await assert.rejects(publisher.publish([]), { name: 'InvalidArgumentError', field: 'events' });
});

test('a refusal of the gateway carries its code and the field it names', async (t) => {
  const publisher = new Publisher(gateway.endpoint);
  t.after(() => publisher.close());
  await assert.rejects(
    publisher.publish([good(), { ...good(), eventType: 'not an event type!' }]),
    (error) => {
      assert.ok(error instanceof GatewayError, String(error));
      assert.equal(error.code, status.INVALID_ARGUMENT);
      assert.equal(error.codeName, 'INVALID_ARGUMENT');
      assert.equal(error.field, 'events[1].eventType');
      return true;
    },
  );
  // A string payload is sent as it is: JSON by default, so it must be JSON text.
  await assert.rejects(publisher.publish([{ ...good(), payload: 'not json' }]), {
    name: 'GatewayError',
    field: 'events[0].payload',
  });
});

test('publish returns the ids in order, the given ones kept and the others generated', async (t) => {
  const publisher = new Publisher(gateway.endpoint);
  t.after(() => publisher.close());
  const id = crypto.randomUUID();
  const ids = await publisher.publish([
    good(id),
    { ...good(), payload: Buffer.from('raw bytes'), contentType: 'application/octet-stream' },
    { ...good(), payload: '{"text": true}' },
  ]);
  assert.equal(ids.length, 3);
  assert.equal(ids[0], id);
  for (const generated of ids.slice(1)) {
    assert.match(generated, /^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
  }
  // The same batch again is recognised as a re-publish: same ids, nothing new stored.
  assert.deepEqual(await publisher.publish([good(id)]), [id]);
});

test('a subscriber of an unknown subscription rejects with NOT_FOUND', async (t) => {
  const subscriber = new Subscriber(gateway.endpoint, unique('missing'));
  t.after(() => subscriber.close());
  await assert.rejects(subscriber.run(() => {}), (error) => {
    assert.ok(error instanceof GatewayError, String(error));
    assert.equal(error.code, status.NOT_FOUND);
    return true;
  });
});
