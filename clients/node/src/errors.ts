// The errors the client throws: bad input caught before any call, refusals of the
// gateway, and the error a handler throws to choose how its delivery is retried.
import { status as Status } from '@grpc/grpc-js';
import type { ServiceError } from '@grpc/grpc-js';

/** Base class of every error this package throws. */
export class OutboxError extends Error {
  override name = 'OutboxError';
}

/**
 * Input the client refuses before calling the gateway, e.g. an empty `aggregateId` or a
 * payload of an unsupported type. `field` names the offending field as the caller wrote
 * it, e.g. `events[0].aggregateId`.
 */
export class InvalidArgumentError extends OutboxError {
  override name = 'InvalidArgumentError';
  /** The gRPC code the gateway would have answered with: always INVALID_ARGUMENT. */
  readonly code = Status.INVALID_ARGUMENT;

  constructor(
    /** The offending field, e.g. `events[0].payload`. */
    readonly field: string,
    reason: string,
  ) {
    super(`${field}: ${reason}`);
  }
}

/**
 * The gateway refused a call (or stayed unavailable through every retry). `code` is the
 * gRPC status code (`grpc.status.INVALID_ARGUMENT`, `NOT_FOUND`, ...), `field` the field
 * the gateway named in camelCase (`events[1].eventType`), when it named one.
 */
export class GatewayError extends OutboxError {
  override name = 'GatewayError';
  /** The gRPC status code. */
  readonly code: Status;
  /** The gRPC status code's name, e.g. `INVALID_ARGUMENT`. */
  readonly codeName: string;
  /** The field the gateway named, in camelCase; undefined when it named none. */
  readonly field: string | undefined;
  /** The gateway's message, without the gRPC code prefix. */
  readonly details: string;

  constructor(error: Pick<ServiceError, 'code' | 'details'>, options?: { cause?: unknown }) {
    const codeName = Status[error.code] ?? String(error.code);
    super(`${codeName}: ${error.details}`, options);
    this.code = error.code;
    this.codeName = codeName;
    this.details = error.details;
    this.field = namedField(error.details);
  }
}

/**
 * The gateway's messages start with the field they are about: `events[0].aggregate_id:
 * must be 1 to 255 bytes`. That path in the client's own spelling, or undefined.
 */
function namedField(details: string): string | undefined {
  const match = /^([a-z_][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])?)*): /.exec(
    details ?? '',
  );
  return match?.[1]?.replace(/_([a-z0-9])/g, (_, letter: string) => letter.toUpperCase());
}

/** How a failed delivery is to be retried; see {@link HandlerError}. */
export interface HandlerErrorOptions {
  /** Retrying cannot help: the event goes to the dead-letter queue now. */
  permanent?: boolean;
  /** Retry after this many milliseconds instead of the subscription's backoff. */
  retryAfterMs?: number;
  /** The error that made the handler fail. */
  cause?: unknown;
}

/**
 * Thrown by a handler to say how its delivery is retried. Any other error is nacked
 * with the subscription's backoff; its message becomes the delivery's last error.
 *
 * ```ts
 * throw new HandlerError('unknown currency', { permanent: true }); // dead-letter now
 * throw new HandlerError('rate limited', { retryAfterMs: 30_000 });
 * ```
 */
export class HandlerError extends OutboxError {
  override name = 'HandlerError';
  readonly permanent: boolean;
  readonly retryAfterMs: number | undefined;

  constructor(reason: string, options: HandlerErrorOptions = {}) {
    super(reason, { cause: options.cause });
    this.permanent = options.permanent ?? false;
    this.retryAfterMs = options.retryAfterMs;
  }
}
