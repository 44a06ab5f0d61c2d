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
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    key        bytea NOT NULL,
    inner_pad  bytea NOT NULL,
    outer_pad  bytea NOT NULL
);

-- One row per event a subscription consumed through this database. The event is named by
-- its source and position, so a redelivery (an expired lease, a requeue, a seek) is
-- recognised whatever its ack id.
CREATE TABLE outbox_consumptions (
    subscription_id   bigint NOT NULL,
    source            text NOT NULL,
    position          bigint NOT NULL,
    consumed_at       timestamptz NOT NULL DEFAULT now(),
    -- The ack id of the latest delivery consumed here whose lease the gateway has not
    -- settled yet; NULL once it has.
    unsettled_ack_id  text,
    PRIMARY KEY (subscription_id, source, position)
);

CREATE INDEX outbox_consumptions_unsettled ON outbox_consumptions (subscription_id)
    WHERE unsettled_ack_id IS NOT NULL;

CREATE FUNCTION outbox_consume(subscription text, ack_id text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    found_id  bigint;
    parts     text[];
    key_row   outbox_consume_key%ROWTYPE;
    seal      text;
    recorded  boolean;
BEGIN
    IF subscription IS NULL THEN
        RAISE EXCEPTION 'outbox_consume: subscription must not be null'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT s.id INTO found_id FROM outbox_consumer_subscriptions s WHERE s.name = subscription;
    IF found_id IS NULL THEN
        RAISE EXCEPTION 'outbox_consume: subscription %: no such subscription', quote_literal(subscription)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'the subscription may have been deleted, or created while this database was unreachable (the gateway adds it within a maintenance interval)';
    END IF;
    -- [source/]position-attempt-token-seal, as the gateway writes it.
    parts := regexp_match(ack_id,
        '^(?:([A-Za-z0-9_-]{1,63})/)?([1-9][0-9]{0,18})-[1-9][0-9]{0,9}-[0-9a-f]{16}-([0-9a-f]{16})$');
    IF parts IS NULL THEN
        RAISE EXCEPTION 'outbox_consume: ack_id %: not an ack id of a Subscribe delivery', quote_nullable(left(ack_id, 100))
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO key_row FROM outbox_consume_key;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox_consume: this database has no ack key yet: a gateway that has it as a source must have started once'
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    seal := left(encode(sha256(key_row.outer_pad || sha256(key_row.inner_pad
                || convert_to(found_id::text || ':' || left(ack_id, length(ack_id) - 17), 'UTF8'))), 'hex'), 16);
    IF seal <> parts[3] THEN
        RAISE EXCEPTION 'outbox_consume: ack_id %: not issued for subscription %', quote_literal(ack_id), quote_literal(subscription)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'an ack id is accepted only for the subscription that delivered it, and not after that subscription was deleted';
    END IF;
    -- A concurrent first call for the same event holds the row's key until it ends: this
    -- waits for it, then finds its record (false) or, if it rolled back, inserts (true).
    INSERT INTO outbox_consumptions AS c (subscription_id, source, position, unsettled_ack_id)
    VALUES (found_id, coalesce(parts[1], 'default'), parts[2]::bigint, ack_id)
    ON CONFLICT (subscription_id, source, position)
        DO UPDATE SET unsettled_ack_id = excluded.unsettled_ack_id
    RETURNING (c.xmax = 0) INTO recorded;
    -- Delivered at commit: the gateway settles the delivery then.
    PERFORM pg_notify('outbox_consumed', '');
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
