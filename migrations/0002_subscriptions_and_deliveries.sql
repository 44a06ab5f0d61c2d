-- Durable subscriptions and their delivery records.
--
-- A subscription's cursor (cursor_xact_id, cursor_position) says how far the outbox has
-- been handed out (or filtered away) for it. A delivery record exists only while an event
-- is unfinished for a subscription: in flight, awaiting a retry, waiting behind an earlier
-- event of its aggregate, or dead-lettered. An ack deletes the record, so this table
-- stays small however many events flow through.

CREATE TABLE outbox_subscriptions (
    id                     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name                   text NOT NULL UNIQUE
                           CHECK (name ~ '^[a-z0-9][a-z0-9._-]{0,127}$'),
    event_types            text[] NOT NULL DEFAULT '{}',
    aggregate_types        text[] NOT NULL DEFAULT '{}',
    metadata_match         jsonb NOT NULL DEFAULT '{}',
    ack_deadline_ms        bigint NOT NULL CHECK (ack_deadline_ms > 0),
    max_attempts           integer NOT NULL CHECK (max_attempts >= 0),
    retry_backoff_min_ms   bigint NOT NULL CHECK (retry_backoff_min_ms >= 0),
    retry_backoff_max_ms   bigint NOT NULL CHECK (retry_backoff_max_ms >= retry_backoff_min_ms),
    ordered                boolean NOT NULL DEFAULT false,
    persistent_event_types text[] NOT NULL DEFAULT '{}',
    -- Everything at or before this point in (xact_id, position) order has been handed out.
    cursor_xact_id         bigint NOT NULL,
    cursor_position        bigint NOT NULL,
    -- Events created before this time are skipped (a start or seek by time).
    not_before             timestamptz,
    created_at             timestamptz NOT NULL DEFAULT now(),
    updated_at             timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE outbox_deliveries (
    subscription_id  bigint NOT NULL,
    position         bigint NOT NULL,
    -- in_flight: leased until due_at; retry: deliverable again from due_at;
    -- waiting: behind an unfinished earlier event of its aggregate (ordered subscriptions);
    -- dead: in the dead-letter queue.
    state            text NOT NULL CHECK (state IN ('in_flight', 'retry', 'waiting', 'dead')),
    -- Deliveries made so far.
    attempt          integer NOT NULL CHECK (attempt >= 0),
    -- Names the lease holder; part of every ack id so settling is compare-and-set.
    lease_token      bigint,
    -- Lease deadline (in_flight) or retry time (retry); NULL otherwise.
    due_at           timestamptz,
    -- Hash of (aggregate_type, aggregate_id) on ordered subscriptions; NULL otherwise.
    ordering_key     bigint,
    last_error       text,
    dead_lettered_at timestamptz,
    resolved_at      timestamptz,
    resolved_by      text,
    notes            text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscription_id, position),
    CHECK ((state IN ('in_flight', 'retry')) = (due_at IS NOT NULL))
);

-- Redelivery: expired leases and due retries, oldest first.
CREATE INDEX outbox_deliveries_due
    ON outbox_deliveries (subscription_id, due_at) WHERE due_at IS NOT NULL;
-- Per-aggregate ordering: is an aggregate busy, and which of its events is next.
CREATE INDEX outbox_deliveries_ordering
    ON outbox_deliveries (subscription_id, ordering_key, position) WHERE ordering_key IS NOT NULL;
-- Dead-letter listings.
CREATE INDEX outbox_deliveries_dead
    ON outbox_deliveries (subscription_id, dead_lettered_at) WHERE state = 'dead';
