// Publisher: checks a batch, publishes it atomically, retries while the gateway is
// unavailable.
import { randomBytes } from 'node:crypto';
import type { ServiceError } from '@grpc/grpc-js';
import { createServiceClient, unary, type ConnectionOptions, type ServiceClient } from './connection';
import { GatewayError, InvalidArgumentError } from './errors';
import { toEventInput, type EventInput } from './event';
import { Backoff, isTransient, sleep } from './retry';

/** Settings of a {@link Publisher}. */
export interface PublisherOptions extends ConnectionOptions {
  /** The source (database) to write to; default the gateway's own (`default`). */
  source?: string;
  /** Tries per call while the gateway is unavailable (default 5). */
  maxAttempts?: number;
  /** Gives up on one try after this many milliseconds (default 30 000). */
  timeoutMs?: number;
}

/** Per-call settings of {@link Publisher.publish}. */
export interface PublishOptions {
  /** Aborts the call (and its retries); the promise rejects with the signal's reason. */
  signal?: AbortSignal;
}

/**
 * Publishes events to the gateway. A batch is stored atomically: every event or none.
 * Events without an `id` get a UUID before the first try, so a retried call stores each
 * event once.
 *
 * ```ts
 * const publisher = new Publisher('http://127.0.0.1:50051');
 * const [id] = await publisher.publish([
 *   { aggregateType: 'order', aggregateId: 'o-42', eventType: 'order.created', payload: { total: 42 } },
 * ]);
 * publisher.close();
 * ```
 */
export class Publisher {
  private readonly client: ServiceClient;
  private readonly source: string;
  private readonly maxAttempts: number;
  private readonly timeoutMs: number;

  /**
   * @param endpoint `http://host:port`, `https://host:port` or `host:port`.
   */
  constructor(endpoint: string, options: PublisherOptions = {}) {
    this.client = createServiceClient('Publisher', endpoint, options);
    this.source = options.source ?? '';
    this.maxAttempts = Math.max(1, options.maxAttempts ?? 5);
    this.timeoutMs = options.timeoutMs ?? 30_000;
  }

  /**
   * Publishes `events` as one batch and resolves with their ids, in order.
   *
   * Throws {@link InvalidArgumentError} at once, before any call, for input the gateway
   * would refuse anyway (an empty `aggregateId`, a payload of another type); rejects with
   * {@link GatewayError} when the gateway refuses the batch or stays unavailable.
   */
  async publish(events: readonly EventInput[], options: PublishOptions = {}): Promise<string[]> {
    if (!Array.isArray(events) || events.length === 0) {
      throw new InvalidArgumentError('events', 'must be a non-empty array of events');
    }
    const request = {
      events: events.map((event, index) => {
        const input = toEventInput(event, index);
        // The idempotency key, fixed before the first try.
        if (input.id === '') input.id = uuidv7();
        return input;
      }),
      source: this.source,
    };
    const backoff = new Backoff();
    for (let attempt = 1; ; attempt += 1) {
      options.signal?.throwIfAborted();
      try {
        const response = await unary(this.client, 'Publish', request, {
          timeoutMs: this.timeoutMs,
          signal: options.signal,
        });
        return response.results.map((result: { id: string }) => result.id);
      } catch (error) {
        const status = error as ServiceError;
        options.signal?.throwIfAborted();
        if (!isTransient(status) || attempt >= this.maxAttempts) {
          throw new GatewayError(status, { cause: error });
        }
        await sleep(backoff.delay(), options.signal);
      }
    }
  }

  /** Closes the connection; later calls fail. */
  close(): void {
    this.client.close();
  }
}

/**
 * A UUIDv7 (RFC 9562), as the gateway generates for events without an id: time-ordered,
 * so ids of consecutive events stay close in the outbox's index.
 */
function uuidv7(): string {
  const bytes = randomBytes(16);
  bytes.writeUIntBE(Date.now(), 0, 6);
  bytes[6] = (bytes[6]! & 0x0f) | 0x70;
  bytes[8] = (bytes[8]! & 0x3f) | 0x80;
  const hex = bytes.toString('hex');
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}
