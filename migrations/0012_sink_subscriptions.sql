-- Sink subscriptions: the gateway publishes a subscription's events into a broker
-- (NATS JetStream, Kafka) named in its configuration. Like `push`, definitions live
-- in the `default` source; the column exists in every source like the rest of the table.

ALTER TABLE outbox_subscriptions
    -- The sink settings (name, subject, topic, key); NULL unless it drains into a sink.
    ADD COLUMN sink jsonb;
