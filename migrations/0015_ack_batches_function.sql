-- The batch ack (first leases held in claim batches, outbox_delivery_batches) as a
-- function, so that an ack is one statement, committed on its own. The gateway ran the
-- statement between BEGIN, two SET LOCALs and COMMIT to give it a generic plan: two
-- round trips to the database per ack besides the statement's own. The function's SET
-- clauses give it the same settings: planned once per connection, generic (its parts are
-- written for that), probing the delivery tables by index whatever their size when the
-- plan was made.
--
-- Each batch row named loses the acked positions, in one write whatever their number,
-- and a row left with nothing is deleted and its acks counted. Compare-and-set like every
-- settlement: the row must carry the ack id's token and an unexpired deadline, and the
-- position must still be in it (not acked before, nor moved out to a record of its own,
-- which the gateway settles apart). Rows are locked before they are read, so a
-- concurrent ack or move of the same row is seen, never undone.
--
-- p_positions and p_lease_tokens pair up (attempt 1), no pair twice. Returns the pairs
-- it settled.
CREATE FUNCTION outbox_ack_batches(
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
    locked AS (
        SELECT b.lease_token, b.chunk, b.positions, n.positions AS named
        FROM named n
        JOIN outbox_delivery_batches b
          ON b.subscription_id = p_subscription_id AND b.lease_token = n.lease_token
        WHERE b.positions && n.positions
          AND b.due_at > now()
        FOR UPDATE OF b
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
