-- One page of a subscription's dead letters, oldest first.
-- $1 subscription id, $2 event-type regex (NULL: all), $3 include resolved,
-- $4/$5 page start (dead_lettered_at, position) exclusive (NULL: first page), $6 limit.
SELECT d.attempt, d.last_error, d.dead_lettered_at, d.resolved_at, d.resolved_by, d.notes,
       d.position,
       e.id, e.aggregate_type, e.aggregate_id, e.aggregate_version, e.event_type, e.payload,
       e.content_type, e.metadata, e.occurred_at, e.created_at
FROM outbox_deliveries d
JOIN outbox_events e ON e.position = d.position
WHERE d.subscription_id = $1
  AND d.state = 'dead'
  AND ($2::text IS NULL OR e.event_type ~ $2)
  AND ($3 OR d.resolved_at IS NULL)
  AND ($4::timestamptz IS NULL OR (d.dead_lettered_at, d.position) > ($4, $5))
ORDER BY d.dead_lettered_at, d.position
LIMIT $6
