-- Settles leased deliveries: compare-and-set on attempt, lease token and an unexpired
-- lease; anything else is stale and left alone. Counts the acks on one counter shard.
-- $1 subscription id, $2 positions, $3 attempts, $4 lease tokens, $5 counter shard.
WITH acked AS (
    DELETE FROM outbox_deliveries d
    USING UNNEST($2::bigint[], $3::int[], $4::bigint[]) AS a(position, attempt, lease_token)
    WHERE d.subscription_id = $1
      AND d.position = a.position
      AND d.attempt = a.attempt
      AND d.lease_token = a.lease_token
      AND d.state = 'in_flight'
      AND d.due_at > now()
    RETURNING d.position, d.ordering_key
),
counted AS (
    INSERT INTO outbox_subscription_counters (subscription_id, shard, acked)
    SELECT $1, $5, count(*) FROM acked HAVING count(*) > 0
    ON CONFLICT (subscription_id, shard)
    DO UPDATE SET acked = outbox_subscription_counters.acked + EXCLUDED.acked
)
SELECT position, ordering_key FROM acked
