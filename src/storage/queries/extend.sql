-- Moves the deadline of leased deliveries (compare-and-set like ack, and found the same
-- way: by primary-key probes, then by row address).
-- $1 subscription id, $2 positions, $3 attempts, $4 lease tokens, $5 extension in ms.
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
UPDATE outbox_deliveries d
SET due_at = now() + $5 * interval '1 millisecond', updated_at = now()
WHERE d.ctid = ANY (ARRAY(SELECT ctid FROM leased))
  AND d.state = 'in_flight'
  AND d.lease_token = ANY ($4::bigint[])
RETURNING d.position, d.due_at
