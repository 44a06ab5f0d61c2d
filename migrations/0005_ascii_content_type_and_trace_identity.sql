-- Two rules the gateway and direct SQL writers must apply identically.
--
-- 1. Whether a content type is JSON. lower() folds beyond ASCII (the Kelvin sign K
--    becomes "k"), while the gateway folds ASCII only: a content type such as
--    "application/vnd.\u212A+json" was JSON to one and not to the other. Fold ASCII only,
--    as media types are ASCII.
CREATE OR REPLACE FUNCTION outbox_is_json_content_type(content_type text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT translate(btrim(split_part(content_type, ';', 1)),
                     'ABCDEFGHIJKLMNOPQRSTUVWXYZ', 'abcdefghijklmnopqrstuvwxyz')
           ~ '^application/([a-z0-9.+_-]+\+)?json$'
$$;

-- 2. What makes a re-published event identical. Trace context (traceparent, tracestate)
--    is not part of an event's identity: a retry usually travels in a new trace. The
--    Publish RPC always treated it so; outbox_publish now does too.
CREATE OR REPLACE FUNCTION outbox_publish_bytes(
    p_aggregate_type    text,
    p_aggregate_id      text,
    p_event_type        text,
    p_payload           bytea,
    p_content_type      text DEFAULT 'application/json',
    p_metadata          jsonb DEFAULT '{}',
    p_id                uuid DEFAULT NULL,
    p_aggregate_version bigint DEFAULT NULL,
    p_occurred_at       timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := coalesce(p_id, gen_random_uuid());
    v_existing outbox_events;
BEGIN
    INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_version, event_type,
                               payload, content_type, metadata, occurred_at)
    VALUES (v_id, p_aggregate_type, p_aggregate_id, p_aggregate_version, p_event_type,
            p_payload, coalesce(p_content_type, 'application/json'),
            coalesce(p_metadata, '{}'), coalesce(p_occurred_at, now()))
    ON CONFLICT (id) DO NOTHING;
    IF FOUND THEN
        RETURN v_id;
    END IF;

    SELECT * INTO v_existing FROM outbox_events WHERE id = v_id;
    IF v_existing.aggregate_type IS DISTINCT FROM p_aggregate_type
       OR v_existing.aggregate_id IS DISTINCT FROM p_aggregate_id
       OR v_existing.aggregate_version IS DISTINCT FROM p_aggregate_version
       OR v_existing.event_type IS DISTINCT FROM p_event_type
       OR v_existing.payload IS DISTINCT FROM p_payload
       OR v_existing.content_type IS DISTINCT FROM coalesce(p_content_type, 'application/json')
       OR v_existing.metadata - 'traceparent' - 'tracestate'
          IS DISTINCT FROM coalesce(p_metadata, '{}') - 'traceparent' - 'tracestate'
       OR (p_occurred_at IS NOT NULL AND v_existing.occurred_at IS DISTINCT FROM p_occurred_at)
    THEN
        RAISE EXCEPTION 'event % already exists with different content', v_id
            USING ERRCODE = 'unique_violation', CONSTRAINT = 'outbox_events_pkey';
    END IF;
    RETURN v_id;
END
$$;

-- CREATE OR REPLACE resets what 0004 set: run with the owner's rights and a fixed
-- search_path again.
DO $$
BEGIN
    EXECUTE format(
        'ALTER FUNCTION outbox_publish_bytes(text, text, text, bytea, text, jsonb, uuid, bigint, timestamptz) '
        'SECURITY DEFINER SET search_path = %I, pg_temp', current_schema());
END
$$;
