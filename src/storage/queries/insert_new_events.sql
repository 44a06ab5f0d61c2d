-- The common case of a Publish batch: every id is new. A plain INSERT, run on its own
-- (autocommit), is one round trip and skips ON CONFLICT's speculative insertion; if any
-- id is already stored, the unique violation aborts the statement, nothing is written,
-- and the caller falls back to insert_events.sql inside a transaction.
INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_version, event_type,
                           payload, content_type, metadata, occurred_at)
SELECT input.id, input.aggregate_type, input.aggregate_id, input.aggregate_version,
       input.event_type, input.payload, input.content_type, input.metadata::jsonb,
       coalesce(input.occurred_at, now())
FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::bytea[],
            $7::text[], $8::text[], $9::timestamptz[])
     WITH ORDINALITY AS input(id, aggregate_type, aggregate_id, aggregate_version, event_type,
                              payload, content_type, metadata, occurred_at, ordinal)
ORDER BY input.ordinal
