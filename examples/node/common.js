// Settings shared by the examples, and the subscription they consume.
//
// The gateway endpoint comes from --endpoint or OUTBOX_ENDPOINT (default
// http://127.0.0.1:50051), the database from --database-url or DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/outbox): the same names and defaults as the gateway.
import { parseArgs } from 'node:util';
import { createServiceClient, status } from '@outbox-gateway/client';

/** Command-line options: --endpoint, --database-url and the program's own `extra`. */
export function args(extra = {}) {
  return parseArgs({
    options: {
      endpoint: {
        type: 'string',
        default: process.env.OUTBOX_ENDPOINT ?? 'http://127.0.0.1:50051',
      },
      'database-url': {
        type: 'string',
        default: process.env.DATABASE_URL ?? 'postgres://postgres@127.0.0.1:5432/outbox',
      },
      ...extra,
    },
  }).values;
}

/**
 * Creates the subscription `name` unless it exists. A new one starts at the earliest
 * retained event, so it also sees events published before the consumer first ran.
 * Administration is not wrapped by the package: this uses its raw Admin client.
 */
export async function ensureSubscription(endpoint, name) {
  const admin = createServiceClient('Admin', endpoint);
  const subscription = { name, eventTypes: ['order.*'], start: { boundary: 'BOUNDARY_EARLIEST' } };
  try {
    await new Promise((resolve, reject) =>
      admin.CreateSubscription({ subscription }, (error) => (error ? reject(error) : resolve())),
    );
  } catch (error) {
    if (error.code !== status.ALREADY_EXISTS) throw error;
  } finally {
    admin.close();
  }
}

/**
 * Stops `controller` after `timeout` seconds or once `count` deliveries were counted
 * with the returned function (0: no limit).
 */
export function stopAfter(controller, count, timeout) {
  const timer = setTimeout(() => {
    console.error(`timed out after ${timeout} s`);
    controller.abort();
  }, timeout * 1000);
  controller.signal.addEventListener('abort', () => clearTimeout(timer));
  let seen = 0;
  return () => {
    seen += 1;
    if (seen === count) controller.abort();
    return seen;
  };
}
