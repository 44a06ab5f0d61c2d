-- Reads what was committed in this source past a read position, for every subscription
-- at once: the relay's scout (see outbox-core's delivery/scout.rs) looks at each new row's type,
-- aggregate type and metadata to wake only the subscriptions it concerns, and to move
-- the read positions of subscriptions it does not concern without a claim of theirs.
--
-- The read position has exactly the shape and rules of a subscription's (claim_new.sql),
-- without a filter: a cursor in (xact_id, position) order plus the transactions still
-- running when the cursor passed them, with how far each one's rows were read. What
-- this statement returns therefore tells, for any subscription whose position it
-- covers, every row that subscription would read next.
--
-- $1/$2 cursor (xact_id, position), $3 pending transaction ids, $4 the position up to
-- which each pending transaction's rows were already read (0: none), $5 most rows.
WITH snapshot AS MATERIALIZED (
    SELECT pg_current_snapshot() AS s
),
pending AS (
    SELECT p.xact_id, p.taken,
           pg_visible_in_snapshot(p.xact_id::text::xid8, (SELECT s FROM snapshot)) AS finished
    FROM unnest($3::bigint[], $4::bigint[]) AS p(xact_id, taken)
),
-- Rows of remembered transactions that have finished since, in reading order.
late AS (
    SELECT l.*
    FROM pending p
    CROSS JOIN LATERAL (
        SELECT e.xact_id, e.position, e.event_type, e.aggregate_type, e.metadata
        FROM outbox_events e
        WHERE (e.xact_id, e.position) > (p.xact_id, p.taken) AND e.xact_id <= p.xact_id
        ORDER BY e.xact_id, e.position
        LIMIT $5
    ) l
    WHERE p.finished
    ORDER BY l.xact_id, l.position
    LIMIT $5
),
-- Committed rows past the cursor; they all come after the late rows in reading order.
fresh AS (
    SELECT e.xact_id, e.position, e.event_type, e.aggregate_type, e.metadata
    FROM outbox_events e
    WHERE (e.xact_id, e.position) > ($1, $2)
    ORDER BY e.xact_id, e.position
    LIMIT $5
),
candidates AS (
    SELECT c.*, row_number() OVER (ORDER BY c.xact_id, c.position) AS n
    FROM (SELECT *, true AS is_late FROM late
          UNION ALL
          SELECT *, false AS is_late FROM fresh) c
),
batch AS (
    SELECT * FROM candidates WHERE n <= $5
),
outcome AS (
    SELECT (SELECT count(*) FROM candidates) = (SELECT count(*) FROM batch) AS took_all,
           (SELECT count(*) FROM late) < $5 AS late_complete,
           (SELECT count(*) FROM fresh) < $5 AS fresh_complete,
           (SELECT max(xact_id) FROM late) AS last_late_xact_id
),
-- Without a filter, the last fresh row read is the newest visible one when nothing was
-- left out; otherwise reading stops there too.
last_taken AS (
    SELECT b.xact_id, b.position FROM batch b WHERE NOT b.is_late
    ORDER BY b.xact_id DESC, b.position DESC
    LIMIT 1
),
cursor_at AS (
    SELECT c.xact_id, c.position
    FROM (SELECT * FROM last_taken
          UNION ALL SELECT $1::bigint, $2::bigint) AS c(xact_id, position)
    ORDER BY c.xact_id DESC, c.position DESC
    LIMIT 1
),
-- As in claim_new.sql: a finished transaction stays pending until all its rows were read.
still_pending AS (
    SELECT p.xact_id,
           coalesce((SELECT max(b.position) FROM batch b
                     WHERE b.is_late AND b.xact_id = p.xact_id), p.taken) AS taken
    FROM pending p, outcome o
    WHERE NOT p.finished
       OR EXISTS (SELECT 1 FROM candidates c
                  WHERE c.is_late AND c.xact_id = p.xact_id AND c.n > (SELECT count(*) FROM batch))
       OR (NOT o.late_complete AND p.xact_id >= o.last_late_xact_id)
    UNION ALL
    -- Transactions running now that the cursor has passed.
    SELECT x.xact_id, 0
    FROM (SELECT r::text::bigint AS xact_id FROM pg_snapshot_xip((SELECT s FROM snapshot)) r) x,
         cursor_at
    WHERE x.xact_id < cursor_at.xact_id
      AND x.xact_id <> ALL ($3::bigint[])
),
summary AS (
    SELECT cursor_at.xact_id AS cursor_xact_id, cursor_at.position AS cursor_position,
           n.xact_ids AS pending_xact_ids, n.positions AS pending_positions,
           o.took_all AND o.late_complete AND o.fresh_complete AS complete
    FROM cursor_at, outcome o,
         (SELECT coalesce(array_agg(xact_id ORDER BY xact_id), '{}') AS xact_ids,
                 coalesce(array_agg(taken ORDER BY xact_id), '{}') AS positions
          FROM still_pending) n
)
SELECT s.cursor_xact_id, s.cursor_position, s.pending_xact_ids, s.pending_positions,
       s.complete, b.position, b.event_type, b.aggregate_type, b.metadata
FROM summary s
LEFT JOIN batch b ON true
ORDER BY b.xact_id, b.position
