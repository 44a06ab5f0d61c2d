-- Adds to a subscription's delivered total. $1 subscription id, $2 shard, $3 count.
INSERT INTO outbox_subscription_counters (subscription_id, shard, delivered)
VALUES ($1, $2, $3)
ON CONFLICT (subscription_id, shard)
DO UPDATE SET delivered = outbox_subscription_counters.delivered + EXCLUDED.delivered
