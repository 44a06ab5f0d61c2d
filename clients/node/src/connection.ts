// Where the gateway is and how to reach it: loads the one proto shipped in dist/proto,
// builds the credentials (TLS, bearer token) every client of the package uses, and
// turns grpc-js callbacks into promises.
import { join } from 'node:path';
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';

/** How to reach the gateway; shared by {@link Publisher} and {@link Subscriber}. */
export interface ConnectionOptions {
  /** Sent as `authorization: Bearer <token>` with every call (gateways with tokens). */
  token?: string;
  /**
   * TLS settings; TLS is used when this is set or the endpoint is `https://`. PEM
   * contents, not file names: `{ ca: readFileSync('ca.pem') }`.
   */
  tls?: {
    /** CA that signed the gateway's certificate; default: the system's roots. */
    ca?: Buffer | string;
    /** Client certificate and key, for gateways that require mutual TLS. */
    cert?: Buffer | string;
    key?: Buffer | string;
  };
  /** Extra grpc-js channel options, e.g. `{ 'grpc.keepalive_time_ms': 30000 }`. */
  channelOptions?: grpc.ChannelOptions;
}

/** The stubs of the outbox.v1 services, as grpc-js builds them from the proto. */
export type ServiceName = 'Publisher' | 'Subscriber' | 'Admin';

/** A grpc-js client whose methods are the RPCs of a service (e.g. `Publish`). */
export type ServiceClient = grpc.Client & Record<string, any>;

let services: Record<ServiceName, grpc.ServiceClientConstructor> | undefined;

/**
 * The outbox.v1 services, loaded at first use from the proto the build copied into
 * dist/proto. Field names are camelCase (`aggregateId`), 64-bit integers strings, enums
 * their names, bytes Buffers.
 */
function loadServices(): Record<ServiceName, grpc.ServiceClientConstructor> {
  if (!services) {
    const definition = protoLoader.loadSync('outbox/v1/outbox.proto', {
      includeDirs: [protoDirectory()],
      keepCase: false,
      longs: String,
      enums: String,
      defaults: true,
      oneofs: true,
    });
    const loaded = grpc.loadPackageDefinition(definition) as any;
    services = loaded.outbox.v1;
  }
  return services!;
}

/** Where the shipped copy of proto/outbox/v1/outbox.proto lives. */
export function protoDirectory(): string {
  return join(__dirname, 'proto');
}

/** `host:port` and whether to use TLS, from `http://host:port`, `https://...` or `host:port`. */
function address(endpoint: string): { target: string; secure: boolean } {
  const match = /^(https?):\/\/([^/]+)\/?$/.exec(endpoint);
  if (match) return { target: match[2]!, secure: match[1] === 'https' };
  if (/^[^/]+:\d+$/.test(endpoint)) return { target: endpoint, secure: false };
  throw new TypeError(
    `endpoint: expected http://host:port, https://host:port or host:port, got ${JSON.stringify(endpoint)}`,
  );
}

/**
 * A raw grpc-js client of an outbox.v1 service (`Publisher`, `Subscriber` or `Admin`),
 * with the package's TLS and token handling, for calls the package does not wrap
 * (administration). Close it with `client.close()`.
 *
 * ```ts
 * const admin = createServiceClient('Admin', 'http://127.0.0.1:50051');
 * admin.CreateSubscription({ subscription: { name: 'billing' } }, (error, created) => {});
 * ```
 */
export function createServiceClient(
  service: ServiceName,
  endpoint: string,
  options: ConnectionOptions = {},
): ServiceClient {
  const { target, secure } = address(endpoint);
  let credentials: grpc.ChannelCredentials;
  if (secure || options.tls) {
    const pem = (value: Buffer | string | undefined) =>
      value === undefined ? null : Buffer.from(value);
    credentials = grpc.credentials.createSsl(
      pem(options.tls?.ca),
      pem(options.tls?.key),
      pem(options.tls?.cert),
    );
  } else {
    credentials = grpc.credentials.createInsecure();
  }
  const Client = loadServices()[service];
  const client = new Client(target, credentials, options.channelOptions) as ServiceClient;
  // Kept for `callMetadata`: grpc-js only attaches call credentials to TLS channels, and
  // tokens are also used over plaintext on loopback.
  tokens.set(client, options.token);
  return client;
}

const tokens = new WeakMap<grpc.Client, string | undefined>();

/** The metadata every call of `client` carries: the bearer token, when set. */
export function callMetadata(client: grpc.Client): grpc.Metadata {
  const metadata = new grpc.Metadata();
  const token = tokens.get(client);
  if (token !== undefined) metadata.set('authorization', `Bearer ${token}`);
  return metadata;
}

/** Calls unary RPC `method` of `client`; resolves with its response. */
export function unary<Response = any>(
  client: ServiceClient,
  method: string,
  request: object,
  options: { timeoutMs?: number; signal?: AbortSignal } = {},
): Promise<Response> {
  const { signal } = options;
  return new Promise((resolve, reject) => {
    const callOptions: grpc.CallOptions = {};
    if (options.timeoutMs !== undefined) callOptions.deadline = Date.now() + options.timeoutMs;
    const cancel = () => call.cancel();
    const call = client[method](
      request,
      callMetadata(client),
      callOptions,
      (error: grpc.ServiceError | null, response: Response) => {
        signal?.removeEventListener('abort', cancel);
        if (error) reject(error);
        else resolve(response);
      },
    );
    signal?.addEventListener('abort', cancel, { once: true });
  });
}

/** A protobuf Timestamp as grpc-js hands it out (seconds as a string). */
export interface TimestampMessage {
  seconds: string | number;
  nanos: number;
}

export function toTimestamp(date: Date): TimestampMessage {
  const ms = date.getTime();
  const seconds = Math.floor(ms / 1000);
  return { seconds: String(seconds), nanos: (ms - seconds * 1000) * 1_000_000 };
}

export function fromTimestamp(timestamp: TimestampMessage | null | undefined): Date | undefined {
  if (!timestamp) return undefined;
  return new Date(Number(timestamp.seconds) * 1000 + Math.floor(timestamp.nanos / 1_000_000));
}

export function toDuration(ms: number): { seconds: string; nanos: number } {
  const seconds = Math.floor(ms / 1000);
  return { seconds: String(seconds), nanos: Math.round((ms - seconds * 1000) * 1_000_000) };
}
