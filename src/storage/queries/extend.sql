-- Moves the deadline of leased deliveries (compare-and-set like ack).
-- $1 subscription id, $2 positions, $3 attempts, $4 lease tokens, $5 extension in ms.
UPDATE outbox_deliveries d
SET due_at = now() + $5 * interval '1 millisecond', updated_at = now()
FROM UNNEST($2::bigint[], $3::int[], $4::bigint[]) AS a(position, attempt, lease_token)
WHERE d.subscription_id = $1
  AND d.position = a.position
  AND d.attempt = a.attempt
  AND d.lease_token = a.lease_token
  AND d.state = 'in_flight'
  AND d.due_at > now()
RETURNING d.position, d.due_at
