-- The common claim of an unordered subscription without a CEL filter, in a statement a
-- fraction of claim_new.sql's size: the next committed events past the read position,
-- leased as rows of outbox_delivery_batches, and the read position moved past them.
-- Starting and ending the executor for claim_new.sql's plan cost more than a claim of a
-- hundred events did, on the path nearly every claim takes.
--
-- The batch is picked from narrow rows (position, size, whether special) and the events
-- going out are read again by the index at the end: keeping whole rows, payloads and
-- all, beside the batch until then cost more in copies than reading them twice.
--
-- It declines, writing nothing, whenever claim_new.sql has more to do: a remembered
-- transaction has finished (its rows are read from the pending list), an event of the
-- batch is scheduled or expired, or the subscription has a record at or past the
-- batch's first position (left from before a seek). The caller then runs claim_new.sql,
-- whose comments say why the reading and the read position work as they do.
--
-- $1 subscription id, $2/$3 cursor (xact_id, position), $4 batch limit,
-- $5 event-type regex (NULL: all), $6 aggregate types (empty: all), $7 metadata match
-- (NULL: all), $8 not_before (NULL: none), $9 pending transaction ids, $10 the position
-- up to which each was taken, $11 lease token, $12 ack deadline in ms, $13 byte budget
-- (the first event is always taken), $14 deliveries already leased by this claim (for
-- the counter), $15 max event age in ms (NULL: none).
WITH snapshot AS MATERIALIZED (
    SELECT pg_current_snapshot() AS s
),
candidates AS (
    SELECT f.xact_id, f.position, f.special, count(*) OVER w AS n,
           sum(f.weight) OVER w - f.weight AS bytes_before
    FROM (
        SELECT e.xact_id, e.position, octet_length(e.payload) + 256 AS weight,
               coalesce(e.deliver_at > now(), false)
               OR coalesce(e.expires_at <= now(), false)
               OR coalesce(greatest(e.created_at, e.deliver_at)
                           + $15::bigint * interval '1 millisecond' <= now(), false) AS special
        FROM outbox_events e
        WHERE (e.xact_id, e.position) > ($2, $3)
          AND CASE WHEN $5::text IS NULL THEN true ELSE e.event_type ~ $5 END
          AND CASE WHEN cardinality($6::text[]) = 0 THEN true ELSE e.aggregate_type = ANY ($6) END
          AND CASE WHEN $7::jsonb IS NULL THEN true ELSE e.metadata @> $7 END
          AND CASE WHEN $8::timestamptz IS NULL THEN true ELSE e.created_at >= $8 END
        ORDER BY e.xact_id, e.position
        LIMIT $4
    ) f
    WINDOW w AS (ORDER BY f.xact_id, f.position ROWS UNBOUNDED PRECEDING)
),
batch AS (
    SELECT * FROM candidates WHERE n = 1 OR bytes_before < $13
),
declined AS (
    SELECT EXISTS (SELECT 1 FROM candidates WHERE special)
           OR EXISTS (SELECT 1 FROM unnest($9::bigint[]) AS p(xact_id)
                      WHERE pg_visible_in_snapshot(p.xact_id::text::xid8,
                                                   (SELECT s FROM snapshot)))
           OR EXISTS (SELECT 1 FROM outbox_deliveries x
                      WHERE x.subscription_id = $1
                        AND x.position >= (SELECT min(b.position) FROM batch b)) AS declined
),
batched AS (
    INSERT INTO outbox_delivery_batches (subscription_id, lease_token, chunk, due_at, positions)
    SELECT $1, $11::bigint, (b.n - 1) / 128, now() + $12 * interval '1 millisecond',
           array_agg(b.position ORDER BY b.n)
    FROM batch b
    WHERE NOT (SELECT declined FROM declined)
    GROUP BY (b.n - 1) / 128
),
-- When every committed row past the cursor was taken, the cursor moves past the newest
-- visible one (rows of other types included); otherwise to the last row taken.
visible_end AS (
    SELECT e.xact_id, e.position
    FROM outbox_events e
    WHERE (e.xact_id, e.position) > ($2, $3)
      AND (SELECT count(*) FROM candidates) < $4
      AND (SELECT count(*) FROM candidates) = (SELECT count(*) FROM batch)
    ORDER BY e.xact_id DESC, e.position DESC
    LIMIT 1
),
last_taken AS (
    SELECT b.xact_id, b.position FROM batch b
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
-- No remembered transaction has finished, so all stay, with the running ones passed now.
still_pending AS (
    SELECT p.xact_id, p.taken FROM unnest($9::bigint[], $10::bigint[]) AS p(xact_id, taken)
    UNION ALL
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
      AND NOT (SELECT declined FROM declined)
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
    FROM batch
    HAVING count(*) + $14 > 0 AND NOT (SELECT declined FROM declined)
    ON CONFLICT (subscription_id, shard)
    DO UPDATE SET delivered = outbox_subscription_counters.delivered + EXCLUDED.delivered
)
-- The summary on a row of its own, then the events leased, in reading order; the columns
-- are claim_new.sql's, and whether this statement declined. The batch is the first rows
-- past the read position, so the same reading, cut at the batch's size, finds its events.
SELECT d.declined, 0::bigint AS expired_dead_lettered, 0::bigint AS expired_dropped,
       NULL::timestamptz AS next_scheduled, (SELECT count(*) FROM batch) >= $4 AS batch_full,
       0::bigint AS filtered, 0::bigint AS filter_errors,
       NULL::bigint AS last_filter_error_position,
       NULL::bigint AS position, NULL::integer AS attempt, NULL::timestamptz AS due_at,
       NULL::uuid AS id, NULL::text AS aggregate_type, NULL::text AS aggregate_id,
       NULL::bigint AS aggregate_version, NULL::text AS event_type, NULL::bytea AS payload,
       NULL::text AS content_type, NULL::jsonb AS metadata, NULL::timestamptz AS occurred_at,
       NULL::timestamptz AS created_at, NULL::timestamptz AS deliver_at,
       NULL::timestamptz AS expires_at, NULL::bigint AS xact_id
FROM declined d
UNION ALL
(SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       e.position, 1, now() + $12 * interval '1 millisecond',
       e.id, e.aggregate_type, e.aggregate_id, e.aggregate_version, e.event_type, e.payload,
       e.content_type, e.metadata, e.occurred_at, e.created_at, e.deliver_at, e.expires_at,
       e.xact_id
FROM outbox_events e
WHERE NOT (SELECT declined FROM declined)
  AND (e.xact_id, e.position) > ($2, $3)
  AND CASE WHEN $5::text IS NULL THEN true ELSE e.event_type ~ $5 END
  AND CASE WHEN cardinality($6::text[]) = 0 THEN true ELSE e.aggregate_type = ANY ($6) END
  AND CASE WHEN $7::jsonb IS NULL THEN true ELSE e.metadata @> $7 END
  AND CASE WHEN $8::timestamptz IS NULL THEN true ELSE e.created_at >= $8 END
ORDER BY e.xact_id, e.position
LIMIT (SELECT count(*) FROM batch))
