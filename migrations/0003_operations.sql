-- Operations: finding an aggregate's latest event, delivery counters, maintenance totals.

-- RequeueLatest, and operators asking "what happened to this aggregate".
CREATE INDEX outbox_events_aggregate ON outbox_events (aggregate_type, aggregate_id, event_type);

-- Deliveries made and acks applied per subscription. Spread over a few rows per
-- subscription so concurrent acks rarely wait for each other.
CREATE TABLE outbox_subscription_counters (
    subscription_id bigint NOT NULL,
    shard           smallint NOT NULL,
    delivered       bigint NOT NULL DEFAULT 0,
    acked           bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (subscription_id, shard)
);

-- Totals kept by background maintenance, e.g. events_force_expired.
CREATE TABLE outbox_gateway_counters (
    name  text PRIMARY KEY,
    value bigint NOT NULL DEFAULT 0
);
