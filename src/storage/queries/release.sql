-- Gives the leases of a finished stream back at once: deliverable again immediately.
-- $1 subscription id, $2 positions, $3 lease token.
UPDATE outbox_deliveries d
SET state = 'retry', due_at = now(), lease_token = NULL, updated_at = now()
WHERE d.subscription_id = $1
  AND d.position = ANY ($2::bigint[])
  AND d.lease_token = $3
  AND d.state = 'in_flight'
