-- The common claim's second statement (see claim_fresh.sql): leases the batch the caller
-- picked from claim_fresh.sql's rows as rows of outbox_delivery_batches, moves the read
-- position and counts the deliveries, in the same transaction and under the same lock.
-- The read position and the pending transactions are computed by the caller from what
-- claim_fresh.sql saw (its rows, newest visible row and running transactions), never
-- from this statement's newer snapshot: a row committed in between was not read, so the
-- cursor must not pass it.
--
-- A claim that followed another (see Store::claim_following) read from where that one
-- left the read position before it committed: it names that position ($10–$13) and
-- leases only when it is still the subscription's, writing nothing otherwise (the claim
-- before it rolled back, or a seek or a replica moved the position since). Returns
-- whether it leased.
--
-- $1 subscription id, $2 positions leased in reading order, $3 lease token, $4 ack
-- deadline in ms, $5/$6 the new cursor (xact_id, position), $7 pending transaction ids
-- and $8 the position up to which each was taken, $9 deliveries already leased by this
-- claim (for the counter), $10/$11/$12/$13 the read position the claim read from
-- (cursor xact_id, position, pending transaction ids and positions; NULL: the claim
-- holds the lock since it read the position itself).
WITH moved AS (
    UPDATE outbox_cursors c
    SET cursor_xact_id = $5, cursor_position = $6,
        pending_xact_ids = $7, pending_positions = $8, updated_at = now()
    WHERE c.subscription_id = $1
      AND ((c.cursor_xact_id, c.cursor_position) IS DISTINCT FROM ($5, $6)
           OR c.pending_xact_ids IS DISTINCT FROM $7::bigint[]
           OR c.pending_positions IS DISTINCT FROM $8::bigint[])
      AND ($10::bigint IS NULL
           OR ((c.cursor_xact_id, c.cursor_position) = ($10, $11)
               AND c.pending_xact_ids = $12::bigint[]
               AND c.pending_positions = $13::bigint[]))
    RETURNING 1
),
leasing AS (
    SELECT $10::bigint IS NULL OR EXISTS (SELECT 1 FROM moved) AS leases
),
batched AS (
    INSERT INTO outbox_delivery_batches (subscription_id, lease_token, chunk, due_at, positions)
    SELECT $1, $3::bigint, (p.n - 1) / 128, now() + $4 * interval '1 millisecond',
           array_agg(p.position ORDER BY p.n)
    FROM unnest($2::bigint[]) WITH ORDINALITY AS p(position, n)
    WHERE (SELECT leases FROM leasing)
    GROUP BY (p.n - 1) / 128
),
-- Deliveries made, on this connection's counter shard (see count_deliveries.sql).
counted AS (
    INSERT INTO outbox_subscription_counters (subscription_id, shard, delivered)
    SELECT $1, (pg_backend_pid() % 64)::smallint, cardinality($2::bigint[]) + $9
    WHERE cardinality($2::bigint[]) + $9 > 0 AND (SELECT leases FROM leasing)
    ON CONFLICT (subscription_id, shard)
    DO UPDATE SET delivered = outbox_subscription_counters.delivered + EXCLUDED.delivered
)
SELECT leases FROM leasing
