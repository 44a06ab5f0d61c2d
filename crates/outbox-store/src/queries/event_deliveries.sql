-- Where one event stands on each of the given subscriptions here: whether the
-- subscription has handed it out (its read position passed it and it is no row of a
-- transaction the subscription still waits for), whether it was skipped as older than
-- the subscription's start time, and its delivery record, if any. Subscriptions without
-- a read position here yield NULL facts. $1 event position, $2 subscription ids.
SELECT s.id AS subscription_id,
       (e.xact_id, e.position) <= (c.cursor_xact_id, c.cursor_position)
           AND NOT EXISTS (SELECT 1
                           FROM unnest(c.pending_xact_ids, c.pending_positions) AS p(xact_id, taken)
                           WHERE p.xact_id = e.xact_id AND e.position > p.taken) AS handed_out,
       (c.not_before IS NOT NULL AND e.created_at < c.not_before) AS skipped,
       d.state, d.attempt, d.due_at, d.due_at <= now() AS overdue, d.last_error,
       d.dead_lettered_at, d.resolved_at, d.resolved_by, d.notes
FROM outbox_events e
CROSS JOIN unnest($2::bigint[]) AS s(id)
LEFT JOIN outbox_cursors c ON c.subscription_id = s.id
LEFT JOIN outbox_delivery_records d ON d.subscription_id = s.id AND d.position = e.position
WHERE e.position = $1
