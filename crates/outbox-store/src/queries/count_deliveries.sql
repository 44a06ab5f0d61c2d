-- Adds to a subscription's delivered total. $1 subscription id, $2 count.
--
-- The shard is picked by connection: a connection runs one transaction at a time, so two
-- writers wait on the same counter row (held until their commits are flushed) only when
-- their backend ids collide modulo 64.
INSERT INTO outbox_subscription_counters (subscription_id, shard, delivered)
VALUES ($1, (pg_backend_pid() % 64)::smallint, $2)
ON CONFLICT (subscription_id, shard)
DO UPDATE SET delivered = outbox_subscription_counters.delivered + EXCLUDED.delivered
