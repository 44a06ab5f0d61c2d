-- Settles leased deliveries: compare-and-set on attempt, lease token and an unexpired
-- lease; anything else is stale and left alone. Counts the acks on this connection's
-- counter shard (see count_deliveries.sql). Follows leased.sql, which finds the leases.
,
acked AS (
    DELETE FROM outbox_deliveries d
    WHERE d.ctid = ANY (ARRAY(SELECT ctid FROM leased))
      AND d.state = 'in_flight'
      AND d.lease_token = ANY ($4::bigint[])
    RETURNING d.position, d.attempt, d.lease_token, d.ordering_key
),
counted AS (
    INSERT INTO outbox_subscription_counters (subscription_id, shard, acked)
    SELECT $1, (pg_backend_pid() % 64)::smallint, count(*) FROM acked HAVING count(*) > 0
    ON CONFLICT (subscription_id, shard)
    DO UPDATE SET acked = outbox_subscription_counters.acked + EXCLUDED.acked
)
SELECT position, attempt, lease_token, ordering_key FROM acked
