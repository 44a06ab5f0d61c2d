-- Push subscriptions: the gateway sends a subscription's events to an HTTP endpoint
-- instead of waiting for Subscribe streams. Definitions live in the `default` source
-- only, so only its table is read; the columns exist in every source like the rest of
-- the table.

ALTER TABLE outbox_subscriptions
    -- The push settings (endpoint, headers, format, timeout_ms, max_concurrency,
    -- rate_limit); NULL for a pull subscription.
    ADD COLUMN push jsonb,
    -- Signing keys, newest first: [{"key": base64, "expires_at": timestamp or null}].
    -- An older key is kept until it expires after a rotation, so receivers can switch.
    ADD COLUMN push_secrets jsonb NOT NULL DEFAULT '[]',
    -- Set when the endpoint answered 410 Gone: pushing stays off until resumed.
    ADD COLUMN push_stopped_at timestamptz,
    ADD COLUMN push_stopped_reason text;
