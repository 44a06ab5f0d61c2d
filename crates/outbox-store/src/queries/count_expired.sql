-- Adds to a subscription's expired total. $1 subscription id, $2 count. Sharded by
-- connection like count_deliveries.sql.
INSERT INTO outbox_subscription_counters (subscription_id, shard, expired)
VALUES ($1, (pg_backend_pid() % 64)::smallint, $2)
ON CONFLICT (subscription_id, shard)
DO UPDATE SET expired = outbox_subscription_counters.expired + EXCLUDED.expired
