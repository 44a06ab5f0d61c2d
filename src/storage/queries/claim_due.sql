-- Re-leases deliveries whose lease expired or whose retry is due, oldest first. An
-- expired lease that used the last attempt goes to the dead-letter queue instead
-- (unless its event type is persistent).
--
-- $1 subscription id, $2 limit, $3 lease token, $4 ack deadline in ms,
-- $5 max attempts (0: unlimited), $6 persistent event-type regex (NULL: none).
WITH due AS (
    SELECT d.position, d.state, d.attempt
    FROM outbox_deliveries d
    WHERE d.subscription_id = $1 AND d.due_at <= now()
    ORDER BY d.due_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
judged AS (
    SELECT due.position, due.state AS old_state,
           (due.state = 'in_flight' AND $5 > 0 AND due.attempt >= $5
            AND ($6::text IS NULL OR e.event_type !~ $6)) AS exhausted
    FROM due
    JOIN outbox_events e ON e.position = due.position
),
updated AS (
    UPDATE outbox_deliveries d
    SET state = CASE WHEN j.exhausted THEN 'dead' ELSE 'in_flight' END,
        attempt = CASE WHEN j.exhausted THEN d.attempt ELSE d.attempt + 1 END,
        lease_token = CASE WHEN j.exhausted THEN NULL ELSE $3::bigint END,
        due_at = CASE WHEN j.exhausted THEN NULL ELSE now() + $4 * interval '1 millisecond' END,
        last_error = CASE WHEN j.old_state = 'in_flight' THEN 'ack deadline exceeded'
                          ELSE d.last_error END,
        dead_lettered_at = CASE WHEN j.exhausted THEN now() END,
        updated_at = now()
    FROM judged j
    WHERE d.subscription_id = $1 AND d.position = j.position
    RETURNING d.position, d.state, d.attempt, d.due_at, d.ordering_key
)
SELECT u.position, u.attempt, u.due_at, u.state, u.ordering_key,
       e.id, e.aggregate_type, e.aggregate_id, e.aggregate_version, e.event_type, e.payload,
       e.content_type, e.metadata, e.occurred_at, e.created_at
FROM updated u
JOIN outbox_events e ON e.position = u.position
ORDER BY e.xact_id, e.position
