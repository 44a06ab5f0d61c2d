-- The relay no longer waits for the oldest transaction still open in the cluster.
--
-- A subscription's read position becomes its cursor plus the transactions that were
-- still running when the cursor passed them: `pending_xact_ids`, with, for each, the
-- position up to which its rows were already handed out (`pending_positions`, 0 for
-- none). Their rows are picked up by xact_id once they finish. Existing cursors were
-- below every running transaction, so nothing is pending for them.
ALTER TABLE outbox_subscriptions
    ADD COLUMN pending_xact_ids bigint[] NOT NULL DEFAULT '{}',
    ADD COLUMN pending_positions bigint[] NOT NULL DEFAULT '{}',
    ADD CONSTRAINT outbox_subscriptions_pending_shape
        CHECK (cardinality(pending_xact_ids) = cardinality(pending_positions));

-- Events of an aggregate no longer become visible in transaction-id order (a transaction
-- that started earlier may commit later), so waiting records on ordered subscriptions
-- are released in the order they were created: the order their events became visible.
CREATE SEQUENCE outbox_delivery_seq;
ALTER TABLE outbox_deliveries ADD COLUMN seq bigint;
UPDATE outbox_deliveries d
SET seq = ordered.seq
FROM (SELECT d2.subscription_id, d2.position,
             row_number() OVER (ORDER BY e.xact_id, e.position) AS seq
      FROM outbox_deliveries d2 JOIN outbox_events e ON e.position = d2.position) ordered
WHERE d.subscription_id = ordered.subscription_id AND d.position = ordered.position;
SELECT setval('outbox_delivery_seq', greatest((SELECT max(seq) FROM outbox_deliveries), 1));
ALTER TABLE outbox_deliveries
    ALTER COLUMN seq SET DEFAULT nextval('outbox_delivery_seq'),
    ALTER COLUMN seq SET NOT NULL;
ALTER SEQUENCE outbox_delivery_seq OWNED BY outbox_deliveries.seq;

DROP INDEX outbox_deliveries_ordering;
CREATE INDEX outbox_deliveries_ordering
    ON outbox_deliveries (subscription_id, ordering_key, seq) WHERE ordering_key IS NOT NULL;

COMMENT ON COLUMN outbox_events.xact_id IS
    'Writing transaction id, set by default; the relay reads rows in (xact_id, position) order and picks up rows of transactions that were still running when it passed them once they finish.';
