// Writes an order and its order.created event in one PostgreSQL transaction.
//
// The first order commits, so its event is delivered. The second is rolled back: neither
// the order nor its event is stored, and the event is never delivered. Prints one JSON
// line per order.
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import { args } from './common.js';

const { 'database-url': databaseUrl } = args();

/** Inserts an order and publishes its event in the current transaction. */
async function createOrder(db, total) {
  const orderId = `o-${randomUUID().slice(0, 8)}`;
  await db.query('INSERT INTO orders (id, total) VALUES ($1, $2)', [orderId, total]);
  const { rows } = await db.query(
    "SELECT outbox_publish('order', $1, 'order.created', $2::jsonb, $3::jsonb) AS id",
    [orderId, JSON.stringify({ total }), JSON.stringify({ source: 'node-example' })],
  );
  return { order_id: orderId, event_id: rows[0].id };
}

const db = new pg.Client({ connectionString: databaseUrl });
await db.connect();
try {
  await db.query('CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, total numeric)');

  await db.query('BEGIN');
  const committed = await createOrder(db, 99.5);
  await db.query('COMMIT');
  console.log(JSON.stringify({ ...committed, committed: true }));

  await db.query('BEGIN');
  const rolledBack = await createOrder(db, 13);
  // Say a business rule fails after the writes: roll the whole transaction back.
  await db.query('ROLLBACK');
  console.log(JSON.stringify({ ...rolledBack, committed: false }));
} finally {
  await db.end();
}
