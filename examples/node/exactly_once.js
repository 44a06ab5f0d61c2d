// Consumes a subscription exactly once, with outbox_consume in the consumer's own database.
//
// Each delivery is handled in one PostgreSQL transaction that first calls
// outbox_consume(subscription, ack_id). True: the transaction records a shipment for the
// order and publishes its shipment.requested event. False: a committed transaction already
// consumed the event, so nothing is written again. The gateway settles the delivery when
// the transaction commits: there is no Ack call. Prints one JSON line per delivery; stops
// after --max-deliveries deliveries or --timeout seconds.
import pg from 'pg';
import { args, client, ensureSubscription, grpc } from './common.js';

const options = args({
  subscription: { type: 'string', default: 'orders-exactly-once-node' },
  'max-deliveries': { type: 'string', default: '0' }, // 0: no limit
  timeout: { type: 'string', default: '30' }, // seconds
});
const { endpoint, subscription, 'database-url': databaseUrl } = options;
const maxDeliveries = Number(options['max-deliveries']);
const timeout = Number(options.timeout);

/** Handles a delivery in one transaction; false when it was consumed before. */
async function consume(db, delivery) {
  const orderId = delivery.event.aggregate_id;
  await db.query('BEGIN');
  try {
    // First: under READ COMMITTED, a concurrent call for the same event waits here.
    const { rows } = await db.query('SELECT outbox_consume($1, $2) AS consumed', [
      subscription,
      delivery.ack_id,
    ]);
    const { consumed } = rows[0];
    if (consumed) {
      await db.query('INSERT INTO shipments (order_id, event_id) VALUES ($1, $2)', [
        orderId,
        delivery.event.id,
      ]);
      await db.query("SELECT outbox_publish('shipment', $1, 'shipment.requested', $2::jsonb)", [
        orderId,
        JSON.stringify({ order_id: orderId }),
      ]);
    }
    // Committed, false included: the gateway settles the delivery now.
    await db.query('COMMIT');
    return consumed;
  } catch (error) {
    await db.query('ROLLBACK');
    throw error;
  }
}

const db = new pg.Client({ connectionString: databaseUrl });
await db.connect();
// No unique constraint: outbox_consume, not the table, keeps a shipment from being
// written twice.
await db.query(`CREATE TABLE IF NOT EXISTS shipments (
  id bigserial PRIMARY KEY, order_id text, event_id text, created_at timestamptz DEFAULT now()
)`);
const admin = client('Admin', endpoint);
const subscriber = client('Subscriber', endpoint);
await ensureSubscription(admin, subscription);

// The deadline bounds the whole stream: it ends the loop after --timeout seconds.
const stream = subscriber.Subscribe({ subscription }, { deadline: Date.now() + timeout * 1000 });
let received = 0;
try {
  for await (const delivery of stream) {
    const { event } = delivery;
    console.log(
      JSON.stringify({
        event_id: event.id,
        event_type: event.event_type,
        aggregate_id: event.aggregate_id,
        consumed: await consume(db, delivery),
      }),
    );
    received += 1;
    if (received === maxDeliveries) break;
  }
} catch (error) {
  if (error.code !== grpc.status.DEADLINE_EXCEEDED) throw error;
  console.error(`timed out after ${timeout} s`);
} finally {
  // A delivery whose settlement has not reached the gateway yet goes back: it comes
  // again, and outbox_consume reports it consumed (false).
  stream.cancel();
  admin.close();
  subscriber.close();
  await db.end();
}
console.error(`received ${received} deliveries`);
