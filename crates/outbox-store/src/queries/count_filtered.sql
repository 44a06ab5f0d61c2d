-- Adds to a subscription's filtered totals and records its filter's last error. $1
-- subscription id, $2 events passed over, $3 of them because the filter failed on them,
-- $4 the last error (NULL: none). Sharded by connection like count_deliveries.sql.
WITH counted AS (
    INSERT INTO outbox_subscription_counters (subscription_id, shard, filtered, filter_errors)
    VALUES ($1, (pg_backend_pid() % 64)::smallint, $2, $3)
    ON CONFLICT (subscription_id, shard)
    DO UPDATE SET filtered = outbox_subscription_counters.filtered + EXCLUDED.filtered,
                  filter_errors = outbox_subscription_counters.filter_errors
                                  + EXCLUDED.filter_errors
)
UPDATE outbox_cursors
SET last_filter_error = $4, last_filter_error_at = now()
WHERE subscription_id = $1 AND $4::text IS NOT NULL
