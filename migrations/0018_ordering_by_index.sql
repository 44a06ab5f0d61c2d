-- Per-aggregate ordering looked up by index, whatever an aggregate's backlog. Releasing an
-- aggregate's next waiting event (promote_waiting) asked, for every waiting record, whether
-- its aggregate had an event out, through the ordering index over every record of the
-- aggregate: its cost grew with the square of the events waiting per aggregate, and it ran
-- under the subscription's lock on every ack. Whether an aggregate is busy and which of its
-- events waits first are now each one index probe.
CREATE INDEX outbox_deliveries_ordering_busy
    ON outbox_deliveries (subscription_id, ordering_key)
    WHERE state IN ('in_flight', 'retry') AND ordering_key IS NOT NULL;
CREATE INDEX outbox_deliveries_ordering_waiting
    ON outbox_deliveries (subscription_id, ordering_key, seq)
    WHERE state = 'waiting';
