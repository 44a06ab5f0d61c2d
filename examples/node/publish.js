// Publishes events with Publisher.publish and prints their ids.
// --poison also publishes an event with payload {"poison": true}.
import { randomUUID } from 'node:crypto';
import { Publisher } from '@outbox-gateway/client';
import { args } from './common.js';

const { endpoint, poison } = args({ poison: { type: 'boolean', default: false } });

const newOrderId = () => `o-${randomUUID().slice(0, 8)}`;
const event = (orderId, eventType, payload) => ({
  aggregateType: 'order',
  aggregateId: orderId,
  eventType,
  payload, // an object is sent as JSON
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

const publisher = new Publisher(endpoint);
// The batch is stored atomically: every event or none.
const ids = await publisher.publish(events);
publisher.close();
for (const id of ids) {
  console.log(id);
}
