// Reads a subscription over outbox.v1.Subscriber/Subscribe and settles every delivery.
//
// Creates the subscription when it is missing, acks each delivery, and sends a poison
// message (a payload with "poison": true) to the dead-letter queue at once. Prints one
// JSON line per delivery; stops after --max-deliveries deliveries or --timeout seconds.
import { args, client, ensureSubscription, grpc, unary } from './common.js';

const options = args({
  subscription: { type: 'string', default: 'orders-node' },
  'max-deliveries': { type: 'string', default: '0' }, // 0: no limit
  timeout: { type: 'string', default: '30' }, // seconds
});
const { endpoint, subscription } = options;
const maxDeliveries = Number(options['max-deliveries']);
const timeout = Number(options.timeout);

/** The payload as JSON when its content type says so, otherwise base64. */
function decode(event) {
  const type = event.content_type.split(';')[0].trim().toLowerCase();
  return /^application\/([a-z0-9.+_-]+\+)?json$/.test(type)
    ? JSON.parse(event.payload.toString('utf8'))
    : event.payload.toString('base64');
}

/** Acks a delivery, or dead-letters it when it can never succeed. */
async function settle(subscriber, delivery, payload) {
  if (payload?.poison === true) {
    const response = await unary(subscriber, 'Nack', {
      subscription,
      ack_id: delivery.ack_id,
      reason: 'poison message',
      dead_letter: true,
    });
    return response.dead_lettered ? 'dead-lettered' : 'nacked';
  }
  // A real consumer handles the event here, then acks it.
  const response = await unary(subscriber, 'Ack', { subscription, ack_ids: [delivery.ack_id] });
  // A stale ack id: the lease expired and the event will be delivered again.
  return response.stale_ack_ids.length > 0 ? 'stale' : 'acked';
}

const admin = client('Admin', endpoint);
const subscriber = client('Subscriber', endpoint);
await ensureSubscription(admin, subscription);

// The deadline bounds the whole stream: it ends the loop after --timeout seconds.
const stream = subscriber.Subscribe({ subscription }, { deadline: Date.now() + timeout * 1000 });
let received = 0;
try {
  for await (const delivery of stream) {
    const { event } = delivery;
    const payload = decode(event);
    const settled = await settle(subscriber, delivery, payload);
    console.log(
      JSON.stringify({
        id: event.id,
        aggregate_type: event.aggregate_type,
        aggregate_id: event.aggregate_id,
        event_type: event.event_type,
        payload,
        metadata: event.metadata,
        attempt: delivery.attempt,
        settled,
      }),
    );
    received += 1;
    if (received === maxDeliveries) break;
  }
} catch (error) {
  if (error.code !== grpc.status.DEADLINE_EXCEEDED) throw error;
  console.error(`timed out after ${timeout} s`);
} finally {
  stream.cancel(); // closing the stream releases unsettled deliveries at once
  admin.close();
  subscriber.close();
}
console.error(`received ${received} deliveries`);
