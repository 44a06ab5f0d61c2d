-- A least-privilege role for services that write events directly: they may add events
-- (a plain INSERT, or the outbox_publish functions) and record what they consumed
-- (outbox_consume, inside their own transactions), and nothing else — no reading of
-- other services' events or of delivery state.
--
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f deploy/writer-role.sql
--   psql "$DATABASE_URL" -c 'GRANT outbox_writer TO billing_service'
--
-- Run it as the owner of the outbox schema, after the gateway has migrated it. With
-- several source databases, run it in each one a service writes to (its own database,
-- a `[[sources]]` entry): the outbox schema is the same in every source.

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_writer') THEN
        CREATE ROLE outbox_writer NOLOGIN;
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO outbox_writer', current_schema());
END
$$;

-- Only the columns a writer may set; position and xact_id are the database's.
GRANT INSERT (id, aggregate_type, aggregate_id, aggregate_version, event_type, payload,
              content_type, metadata, occurred_at, deliver_at, expires_at)
    ON outbox_events TO outbox_writer;

GRANT EXECUTE ON FUNCTION outbox_publish(text, text, text, jsonb, jsonb, uuid, bigint, timestamptz,
                                         timestamptz, timestamptz)
    TO outbox_writer;
GRANT EXECUTE ON FUNCTION outbox_publish_bytes(text, text, text, bytea, text, jsonb, uuid, bigint,
                                               timestamptz, timestamptz, timestamptz)
    TO outbox_writer;
GRANT EXECUTE ON FUNCTION outbox_consume(text, text) TO outbox_writer;
