-- The outbox table: a public contract. Services in any language insert into it (or call
-- outbox_publish) inside their own transactions; the gateway relays what commits.
--
-- Rows are written once and never updated. `xact_id` records the writing transaction so
-- the relay reads only rows whose transaction is older than every transaction still
-- running, in (xact_id, position) order: a row that takes a low position but commits
-- late is never skipped, and a rolled-back row never becomes visible.

CREATE FUNCTION outbox_is_json_content_type(content_type text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT lower(btrim(split_part(content_type, ';', 1))) ~ '^application/([a-z0-9.+_-]+\+)?json$'
$$;
COMMENT ON FUNCTION outbox_is_json_content_type(text) IS
    'True for application/json and application/*+json (parameters ignored): payloads of these types must be valid JSON.';

CREATE FUNCTION outbox_metadata_is_valid(metadata jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT jsonb_typeof(metadata) = 'object'
       AND NOT EXISTS (
           SELECT 1 FROM jsonb_each(metadata) AS entry(key, value)
           WHERE jsonb_typeof(entry.value) <> 'string'
              OR octet_length(entry.key) NOT BETWEEN 1 AND 128
       )
$$;
COMMENT ON FUNCTION outbox_metadata_is_valid(jsonb) IS
    'True for a JSON object whose keys are 1 to 128 bytes and whose values are all strings.';

CREATE TABLE outbox_events (
    -- Order of insertion; with xact_id, the relay's reading order.
    position          bigint GENERATED ALWAYS AS IDENTITY,
    -- The writing transaction (pg_current_xact_id()); never set it yourself.
    xact_id           bigint NOT NULL DEFAULT (pg_current_xact_id()::text::bigint),
    -- The idempotency key.
    id                uuid NOT NULL DEFAULT gen_random_uuid(),
    aggregate_type    text NOT NULL,
    aggregate_id      text NOT NULL,
    aggregate_version bigint,
    event_type        text NOT NULL,
    payload           bytea NOT NULL,
    content_type      text NOT NULL DEFAULT 'application/json',
    metadata          jsonb NOT NULL DEFAULT '{}',
    occurred_at       timestamptz NOT NULL DEFAULT now(),
    created_at        timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT outbox_events_pkey PRIMARY KEY (id),
    CONSTRAINT outbox_events_position_key UNIQUE (position),
    CONSTRAINT outbox_events_aggregate_type_length
        CHECK (octet_length(aggregate_type) BETWEEN 1 AND 255),
    CONSTRAINT outbox_events_aggregate_id_length
        CHECK (octet_length(aggregate_id) BETWEEN 1 AND 255),
    CONSTRAINT outbox_events_aggregate_version_positive
        CHECK (aggregate_version IS NULL OR aggregate_version >= 1),
    CONSTRAINT outbox_events_event_type_format
        CHECK (octet_length(event_type) <= 255
               AND event_type ~ '^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$'),
    CONSTRAINT outbox_events_content_type_length
        CHECK (octet_length(content_type) BETWEEN 1 AND 255),
    -- Casting raises "invalid input syntax for type json" for a malformed JSON payload.
    CONSTRAINT outbox_events_payload_json
        CHECK (NOT outbox_is_json_content_type(content_type)
               OR convert_from(payload, 'UTF8')::json IS NOT NULL),
    CONSTRAINT outbox_events_metadata_format
        CHECK (outbox_metadata_is_valid(metadata)),
    CONSTRAINT outbox_events_metadata_size
        CHECK (octet_length(metadata::text) <= 65536)
);

-- The relay's reading order.
CREATE UNIQUE INDEX outbox_events_relay_order ON outbox_events (xact_id, position);

COMMENT ON TABLE outbox_events IS
    'Transactional outbox: insert an event in the same transaction as the business change; outbox-gateway delivers it once the transaction commits.';
COMMENT ON COLUMN outbox_events.xact_id IS
    'Writing transaction id, set by default; the relay reads rows below the oldest running transaction in (xact_id, position) order.';

-- Wakes gateways when a transaction that wrote events commits (NOTIFY is only delivered
-- at commit, and identical notifications of one transaction are folded into one).
-- Gateway connections set outbox.suppress_notify=on: they wake their own relay in
-- process and send one coalesced notification outside the publishing transaction,
-- because a NOTIFY serializes commits cluster-wide.
CREATE FUNCTION outbox_notify_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('outbox.suppress_notify', true), '') <> 'on' THEN
        PERFORM pg_notify('outbox_events', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_events_notify
    AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify_insert();

-- Publishes one event from SQL, inside the caller's transaction, with the same rules as
-- the Publish RPC: re-publishing an id with identical content is a no-op that returns
-- the id; the same id with different content raises unique_violation (23505).
CREATE FUNCTION outbox_publish_bytes(
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
       OR v_existing.metadata IS DISTINCT FROM coalesce(p_metadata, '{}')
       OR (p_occurred_at IS NOT NULL AND v_existing.occurred_at IS DISTINCT FROM p_occurred_at)
    THEN
        RAISE EXCEPTION 'event % already exists with different content', v_id
            USING ERRCODE = 'unique_violation', CONSTRAINT = 'outbox_events_pkey';
    END IF;
    RETURN v_id;
END
$$;

-- The common case: a JSON payload.
CREATE FUNCTION outbox_publish(
    p_aggregate_type    text,
    p_aggregate_id      text,
    p_event_type        text,
    p_payload           jsonb,
    p_metadata          jsonb DEFAULT '{}',
    p_id                uuid DEFAULT NULL,
    p_aggregate_version bigint DEFAULT NULL,
    p_occurred_at       timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE sql AS $$
    SELECT outbox_publish_bytes(p_aggregate_type, p_aggregate_id, p_event_type,
                                convert_to(p_payload::text, 'UTF8'), 'application/json',
                                p_metadata, p_id, p_aggregate_version, p_occurred_at)
$$;
