-- CEL filters and transforms: a subscription's `filter` selects events by their content
-- on top of the other filters, its `transform` shapes the payload delivered. Both are
-- evaluated by the gateway; definitions live in the `default` source like the rest of
-- the subscription.

ALTER TABLE outbox_subscriptions
    ADD COLUMN filter text,
    ADD COLUMN transform text;

-- Events the filter passed over, and events it could not be evaluated on (also passed
-- over), next to the subscription's other totals in each source.
ALTER TABLE outbox_subscription_counters
    ADD COLUMN filtered bigint NOT NULL DEFAULT 0,
    ADD COLUMN filter_errors bigint NOT NULL DEFAULT 0;

-- The last evaluation error of the subscription's filter in this source, for operators.
ALTER TABLE outbox_cursors
    ADD COLUMN last_filter_error text,
    ADD COLUMN last_filter_error_at timestamptz;
