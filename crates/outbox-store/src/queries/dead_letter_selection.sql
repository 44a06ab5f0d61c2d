-- The condition a dead-letter selection puts on a delivery record `d` joined with its
-- event `e`; every statement about selected dead letters shares it.
-- $1 subscription id, $2 event ids (empty: any), $3 event-type regex (NULL: any),
-- $4 aggregate type, $5 aggregate id, $6 last error ('' for none), $7 dead-lettered at
-- or after, $8 dead-lettered before (NULL: no bound), $9 include resolved ones.
d.subscription_id = $1
AND d.state = 'dead'
AND (cardinality($2::uuid[]) = 0 OR e.id = ANY ($2))
AND ($3::text IS NULL OR e.event_type ~ $3)
AND ($4::text IS NULL OR e.aggregate_type = $4)
AND ($5::text IS NULL OR e.aggregate_id = $5)
AND ($6::text IS NULL OR coalesce(d.last_error, '') = $6)
AND ($7::timestamptz IS NULL OR d.dead_lettered_at >= $7)
AND ($8::timestamptz IS NULL OR d.dead_lettered_at < $8)
AND ($9::boolean OR d.resolved_at IS NULL)
