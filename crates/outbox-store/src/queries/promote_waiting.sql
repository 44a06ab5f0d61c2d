-- Makes the next waiting event of each given aggregate deliverable, once that aggregate
-- has nothing in flight or awaiting retry: due now, or at its deliver_at when that is
-- later (it then holds its aggregate until it has gone out). "Next" is the order in which
-- the events became visible to the subscription (`seq`). The caller holds the
-- subscription lock so a concurrent claim cannot slip a new waiting record past this
-- check.
-- Each aggregate costs two index probes (0018's partial indexes): whether it is busy,
-- and its earliest waiting record, so the statement's cost follows the aggregates
-- named, not the events waiting behind them. The record is then updated by nothing but
-- the row id (ctid) it was found at, so that a generic plan made while the table was
-- nearly empty cannot read every record of the subscription for each one (14 s for 75
-- aggregates with 22,500 records waiting, against 3 ms; see claim_due.sql). The caller's
-- lock keeps the record from changing meanwhile.
-- $1 subscription id, $2 ordering keys.
WITH free AS (
    SELECT DISTINCT k.ordering_key
    FROM unnest($2::bigint[]) AS k(ordering_key)
    WHERE NOT EXISTS (SELECT 1 FROM outbox_deliveries busy
                      WHERE busy.subscription_id = $1
                        AND busy.ordering_key = k.ordering_key
                        AND busy.state IN ('in_flight', 'retry')
                        AND busy.ordering_key IS NOT NULL)
), next AS (
    SELECT first.row_id, first.position, e.deliver_at
    FROM free
    CROSS JOIN LATERAL (
        SELECT w.ctid AS row_id, w.position
        FROM outbox_deliveries w
        WHERE w.subscription_id = $1
          AND w.ordering_key = free.ordering_key
          AND w.state = 'waiting'
        ORDER BY w.seq
        LIMIT 1
    ) first
    JOIN outbox_events e ON e.position = first.position
)
UPDATE outbox_deliveries d
SET state = 'retry', due_at = greatest(now(), next.deliver_at), updated_at = now()
FROM next
WHERE d.ctid = next.row_id
