-- Hard maximum retention: deletes one bounded batch of events older than the limit
-- whatever their delivery state, with their delivery records, and counts the deleted
-- events some subscription still needed (not yet handed out, or unfinished).
-- $1 maximum retention in ms, $2/$3 the lowest subscription cursor, $4 batch size,
-- $5 transactions some subscription still waits for.
WITH doomed AS (
    SELECT e.position,
           (e.xact_id, e.position) > ($2, $3) OR e.xact_id = ANY ($5::bigint[])
               AS not_handed_out
    FROM outbox_events e
    WHERE e.created_at < now() - $1 * interval '1 millisecond'
    ORDER BY e.xact_id, e.position
    LIMIT $4
),
records AS (
    DELETE FROM outbox_deliveries d USING doomed WHERE d.position = doomed.position
    RETURNING d.position, d.state, d.resolved_at
),
-- Claim batches lose the doomed events (they were in flight); a row left with nothing
-- goes, and its acks are counted as an ack's would be.
batch_rows AS (
    SELECT b.subscription_id, b.lease_token, b.chunk, b.acked,
           ARRAY(SELECT p FROM unnest(b.positions) AS p WHERE p <> ALL (x.positions)) AS remaining,
           ARRAY(SELECT p FROM unnest(b.positions) AS p WHERE p = ANY (x.positions)) AS doomed_here
    FROM outbox_delivery_batches b,
         (SELECT coalesce(array_agg(position), '{}') AS positions FROM doomed) x
    WHERE b.positions && x.positions
    FOR UPDATE OF b
),
batches_emptied AS (
    DELETE FROM outbox_delivery_batches b
    USING batch_rows r
    WHERE b.subscription_id = r.subscription_id AND b.lease_token = r.lease_token
      AND b.chunk = r.chunk AND cardinality(r.remaining) = 0
),
batches_shrunk AS (
    UPDATE outbox_delivery_batches b
    SET positions = r.remaining
    FROM batch_rows r
    WHERE b.subscription_id = r.subscription_id AND b.lease_token = r.lease_token
      AND b.chunk = r.chunk AND cardinality(r.remaining) > 0
),
batch_acks AS (
    INSERT INTO outbox_subscription_counters (subscription_id, shard, acked)
    SELECT r.subscription_id, (pg_backend_pid() % 64)::smallint, sum(r.acked)
    FROM batch_rows r
    WHERE cardinality(r.remaining) = 0
    GROUP BY r.subscription_id
    HAVING sum(r.acked) > 0
    ON CONFLICT (subscription_id, shard)
    DO UPDATE SET acked = outbox_subscription_counters.acked + EXCLUDED.acked
),
events AS (
    DELETE FROM outbox_events e USING doomed WHERE e.position = doomed.position
    RETURNING e.position
),
still_needed AS (
    SELECT count(*) AS n
    FROM doomed
    WHERE doomed.not_handed_out
       OR EXISTS (SELECT 1 FROM batch_rows b WHERE doomed.position = ANY (b.doomed_here))
       OR EXISTS (SELECT 1 FROM records r
                  WHERE r.position = doomed.position
                    AND NOT (r.state = 'dead' AND r.resolved_at IS NOT NULL))
),
counted AS (
    INSERT INTO outbox_gateway_counters (name, value)
    SELECT 'events_force_expired', n FROM still_needed WHERE n > 0
    ON CONFLICT (name) DO UPDATE SET value = outbox_gateway_counters.value + EXCLUDED.value
)
SELECT (SELECT count(*) FROM events) AS deleted, (SELECT n FROM still_needed) AS still_needed
