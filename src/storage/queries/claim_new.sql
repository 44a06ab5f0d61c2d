-- Claims the next events of one subscription past its cursor and below the read horizon,
-- records their deliveries and moves the cursor, in one statement. The caller holds the
-- subscription row lock and binds the cursor as parameters (joining it would turn the
-- index range below into a filter over every earlier event).
--
-- $1 subscription id, $2/$3 cursor (xact_id, position), $4 batch limit,
-- $5 event-type regex (NULL: all), $6 aggregate types (empty: all), $7 metadata match (NULL: all),
-- $8 not_before (NULL: none), $9 lease token, $10 ack deadline in ms, $11 ordered.
WITH horizon AS (
    -- Every transaction below this id has finished: rows below it can no longer appear.
    SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS xact_id
),
batch AS (
    SELECT e.xact_id, e.position, e.aggregate_type, e.aggregate_id
    FROM outbox_events e
    WHERE (e.xact_id, e.position) > ($2, $3)
      AND e.xact_id < (SELECT xact_id FROM horizon)
      AND ($5::text IS NULL OR e.event_type ~ $5)
      AND (cardinality($6::text[]) = 0 OR e.aggregate_type = ANY ($6))
      AND ($7::jsonb IS NULL OR e.metadata @> $7)
      AND ($8::timestamptz IS NULL OR e.created_at >= $8)
    ORDER BY e.xact_id, e.position
    LIMIT $4
),
keyed AS (
    SELECT b.position, b.xact_id,
           CASE WHEN $11 THEN hashtextextended(b.aggregate_type || E'\x1f' || b.aggregate_id, 0) END
               AS ordering_key
    FROM batch b
),
decided AS (
    -- On ordered subscriptions an event goes out only when it is the first of its
    -- aggregate in this batch and its aggregate has nothing unfinished; dead letters do
    -- not hold an aggregate back.
    SELECT k.position, k.ordering_key,
           k.ordering_key IS NULL
           OR (row_number() OVER (PARTITION BY k.ordering_key ORDER BY k.xact_id, k.position) = 1
               AND NOT EXISTS (SELECT 1 FROM outbox_deliveries d
                               WHERE d.subscription_id = $1
                                 AND d.ordering_key = k.ordering_key
                                 AND d.state <> 'dead')) AS deliver_now
    FROM keyed k
),
inserted AS (
    INSERT INTO outbox_deliveries (subscription_id, position, state, attempt, lease_token,
                                   due_at, ordering_key)
    SELECT $1, d.position,
           CASE WHEN d.deliver_now THEN 'in_flight' ELSE 'waiting' END,
           CASE WHEN d.deliver_now THEN 1 ELSE 0 END,
           CASE WHEN d.deliver_now THEN $9::bigint END,
           CASE WHEN d.deliver_now THEN now() + $10 * interval '1 millisecond' END,
           d.ordering_key
    FROM decided d
    -- A record left from before a seek keeps its state.
    ON CONFLICT (subscription_id, position) DO NOTHING
    RETURNING position, state, attempt, due_at
),
new_cursor AS (
    -- The last claimed event when the batch is full; otherwise every event below the
    -- horizon was considered, so the cursor may pass the last of them.
    SELECT c.xact_id, c.position
    FROM ((SELECT b.xact_id, b.position FROM batch b
           ORDER BY b.xact_id DESC, b.position DESC LIMIT 1)
          UNION ALL
          (SELECT e.xact_id, e.position FROM outbox_events e
           WHERE e.xact_id < (SELECT xact_id FROM horizon)
             AND (SELECT count(*) FROM batch) < $4
           ORDER BY e.xact_id DESC, e.position DESC LIMIT 1)) AS c
    WHERE (c.xact_id, c.position) > ($2, $3)
    ORDER BY c.xact_id DESC, c.position DESC
    LIMIT 1
),
advanced AS (
    UPDATE outbox_subscriptions s
    SET cursor_xact_id = n.xact_id, cursor_position = n.position
    FROM new_cursor n
    WHERE s.id = $1
    RETURNING s.id
)
-- The events are read back by position rather than joined with `batch`: the batch's
-- row estimate is often 1, and a nested loop over two CTEs compares every pair.
SELECT i.position, i.attempt, i.due_at,
       e.id, e.aggregate_type, e.aggregate_id, e.aggregate_version, e.event_type, e.payload,
       e.content_type, e.metadata, e.occurred_at, e.created_at
FROM inserted i
JOIN outbox_events e ON e.position = i.position
WHERE i.state = 'in_flight'
ORDER BY e.xact_id, e.position
