-- Claims the next events of one subscription, records their deliveries (per claim on
-- unordered subscriptions, per event on ordered ones) and moves the subscription's read
-- position (its row of outbox_cursors), in one statement. The caller holds the
-- subscription's lock and binds its read position as parameters (joining it would turn
-- the index range below into a filter over every earlier event).
--
-- The read position is a cursor in (xact_id, position) order plus the transactions that
-- were still running when the cursor passed them ("pending": their rows were invisible
-- then and may appear later). Every row visible in this statement's snapshot is
-- committed, so the cursor moves past all of them, whatever transactions are still
-- open; the running ones it passes are remembered, and their rows are picked up by an
-- index probe on xact_id once they finish. Nothing is skipped and nothing waits for a
-- stranger's transaction; a claim never rescans what it passed.
--
-- $1 subscription id, $2/$3 cursor (xact_id, position), $4 batch limit,
-- $5 event-type regex (NULL: all), $6 aggregate types (empty: all), $7 metadata match
-- (NULL: all), $8 not_before (NULL: none), $9 pending transaction ids, $10 the position
-- up to which each pending transaction's rows were already taken (0: none), $11 lease
-- token, $12 ack deadline in ms, $13 byte budget (the first event is always taken),
-- $14 deliveries already leased by this claim (for the counter), $15 max event age in
-- ms (NULL: none); the first ten are claim_fresh.sql's, in its order. Then $16 ordered,
-- $17 dead-letter expired events, $18 positions the subscription's CEL filter passes
-- over (NULL without a filter), $19 the snapshot they were read in (peek_new.sql; NULL
-- without a filter: the current one), $20 those of $18 the filter failed on.
--
-- The claim runs with a cached generic plan (see GENERIC_PLANS in lib.rs): planning this
-- statement anew took as long as running it. Its optional filters are therefore written
-- as CASE, which the planner estimates as neutral, not as `$n IS NULL OR …`, whose
-- default selectivity makes a generic plan expect one row and read every event past the
-- cursor with a bitmap scan instead of walking the relay-order index to the LIMIT.
--
-- With a snapshot given, only rows visible in it are considered, so the claim decides on
-- exactly the rows the filter was evaluated on. Rows the filter passes over are passed
-- like rows of other types: no record, no bytes, no hold on their aggregate.
--
-- Time controls: an event past its expires_at or the subscription's max event age gets
-- no delivery (a dead letter "expired" with $17, else nothing: it is counted and
-- passed). An event whose deliver_at is ahead gets a never-delivered retry record due
-- then, which the due claim picks up at its time through the due index; it holds back
-- nothing but the later events of its aggregate on ordered subscriptions. Neither takes
-- room or bytes of the batch, but both count against its LIMIT: a batch full of them
-- reports `batch_full` so the caller claims again at once.
WITH snapshot AS MATERIALIZED (
    SELECT coalesce($19::text::pg_snapshot, pg_current_snapshot()) AS s
),
pending AS (
    SELECT p.xact_id, p.taken,
           pg_visible_in_snapshot(p.xact_id::text::xid8, (SELECT s FROM snapshot)) AS finished
    FROM unnest($9::bigint[], $10::bigint[]) AS p(xact_id, taken)
),
-- Rows of remembered transactions that have finished since (committed or not: a rolled
-- back one simply has no rows), in reading order.
late AS (
    SELECT l.*
    FROM pending p
    CROSS JOIN LATERAL (
        SELECT e.xact_id, e.position, e.aggregate_type, e.aggregate_id,
               octet_length(e.payload) AS size, e.created_at, e.deliver_at, e.expires_at
        FROM outbox_events e
        -- The transaction's rows after `taken`, said so that only the relay-order index
        -- can serve it: given `position > taken`, the planner may walk the position index
        -- and filter the whole table for them (when few transactions wrote most rows,
        -- it expects many rows per transaction).
        WHERE (e.xact_id, e.position) > (p.xact_id, p.taken) AND e.xact_id <= p.xact_id
          AND CASE WHEN $5::text IS NULL THEN true ELSE e.event_type ~ $5 END
          AND CASE WHEN cardinality($6::text[]) = 0 THEN true ELSE e.aggregate_type = ANY ($6) END
          AND CASE WHEN $7::jsonb IS NULL THEN true ELSE e.metadata @> $7 END
          AND CASE WHEN $8::timestamptz IS NULL THEN true ELSE e.created_at >= $8 END
        ORDER BY e.xact_id, e.position
        LIMIT $4
    ) l
    WHERE p.finished
    ORDER BY l.xact_id, l.position
    LIMIT $4
),
-- Committed rows past the cursor. Every pending transaction id is below the cursor, so
-- these all come after the late rows in reading order.
fresh AS (
    SELECT e.xact_id, e.position, e.aggregate_type, e.aggregate_id,
           octet_length(e.payload) AS size, e.created_at, e.deliver_at, e.expires_at
    FROM outbox_events e
    WHERE (e.xact_id, e.position) > ($2, $3)
      AND CASE WHEN $19::text IS NULL THEN true
           ELSE pg_visible_in_snapshot(e.xact_id::text::xid8, (SELECT s FROM snapshot)) END
      AND CASE WHEN $5::text IS NULL THEN true ELSE e.event_type ~ $5 END
      AND CASE WHEN cardinality($6::text[]) = 0 THEN true ELSE e.aggregate_type = ANY ($6) END
      AND CASE WHEN $7::jsonb IS NULL THEN true ELSE e.metadata @> $7 END
      AND CASE WHEN $8::timestamptz IS NULL THEN true ELSE e.created_at >= $8 END
    ORDER BY e.xact_id, e.position
    LIMIT $4
),
-- Age counts from when the event became deliverable: its creation, or its deliver_at.
expiring AS (
    -- A hashed subplan: `= ANY` would compare every candidate with every position.
    -- $18 is NULL without a filter, which plans the subplan away.
    SELECT c.*, ($18::bigint[] IS NOT NULL AND c.position IN (SELECT unnest($18::bigint[])))
               AS filtered,
           coalesce(c.expires_at <= now(), false)
           OR coalesce(greatest(c.created_at, c.deliver_at)
                       + $15::bigint * interval '1 millisecond' <= now(), false) AS expired
    FROM (SELECT *, true AS is_late FROM late
          UNION ALL
          SELECT *, false AS is_late FROM fresh) c
),
flagged AS (
    SELECT x.*, NOT x.expired AND NOT x.filtered AND coalesce(x.deliver_at > now(), false)
               AS scheduled
    FROM expiring x
),
-- One window frame for both the count and the running byte sum: two frames cost two
-- passes over the candidates.
candidates AS (
    SELECT c.*, count(*) OVER w AS n,
           sum(CASE WHEN c.expired OR c.scheduled OR c.filtered THEN 0
                    ELSE c.size + 256 END) OVER w
             - CASE WHEN c.expired OR c.scheduled OR c.filtered THEN 0 ELSE c.size + 256 END
               AS bytes_before
    FROM flagged c
    WINDOW w AS (ORDER BY c.xact_id, c.position ROWS UNBOUNDED PRECEDING)
),
batch AS (
    SELECT * FROM candidates WHERE n <= $4 AND (n = 1 OR bytes_before < $13)
),
-- Ordered subscriptions only: the branch of `decided` for the other kind is not run, so
-- an unordered claim neither hashes aggregates nor sorts the batch by them.
keyed AS (
    SELECT b.position, b.xact_id, b.n, b.expired, b.filtered, b.scheduled, b.deliver_at,
           hashtextextended(b.aggregate_type || E'\x1f' || b.aggregate_id, 0) AS ordering_key
    FROM batch b
    WHERE $16
),
decided AS (
    -- On ordered subscriptions an event goes out (or, when scheduled, waits for its time)
    -- only when it is the first unexpired one of its aggregate in this batch and its
    -- aggregate has nothing unfinished; dead letters do not hold an aggregate back.
    -- State NULL: passed over by the filter, or expired and dropped; no record.
    SELECT k.position, k.xact_id, k.n, k.ordering_key, k.deliver_at, k.expired, k.filtered,
           CASE WHEN k.filtered THEN NULL
                WHEN k.expired THEN CASE WHEN $17 THEN 'dead' END
                WHEN row_number() OVER (PARTITION BY k.ordering_key, k.expired OR k.filtered
                                        ORDER BY k.xact_id, k.position) > 1
                     OR EXISTS (SELECT 1 FROM outbox_deliveries d
                                WHERE d.subscription_id = $1
                                  AND d.ordering_key = k.ordering_key
                                  AND d.state <> 'dead') THEN 'waiting'
                WHEN k.scheduled THEN 'retry'
                ELSE 'in_flight'
           END AS state
    FROM keyed k
    UNION ALL
    SELECT b.position, b.xact_id, b.n, NULL, b.deliver_at, b.expired, b.filtered,
           CASE WHEN b.filtered THEN NULL
                WHEN b.expired THEN CASE WHEN $17 THEN 'dead' END
                WHEN b.scheduled THEN 'retry'
                ELSE 'in_flight'
           END
    FROM batch b
    WHERE NOT $16
),
inserted AS (
    -- Records of their own: on ordered subscriptions every event's, elsewhere those of
    -- events that do not go out now. They get their `seq` (the order waiting records are
    -- released in) from the column default, row by row in the order selected here: the
    -- order in which the events became visible to this subscription.
    INSERT INTO outbox_deliveries (subscription_id, position, state, attempt, lease_token,
                                   due_at, ordering_key, last_error, dead_lettered_at)
    SELECT $1, d.position, d.state,
           CASE WHEN d.state = 'in_flight' THEN 1 ELSE 0 END,
           CASE WHEN d.state = 'in_flight' THEN $11::bigint END,
           CASE d.state WHEN 'in_flight' THEN now() + $12 * interval '1 millisecond'
                        WHEN 'retry' THEN d.deliver_at END,
           d.ordering_key,
           CASE WHEN d.state = 'dead' THEN 'expired' END,
           CASE WHEN d.state = 'dead' THEN now() END
    FROM decided d
    WHERE d.state IS NOT NULL AND (d.state <> 'in_flight' OR $16)
    ORDER BY d.xact_id, d.position
    -- A record left from before a seek keeps its state.
    ON CONFLICT (subscription_id, position) DO NOTHING
    RETURNING position, state, attempt, due_at
),
-- Elsewhere the deliveries are leased as rows of up to 128 (see
-- outbox_delivery_batches), not one record each; an event that has a record from before
-- a seek keeps it (a seek moves the subscription's batches into records). Such records
-- are rare: one probe for any record at or past the batch's first position spares the
-- probe per event when there is none. The rows are numbered by `n`, which has gaps where
-- events did not go out, so some rows hold fewer than 128.
batch_slots AS (
    SELECT d.position, d.n
    FROM decided d
    WHERE d.state = 'in_flight' AND NOT $16
      AND ((SELECT NOT EXISTS (SELECT 1 FROM outbox_deliveries x
                               WHERE x.subscription_id = $1
                                 AND x.position >= (SELECT min(b.position) FROM batch b)))
           OR NOT EXISTS (SELECT 1 FROM outbox_deliveries x
                          WHERE x.subscription_id = $1 AND x.position = d.position))
),
batched AS (
    INSERT INTO outbox_delivery_batches (subscription_id, lease_token, chunk, due_at, positions)
    SELECT $1, $11::bigint, (s.n - 1) / 128, now() + $12 * interval '1 millisecond',
           array_agg(s.position ORDER BY s.n)
    FROM batch_slots s
    GROUP BY (s.n - 1) / 128
    RETURNING due_at, positions
),
delivered AS (
    SELECT i.position, i.attempt, i.due_at FROM inserted i WHERE i.state = 'in_flight'
    UNION ALL
    SELECT p.position, 1, b.due_at FROM batched b CROSS JOIN unnest(b.positions) AS p(position)
),
-- Where reading stands after this batch.
outcome AS (
    SELECT (SELECT count(*) FROM candidates) = (SELECT count(*) FROM batch) AS took_all,
           (SELECT count(*) FROM late) < $4 AS late_complete,
           (SELECT count(*) FROM fresh) < $4 AS fresh_complete,
           (SELECT max(xact_id) FROM late) AS last_late_xact_id
),
-- When every committed row past the cursor was considered, the cursor moves past the
-- newest visible row, so filtered-out rows are never scanned twice; otherwise it stops
-- at the last row taken.
visible_end AS (
    SELECT e.xact_id, e.position
    FROM outbox_events e
    WHERE (e.xact_id, e.position) > ($2, $3)
      AND (SELECT took_all AND late_complete AND fresh_complete FROM outcome)
      AND CASE WHEN $19::text IS NULL THEN true
           ELSE pg_visible_in_snapshot(e.xact_id::text::xid8, (SELECT s FROM snapshot)) END
    ORDER BY e.xact_id DESC, e.position DESC
    LIMIT 1
),
last_taken AS (
    SELECT b.xact_id, b.position FROM batch b WHERE NOT b.is_late
    ORDER BY b.xact_id DESC, b.position DESC
    LIMIT 1
),
cursor_at AS (
    SELECT c.xact_id, c.position
    FROM (SELECT * FROM visible_end
          UNION ALL SELECT * FROM last_taken
          UNION ALL SELECT $2::bigint, $3::bigint) AS c(xact_id, position)
    ORDER BY c.xact_id DESC, c.position DESC
    LIMIT 1
),
-- A finished transaction is done when all its rows were taken: none of its candidates
-- was left out, and its candidates were not cut short by the LIMIT of `late`.
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
      AND x.xact_id <> ALL ($9::bigint[])
),
moved AS (
    UPDATE outbox_cursors c
    SET cursor_xact_id = cursor_at.xact_id,
        cursor_position = cursor_at.position,
        pending_xact_ids = n.xact_ids,
        pending_positions = n.positions,
        updated_at = now()
    FROM cursor_at,
         (SELECT coalesce(array_agg(xact_id ORDER BY xact_id), '{}') AS xact_ids,
                 coalesce(array_agg(taken ORDER BY xact_id), '{}') AS positions
          FROM still_pending) n
    WHERE c.subscription_id = $1
      AND ((c.cursor_xact_id, c.cursor_position)
               IS DISTINCT FROM (cursor_at.xact_id, cursor_at.position)
           OR c.pending_xact_ids IS DISTINCT FROM n.xact_ids
           OR c.pending_positions IS DISTINCT FROM n.positions)
    RETURNING c.subscription_id
),
counted AS (
    -- Deliveries made, on this connection's counter shard (see count_deliveries.sql).
    INSERT INTO outbox_subscription_counters (subscription_id, shard, delivered)
    SELECT $1, (pg_backend_pid() % 64)::smallint, count(*) + $14
    FROM delivered
    HAVING count(*) + $14 > 0
    ON CONFLICT (subscription_id, shard)
    DO UPDATE SET delivered = outbox_subscription_counters.delivered + EXCLUDED.delivered
),
-- What became of the batch besides its deliveries, returned on a row of its own. An
-- expired event that already had a record (from before a seek) was not expired by this
-- claim. One pass over each CTE counted.
summary AS (
    SELECT i.expired_dead_lettered,
           (SELECT count(*) FROM decided d
            WHERE d.expired AND NOT d.filtered AND d.state IS NULL
              AND NOT EXISTS (SELECT 1 FROM outbox_deliveries x
                              WHERE x.subscription_id = $1 AND x.position = d.position))
               AS expired_dropped,
           i.next_scheduled,
           (SELECT count(*) FROM batch) >= $4 AS batch_full,
           f.filtered, f.filter_errors, f.last_filter_error_position
    FROM (SELECT count(*) FILTER (WHERE state = 'dead') AS expired_dead_lettered,
                 min(due_at) FILTER (WHERE state = 'retry') AS next_scheduled
          FROM inserted) i,
         (SELECT count(*) AS filtered,
                 count(*) FILTER (WHERE position = ANY ($20)) AS filter_errors,
                 max(position) FILTER (WHERE position = ANY ($20)) AS last_filter_error_position
          FROM decided WHERE filtered) f
)
-- The summary on a row of its own, then the events leased. They are read back by
-- position rather than joined with `batch`: the batch's row estimate is often 1, and a
-- nested loop over two CTEs compares every pair. The rows come unordered (sorting them
-- here cost a tenth of the claim): the caller puts them in reading order by
-- (xact_id, position).
SELECT s.expired_dead_lettered, s.expired_dropped, s.next_scheduled, s.batch_full,
       s.filtered, s.filter_errors, s.last_filter_error_position,
       NULL::bigint AS position, NULL::integer AS attempt, NULL::timestamptz AS due_at,
       NULL::uuid AS id, NULL::text AS aggregate_type, NULL::text AS aggregate_id,
       NULL::bigint AS aggregate_version, NULL::text AS event_type, NULL::bytea AS payload,
       NULL::text AS content_type, NULL::jsonb AS metadata, NULL::timestamptz AS occurred_at,
       NULL::timestamptz AS created_at, NULL::timestamptz AS deliver_at,
       NULL::timestamptz AS expires_at, NULL::bigint AS xact_id
FROM summary s
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       i.position, i.attempt, i.due_at,
       e.id, e.aggregate_type, e.aggregate_id, e.aggregate_version, e.event_type, e.payload,
       e.content_type, e.metadata, e.occurred_at, e.created_at, e.deliver_at, e.expires_at,
       e.xact_id
FROM delivered i
JOIN outbox_events e ON e.position = i.position
