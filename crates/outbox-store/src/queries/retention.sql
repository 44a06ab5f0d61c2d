-- Deletes one bounded batch of events older than the retention period that every
-- subscription has passed and none still needs (in flight, awaiting retry, waiting, or an
-- unresolved dead letter), with their resolved dead letters.
-- $1 retention in ms, $2/$3 the lowest subscription cursor (no subscription: the top),
-- $4 batch size, $5 transactions some subscription still waits for (their rows are
-- behind its cursor but not yet handed out).
WITH needed AS (
    SELECT DISTINCT d.position
    FROM outbox_deliveries d
    WHERE NOT (d.state = 'dead' AND d.resolved_at IS NOT NULL)
    UNION
    SELECT p.position
    FROM outbox_delivery_batches b
    CROSS JOIN unnest(b.positions) AS p(position)
),
doomed AS (
    SELECT e.position
    FROM outbox_events e
    WHERE (e.xact_id, e.position) <= ($2, $3)
      AND e.created_at < now() - $1 * interval '1 millisecond'
      AND e.xact_id <> ALL ($5::bigint[])
      AND NOT EXISTS (SELECT 1 FROM needed n WHERE n.position = e.position)
    ORDER BY e.xact_id, e.position
    LIMIT $4
),
resolved AS (
    DELETE FROM outbox_deliveries d USING doomed WHERE d.position = doomed.position
)
DELETE FROM outbox_events e USING doomed WHERE e.position = doomed.position
