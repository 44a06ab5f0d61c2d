// Consumes a subscription exactly once with Subscriber.runExactlyOnce.
//
// Each delivery is handled in one PostgreSQL transaction that first calls outbox_consume.
// The handler runs only for an event no committed transaction consumed before: it records
// a shipment for the order and publishes its shipment.requested event. The gateway settles
// the delivery when the transaction commits: there is no Ack call. Prints one JSON line
// per delivery handled; stops after --max-deliveries deliveries or --timeout seconds.
import pg from 'pg';
import { Subscriber } from '@outbox-gateway/client';
import { args, ensureSubscription, stopAfter } from './common.js';

const options = args({
  subscription: { type: 'string', default: 'orders-exactly-once-node' },
  'max-deliveries': { type: 'string', default: '0' }, // 0: no limit
  timeout: { type: 'string', default: '30' }, // seconds
});
const { endpoint, subscription, 'database-url': databaseUrl } = options;

const pool = new pg.Pool({ connectionString: databaseUrl });
// No unique constraint: outbox_consume, not the table, keeps a shipment from being
// written twice.
await pool.query(`CREATE TABLE IF NOT EXISTS shipments (
  id bigserial PRIMARY KEY, order_id text, event_id text, created_at timestamptz DEFAULT now()
)`);
await ensureSubscription(endpoint, subscription);

const controller = new AbortController();
const count = stopAfter(controller, Number(options['max-deliveries']), Number(options.timeout));
const subscriber = new Subscriber(endpoint, subscription);
await subscriber.runExactlyOnce(
  pool,
  async (delivery, client) => {
    const { event } = delivery;
    await client.query('INSERT INTO shipments (order_id, event_id) VALUES ($1, $2)', [
      event.aggregateId,
      event.id,
    ]);
    await client.query("SELECT outbox_publish('shipment', $1, 'shipment.requested', $2::jsonb)", [
      event.aggregateId,
      JSON.stringify({ order_id: event.aggregateId }),
    ]);
    console.log(JSON.stringify({ event_id: event.id, event_type: event.eventType, consumed: true }));
    count();
  },
  { signal: controller.signal },
);
subscriber.close();
await pool.end();
console.error('stopped');
