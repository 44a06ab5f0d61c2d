-- Time controls.
--
-- Pause: a paused subscription hands out nothing new while its acks, nacks and lease
-- extensions still apply. The pause lives in the definition (the `default` source), so
-- it survives restarts and every gateway reads it with the definition. `paused_at` set
-- means paused; `paused_until` ends it by itself; `pause_reason` says why (an operator's
-- words, or the gateway's own when it stops deliveries itself).
ALTER TABLE outbox_subscriptions
    ADD COLUMN paused_at    timestamptz,
    ADD COLUMN pause_reason text,
    ADD COLUMN paused_until timestamptz,
    ADD CONSTRAINT outbox_subscriptions_pause_shape
        CHECK (paused_at IS NOT NULL OR (pause_reason IS NULL AND paused_until IS NULL));

-- Expiry and scheduling, per event (in every source). `expires_at`: not delivered (or
-- redelivered) from then on. `deliver_at`: delivered to no subscription before then.
-- NOT VALID: the new columns are NULL in every existing row, so there is nothing to
-- check, and validating would scan the table under an exclusive lock; new rows are
-- checked all the same.
ALTER TABLE outbox_events
    ADD COLUMN deliver_at timestamptz,
    ADD COLUMN expires_at timestamptz,
    ADD CONSTRAINT outbox_events_expires_after_occurred
        CHECK (expires_at >= occurred_at) NOT VALID,
    ADD CONSTRAINT outbox_events_expires_after_delivery
        CHECK (expires_at > deliver_at) NOT VALID;

COMMENT ON COLUMN outbox_events.deliver_at IS
    'Deliver to no subscription before this time (NULL or past: at once).';
COMMENT ON COLUMN outbox_events.expires_at IS
    'Deliver (or redeliver) to no subscription from this time on; counted as expired instead.';

-- Writers granted INSERT on chosen columns (deploy/writer-role.sql) may set the new
-- ones too.
DO $$
DECLARE
    v_grantee regrole;
BEGIN
    FOR v_grantee IN
        SELECT DISTINCT acl.grantee::regrole
        FROM pg_attribute a
        CROSS JOIN LATERAL aclexplode(a.attacl) AS acl
        WHERE a.attrelid = 'outbox_events'::regclass AND a.attname = 'payload'
          AND acl.privilege_type = 'INSERT' AND acl.grantee <> 0
    LOOP
        EXECUTE format('GRANT INSERT (deliver_at, expires_at) ON outbox_events TO %s', v_grantee);
    END LOOP;
END
$$;

-- Expiry per subscription: an event older than `max_event_age_ms` (counted from when it
-- became deliverable: its creation, or its deliver_at when later) is not delivered;
-- `dead_letter_expired` sends expired events to the dead-letter queue (error "expired")
-- instead of dropping them.
ALTER TABLE outbox_subscriptions
    ADD COLUMN max_event_age_ms bigint CHECK (max_event_age_ms > 0),
    ADD COLUMN dead_letter_expired boolean NOT NULL DEFAULT false;

-- Events a subscription let expire (dropped or dead-lettered), next to its delivered
-- and acked totals.
ALTER TABLE outbox_subscription_counters
    ADD COLUMN expired bigint NOT NULL DEFAULT 0;

-- The publish functions take the new columns as optional arguments. A function's
-- arguments are part of its identity, so the old ones are dropped (an overload with
-- more defaulted arguments would make every existing call ambiguous); the EXECUTE grants
-- made on them carry over to the new ones.
CREATE TEMPORARY TABLE outbox_publish_grants ON COMMIT DROP AS
SELECT p.proname::text AS function_name, acl.grantee
FROM pg_proc p
CROSS JOIN LATERAL aclexplode(p.proacl) AS acl
WHERE p.oid IN ('outbox_publish_bytes(text, text, text, bytea, text, jsonb, uuid, bigint, timestamptz)'::regprocedure,
                'outbox_publish(text, text, text, jsonb, jsonb, uuid, bigint, timestamptz)'::regprocedure)
  AND acl.privilege_type = 'EXECUTE'
  AND acl.grantee <> p.proowner
  AND acl.grantee <> 0;

DROP FUNCTION outbox_publish(text, text, text, jsonb, jsonb, uuid, bigint, timestamptz);
DROP FUNCTION outbox_publish_bytes(text, text, text, bytea, text, jsonb, uuid, bigint, timestamptz);

-- Publishes one event from SQL, inside the caller's transaction, with the same rules as
-- the Publish RPC: re-publishing an id with identical content is a no-op that returns
-- the id; the same id with different content raises unique_violation (23505). Trace
-- context is not part of an event's identity; an argument left NULL is not compared.
CREATE FUNCTION outbox_publish_bytes(
    p_aggregate_type    text,
    p_aggregate_id      text,
    p_event_type        text,
    p_payload           bytea,
    p_content_type      text DEFAULT 'application/json',
    p_metadata          jsonb DEFAULT '{}',
    p_id                uuid DEFAULT NULL,
    p_aggregate_version bigint DEFAULT NULL,
    p_occurred_at       timestamptz DEFAULT NULL,
    p_deliver_at        timestamptz DEFAULT NULL,
    p_expires_at        timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := coalesce(p_id, gen_random_uuid());
    v_existing outbox_events;
BEGIN
    INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_version, event_type,
                               payload, content_type, metadata, occurred_at, deliver_at,
                               expires_at)
    VALUES (v_id, p_aggregate_type, p_aggregate_id, p_aggregate_version, p_event_type,
            p_payload, coalesce(p_content_type, 'application/json'),
            coalesce(p_metadata, '{}'), coalesce(p_occurred_at, now()), p_deliver_at,
            p_expires_at)
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
       OR (p_deliver_at IS NOT NULL AND v_existing.deliver_at IS DISTINCT FROM p_deliver_at)
       OR (p_expires_at IS NOT NULL AND v_existing.expires_at IS DISTINCT FROM p_expires_at)
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
    p_occurred_at       timestamptz DEFAULT NULL,
    p_deliver_at        timestamptz DEFAULT NULL,
    p_expires_at        timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE sql AS $$
    SELECT outbox_publish_bytes(p_aggregate_type, p_aggregate_id, p_event_type,
                                convert_to(p_payload::text, 'UTF8'), 'application/json',
                                p_metadata, p_id, p_aggregate_version, p_occurred_at,
                                p_deliver_at, p_expires_at)
$$;

-- As 0004: the owner's rights, a fixed search_path, EXECUTE only for those granted it.
DO $$
DECLARE
    v_grant record;
BEGIN
    EXECUTE format(
        'ALTER FUNCTION outbox_publish_bytes(text, text, text, bytea, text, jsonb, uuid, bigint, timestamptz, timestamptz, timestamptz) '
        'SECURITY DEFINER SET search_path = %I, pg_temp', current_schema());
    EXECUTE format(
        'ALTER FUNCTION outbox_publish(text, text, text, jsonb, jsonb, uuid, bigint, timestamptz, timestamptz, timestamptz) '
        'SECURITY DEFINER SET search_path = %I, pg_temp', current_schema());
    FOR v_grant IN SELECT * FROM outbox_publish_grants LOOP
        IF v_grant.function_name = 'outbox_publish' THEN
            EXECUTE format(
                'GRANT EXECUTE ON FUNCTION outbox_publish(text, text, text, jsonb, jsonb, uuid, bigint, timestamptz, timestamptz, timestamptz) TO %s',
                v_grant.grantee::regrole);
        ELSE
            EXECUTE format(
                'GRANT EXECUTE ON FUNCTION outbox_publish_bytes(text, text, text, bytea, text, jsonb, uuid, bigint, timestamptz, timestamptz, timestamptz) TO %s',
                v_grant.grantee::regrole);
        END IF;
    END LOOP;
END
$$;

REVOKE EXECUTE ON FUNCTION outbox_publish_bytes(text, text, text, bytea, text, jsonb, uuid, bigint, timestamptz, timestamptz, timestamptz) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox_publish(text, text, text, jsonb, jsonb, uuid, bigint, timestamptz, timestamptz, timestamptz) FROM PUBLIC;
