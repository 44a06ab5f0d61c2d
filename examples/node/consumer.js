// Consumes a subscription with Subscriber.run: the handler's outcome settles each delivery.
//
// Creates the subscription when it is missing. A handler that returns acks its delivery;
// a poison message (a payload with "poison": true) throws a permanent HandlerError, which
// sends it to the dead-letter queue at once. Prints one JSON line per delivery; stops
// after --max-deliveries deliveries or --timeout seconds, letting running handlers finish.
import { HandlerError, Subscriber } from '@outbox-gateway/client';
import { args, ensureSubscription, stopAfter } from './common.js';

const options = args({
  subscription: { type: 'string', default: 'orders-node' },
  'max-deliveries': { type: 'string', default: '0' }, // 0: no limit
  timeout: { type: 'string', default: '30' }, // seconds
});
const { endpoint, subscription } = options;
await ensureSubscription(endpoint, subscription);

const controller = new AbortController();
const count = stopAfter(controller, Number(options['max-deliveries']), Number(options.timeout));
const subscriber = new Subscriber(endpoint, subscription);
await subscriber.run(
  (delivery) => {
    const { event } = delivery;
    // The payload is parsed already when its content type is JSON.
    const poison = event.payload?.poison === true;
    console.log(
      JSON.stringify({
        id: event.id,
        aggregate_type: event.aggregateType,
        aggregate_id: event.aggregateId,
        event_type: event.eventType,
        payload: Buffer.isBuffer(event.payload) ? event.payload.toString('base64') : event.payload,
        metadata: event.metadata,
        attempt: delivery.attempt,
        settled: poison ? 'dead-lettered' : 'acked',
      }),
    );
    count();
    // A real consumer handles the event here; returning acks it.
    if (poison) throw new HandlerError('poison message', { permanent: true });
  },
  { signal: controller.signal },
);
subscriber.close();
console.error('stopped');
