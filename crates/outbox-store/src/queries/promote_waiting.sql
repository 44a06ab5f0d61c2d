-- Makes the next waiting event of each given aggregate deliverable, once that aggregate
-- has nothing in flight or awaiting retry: due now, or at its deliver_at when that is
-- later (it then holds its aggregate until it has gone out). "Next" is the order in which
-- the events became visible to the subscription (`seq`). The caller holds the
-- subscription lock so a concurrent claim cannot slip a new waiting record past this
-- check.
-- $1 subscription id, $2 ordering keys.
UPDATE outbox_deliveries d
SET state = 'retry', due_at = greatest(now(), next.deliver_at), updated_at = now()
FROM (
    SELECT DISTINCT ON (w.ordering_key) w.position, e.deliver_at
    FROM outbox_deliveries w
    JOIN outbox_events e ON e.position = w.position
    WHERE w.subscription_id = $1
      AND w.ordering_key = ANY ($2::bigint[])
      AND w.state = 'waiting'
      AND NOT EXISTS (SELECT 1 FROM outbox_deliveries busy
                      WHERE busy.subscription_id = $1
                        AND busy.ordering_key = w.ordering_key
                        AND busy.state IN ('in_flight', 'retry'))
    ORDER BY w.ordering_key, w.seq
) next
WHERE d.subscription_id = $1 AND d.position = next.position
