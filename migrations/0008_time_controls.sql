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
