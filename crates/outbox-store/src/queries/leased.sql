-- The first CTE of ack.sql and extend.sql, which settle or extend the leases named by ack
-- ids: $1 subscription id, $2 positions, $3 attempts, $4 lease tokens.
--
-- Each ack id is one primary-key probe, and the rows found are then changed by their row
-- address. The probe names only key columns, and its LIMIT keeps the planner from merging
-- it into a join it could reorder: planned on the stale statistics of this high-churn
-- table, a plain join or a probe that mentions due_at walked the due-index, every lease
-- and the dead entries of earlier acks, once per ack. A row changed between the probe and
-- the statement's own change is checked again by that statement's conditions: a new
-- lease has a token no ack id in the call can carry.
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
)
