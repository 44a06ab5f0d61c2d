-- Turns expired leases of one subscription into retries due now — or dead letters when
-- they used the last attempt and their type is not persistent — so crashed gateways'
-- work flows again and figures stay true even when no stream is asking.
-- $1 subscription id, $2 max attempts (0: unlimited), $3 persistent regex (NULL: none).
WITH expired AS (
    SELECT d.position,
           ($2 > 0 AND d.attempt >= $2 AND ($3::text IS NULL OR e.event_type !~ $3)) AS exhausted
    FROM outbox_deliveries d
    JOIN outbox_events e ON e.position = d.position
    WHERE d.subscription_id = $1 AND d.state = 'in_flight' AND d.due_at <= now()
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE outbox_deliveries d
SET state = CASE WHEN x.exhausted THEN 'dead' ELSE 'retry' END,
    due_at = CASE WHEN x.exhausted THEN NULL ELSE now() END,
    lease_token = NULL,
    last_error = 'ack deadline exceeded',
    dead_lettered_at = CASE WHEN x.exhausted THEN now() END,
    updated_at = now()
FROM expired x
WHERE d.subscription_id = $1 AND d.position = x.position
RETURNING d.state, d.ordering_key
