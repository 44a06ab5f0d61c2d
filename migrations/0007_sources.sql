-- Several source databases. Each database the gateway relays from (a "source") keeps its
-- own events, read positions and delivery records, so a claim or an ack is one statement
-- in one database. Subscription definitions stay in the gateway's own database (the
-- source named `default`); every other source holds only read positions and delivery
-- records, keyed by the subscription's id there.

-- Read positions move out of the definitions into a table of their own, present in
-- every source.
CREATE TABLE outbox_cursors (
    subscription_id   bigint PRIMARY KEY,
    -- Everything at or before this point in (xact_id, position) order was handed out,
    -- except rows of the pending transactions below.
    cursor_xact_id    bigint NOT NULL,
    cursor_position   bigint NOT NULL,
    pending_xact_ids  bigint[] NOT NULL DEFAULT '{}',
    pending_positions bigint[] NOT NULL DEFAULT '{}',
    -- Events created before this time are skipped (a start or seek by time).
    not_before        timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT outbox_cursors_pending_shape
        CHECK (cardinality(pending_xact_ids) = cardinality(pending_positions))
);

INSERT INTO outbox_cursors (subscription_id, cursor_xact_id, cursor_position,
                            pending_xact_ids, pending_positions, not_before, created_at)
SELECT id, cursor_xact_id, cursor_position, pending_xact_ids, pending_positions, not_before,
       created_at
FROM outbox_subscriptions;

ALTER TABLE outbox_subscriptions
    DROP CONSTRAINT outbox_subscriptions_pending_shape,
    DROP COLUMN cursor_xact_id,
    DROP COLUMN cursor_position,
    DROP COLUMN pending_xact_ids,
    DROP COLUMN pending_positions,
    DROP COLUMN not_before,
    -- The sources a subscription reads (empty: every source, including ones added later).
    ADD COLUMN sources text[] NOT NULL DEFAULT '{}',
    -- How it started, so a source that joins later (or was down when the subscription was
    -- created) starts it the same way: 'latest' (events created from the subscription's
    -- creation on), 'earliest', or 'time' (events created from start_time on).
    ADD COLUMN start_kind text NOT NULL DEFAULT 'latest'
        CHECK (start_kind IN ('latest', 'earliest', 'time')),
    ADD COLUMN start_time timestamptz,
    ADD CONSTRAINT outbox_subscriptions_start_time
        CHECK ((start_kind = 'time') = (start_time IS NOT NULL));
