-- Delivery figures of one subscription. Its CEL filter, if any, is not applied here:
-- events it will pass over count as pending until the relay reads past them.
-- The pending scans use the same index ranges and
-- filters as a claim. $1 subscription id, $2/$3 cursor, $4 event-type regex,
-- $5 aggregate types, $6 metadata match (NULL: all), $7 not_before, $8 pending
-- transaction ids, $9 the position up to which each one's rows were taken.
-- An event whose deliver_at is still ahead is scheduled, not pending: it is counted in
-- `scheduled` only, and the oldest unacked event is the one longest due (since its
-- creation, or its deliver_at when later), as an operator's lag is how long events wait
-- once they may go out.
WITH pending AS (
    SELECT p.xact_id, p.taken,
           pg_visible_in_snapshot(p.xact_id::text::xid8, pg_current_snapshot()) AS finished
    FROM unnest($8::bigint[], $9::bigint[]) AS p(xact_id, taken)
),
not_handed_out AS (
    SELECT e.created_at, e.deliver_at, NULL::bigint AS late_xact_id
    FROM outbox_events e
    WHERE (e.xact_id, e.position) > ($2, $3)
      AND ($4::text IS NULL OR e.event_type ~ $4)
      AND (cardinality($5::text[]) = 0 OR e.aggregate_type = ANY ($5))
      AND ($6::jsonb IS NULL OR e.metadata @> $6)
      AND ($7::timestamptz IS NULL OR e.created_at >= $7)
    UNION ALL
    -- Rows of transactions that finished after the cursor passed them.
    SELECT e.created_at, e.deliver_at, e.xact_id
    FROM pending p
    JOIN outbox_events e ON e.xact_id = p.xact_id AND e.position > p.taken
    WHERE p.finished
      AND ($4::text IS NULL OR e.event_type ~ $4)
      AND (cardinality($5::text[]) = 0 OR e.aggregate_type = ANY ($5))
      AND ($6::jsonb IS NULL OR e.metadata @> $6)
      AND ($7::timestamptz IS NULL OR e.created_at >= $7)
),
-- A record that waits for its event's deliver_at is a retry record never delivered
-- (attempt 0) whose time has not come.
records AS (
    SELECT count(*) FILTER (WHERE d.state = 'in_flight' AND d.due_at > now()) AS in_flight,
           count(*) FILTER (WHERE (d.state = 'retry' AND NOT (d.attempt = 0 AND d.due_at > now()))
                               OR (d.state = 'in_flight' AND d.due_at <= now())) AS awaiting_retry,
           count(*) FILTER (WHERE d.state = 'retry' AND d.attempt = 0 AND d.due_at > now())
               AS scheduled,
           min(d.due_at) FILTER (WHERE d.state = 'retry' AND d.attempt = 0 AND d.due_at > now())
               AS next_scheduled,
           count(*) FILTER (WHERE d.state = 'waiting') AS waiting,
           count(*) FILTER (WHERE d.state = 'dead' AND d.resolved_at IS NULL) AS dead_lettered,
           min(GREATEST(e.created_at, e.deliver_at))
               FILTER (WHERE d.state <> 'dead'
                         AND NOT (d.state = 'retry' AND d.attempt = 0 AND d.due_at > now()))
               AS oldest_record
    FROM outbox_delivery_records d
    JOIN outbox_events e ON e.position = d.position
    WHERE d.subscription_id = $1
),
totals AS (
    SELECT coalesce(sum(delivered), 0)::bigint AS delivered,
           (coalesce(sum(acked), 0)
            -- Acks of batch rows still held are counted when the row goes.
            + (SELECT coalesce(sum(b.acked), 0) FROM outbox_delivery_batches b
               WHERE b.subscription_id = $1))::bigint AS acked,
           coalesce(sum(expired), 0)::bigint AS expired,
           coalesce(sum(filtered), 0)::bigint AS filtered,
           coalesce(sum(filter_errors), 0)::bigint AS filter_errors
    FROM outbox_subscription_counters
    WHERE subscription_id = $1
)
SELECT (SELECT count(*) FROM not_handed_out
        WHERE deliver_at IS NULL OR deliver_at <= now()) + r.waiting AS pending,
       r.in_flight, r.awaiting_retry, r.dead_lettered,
       LEAST(r.oldest_record,
             (SELECT min(GREATEST(created_at, deliver_at)) FROM not_handed_out
              WHERE deliver_at IS NULL OR deliver_at <= now())) AS oldest_unacked,
       t.delivered, t.acked, t.expired,
       -- Finished transactions with events to take; most that are remembered wrote
       -- none here (transaction ids are the server's), and the next claim forgets them.
       (SELECT count(DISTINCT late_xact_id) FROM not_handed_out) AS late_transactions,
       r.scheduled + (SELECT count(*) FROM not_handed_out WHERE deliver_at > now()) AS scheduled,
       LEAST(r.next_scheduled,
             (SELECT min(deliver_at) FROM not_handed_out WHERE deliver_at > now()))
           AS next_scheduled,
       t.filtered, t.filter_errors, c.last_filter_error, c.last_filter_error_at
FROM records r, totals t
LEFT JOIN outbox_cursors c ON c.subscription_id = $1
