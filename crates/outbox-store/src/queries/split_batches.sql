-- Moves leased deliveries out of their claim batches (outbox_delivery_batches) into
-- records of their own, with the same lease: attempt 1, the batch's token and deadline.
-- Whatever happens next to them — a nack, an extension, a release, a lease that
-- expired, a requeue, a seek — then happens to records, as it always did; moving does
-- not change what a delivery is, so it needs no transaction with what follows.
-- A batch row left with nothing is deleted and its acks counted (see count_deliveries.sql).
-- $1 subscription id, $2 lease tokens (NULL: any), $3 positions (NULL: all of each
-- chosen row), $4 only rows whose lease expired.
WITH chosen AS (
    SELECT b.lease_token, b.chunk, b.due_at, b.positions,
           CASE WHEN $3::bigint[] IS NULL THEN b.positions
                ELSE ARRAY(SELECT p FROM unnest(b.positions) AS p WHERE p = ANY ($3)) END AS moving
    FROM outbox_delivery_batches b
    WHERE b.subscription_id = $1
      AND ($2::bigint[] IS NULL OR b.lease_token = ANY ($2))
      AND ($3::bigint[] IS NULL OR b.positions && $3)
      AND (NOT $4 OR b.due_at <= now())
    FOR UPDATE OF b
),
moved AS (
    INSERT INTO outbox_deliveries (subscription_id, position, state, attempt, lease_token, due_at)
    SELECT $1, m.position, 'in_flight', 1, c.lease_token, c.due_at
    FROM chosen c
    CROSS JOIN unnest(c.moving) AS m(position)
    ON CONFLICT (subscription_id, position) DO NOTHING
    RETURNING position
),
emptied AS (
    DELETE FROM outbox_delivery_batches b
    USING chosen c
    WHERE b.subscription_id = $1 AND b.lease_token = c.lease_token AND b.chunk = c.chunk
      AND cardinality(c.moving) = cardinality(c.positions)
    RETURNING b.acked
),
shrunk AS (
    UPDATE outbox_delivery_batches b
    SET positions = ARRAY(SELECT p FROM unnest(c.positions) AS p WHERE p <> ALL (c.moving))
    FROM chosen c
    WHERE b.subscription_id = $1 AND b.lease_token = c.lease_token AND b.chunk = c.chunk
      AND cardinality(c.moving) BETWEEN 1 AND cardinality(c.positions) - 1
),
counted AS (
    INSERT INTO outbox_subscription_counters (subscription_id, shard, acked)
    SELECT $1, (pg_backend_pid() % 64)::smallint, sum(acked) FROM emptied HAVING sum(acked) > 0
    ON CONFLICT (subscription_id, shard)
    DO UPDATE SET acked = outbox_subscription_counters.acked + EXCLUDED.acked
)
SELECT count(*) FROM moved
