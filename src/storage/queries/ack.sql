-- Settles leased deliveries: compare-and-set on attempt, lease token and an unexpired
-- lease; anything else is stale and left alone. Counts the acks on this connection's
-- counter shard (see count_deliveries.sql).
-- $1 subscription id, $2 positions, $3 attempts, $4 lease tokens.
--
-- Each ack id is one primary-key probe, and the rows found are deleted by their row
-- address. The probe names only key columns, and its LIMIT keeps the planner from merging
-- it into a join it could reorder: planned on the stale statistics of this high-churn
-- table, a plain join or a probe that mentions due_at walked the due-index, every lease
-- and the dead entries of earlier acks, once per ack. A row changed between the probe and
-- the delete is checked again by the delete's own conditions: a new lease has a token no
-- ack id in this call can carry.
WITH leased AS (
    SELECT l.ctid
    FROM UNNEST($2::bigint[], $3::int[], $4::bigint[]) AS a(position, attempt, lease_token)
    CROSS JOIN LATERAL (
        SELECT d.ctid, d.state, d.attempt, d.lease_token, d.due_at
        FROM outbox_deliveries d
        WHERE d.subscription_id = $1 AND d.position = a.position
        LIMIT 1
    ) l
    WHERE l.attempt = a.attempt
      AND l.lease_token = a.lease_token
      AND l.state = 'in_flight'
      AND l.due_at > now()
),
acked AS (
    DELETE FROM outbox_deliveries d
    WHERE d.ctid = ANY (ARRAY(SELECT ctid FROM leased))
      AND d.state = 'in_flight'
      AND d.lease_token = ANY ($4::bigint[])
    RETURNING d.position, d.ordering_key
),
counted AS (
    INSERT INTO outbox_subscription_counters (subscription_id, shard, acked)
    SELECT $1, (pg_backend_pid() % 64)::smallint, count(*) FROM acked HAVING count(*) > 0
    ON CONFLICT (subscription_id, shard)
    DO UPDATE SET acked = outbox_subscription_counters.acked + EXCLUDED.acked
)
SELECT position, ordering_key FROM acked
