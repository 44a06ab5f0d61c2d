// Which failures are worth retrying, and the one backoff policy of the client (the
// publisher's retries and the subscriber's reconnects), as in the Rust client.
import { status as Status } from '@grpc/grpc-js';

const FIRST_DELAY_MS = 100;
const MAX_DELAY_MS = 10_000;

/**
 * Calls worth retrying: the gateway or its database may come back. A connection cut
 * mid-call surfaces as UNKNOWN or CANCELLED too, and a stream reset by a gateway that
 * shuts down as INTERNAL with an HTTP/2 error (the gateway's own internal errors never
 * mention one).
 */
export function isTransient(error: { code?: number; details?: string }): boolean {
  switch (error.code) {
    case Status.UNAVAILABLE:
    case Status.RESOURCE_EXHAUSTED:
    case Status.DEADLINE_EXCEEDED:
    case Status.ABORTED:
    case Status.UNKNOWN:
    case Status.CANCELLED:
      return true;
    case Status.INTERNAL:
      return /h2 protocol error|http2|rst_stream|stream closed/i.test(error.details ?? '');
    default:
      return false;
  }
}

/** Delays doubling from 100 ms to at most 10 s; starts over after `reset`. */
export class Backoff {
  private next = FIRST_DELAY_MS;

  /** How long to wait before the next attempt. */
  delay(): number {
    const delay = this.next;
    this.next = Math.min(this.next * 2, MAX_DELAY_MS);
    return delay;
  }

  /** The last attempt worked: the next failure waits the shortest delay again. */
  reset(): void {
    this.next = FIRST_DELAY_MS;
  }
}

/** Resolves after `ms`, or at once when `signal` aborts (never rejects). */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve();
    const done = () => {
      clearTimeout(timer);
      signal?.removeEventListener('abort', done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal?.addEventListener('abort', done, { once: true });
  });
}

/**
 * Resolves when `register`'s callback is called or `signal` aborts, whichever comes
 * first, leaving no listener behind on the signal (a run waits on it once per delivery).
 */
export function wakeOrAbort(signal: AbortSignal | undefined, register: (wake: () => void) => void): Promise<void> {
  return new Promise((resolve) => {
    const done = () => {
      signal?.removeEventListener('abort', done);
      resolve();
    };
    register(done);
    signal?.addEventListener('abort', done, { once: true });
  });
}
