// Settings and gRPC clients shared by the examples.
//
// The gateway endpoint comes from --endpoint or OUTBOX_ENDPOINT (default
// http://127.0.0.1:50051), the database from --database-url or DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/outbox): the same names and defaults as the gateway.
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

export { grpc };

// The API is loaded from the .proto at run time: no generated code.
const definition = protoLoader.loadSync('outbox/v1/outbox.proto', {
  includeDirs: [join(import.meta.dirname, '..', '..', 'proto')],
  keepCase: true, // field names as in the .proto: aggregate_id, ack_id, ...
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
});
const { outbox } = grpc.loadPackageDefinition(definition);

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

/** A plaintext client of `service` (Publisher, Subscriber or Admin). */
export function client(service, endpoint) {
  // grpc-js wants host:port, so an http:// prefix is dropped.
  const address = endpoint.replace(/^http:\/\//, '');
  return new outbox.v1[service](address, grpc.credentials.createInsecure());
}

/** Calls a unary RPC and returns a promise of its response. */
export function unary(client, method, request, timeoutSeconds = 10) {
  const deadline = Date.now() + timeoutSeconds * 1000;
  return new Promise((resolve, reject) =>
    client[method](request, { deadline }, (error, response) =>
      error ? reject(error) : resolve(response),
    ),
  );
}

/**
 * Creates the subscription `name` unless it exists. A new one starts at the earliest
 * retained event, so it also sees events published before the consumer first ran.
 */
export async function ensureSubscription(admin, name) {
  const settings = {
    name,
    event_types: ['order.*'],
    start: { boundary: 'BOUNDARY_EARLIEST' },
  };
  try {
    await unary(admin, 'CreateSubscription', { subscription: settings });
  } catch (error) {
    if (error.code !== grpc.status.ALREADY_EXISTS) throw error;
  }
}
