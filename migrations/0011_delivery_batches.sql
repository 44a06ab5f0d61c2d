-- Delivery bookkeeping per claim instead of per event: on unordered subscriptions a
-- claim leases its new events as rows of outbox_delivery_batches (one row per up to
-- 128 events), and acks shrink those rows; a row whose events are all settled is
-- deleted. A delivery that needs a state of its own — nacked, extended, released by a
-- closing stream, expired, requeued — is moved out of its batch into an outbox_deliveries
-- record first (the same lease: attempt 1, the batch's token and deadline), and from
-- there everything happens as before. Ordered subscriptions keep a record per event.
--
-- Records written before this migration stay where they are and are settled as before,
-- so ack ids handed out by the previous version keep working.
CREATE TABLE outbox_delivery_batches (
    subscription_id  bigint NOT NULL,
    -- The claim's lease token: with the attempt (always 1 here) and the position, it is
    -- what an ack id names, so ack ids did not change.
    lease_token      bigint NOT NULL,
    -- A claim of more than 128 events writes several rows: 0, 1, 2...
    chunk            integer NOT NULL,
    -- Lease deadline of every event in the row.
    due_at           timestamptz NOT NULL,
    -- Events of the row acked so far (added to the subscription's counters when the row
    -- goes).
    acked            integer NOT NULL DEFAULT 0,
    -- Positions leased and not yet settled or moved out, in reading order. Last, and
    -- beside `acked`, so the write-ahead log of an ack carries little more than the
    -- bytes that changed.
    positions        bigint[] NOT NULL,
    PRIMARY KEY (subscription_id, lease_token, chunk)
) WITH (fillfactor = 50);

-- Every delivery record, one row per event, wherever it is kept: for reading only
-- (stats, where an event stands, operators' queries).
CREATE VIEW outbox_delivery_records AS
SELECT d.subscription_id, d.position, d.state, d.attempt, d.lease_token, d.due_at,
       d.ordering_key, d.last_error, d.dead_lettered_at, d.resolved_at, d.resolved_by,
       d.notes, d.updated_at
FROM outbox_deliveries d
UNION ALL
SELECT b.subscription_id, p.position, 'in_flight', 1, b.lease_token, b.due_at,
       NULL::bigint, NULL::text, NULL::timestamptz, NULL::timestamptz, NULL::text,
       NULL::text, NULL::timestamptz
FROM outbox_delivery_batches b
CROSS JOIN unnest(b.positions) AS p(position);
