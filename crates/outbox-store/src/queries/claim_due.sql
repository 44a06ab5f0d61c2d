-- Re-leases deliveries whose lease expired or whose retry is due (scheduled events
-- included, at their deliver_at), oldest first, within a byte budget (the first is always
-- taken). An expired lease that used the last attempt, or one its stream gave back on
-- the last attempt (a retry whose attempt reached the limit: a nack on the last attempt
-- dead-letters at once), goes to the dead-letter queue instead (unless its event type is
-- persistent). An event past its expires_at or the
-- subscription's max event age is not redelivered: its record goes to the dead-letter
-- queue with the error "expired" ($9), or is dropped.
--
-- $1 subscription id, $2 limit, $3 lease token, $4 ack deadline in ms,
-- $5 max attempts (0: unlimited), $6 persistent event-type regex (NULL: none),
-- $7 byte budget, $8 max event age in ms (NULL: none), $9 dead-letter expired events.
--
-- Returns the leased rows with their events, and one row without an event for each
-- record dead-lettered (state 'dead') or dropped (state 'expired'); `expired` says which
-- of them expired.
--
-- The records it changes are found again by nothing but the row ids (ctid) of the
-- versions it locked, so that the only way to them is a probe by row id. Joined on the
-- subscription and position instead, the claim's generic plan, made once per connection
-- and often while the table is nearly empty, read every record of the subscription for
-- each claim (880 ms with 22,500 records waiting on an ordered subscription, against
-- 3 ms this way). A locked version cannot change or move before the statement ends. A
-- record another transaction changed after this statement's snapshot (a nack, an
-- extension) is locked in its newest version, which the snapshot cannot see: it is left
-- as that transaction made it, for a later claim to judge.
WITH due AS (
    SELECT d.ctid AS row_id, d.position, d.state, d.attempt, d.due_at
    FROM outbox_deliveries d
    WHERE d.subscription_id = $1 AND d.due_at <= now()
    ORDER BY d.due_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
judged AS (
    SELECT due.row_id, due.position, due.due_at, due.state AS old_state,
           (coalesce(e.expires_at <= now(), false)
            OR coalesce(greatest(e.created_at, e.deliver_at)
                        + $8::bigint * interval '1 millisecond' <= now(), false)) AS expired,
           (due.state IN ('in_flight', 'retry') AND $5 > 0 AND due.attempt >= $5
            AND ($6::text IS NULL OR e.event_type !~ $6)) AS exhausted,
           octet_length(e.payload) AS size
    FROM due
    JOIN outbox_events e ON e.position = due.position
),
sized AS (
    SELECT j.*,
           coalesce(sum(CASE WHEN j.exhausted OR j.expired THEN 0 ELSE j.size + 256 END)
                        OVER (ORDER BY j.due_at, j.position
                              ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
               AS bytes_before
    FROM judged j
),
dropped AS (
    DELETE FROM outbox_deliveries d
    USING sized s
    WHERE d.ctid = s.row_id AND s.expired AND NOT $9
    RETURNING d.position, d.ordering_key
),
updated AS (
    UPDATE outbox_deliveries d
    SET state = CASE WHEN s.exhausted OR s.expired THEN 'dead' ELSE 'in_flight' END,
        attempt = CASE WHEN s.exhausted OR s.expired THEN d.attempt ELSE d.attempt + 1 END,
        lease_token = CASE WHEN s.exhausted OR s.expired THEN NULL ELSE $3::bigint END,
        due_at = CASE WHEN s.exhausted OR s.expired THEN NULL
                      ELSE now() + $4 * interval '1 millisecond' END,
        last_error = CASE WHEN s.expired THEN 'expired'
                          WHEN s.old_state = 'in_flight' THEN 'ack deadline exceeded'
                          ELSE d.last_error END,
        dead_lettered_at = CASE WHEN s.exhausted OR s.expired THEN now() END,
        updated_at = now()
    FROM sized s
    WHERE d.ctid = s.row_id
      AND NOT (s.expired AND NOT $9)
      AND (s.exhausted OR s.expired OR s.bytes_before < $7)
    RETURNING d.position, d.state, d.attempt, d.due_at, d.ordering_key, s.expired
),
settled AS (
    SELECT u.position, u.attempt, u.due_at, u.state, u.ordering_key, u.expired FROM updated u
    UNION ALL
    SELECT r.position, NULL, NULL, 'expired', r.ordering_key, true FROM dropped r
)
SELECT s.position, s.attempt, s.due_at, s.state, s.ordering_key, s.expired,
       e.id, e.aggregate_type, e.aggregate_id, e.aggregate_version, e.event_type, e.payload,
       e.content_type, e.metadata, e.occurred_at, e.created_at, e.deliver_at, e.expires_at,
       e.xact_id
FROM settled s
LEFT JOIN outbox_events e ON e.position = s.position AND s.state = 'in_flight'
ORDER BY e.xact_id, e.position
