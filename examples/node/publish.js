// Publishes events over gRPC (outbox.v1.Publisher/Publish) and prints their ids.
// --poison also publishes an event with payload {"poison": true}.
import { randomUUID } from 'node:crypto';
import { args, client, unary } from './common.js';

const { endpoint, poison } = args({ poison: { type: 'boolean', default: false } });

const newOrderId = () => `o-${randomUUID().slice(0, 8)}`;
const event = (orderId, eventType, payload) => ({
  aggregate_type: 'order',
  aggregate_id: orderId,
  event_type: eventType,
  payload: Buffer.from(JSON.stringify(payload)),
  metadata: { source: 'node-example' },
});

const orderId = newOrderId();
const events = [
  event(orderId, 'order.created', { total: 42 }),
  event(orderId, 'order.paid', { amount: 42 }),
];
if (poison) {
  events.push(event(newOrderId(), 'order.created', { poison: true }));
}

const publisher = client('Publisher', endpoint);
// The batch is stored atomically: every event or none.
const { results } = await unary(publisher, 'Publish', { events });
publisher.close();
for (const result of results) {
  console.log(result.id);
}
