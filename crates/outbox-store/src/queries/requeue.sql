-- Makes events deliverable again for one subscription with attempts reset: existing
-- records (retry, waiting, dead — never in flight) are reset, missing ones (acked) are
-- recreated. On ordered subscriptions an event goes out only when its aggregate has
-- nothing in flight or awaiting retry and it is the earliest requeued of its aggregate;
-- otherwise it waits its turn. The caller holds the subscription lock.
-- $1 subscription id, $2 positions, $3 ordered.
WITH target AS (
    SELECT e.position, e.xact_id,
           CASE WHEN $3 THEN hashtextextended(e.aggregate_type || E'\x1f' || e.aggregate_id, 0) END
               AS ordering_key
    FROM outbox_events e
    WHERE e.position = ANY ($2::bigint[])
),
decided AS (
    SELECT t.position, t.xact_id, t.ordering_key,
           t.ordering_key IS NULL
           OR (row_number() OVER (PARTITION BY t.ordering_key ORDER BY t.xact_id, t.position) = 1
               AND NOT EXISTS (SELECT 1 FROM outbox_deliveries busy
                               WHERE busy.subscription_id = $1
                                 AND busy.ordering_key = t.ordering_key
                                 AND busy.state IN ('in_flight', 'retry')
                                 AND busy.position <> ALL ($2::bigint[]))) AS deliver_now
    FROM target t
)
INSERT INTO outbox_deliveries (subscription_id, position, state, attempt, due_at, ordering_key)
SELECT $1, d.position,
       CASE WHEN d.deliver_now THEN 'retry' ELSE 'waiting' END,
       0,
       CASE WHEN d.deliver_now THEN now() END,
       d.ordering_key
FROM decided d
ORDER BY d.xact_id, d.position
ON CONFLICT (subscription_id, position) DO UPDATE
SET state = EXCLUDED.state,
    attempt = 0,
    due_at = EXCLUDED.due_at,
    lease_token = NULL,
    dead_lettered_at = NULL,
    resolved_at = NULL,
    resolved_by = NULL,
    notes = NULL,
    updated_at = now()
WHERE outbox_deliveries.state <> 'in_flight'
RETURNING position
