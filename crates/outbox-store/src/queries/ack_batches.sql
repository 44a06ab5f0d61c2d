-- Settles first leases held in claim batches (outbox_delivery_batches): each batch row
-- named loses the acked positions, in one write whatever their number, and a row left
-- with nothing is deleted and its acks counted (see count_deliveries.sql). Compare-and-
-- set like every settlement: the row must carry the ack id's token and an unexpired
-- deadline, and the position must still be in it (not acked before, nor moved out to a
-- record of its own: ack.sql settles those). Rows are locked before they are read, so
-- a concurrent ack or move of the same row is seen, never undone.
-- $1 subscription id, $2 positions, $3 their lease tokens (attempt 1); no pair twice.
WITH named AS (
    SELECT a.lease_token, array_agg(a.position) AS positions
    FROM unnest($2::bigint[], $3::bigint[]) AS a(position, lease_token)
    GROUP BY a.lease_token
),
locked AS (
    SELECT b.lease_token, b.chunk, b.positions, n.positions AS named
    FROM named n
    JOIN outbox_delivery_batches b
      ON b.subscription_id = $1 AND b.lease_token = n.lease_token
    WHERE b.positions && n.positions
      AND b.due_at > now()
    FOR UPDATE OF b
),
-- Each row's positions are split into acked and remaining in one pass: a hash join of
-- its positions with the acks of its token (an `IN` and a `NOT IN` over all the acks took
-- two passes and two hashes, `= ANY` compared every position with every ack).
settled AS (
    SELECT l.lease_token, l.chunk, coalesce(s.acked, '{}') AS acked,
           coalesce(s.remaining, '{}') AS remaining
    FROM locked l
    CROSS JOIN LATERAL (
        SELECT array_agg(p.position) FILTER (WHERE a.position IS NOT NULL) AS acked,
               array_agg(p.position) FILTER (WHERE a.position IS NULL) AS remaining
        FROM unnest(l.positions) AS p(position)
        LEFT JOIN unnest(l.named) AS a(position) ON a.position = p.position
    ) s
),
emptied AS (
    DELETE FROM outbox_delivery_batches b
    USING settled s
    WHERE b.subscription_id = $1 AND b.lease_token = s.lease_token AND b.chunk = s.chunk
      AND cardinality(s.remaining) = 0
    RETURNING b.acked + cardinality(s.acked) AS acked
),
shrunk AS (
    UPDATE outbox_delivery_batches b
    SET acked = b.acked + cardinality(s.acked), positions = s.remaining
    FROM settled s
    WHERE b.subscription_id = $1 AND b.lease_token = s.lease_token AND b.chunk = s.chunk
      AND cardinality(s.remaining) > 0
),
counted AS (
    INSERT INTO outbox_subscription_counters (subscription_id, shard, acked)
    SELECT $1, (pg_backend_pid() % 64)::smallint, sum(acked) FROM emptied HAVING sum(acked) > 0
    ON CONFLICT (subscription_id, shard)
    DO UPDATE SET acked = outbox_subscription_counters.acked + EXCLUDED.acked
)
SELECT a.position, s.lease_token
FROM settled s
CROSS JOIN unnest(s.acked) AS a(position)
