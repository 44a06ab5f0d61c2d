-- Rejects one leased delivery (compare-and-set like ack): back to retry after a delay, or
-- to the dead-letter queue when asked for or out of attempts, unless the event type is
-- persistent.
-- $1 subscription id, $2 position, $3 attempt, $4 lease token, $5 reason,
-- $6 retry delay in ms, $7 dead-letter now, $8 max attempts, $9 persistent regex.
WITH target AS (
    SELECT d.position,
           NOT ($9::text IS NOT NULL AND e.event_type ~ $9)
           AND ($7 OR ($8 > 0 AND d.attempt >= $8)) AS to_dead
    FROM outbox_deliveries d
    JOIN outbox_events e ON e.position = d.position
    WHERE d.subscription_id = $1
      AND d.position = $2
      AND d.attempt = $3
      AND d.lease_token = $4
      AND d.state = 'in_flight'
      -- Written so no index can serve it: the record is found by primary key, never by
      -- walking the due-index (see leased.sql).
      AND (d.due_at > now()) IS TRUE
    FOR UPDATE OF d
)
UPDATE outbox_deliveries d
SET state = CASE WHEN t.to_dead THEN 'dead' ELSE 'retry' END,
    due_at = CASE WHEN t.to_dead THEN NULL ELSE now() + $6 * interval '1 millisecond' END,
    lease_token = NULL,
    last_error = $5,
    dead_lettered_at = CASE WHEN t.to_dead THEN now() END,
    updated_at = now()
FROM target t
WHERE d.subscription_id = $1 AND d.position = t.position
RETURNING t.to_dead, d.due_at, d.ordering_key
