// Subscriber: reads a subscription over a Subscribe stream and runs a handler for each
// delivery, settling it by the handler's outcome. Owns the consumer loop the Rust
// client's Subscriber has: bounded concurrency, batched acks, nacks with the
// subscription's backoff, lease extension, reconnects, draining on abort, and
// exactly-once consumption through outbox_consume.
import type { ClientReadableStream, ServiceError } from '@grpc/grpc-js';
import {
  callMetadata,
  createServiceClient,
  toDuration,
  unary,
  type ConnectionOptions,
  type ServiceClient,
} from './connection';
import { GatewayError, HandlerError } from './errors';
import { fromDelivery, type Delivery } from './event';
import { Backoff, isTransient, sleep, wakeOrAbort } from './retry';

/** Settings of a {@link Subscriber}. */
export interface SubscriberOptions extends ConnectionOptions {
  /**
   * Most unsettled deliveries the stream holds at once; default twice the run's
   * concurrency. Deliveries waiting for a free handler keep their leases extended.
   */
  maxInFlight?: number;
}

/** Settings of one {@link Subscriber.run}. */
export interface RunOptions {
  /** Stops the run: no new handler starts, running ones finish and are settled. */
  signal?: AbortSignal;
  /** Handlers running at once (default 1). */
  concurrency?: number;
  /**
   * Told about failures the run survives: a lost stream before it reconnects, an ack,
   * nack or lease extension the gateway did not take. Default: none reported.
   */
  onError?: (error: Error) => void;
}

/** A handler of {@link Subscriber.run}: resolves to ack, throws or rejects to nack. */
export type Handler = (delivery: Delivery) => unknown;

/**
 * What {@link Subscriber.runExactlyOnce} needs of a connection: node-postgres's
 * `PoolClient` has it. Declared here so that the package needs no `pg` types.
 */
export interface TransactionClient {
  query(text: string, values?: unknown[]): Promise<{ rows: any[] }>;
  /** Returns the connection to its pool; destroys it when given an error. */
  release(error?: Error | boolean): void;
}

/** What {@link Subscriber.runExactlyOnce} needs of a pool: node-postgres's `Pool` has it. */
export interface TransactionPool<Client extends TransactionClient = TransactionClient> {
  connect(): Promise<Client>;
}

/** A handler of {@link Subscriber.runExactlyOnce}, given the transaction's connection. */
export type TransactionHandler<Client extends TransactionClient = TransactionClient> = (
  delivery: Delivery,
  client: Client,
) => unknown;

/** Acks go out in batches of at most this many, at least every ACK_FLUSH_MS. */
const ACK_BATCH = 500;
const ACK_FLUSH_MS = 10;
/** Tries of an ack or nack the gateway could not take (unavailable, say). */
const SETTLE_ATTEMPTS = 5;
/** Lease bounds of ExtendAckDeadline. */
const MIN_LEASE_MS = 1_000;
const MAX_LEASE_MS = 12 * 3600 * 1000;
/** Longest reason a Nack carries. */
const MAX_REASON_BYTES = 4096;

/**
 * Consumes a subscription with a handler.
 *
 * ```ts
 * const controller = new AbortController();
 * process.once('SIGTERM', () => controller.abort());
 * await new Subscriber('http://127.0.0.1:50051', 'billing').run(
 *   async (delivery) => {
 *     console.log(delivery.event.eventType, delivery.event.payload);
 *   },
 *   { signal: controller.signal, concurrency: 8 },
 * );
 * ```
 */
export class Subscriber {
  private readonly client: ServiceClient;

  /**
   * @param endpoint `http://host:port`, `https://host:port` or `host:port`.
   * @param subscription name of an existing subscription.
   */
  constructor(
    endpoint: string,
    readonly subscription: string,
    private readonly options: SubscriberOptions = {},
  ) {
    if (typeof subscription !== 'string' || subscription === '') {
      throw new TypeError('subscription: must be a non-empty string');
    }
    this.client = createServiceClient('Subscriber', endpoint, options);
  }

  /**
   * Runs `handler` for each delivery until `signal` aborts; then stops taking
   * deliveries, lets running handlers finish, sends their acks and nacks, and resolves.
   *
   * A delivery is acked when its handler resolves and nacked when it throws or rejects:
   * it comes back after the subscription's backoff (a {@link HandlerError} may ask for
   * a dead letter or another delay). While a handler runs longer than half the lease
   * its lease is extended. A lost stream is reopened with backoff; the run rejects with
   * {@link GatewayError} only for refusals retrying cannot fix (an unknown subscription,
   * a missing permission).
   */
  run(handler: Handler, options: RunOptions = {}): Promise<void> {
    if (typeof handler !== 'function') throw new TypeError('handler: must be a function');
    return this.runSettling(handler, true, options);
  }

  /**
   * Runs `handler` for each delivery inside a transaction of `pool`'s database, which
   * must be one of the gateway's sources. The transaction first records the delivery
   * with `outbox_consume`; it runs the handler with its connection unless a committed
   * transaction consumed the event before, then commits. What the handler writes with
   * that connection (its effects, events it publishes with `outbox_publish`) therefore
   * happens once per event, and the gateway settles the delivery when the transaction
   * commits: no ack is sent. A handler error rolls the transaction back and nacks.
   *
   * Annotate the handler's `client` as `pg.PoolClient` for node-postgres's full types.
   *
   * ```ts
   * await subscriber.runExactlyOnce(pool, async (delivery, client: pg.PoolClient) => {
   *   await client.query('INSERT INTO shipments (order_id) VALUES ($1)', [delivery.event.aggregateId]);
   * }, { signal });
   * ```
   */
  runExactlyOnce<Client extends TransactionClient>(
    pool: TransactionPool<Client>,
    handler: TransactionHandler<Client>,
    options: RunOptions = {},
  ): Promise<void> {
    if (typeof handler !== 'function') throw new TypeError('handler: must be a function');
    if (typeof pool?.connect !== 'function') {
      throw new TypeError('pool: must be a pg Pool (or anything with connect())');
    }
    const inTransaction = async (delivery: Delivery) => {
      const client = await pool.connect().catch((error: unknown) => {
        throw databaseError(error);
      });
      // A connection whose state is unknown is destroyed, not returned to the pool.
      let broken: Error | undefined;
      try {
        let first: boolean;
        try {
          await client.query('BEGIN');
          const { rows } = await client.query('SELECT outbox_consume($1, $2) AS first', [
            this.subscription,
            delivery.ackId,
          ]);
          first = rows[0].first === true;
        } catch (error) {
          throw databaseError(error);
        }
        if (first) await handler(delivery, client);
        try {
          await client.query('COMMIT');
        } catch (error) {
          throw databaseError(error);
        }
      } catch (error) {
        try {
          await client.query('ROLLBACK');
        } catch (rollbackError) {
          broken = rollbackError as Error;
        }
        throw error;
      } finally {
        client.release(broken);
      }
    };
    return this.runSettling(inTransaction, false, options);
  }

  /** Closes the connection; a running run keeps reconnecting in vain, so abort it first. */
  close(): void {
    this.client.close();
  }

  private async runSettling(
    handler: Handler,
    ack: boolean,
    options: RunOptions,
  ): Promise<void> {
    const { signal, onError = () => {} } = options;
    const concurrency = options.concurrency ?? 1;
    if (!Number.isInteger(concurrency) || concurrency < 1) {
      throw new TypeError(`concurrency: must be a positive integer, got ${concurrency}`);
    }
    const maxInFlight = this.options.maxInFlight ?? 2 * concurrency;
    const acks = new AckSender(this.client, this.subscription, onError);
    const slots = new Slots(concurrency);
    const running = new Set<Promise<void>>();
    const backoff = new Backoff();
    // The stream open at the abort stays open until the running handlers are settled:
    // closing it gives its leases back, and an ack after that would be stale.
    let openAtAbort: ClientReadableStream<unknown> | undefined;
    let failure: GatewayError | undefined;

    reading: while (!signal?.aborted) {
      const stream: ClientReadableStream<unknown> = this.client.Subscribe(
        { subscription: this.subscription, maxInFlight },
        callMetadata(this.client),
      );
      const reader = new StreamReader(stream);
      for (;;) {
        const next = await reader.next(signal);
        if (next.kind === 'aborted') {
          openAtAbort = stream;
          break reading;
        }
        if (next.kind === 'ended') {
          const error = next.error;
          if (error && !isTransient(error)) {
            failure = new GatewayError(error, { cause: error });
            break reading;
          }
          onError(error ? new GatewayError(error, { cause: error }) : new Error('the delivery stream ended'));
          break;
        }
        backoff.reset();
        const delivery = fromDelivery(next.message);
        const lease = new LeaseKeeper(this.client, this.subscription, delivery, onError);
        // Waiting for a free handler ends at the abort too: no handler starts after it,
        // and closing the stream gives this delivery back.
        if (!(await slots.acquire(signal))) {
          lease.stop();
          openAtAbort = stream;
          break reading;
        }
        const task = this.handle(handler, delivery, lease, ack ? acks : undefined, onError).finally(
          () => {
            running.delete(task);
            slots.release();
          },
        );
        running.add(task);
      }
      stream.cancel();
      await sleep(backoff.delay(), signal);
    }
    // Drain: running handlers finish and are settled, acks go out; then the stream
    // closes and gives back what was never handled.
    while (running.size > 0) await Promise.all(running);
    await acks.close();
    openAtAbort?.cancel();
    if (failure) throw failure;
  }

  /** Runs the handler for one delivery and settles it; never rejects. */
  private async handle(
    handler: Handler,
    delivery: Delivery,
    lease: LeaseKeeper,
    acks: AckSender | undefined,
    onError: (error: Error) => void,
  ): Promise<void> {
    let failed: unknown;
    let succeeded = false;
    try {
      await handler(delivery);
      succeeded = true;
    } catch (error) {
      failed = error;
    } finally {
      lease.stop();
    }
    if (succeeded) {
      acks?.add(delivery.ackId);
      return;
    }
    const error = failed instanceof HandlerError ? failed : undefined;
    const request = {
      subscription: this.subscription,
      ackId: delivery.ackId,
      reason: reasonOf(failed),
      retryAfter: error?.retryAfterMs === undefined ? null : toDuration(error.retryAfterMs),
      deadLetter: error?.permanent ?? false,
    };
    const backoff = new Backoff();
    for (let attempt = 1; ; attempt += 1) {
      try {
        await unary(this.client, 'Nack', request, { timeoutMs: 30_000 });
        return;
      } catch (nackError) {
        const status = nackError as ServiceError;
        // Stale (FAILED_PRECONDITION): the lease is gone, the event comes back anyway.
        if (!isTransient(status) || attempt >= SETTLE_ATTEMPTS) {
          onError(new GatewayError(status, { cause: nackError }));
          return;
        }
        await sleep(backoff.delay());
      }
    }
  }
}

/** What a Nack records as the delivery's last error: the error's message, bounded. */
function reasonOf(error: unknown): string {
  const text = error instanceof Error ? error.message || error.name : String(error);
  const bytes = Buffer.from(text, 'utf8');
  if (bytes.length <= MAX_REASON_BYTES) return text;
  // Cut on a character boundary.
  return bytes.subarray(0, MAX_REASON_BYTES).toString('utf8').replace(/\uFFFD$/, '');
}

/**
 * A database failure of the consuming transaction. `outbox_consume` refusing its
 * arguments (SQLSTATE 22023: an ack id of a deleted subscription, say) cannot pass and
 * dead-letters; anything else (a lost connection, a serialization failure) may.
 */
function databaseError(error: unknown): unknown {
  if ((error as { code?: unknown })?.code === '22023') {
    return new HandlerError((error as Error).message, { permanent: true, cause: error });
  }
  return error;
}

/** Deliveries of one Subscribe stream, taken one at a time. */
class StreamReader {
  private readonly queue: unknown[] = [];
  private ended = false;
  private error: ServiceError | undefined;
  private wake: (() => void) | undefined;

  constructor(stream: ClientReadableStream<unknown>) {
    const wake = () => {
      this.wake?.();
      this.wake = undefined;
    };
    stream.on('data', (message) => {
      this.queue.push(message);
      wake();
    });
    stream.on('error', (error: ServiceError) => {
      this.error ??= error;
      this.ended = true;
      wake();
    });
    stream.on('end', () => {
      this.ended = true;
      wake();
    });
  }

  async next(
    signal: AbortSignal | undefined,
  ): Promise<
    | { kind: 'delivery'; message: unknown }
    | { kind: 'aborted' }
    | { kind: 'ended'; error: ServiceError | undefined }
  > {
    for (;;) {
      if (signal?.aborted) return { kind: 'aborted' };
      // Deliveries still queued when the stream failed were given back with it.
      if (this.ended) return { kind: 'ended', error: this.error };
      if (this.queue.length > 0) return { kind: 'delivery', message: this.queue.shift() };
      await wakeOrAbort(signal, (wake) => (this.wake = wake));
    }
  }
}

/** A counting semaphore whose waits end at an abort. */
class Slots {
  private readonly waiting: Array<() => void> = [];

  constructor(private free: number) {}

  /** Takes a slot; false when `signal` aborted first. */
  async acquire(signal: AbortSignal | undefined): Promise<boolean> {
    while (this.free === 0) {
      if (signal?.aborted) return false;
      await wakeOrAbort(signal, (wake) => this.waiting.push(wake));
    }
    if (signal?.aborted) return false;
    this.free -= 1;
    return true;
  }

  release(): void {
    this.free += 1;
    this.waiting.shift()?.();
  }
}

/**
 * Keeps one delivery's lease from running out: from its arrival until it is settled,
 * every half lease it extends the lease by the length it was granted with.
 */
class LeaseKeeper {
  private readonly timer: NodeJS.Timeout;

  constructor(client: ServiceClient, subscription: string, delivery: Delivery, onError: (error: Error) => void) {
    const granted = (delivery.ackDeadline?.getTime() ?? Date.now() + 30_000) - Date.now();
    const lease = Math.min(Math.max(granted, MIN_LEASE_MS), MAX_LEASE_MS);
    const request = { subscription, ackIds: [delivery.ackId], extension: toDuration(lease) };
    this.timer = setInterval(() => {
      unary(client, 'ExtendAckDeadline', request, { timeoutMs: lease / 2 }).then(
        (response: { staleAckIds: string[] }) => {
          if (response.staleAckIds.length > 0) {
            onError(new Error(`the lease of ${delivery.ackId} ran out before it could be extended`));
          }
        },
        (error: ServiceError) => onError(new GatewayError(error, { cause: error })),
      );
    }, lease / 2);
  }

  stop(): void {
    clearInterval(this.timer);
  }
}

/**
 * Sends acks in batches. Ack ids the gateway could not take now (unavailable, or its
 * source unreachable) are sent again a few times; an ack that never arrives only costs a
 * redelivery once its lease runs out.
 */
class AckSender {
  private queue: Array<{ ackId: string; tries: number }> = [];
  private timer: NodeJS.Timeout | undefined;
  private sending: Promise<void> = Promise.resolve();
  private readonly backoff = new Backoff();

  constructor(
    private readonly client: ServiceClient,
    private readonly subscription: string,
    private readonly onError: (error: Error) => void,
  ) {}

  add(ackId: string): void {
    this.queue.push({ ackId, tries: 0 });
    this.schedule(this.queue.length >= ACK_BATCH ? 0 : ACK_FLUSH_MS);
  }

  /** Sends everything queued, retries included, and resolves when done. */
  async close(): Promise<void> {
    clearTimeout(this.timer);
    this.timer = undefined;
    while (this.queue.length > 0) {
      await this.flush();
      if (this.queue.length > 0) await sleep(this.backoff.delay());
    }
    await this.sending;
  }

  private schedule(delayMs: number): void {
    if (this.timer !== undefined && delayMs > 0) return;
    clearTimeout(this.timer);
    this.timer = setTimeout(() => {
      this.timer = undefined;
      void this.flush().then(() => {
        if (this.queue.length > 0) this.schedule(this.backoff.delay());
      });
    }, delayMs);
  }

  /** Sends the queue in batches, one call at a time. */
  private flush(): Promise<void> {
    this.sending = this.sending.then(async () => {
      while (this.queue.length > 0) {
        const batch = this.queue.splice(0, ACK_BATCH);
        const request = { subscription: this.subscription, ackIds: batch.map((entry) => entry.ackId) };
        let again: string[];
        try {
          const response = await unary(this.client, 'Ack', request, { timeoutMs: 30_000 });
          again = response.unavailableAckIds;
          this.backoff.reset();
        } catch (error) {
          const status = error as ServiceError;
          if (!isTransient(status)) {
            this.onError(new GatewayError(status, { cause: error }));
            continue;
          }
          again = request.ackIds;
        }
        const retry = batch.filter((entry) => again.includes(entry.ackId) && ++entry.tries < SETTLE_ATTEMPTS);
        if (again.length > retry.length) {
          this.onError(new Error(`${again.length - retry.length} acks could not be sent; they come back`));
        }
        if (retry.length > 0) {
          this.queue.unshift(...retry);
          // Let the caller wait a backoff before the next try.
          return;
        }
      }
    });
    return this.sending;
  }
}
