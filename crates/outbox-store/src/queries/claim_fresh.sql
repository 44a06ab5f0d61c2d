-- The common claim of an unordered subscription without a CEL filter, first of two
-- statements: reads the next committed events past the read position and returns
-- those of the batch, whole, with what the caller needs to decide whether this
-- path may take it. The caller then leases the batch with lease_fresh.sql, in the same
-- transaction, from what this statement saw: its rows, whether it read any it did not
-- return, the newest visible row and the transactions running in its snapshot. One
-- statement that picked the batch, wrote it and then read the events going out a second
-- time cost half as much again as the two.
--
-- The caller declines, writing nothing, and runs claim_new.sql instead whenever that
-- has more to do: a remembered transaction has finished with events not yet taken
-- (`declined`), an event of the batch is scheduled or expired (`special`), or the
-- subscription has a record at or past the batch's first position
-- (`last_record_position`; left from before a seek). A remembered transaction that
-- finished without such events is only forgotten, which the caller does: most are the
-- service's own transactions that wrote no events, or another database's (transaction
-- ids are the server's). claim_new.sql's comments say why the reading and the read
-- position work as they do.
--
-- $1 subscription id, $2/$3 cursor (xact_id, position), $4 batch limit,
-- $5 event-type regex (NULL: all), $6 aggregate types (empty: all), $7 metadata match
-- (NULL: all), $8 not_before (NULL: none), $9 pending transaction ids, $10 the position
-- up to which each was taken, $11 ack deadline in ms, $12 max event age in ms (NULL:
-- none), $13 byte budget.
--
-- The summary comes on a row of its own, without a position, then the batch's events.
--
-- How many events the batch takes is settled before any is sent, from a narrow pass over
-- the rows to read (their count and bytes): all of them when their bytes fit the budget,
-- the common case; otherwise as many as fit, the first always, counted by a second narrow
-- pass with running sums that only then runs. The batch's rows are then read a last time,
-- whole, and streamed: the pages are in memory by then, and a running sum over whole rows
-- (which held every row in a tuple store) cost PostgreSQL 1.6 times as much for 1,000.
-- All three read in the statement's one snapshot, so they see the same rows. A payload
-- stored out of line is measured without being fetched, and only the batch's events are
-- sent. Each pass writes the filter out: one shared (inlined) CTE for the three cost
-- 8–10 % more.
WITH snapshot AS MATERIALIZED (
    SELECT pg_current_snapshot() AS s
),
unread AS MATERIALIZED (
    SELECT count(*) AS events, coalesce(sum(octet_length(r.payload) + 256), 0) AS bytes
    FROM (SELECT e.payload
          FROM outbox_events e
          WHERE (e.xact_id, e.position) > ($2, $3)
            AND CASE WHEN $5::text IS NULL THEN true ELSE e.event_type ~ $5 END
            AND CASE WHEN cardinality($6::text[]) = 0 THEN true ELSE e.aggregate_type = ANY ($6) END
            AND CASE WHEN $7::jsonb IS NULL THEN true ELSE e.metadata @> $7 END
            AND CASE WHEN $8::timestamptz IS NULL THEN true ELSE e.created_at >= $8 END
          ORDER BY e.xact_id, e.position
          LIMIT $4) r
),
-- The first events while the bytes before each stay within $13.
within_budget AS MATERIALIZED (
    SELECT count(*) AS events
    FROM (SELECT row_number() OVER w AS n,
                 sum(octet_length(r.payload) + 256) OVER w - (octet_length(r.payload) + 256)
                     AS bytes_before
          FROM (SELECT e.xact_id, e.position, e.payload
                FROM outbox_events e
                WHERE (e.xact_id, e.position) > ($2, $3)
                  AND CASE WHEN $5::text IS NULL THEN true ELSE e.event_type ~ $5 END
                  AND CASE WHEN cardinality($6::text[]) = 0 THEN true ELSE e.aggregate_type = ANY ($6) END
                  AND CASE WHEN $7::jsonb IS NULL THEN true ELSE e.metadata @> $7 END
                  AND CASE WHEN $8::timestamptz IS NULL THEN true ELSE e.created_at >= $8 END
                ORDER BY e.xact_id, e.position
                LIMIT $4) r
          WINDOW w AS (ORDER BY r.xact_id, r.position ROWS UNBOUNDED PRECEDING)) c
    WHERE c.n = 1 OR c.bytes_before < $13
),
batch AS MATERIALIZED (
    SELECT u.events AS read,
           CASE WHEN u.bytes < $13 THEN u.events
                ELSE (SELECT events FROM within_budget) END AS taken
    FROM unread u
)
SELECT EXISTS (SELECT 1 FROM unnest($9::bigint[], $10::bigint[]) AS p(xact_id, taken)
               WHERE pg_visible_in_snapshot(p.xact_id::text::xid8, (SELECT s FROM snapshot))
                 AND EXISTS (SELECT 1 FROM outbox_events e
                             WHERE (e.xact_id, e.position) > (p.xact_id, p.taken)
                               AND e.xact_id <= p.xact_id))
           AS declined,
       (SELECT max(x.position) FROM outbox_deliveries x WHERE x.subscription_id = $1)
           AS last_record_position,
       -- Where the cursor moves when every row read is taken and fewer than $4 were read:
       -- past the newest visible row, rows of other types included.
       v.xact_id AS visible_end_xact_id, v.position AS visible_end_position,
       (SELECT coalesce(array_agg(r::text::bigint), '{}')
        FROM pg_snapshot_xip((SELECT s FROM snapshot)) r) AS running_xact_ids,
       -- Whether the byte budget left events read out of the batch.
       (SELECT taken < read FROM batch) AS cut_by_bytes, NULL::boolean AS special,
       NULL::bigint AS position, NULL::integer AS attempt, NULL::timestamptz AS due_at,
       NULL::uuid AS id, NULL::text AS aggregate_type, NULL::text AS aggregate_id,
       NULL::bigint AS aggregate_version, NULL::text AS event_type, NULL::bytea AS payload,
       NULL::text AS content_type, NULL::jsonb AS metadata, NULL::timestamptz AS occurred_at,
       NULL::timestamptz AS created_at, NULL::timestamptz AS deliver_at,
       NULL::timestamptz AS expires_at, NULL::bigint AS xact_id
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT e.xact_id, e.position
    FROM outbox_events e
    WHERE (e.xact_id, e.position) > ($2, $3)
    ORDER BY e.xact_id DESC, e.position DESC
    LIMIT 1
) v ON true
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, c.special,
       c.position, 1, now() + $11 * interval '1 millisecond',
       c.id, c.aggregate_type, c.aggregate_id, c.aggregate_version, c.event_type, c.payload,
       c.content_type, c.metadata, c.occurred_at, c.created_at, c.deliver_at, c.expires_at,
       c.xact_id
FROM (
    SELECT e.*,
           coalesce(e.deliver_at > now(), false)
           OR coalesce(e.expires_at <= now(), false)
           OR coalesce(greatest(e.created_at, e.deliver_at)
                       + $12::bigint * interval '1 millisecond' <= now(), false) AS special
    FROM outbox_events e
    WHERE (e.xact_id, e.position) > ($2, $3)
      AND CASE WHEN $5::text IS NULL THEN true ELSE e.event_type ~ $5 END
      AND CASE WHEN cardinality($6::text[]) = 0 THEN true ELSE e.aggregate_type = ANY ($6) END
      AND CASE WHEN $7::jsonb IS NULL THEN true ELSE e.metadata @> $7 END
      AND CASE WHEN $8::timestamptz IS NULL THEN true ELSE e.created_at >= $8 END
    ORDER BY e.xact_id, e.position
    LIMIT (SELECT taken FROM batch)
) c
