-- One statement per Publish batch. Run on its own (autocommit) when every id should be
-- new: one round trip, no speculative insertion, and a stored id aborts it with nothing
-- written. The fallback, inside a transaction, appends `ON CONFLICT (id) DO NOTHING
-- RETURNING id` and compares the skipped ids with the stored rows afterwards (an
-- identical re-publish is a duplicate, anything else a conflict).
INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_version, event_type,
                           payload, content_type, metadata, occurred_at, deliver_at,
                           expires_at)
SELECT input.id, input.aggregate_type, input.aggregate_id, input.aggregate_version,
       input.event_type, input.payload, input.content_type, input.metadata::jsonb,
       coalesce(input.occurred_at, now()), input.deliver_at, input.expires_at
FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::bytea[],
            $7::text[], $8::text[], $9::timestamptz[], $10::timestamptz[], $11::timestamptz[])
     WITH ORDINALITY AS input(id, aggregate_type, aggregate_id, aggregate_version, event_type,
                              payload, content_type, metadata, occurred_at, deliver_at,
                              expires_at, ordinal)
ORDER BY input.ordinal
