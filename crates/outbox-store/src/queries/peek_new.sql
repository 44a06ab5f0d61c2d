-- Reads, without taking them, the events the next claim of a subscription with a CEL
-- filter considers: claim_new.sql's candidates (the same read position, filters and
-- limit), with the snapshot they were read in. The gateway evaluates the filter on them
-- and hands claim_new.sql that snapshot and the positions the filter passes over, so the
-- claim decides on exactly these rows: one committed meanwhile is left to the next claim
-- (and its filter), never taken unfiltered nor skipped.
--
-- Its optional filters are written as CASE for the generic plan, as in claim_new.sql.
--
-- $1/$2 cursor (xact_id, position), $3 limit, $4 event-type regex (NULL: all),
-- $5 aggregate types (empty: all), $6 metadata match (NULL: all), $7 not_before
-- (NULL: none), $8 pending transaction ids, $9 the position up to which each pending
-- transaction's rows were already taken.
WITH snapshot AS MATERIALIZED (
    SELECT pg_current_snapshot() AS s
),
pending AS (
    SELECT p.xact_id, p.taken,
           pg_visible_in_snapshot(p.xact_id::text::xid8, (SELECT s FROM snapshot)) AS finished
    FROM unnest($8::bigint[], $9::bigint[]) AS p(xact_id, taken)
),
late AS (
    SELECT l.*
    FROM pending p
    CROSS JOIN LATERAL (
        SELECT e.xact_id, e.position
        FROM outbox_events e
        WHERE (e.xact_id, e.position) > (p.xact_id, p.taken) AND e.xact_id <= p.xact_id
          AND CASE WHEN $4::text IS NULL THEN true ELSE e.event_type ~ $4 END
          AND CASE WHEN cardinality($5::text[]) = 0 THEN true ELSE e.aggregate_type = ANY ($5) END
          AND CASE WHEN $6::jsonb IS NULL THEN true ELSE e.metadata @> $6 END
          AND CASE WHEN $7::timestamptz IS NULL THEN true ELSE e.created_at >= $7 END
        ORDER BY e.xact_id, e.position
        LIMIT $3
    ) l
    WHERE p.finished
    ORDER BY l.xact_id, l.position
    LIMIT $3
),
fresh AS (
    SELECT e.xact_id, e.position
    FROM outbox_events e
    WHERE (e.xact_id, e.position) > ($1, $2)
      AND CASE WHEN $4::text IS NULL THEN true ELSE e.event_type ~ $4 END
      AND CASE WHEN cardinality($5::text[]) = 0 THEN true ELSE e.aggregate_type = ANY ($5) END
      AND CASE WHEN $6::jsonb IS NULL THEN true ELSE e.metadata @> $6 END
      AND CASE WHEN $7::timestamptz IS NULL THEN true ELSE e.created_at >= $7 END
    ORDER BY e.xact_id, e.position
    LIMIT $3
),
candidates AS (
    SELECT c.position, row_number() OVER (ORDER BY c.xact_id, c.position) AS n
    FROM (SELECT * FROM late UNION ALL SELECT * FROM fresh) c
)
SELECT (SELECT s::text FROM snapshot) AS snapshot, r.*
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT e.position, e.id, e.aggregate_type, e.aggregate_id, e.aggregate_version,
           e.event_type, e.payload, e.content_type, e.metadata, e.occurred_at, e.created_at,
           e.deliver_at, e.expires_at, e.xact_id
    FROM candidates c
    JOIN outbox_events e ON e.position = c.position
    WHERE c.n <= $3
) r ON true
ORDER BY r.xact_id, r.position
