-- Settles leased deliveries: compare-and-set on attempt, lease token and an unexpired
-- lease; anything else is stale and left alone. Counts the acks on this connection's
-- counter shard (see count_deliveries.sql).
-- $1 subscription id, $2 positions, $3 attempts, $4 lease tokens.
--
-- Each ack id is one primary-key probe, and the rows found are deleted by their row
-- address. (The LIMIT keeps the planner from flattening the lateral subquery into a join
-- it may reorder.) Planned as a plain join on the stale statistics of this high-churn
-- table, the delete instead read every record of the subscription, and the dead entries
-- of earlier acks with them, on every ack. A row changed between the probe and the
-- delete has moved to a new address and is left alone, like any stale lease.
WITH leased AS (
    SELECT l.ctid
    FROM UNNEST($2::bigint[], $3::int[], $4::bigint[]) AS a(position, attempt, lease_token)
    CROSS JOIN LATERAL (
        SELECT d.ctid
        FROM outbox_deliveries d
        WHERE d.subscription_id = $1
          AND d.position = a.position
          AND d.attempt = a.attempt
          AND d.lease_token = a.lease_token
          AND d.state = 'in_flight'
          AND d.due_at > now()
        LIMIT 1
    ) l
),
acked AS (
    DELETE FROM outbox_deliveries d
    WHERE d.ctid = ANY (ARRAY(SELECT ctid FROM leased))
    RETURNING d.position, d.ordering_key
),
counted AS (
    INSERT INTO outbox_subscription_counters (subscription_id, shard, acked)
    SELECT $1, (pg_backend_pid() % 64)::smallint, count(*) FROM acked HAVING count(*) > 0
    ON CONFLICT (subscription_id, shard)
    DO UPDATE SET acked = outbox_subscription_counters.acked + EXCLUDED.acked
)
SELECT position, ordering_key FROM acked
