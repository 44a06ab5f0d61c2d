-- outbox_ack_batches (0015) found the claim batches an ack names by joining the acked
-- tokens by hash to every batch row of the subscription: its generic plan scanned them
-- all (and the dead versions that acks leave behind) for each ack, so an ack cost more
-- the more deliveries the subscription had in flight — three times as much per event
-- with streams holding 3,000 each as with 1,000. The same function, each token's rows
-- now looked up by the primary key.
CREATE OR REPLACE FUNCTION outbox_ack_batches(
    p_subscription_id bigint,
    p_positions       bigint[],
    p_lease_tokens    bigint[]
) RETURNS TABLE (acked_position bigint, acked_lease_token bigint)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    RETURN QUERY
    WITH named AS (
        SELECT a.lease_token, array_agg(a.position) AS positions
        FROM unnest(p_positions, p_lease_tokens) AS a(position, lease_token)
        GROUP BY a.lease_token
    ),
    -- Each token's rows are found through the primary key by (subscription, token): a
    -- lateral subquery, so that the generic plan cannot join the tokens by hash to every
    -- row of the subscription instead.
    locked AS (
        SELECT b.lease_token, b.chunk, b.positions, n.positions AS named
        FROM named n
        CROSS JOIN LATERAL (
            SELECT b.lease_token, b.chunk, b.positions
            FROM outbox_delivery_batches b
            WHERE b.subscription_id = p_subscription_id
              AND b.lease_token = n.lease_token
              AND b.positions && n.positions
              AND b.due_at > now()
            FOR UPDATE OF b
        ) b
    ),
    -- Each row's positions are split into acked and remaining in one pass: a hash join
    -- of its positions with the acks of its token (an `IN` and a `NOT IN` over all the
    -- acks took two passes and two hashes, `= ANY` compared every position with every
    -- ack).
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
        WHERE b.subscription_id = p_subscription_id
          AND b.lease_token = s.lease_token AND b.chunk = s.chunk
          AND cardinality(s.remaining) = 0
        RETURNING b.acked + cardinality(s.acked) AS acked
    ),
    shrunk AS (
        UPDATE outbox_delivery_batches b
        SET acked = b.acked + cardinality(s.acked), positions = s.remaining
        FROM settled s
        WHERE b.subscription_id = p_subscription_id
          AND b.lease_token = s.lease_token AND b.chunk = s.chunk
          AND cardinality(s.remaining) > 0
    ),
    counted AS (
        INSERT INTO outbox_subscription_counters (subscription_id, shard, acked)
        SELECT p_subscription_id, (pg_backend_pid() % 64)::smallint, sum(acked)
        FROM emptied HAVING sum(acked) > 0
        ON CONFLICT (subscription_id, shard)
        DO UPDATE SET acked = outbox_subscription_counters.acked + EXCLUDED.acked
    )
    SELECT a.position, s.lease_token
    FROM settled s
    CROSS JOIN unnest(s.acked) AS a(position);
END
$$;
