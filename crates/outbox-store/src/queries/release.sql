-- Gives the leases of a finished stream back at once: deliverable again immediately, the
-- attempt used (on the last one, the next claim dead-letters it with this error).
-- Found like acks: by primary-key probes, then by row address.
-- $1 subscription id, $2 positions, $3 their lease tokens.
WITH leased AS (
    SELECT l.ctid
    FROM UNNEST($2::bigint[], $3::bigint[]) AS r(position, lease_token)
    CROSS JOIN LATERAL (
        SELECT d.ctid, d.state, d.lease_token
        FROM outbox_deliveries d
        WHERE d.subscription_id = $1 AND d.position = r.position
        LIMIT 1
    ) l
    WHERE l.lease_token = r.lease_token AND l.state = 'in_flight'
)
UPDATE outbox_deliveries d
SET state = 'retry', due_at = now(), lease_token = NULL,
    last_error = 'stream closed before settling', updated_at = now()
WHERE d.ctid = ANY (ARRAY(SELECT ctid FROM leased))
  AND d.state = 'in_flight'
  AND d.lease_token = ANY ($3::bigint[])
