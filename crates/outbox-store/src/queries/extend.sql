-- Moves the deadline of leased deliveries (compare-and-set like ack). Follows leased.sql,
-- which finds the leases. $5 extension in ms.
UPDATE outbox_deliveries d
SET due_at = now() + $5 * interval '1 millisecond', updated_at = now()
WHERE d.ctid = ANY (ARRAY(SELECT ctid FROM leased))
  AND d.state = 'in_flight'
  AND d.lease_token = ANY ($4::bigint[])
RETURNING d.position, d.attempt, d.lease_token, d.due_at
