-- Which gateways hold Subscribe streams on which subscriptions, so that every replica
-- can tell a pull subscription with no consumer anywhere within a poll interval:
-- last_attached_at only says when a stream was last seen, not that the last one left.
--
-- Each gateway keeps one row per subscription it has streams on (gateway: a random id
-- per process), rewrites its rows when its streams come or go and refreshes seen_at
-- while they stay; it removes its rows when it stops. A gateway that dies leaves its
-- rows behind: readers ignore a row whose seen_at is older than a few refreshes, and
-- gateways delete such rows as they write their own. No foreign key: subscription ids
-- are never reused, and a row of a deleted subscription goes with its gateway's next
-- write instead of making that write fail.
CREATE TABLE outbox_subscription_streams (
    subscription_id bigint NOT NULL,
    gateway         uuid NOT NULL,
    streams         integer NOT NULL CHECK (streams > 0),
    seen_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscription_id, gateway)
);
