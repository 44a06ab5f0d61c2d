-- Gives the leases of a finished stream back at once: deliverable again immediately.
-- $1 subscription id, $2 positions, $3 their lease tokens.
UPDATE outbox_deliveries d
SET state = 'retry', due_at = now(), lease_token = NULL, updated_at = now()
FROM UNNEST($2::bigint[], $3::bigint[]) AS l(position, lease_token)
WHERE d.subscription_id = $1
  AND d.position = l.position
  AND d.lease_token = l.lease_token
  AND d.state = 'in_flight'
