-- Exactly-once consumption: a consumer calls outbox_consume(subscription, ack_id) in its
-- own transaction, in a database that is one of the gateway's sources. The call records
-- that the subscription consumed the event (true the first time, false once a committed
-- transaction has recorded it), and the gateway settles the delivery when the record
-- commits: the consumer's side effects, its reaction events (outbox_publish) and its ack
-- commit or roll back together.

-- The subscriptions whose ack ids this database accepts, kept by the gateway (every
-- source knows every subscription: a consumer's database need not be one it reads).
CREATE TABLE outbox_consumer_subscriptions (
    id    bigint PRIMARY KEY,
    name  text NOT NULL UNIQUE
);

-- The key ack ids are sealed with (HMAC-SHA256 over the subscription id and the ack id),
-- the same in every source of a gateway: a consumer can only record ack ids the gateway
-- handed out for that subscription. Stored with its HMAC pads, so the function needs
-- nothing but sha256().
CREATE TABLE outbox_consume_key (
    singleton            boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    key                  bytea NOT NULL,
    inner_pad            bytea NOT NULL,
    outer_pad            bytea NOT NULL,
    -- A gateway is settling this database's consumptions as they come, polling, until
    -- then: consuming transactions need not NOTIFY (a NOTIFY serializes commits).
    settler_awake_until  timestamptz
);

-- One row per event a subscription consumed through this database. The event is named by
-- its source and position, so a redelivery (an expired lease, a requeue, a seek) is
-- recognised whatever its ack id. Written once, never updated.
CREATE TABLE outbox_consumptions (
    subscription_id  bigint NOT NULL,
    source           text NOT NULL,
    position         bigint NOT NULL,
    consumed_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscription_id, source, position)
);

-- Deliveries consumed (or found consumed) whose lease the gateway has yet to settle: a
-- queue the gateway empties as it settles them. No index: it holds what the last few
-- milliseconds committed, and is read whole.
CREATE TABLE outbox_consumed_acks (
    subscription_id  bigint NOT NULL,
    ack_id           text NOT NULL
);

CREATE FUNCTION outbox_consume(subscription text, ack_id text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    -- `[source/]position-attempt-token-seal` as the gateway writes it: the seal is the
    -- first 64 bits (16 hex digits) of HMAC-SHA256 over "subscription id:" and the rest.
    unsealed  text := left(ack_id, length(ack_id) - 17);
    lease     text;
    found_id  bigint;
    seal      text;
    awake     timestamptz;
    recorded  boolean;
BEGIN
    SELECT s.id,
           left(encode(sha256(k.outer_pad || sha256(k.inner_pad
               || convert_to(s.id::text || ':' || unsealed, 'UTF8'))), 'hex'), 16),
           k.settler_awake_until
      INTO found_id, seal, awake
      FROM outbox_consumer_subscriptions s
      LEFT JOIN outbox_consume_key k ON true
     WHERE s.name = subscription;
    IF found_id IS NULL THEN
        IF subscription IS NULL THEN
            RAISE EXCEPTION 'outbox_consume: subscription must not be null'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RAISE EXCEPTION 'outbox_consume: subscription %: no such subscription', quote_literal(subscription)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'the subscription may have been deleted, or created while this database was unreachable (the gateway adds it within a maintenance interval)';
    END IF;
    -- Only the gateway can seal a text, and it seals only well-formed ack ids: a seal that
    -- matches vouches for the rest, so the common case parses nothing more.
    IF seal IS NULL OR ack_id IS DISTINCT FROM unsealed || '-' || seal THEN
        IF ack_id IS NULL OR ack_id !~ '^([a-z0-9][a-z0-9_-]*/)?[1-9][0-9]*-[1-9][0-9]*-[0-9a-f]{16}-[0-9a-f]{16}$' THEN
            RAISE EXCEPTION 'outbox_consume: ack_id %: not an ack id of a Subscribe delivery', quote_nullable(left(ack_id, 100))
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF seal IS NULL THEN
            RAISE EXCEPTION 'outbox_consume: this database has no ack key yet: a gateway that has it as a source must have started once'
                USING ERRCODE = 'object_not_in_prerequisite_state';
        END IF;
        RAISE EXCEPTION 'outbox_consume: ack_id %: not issued for subscription %', quote_literal(ack_id), quote_literal(subscription)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'an ack id is accepted only for the subscription that delivered it, and not after that subscription was deleted';
    END IF;
    lease := split_part(unsealed, '/', -1);
    -- Records the consumption unless it is recorded (inserted: the first time). A
    -- concurrent first call for the same event holds the row's key until it ends: this
    -- waits for it, then finds its record or, if it rolled back, inserts. Either way the
    -- ack id is queued for the gateway to settle the delivery once this commits (of an
    -- event consumed before, too: its redelivery is settled).
    WITH recorded AS (
        INSERT INTO outbox_consumptions (subscription_id, source, position)
        VALUES (found_id,
                CASE WHEN lease = unsealed THEN 'default' ELSE split_part(unsealed, '/', 1) END,
                split_part(lease, '-', 1)::bigint)
        ON CONFLICT DO NOTHING
        RETURNING 1
    ), queued AS (
        INSERT INTO outbox_consumed_acks (subscription_id, ack_id) VALUES (found_id, ack_id)
    )
    SELECT EXISTS (SELECT FROM recorded) INTO recorded;
    -- Delivered when this commits, unless a settler is polling anyway.
    IF awake IS NULL OR awake < clock_timestamp() THEN
        PERFORM pg_notify('outbox_consumed', '');
    END IF;
    RETURN recorded;
END
$$;

-- Like the publish functions: the owner's rights (a consumer needs no rights on these
-- tables), a fixed search_path, EXECUTE only for the roles granted it
-- (deploy/writer-role.sql).
DO $$
BEGIN
    EXECUTE format(
        'ALTER FUNCTION outbox_consume(text, text) SECURITY DEFINER SET search_path = %I, pg_temp',
        current_schema());
END
$$;
REVOKE EXECUTE ON FUNCTION outbox_consume(text, text) FROM PUBLIC;
