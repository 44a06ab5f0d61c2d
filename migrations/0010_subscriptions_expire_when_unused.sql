-- Subscriptions that delete themselves once unused: a reader that goes away without
-- deleting its subscription (killed, or its machine lost) must not leave it behind to
-- hold retention back for ever.
--
-- expire_after_idle_ms: NULL keeps the subscription until it is deleted.
-- last_attached_at: while a gateway holds a Subscribe stream on the subscription, it
-- sets this to now() every few seconds; the subscription expires once this is older
-- than expire_after_idle_ms.
ALTER TABLE outbox_subscriptions
    ADD COLUMN expire_after_idle_ms bigint
        CONSTRAINT outbox_subscriptions_expire_after_idle_positive
        CHECK (expire_after_idle_ms > 0),
    ADD COLUMN last_attached_at timestamptz NOT NULL DEFAULT now();

CREATE INDEX outbox_subscriptions_expiring
    ON outbox_subscriptions (last_attached_at)
    WHERE expire_after_idle_ms IS NOT NULL;
