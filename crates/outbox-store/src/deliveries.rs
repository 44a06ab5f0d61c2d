//! Delivery records: claiming events for a subscription, settling leases, releasing them.
//!
//! On unordered subscriptions a claim keeps its leases as rows of
//! `outbox_delivery_batches` (one per 128 events), which acks shrink; whatever gives a
//! delivery a state of its own first moves it into an `outbox_deliveries` record with the
//! same lease (`split_batches`). Ordered subscriptions keep a record per event.
//!
//! Everything that decides which event goes out next for a subscription (claims, and on
//! ordered subscriptions the acks and dead letters that free an aggregate) runs under a
//! transaction-scoped advisory lock on the subscription. An advisory lock, unlike a row
//! lock, does not give the claiming transaction an id before its snapshot is taken, so
//! claimers do not hold back each other's read horizon. A claim that follows another
//! ([`Store::claim_following`]) reads before it holds the lock, and leases under it only
//! if the read position is still the one it read from. A claim of a subscription with a
//! CEL filter evaluates it on the events it will consider before it takes the lock.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use futures_util::TryStreamExt;
use sqlx::{PgConnection, Postgres, Row, pool::PoolConnection, postgres::PgRow};

use super::{
    GENERIC_PLANS, Result, Store, StoreError,
    columns::{Cursor, bind_unread, cursor, millis},
    events::{EventColumns, column_at, typed_column_at},
    locks::{LockMode, begin_locked, lock_subscription},
    run_again_on_conflict,
};
use outbox_domain::{
    AckId, Delivery, EventFilter, LeaseId, SourceName, Subscription, SubscriptionId,
};

/// What one claim produced.
#[derive(Debug)]
pub struct Claim {
    /// Newly leased deliveries: due ones first, then new events in reading order.
    pub deliveries: Vec<Delivery>,
    /// Records that went to the dead-letter queue: expired leases that used their last
    /// attempt, and expired events of subscriptions that dead-letter them.
    pub dead_lettered: u64,
    /// Events that expired instead of going out (dead-lettered or dropped).
    pub expired: u64,
    /// Events the subscription's filter passed over, and how many of those because it
    /// failed on them.
    pub filtered: u64,
    pub filter_errors: u64,
    /// The earliest deliver_at of the scheduled events this claim recorded.
    pub next_scheduled: Option<DateTime<Utc>>,
    /// The claim read as many new events as it could (some of them scheduled or expired,
    /// so not delivered): more may be waiting even when few went out.
    pub read_full_batch: bool,
    /// Records it dead-lettered or dropped freed their aggregates on an ordered
    /// subscription: the next events of those are due now.
    pub made_due: bool,
}

/// How much one claim may lease.
#[derive(Debug, Clone, Copy)]
pub struct ClaimLimits {
    /// Most deliveries.
    pub count: usize,
    /// Most bytes of events (approximately: payloads plus a fixed allowance per event);
    /// the first delivery is leased whatever its size.
    pub bytes: u64,
}

/// What the common claim may lease (see [`Store::claim_fresh`]).
#[derive(Debug, Clone, Copy)]
struct FreshLimits {
    count: i64,
    /// The first delivery is leased whatever its size.
    bytes: i64,
    /// Deliveries this claim leased before (due ones), for the counter.
    already_leased: i64,
}

/// Where a claim moves the read position, handed to a claim that follows it before it
/// commits (see [`Store::claim_following`]).
#[derive(Debug)]
pub struct ClaimHandover {
    cursor: Cursor,
    /// Deliveries and bytes the claim handing over leases.
    pub leased: usize,
    pub bytes: u64,
}

/// Where a claim that may hand over its read position sends it, once.
pub type HandoverSender = tokio::sync::oneshot::Sender<ClaimHandover>;

/// An event a claim read: its row as it came, or the delivery decoded from it.
// Boxing the delivery would allocate once more per event; these live for one claim.
#[allow(clippy::large_enum_variant)]
enum Read {
    Kept(PgRow),
    Decoded(Delivery),
}

/// How the common claim relates to the claims before and after it.
enum Sequence<'a> {
    /// It read the read position under the subscription's lock, which it holds until it
    /// commits; it hands the position it moves to over to the sender, if any (and more
    /// events may be waiting), before leasing.
    Leading(&'a std::sync::Mutex<Option<HandoverSender>>),
    /// It reads from a position handed over by a claim that may not have committed yet:
    /// it takes the lock only to lease, and leases only if that position is still the
    /// subscription's by then.
    Following,
}

/// What the common claim leased, in reading order.
struct FreshClaim {
    deliveries: Vec<Delivery>,
    /// It leased as many as it could: more may be waiting.
    read_full_batch: bool,
}

/// How many times a claim of a filtered subscription peeks at its events outside the
/// lock before it evaluates them under it: each time the read position moved meanwhile
/// (another gateway's claim), the verdicts were for events already taken.
const FILTER_PEEKS: u32 = 3;

/// One claim's part: what [`Store::claim_handing_over`] asks of each attempt.
struct ClaimAttempt<'a> {
    lease_token: i64,
    limits: ClaimLimits,
    include_due: bool,
    handover: &'a std::sync::Mutex<Option<HandoverSender>>,
    /// The filter's verdicts on the events past the read position, evaluated before the
    /// attempt began (`None` without a filter, or when they are to be found under the
    /// lock).
    peeked: Option<&'a FilteredPeek>,
}

/// How one attempt of a claim ended.
enum Attempted {
    /// It ran: what it leased, `None` when the subscription has no read position here.
    Claimed(Option<Claim>),
    /// The read position moved since the events were peeked at; nothing was written.
    PositionMoved,
}

/// The events past a read position, and the filter's verdicts on them.
struct FilteredPeek {
    cursor: Cursor,
    verdicts: FilterVerdicts,
}

/// What a subscription's filter made of the events a claim considers.
#[derive(Debug, Default)]
struct FilterVerdicts {
    /// The snapshot they were read in.
    snapshot: Option<String>,
    /// Positions of the events it passes over.
    passed: Vec<i64>,
    /// Of those, the ones it failed on, and why.
    failed: Vec<i64>,
    errors: HashMap<i64, String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NackOutcome {
    pub dead_lettered: bool,
    pub retry_at: Option<DateTime<Utc>>,
}

impl Store {
    /// Leases deliveries of the subscription in this database to `lease_token`, within
    /// `limits`: first expired leases and due retries (when `include_due`), then new
    /// events. `None` when the subscription has no read position here (it was deleted,
    /// or has not started reading this database yet).
    pub async fn claim(
        &self,
        subscription: &Subscription,
        lease_token: i64,
        limits: ClaimLimits,
        include_due: bool,
    ) -> Result<Option<Claim>> {
        self.claim_handing_over(subscription, lease_token, limits, include_due, None)
            .await
    }

    /// [`Store::claim`], which also sends where it moves the read position to `handover`
    /// before it leases and commits, when it takes the common path, leases no due
    /// deliveries and more events may be waiting past its batch: a claim that follows it
    /// ([`Store::claim_following`]) reads them meanwhile. Dropped unsent otherwise.
    pub async fn claim_handing_over(
        &self,
        subscription: &Subscription,
        lease_token: i64,
        limits: ClaimLimits,
        include_due: bool,
        handover: Option<HandoverSender>,
    ) -> Result<Option<Claim>> {
        let handover = std::sync::Mutex::new(handover);
        let mut peeks = 0;
        loop {
            // A filter is evaluated before the claim takes the subscription's lock, with no
            // transaction open: however long it takes (within its cost budget), it holds up
            // no ack, claim or admin call of the subscription. The last attempt, after the
            // read position moved under every earlier one, evaluates under the lock.
            let peeked = match &subscription.settings.filter {
                Some(filter) if peeks < FILTER_PEEKS => {
                    peeks += 1;
                    match self
                        .peek_filtered(subscription, limits.count, filter)
                        .await?
                    {
                        Some(peeked) => Some(peeked),
                        None => return Ok(None),
                    }
                }
                _ => None,
            };
            let attempt = ClaimAttempt {
                lease_token,
                limits,
                include_due,
                handover: &handover,
                peeked: peeked.as_ref(),
            };
            match self.claim_once(subscription, attempt).await? {
                Attempted::Claimed(claim) => return Ok(claim),
                Attempted::PositionMoved => {}
            }
        }
    }

    /// One claim in one transaction.
    async fn claim_once(
        &self,
        subscription: &Subscription,
        attempt: ClaimAttempt<'_>,
    ) -> Result<Attempted> {
        let ClaimAttempt {
            lease_token,
            limits,
            include_due,
            handover,
            peeked,
        } = attempt;
        let subscription_id = subscription.id;
        let begin = begin_locked(GENERIC_PLANS, subscription_id);
        run_in_transaction!(self.pool, begin = begin.clone(), |transaction| {
            let Some(cursor) = cursor(transaction, subscription_id).await? else {
                return Ok(Attempted::Claimed(None));
            };
            if peeked.is_some_and(|peeked| peeked.cursor != cursor) {
                return Ok(Attempted::PositionMoved);
            }
            let settings = &subscription.settings;
            let max_event_age = settings.max_event_age.map(millis);
            let limit = i64::try_from(limits.count).unwrap_or(i64::MAX);
            let byte_budget = i64::try_from(limits.bytes).unwrap_or(i64::MAX);

            let due_rows = if include_due {
                // Expired leases of claim batches are redelivered from records of their own.
                split_batches(&mut *transaction, subscription_id, Moved::Expired).await?;
                sqlx::query(include_str!("queries/claim_due.sql"))
                    .bind(subscription_id.0)
                    .bind(limit)
                    .bind(lease_token)
                    .bind(millis(settings.ack_deadline))
                    .bind(settings.max_attempts as i32)
                    .bind(settings.persistent_event_types.to_regex())
                    .bind(byte_budget)
                    .bind(max_event_age)
                    .bind(settings.dead_letter_expired)
                    .fetch_all(&mut *transaction)
                    .await?
            } else {
                Vec::new()
            };
            let mut deliveries = Vec::with_capacity(due_rows.len());
            let mut freed_keys = Vec::new();
            let mut dead_lettered = 0;
            let mut expired = 0;
            for row in &due_rows {
                let state: &str = row.try_get("state")?;
                if state == "in_flight" {
                    // Redeliveries are few: their columns are found row by row.
                    let columns = DeliveryColumns::of(row)?;
                    deliveries.push(self.delivery_from_row(row, &columns, lease_token)?);
                    continue;
                }
                // Dead-lettered or dropped: either way its aggregate is free.
                dead_lettered += u64::from(state == "dead");
                expired += u64::from(row.try_get::<bool, _>("expired")?);
                if let Some(key) = row.try_get::<Option<i64>, _>("ordering_key")? {
                    freed_keys.push(key);
                }
            }
            promote_waiting(transaction, subscription_id, &freed_keys).await?;
            let made_due = !freed_keys.is_empty();

            let due_count = deliveries.len() as i64;
            let due_bytes: u64 = deliveries.iter().map(Delivery::size).sum();
            let remaining = limit - due_count;
            let remaining_bytes =
                byte_budget.saturating_sub(i64::try_from(due_bytes).unwrap_or(i64::MAX));
            let mut next_scheduled = None;
            let mut read_full_batch = false;
            let mut filtered = 0;
            let mut filter_errors = 0;
            if remaining > 0 && (remaining_bytes > 0 || deliveries.is_empty()) {
                // Nearly every claim of an unordered subscription without a CEL filter
                // takes the short path; it declines, writing nothing, when the full
                // statement has more to do.
                let fresh = match settings.ordered || settings.filter.is_some() {
                    true => None,
                    false => {
                        let limits = FreshLimits {
                            count: remaining,
                            bytes: remaining_bytes,
                            already_leased: due_count,
                        };
                        let sequence = Sequence::Leading(handover);
                        self.claim_fresh(
                            transaction,
                            subscription,
                            &cursor,
                            lease_token,
                            limits,
                            sequence,
                        )
                        .await?
                    }
                };
                let mut new_rows = Vec::new();
                let evaluated_here;
                let mut verdicts = &FilterVerdicts::default();
                if let Some(fresh) = fresh {
                    // Nearly always none were due: the batch is taken as it is, not copied.
                    match deliveries.is_empty() {
                        true => deliveries = fresh.deliveries,
                        false => deliveries.extend(fresh.deliveries),
                    }
                    read_full_batch = fresh.read_full_batch;
                } else {
                    if let Some(filter) = &settings.filter {
                        // The events peeked at, from this read position in the snapshot
                        // they were read in, begin with the ones this claim considers.
                        verdicts = match peeked {
                            Some(peeked) => &peeked.verdicts,
                            None => {
                                let rows =
                                    peek_new(transaction, subscription, &cursor, remaining).await?;
                                evaluated_here = evaluate(&self.source, filter, &rows)?;
                                &evaluated_here
                            }
                        };
                    }
                    let query = sqlx::query(include_str!("queries/claim_new.sql"))
                        .bind(subscription_id.0)
                        .bind(cursor.xact_id)
                        .bind(cursor.position)
                        .bind(remaining);
                    new_rows = bind_unread(query, settings, &cursor)
                        .bind(lease_token)
                        .bind(millis(settings.ack_deadline))
                        .bind(remaining_bytes)
                        .bind(due_count)
                        .bind(max_event_age)
                        .bind(settings.ordered)
                        .bind(settings.dead_letter_expired)
                        .bind(verdicts.snapshot.is_some().then_some(&verdicts.passed))
                        .bind(&verdicts.snapshot)
                        .bind(&verdicts.failed)
                        .fetch_all(&mut *transaction)
                        .await?;
                }
                if let Some(summary) = summary_row(&new_rows)? {
                    let expired_dead_lettered = count(summary, "expired_dead_lettered")?;
                    dead_lettered += expired_dead_lettered;
                    expired += expired_dead_lettered + count(summary, "expired_dropped")?;
                    next_scheduled = summary.try_get("next_scheduled")?;
                    read_full_batch = summary.try_get("batch_full")?;
                    filtered = count(summary, "filtered")?;
                    filter_errors = count(summary, "filter_errors")?;
                    if filtered > 0 {
                        let last_error = summary
                            .try_get::<Option<i64>, _>("last_filter_error_position")?
                            .and_then(|position| verdicts.errors.get(&position));
                        sqlx::query(include_str!("queries/count_filtered.sql"))
                            .bind(subscription_id.0)
                            .bind(i64::try_from(filtered).unwrap_or(i64::MAX))
                            .bind(i64::try_from(filter_errors).unwrap_or(i64::MAX))
                            .bind(last_error)
                            .execute(&mut *transaction)
                            .await?;
                    }
                }
                if let Some(first) = new_rows.first() {
                    let columns = DeliveryColumns::of(first)?;
                    for row in &new_rows {
                        if row.try_get::<Option<i64>, _>(columns.position)?.is_some() {
                            deliveries.push(self.delivery_from_row(row, &columns, lease_token)?);
                        }
                    }
                    // claim_new.sql leaves them unordered (claim_fresh sorts its own); they
                    // go out in reading order.
                    deliveries[due_count as usize..]
                        .sort_unstable_by_key(|d| (d.event.transaction_id, d.ack_id.position));
                }
            } else if due_count > 0 {
                sqlx::query(include_str!("queries/count_deliveries.sql"))
                    .bind(subscription_id.0)
                    .bind(due_count)
                    .execute(&mut *transaction)
                    .await?;
            }
            if expired > 0 {
                sqlx::query(include_str!("queries/count_expired.sql"))
                    .bind(subscription_id.0)
                    .bind(i64::try_from(expired).unwrap_or(i64::MAX))
                    .execute(&mut *transaction)
                    .await?;
            }
            Ok(Attempted::Claimed(Some(Claim {
                deliveries,
                dead_lettered,
                expired,
                filtered,
                filter_errors,
                next_scheduled,
                read_full_batch,
                made_due,
            })))
        })
    }

    /// A claim that reads on from where the claim that handed `handover` over moves the
    /// read position, while that one leases and commits: so one subscription's claims
    /// overlap, where they would otherwise run one at a time. It leases within `limits`
    /// once the claim before it committed, and only if the read position is still where
    /// that one left it; `None`, having written nothing, when it is not (the claim before
    /// rolled back, or a seek or a replica moved the position since), or when the
    /// events need the full claim statement ([`Store::claim`] takes them).
    pub async fn claim_following(
        &self,
        subscription: &Subscription,
        lease_token: i64,
        limits: ClaimLimits,
        handover: ClaimHandover,
    ) -> Result<Option<Claim>> {
        let limits = FreshLimits {
            count: i64::try_from(limits.count).unwrap_or(i64::MAX),
            bytes: i64::try_from(limits.bytes).unwrap_or(i64::MAX),
            already_leased: 0,
        };
        let fresh = run_in_transaction!(self.pool, begin = GENERIC_PLANS, |transaction| {
            let cursor = &handover.cursor;
            let sequence = Sequence::Following;
            self.claim_fresh(
                transaction,
                subscription,
                cursor,
                lease_token,
                limits,
                sequence,
            )
            .await
        })?;
        Ok(fresh.map(|fresh| Claim {
            deliveries: fresh.deliveries,
            dead_lettered: 0,
            expired: 0,
            filtered: 0,
            filter_errors: 0,
            next_scheduled: None,
            read_full_batch: fresh.read_full_batch,
            made_due: false,
        }))
    }

    /// The common claim of an unordered subscription without a CEL filter: reads the
    /// next events, the batch within `limits` cut by the statement
    /// (`queries/claim_fresh.sql`), then leases it and moves the read position
    /// (`queries/lease_fresh.sql`). `None`, having written nothing, when
    /// `claim_new.sql` must claim instead.
    async fn claim_fresh(
        &self,
        transaction: &mut PgConnection,
        subscription: &Subscription,
        cursor: &Cursor,
        lease_token: i64,
        limits: FreshLimits,
        sequence: Sequence<'_>,
    ) -> Result<Option<FreshClaim>> {
        let settings = &subscription.settings;
        let query = sqlx::query(include_str!("queries/claim_fresh.sql"))
            .bind(subscription.id.0)
            .bind(cursor.xact_id)
            .bind(cursor.position)
            .bind(limits.count);
        let mut rows = bind_unread(query, settings, cursor)
            .bind(millis(settings.ack_deadline))
            .bind(settings.max_event_age.map(millis))
            .bind(limits.bytes)
            .fetch(&mut *transaction);
        // The rows are decoded as they arrive, while PostgreSQL reads and sends the next;
        // except by a claim that may hand its read position over, which keeps them and
        // decodes them after handing over, so that the claim following it reads on
        // meanwhile instead of after.
        let hands_over = match sequence {
            Sequence::Leading(handover) => handover.lock().expect("handover lock").is_some(),
            Sequence::Following => false,
        };
        let mut summary = None;
        // Room for a few hundred from the start: growing from nothing copied a batch of
        // 1,000 ten times.
        let mut batch_rows = Vec::with_capacity(limits.count.clamp(0, 256) as usize);
        let mut columns = None;
        while let Some(row) = rows.try_next().await? {
            // Every row has the same columns, the summary's included.
            let (columns, special) = match &columns {
                Some(columns) => columns,
                None => columns.insert((
                    DeliveryColumns::of(&row)?,
                    typed_column_at::<bool>(&row, "special")?,
                )),
            };
            let Some(position) = row.try_get_unchecked::<Option<i64>, _>(columns.position)? else {
                if row.try_get::<bool, _>("declined")? {
                    return Ok(None);
                }
                summary = Some(row);
                continue;
            };
            if row.try_get_unchecked::<bool, _>(*special)? {
                return Ok(None);
            }
            let place = (columns.event.transaction_id(&row)?, position);
            batch_rows.push(if hands_over {
                (place, Read::Kept(row))
            } else {
                (
                    place,
                    Read::Decoded(self.delivery_from_row(&row, columns, lease_token)?),
                )
            });
        }
        drop(rows);
        let (Some(summary), Some((columns, _))) = (summary, &columns) else {
            return Err(StoreError::Corrupt("a claim returned no summary".into()));
        };
        // The batch holds every event read (the byte budget cut none).
        let took_all_read = !summary.try_get::<bool, _>("cut_by_bytes")?;
        batch_rows.sort_unstable_by_key(|(place, _)| *place);
        let batch = batch_rows.len();
        let positions: Vec<i64> = batch_rows
            .iter()
            .map(|((_, position), _)| *position)
            .collect();
        let last_record: Option<i64> = summary.try_get("last_record_position")?;
        // A record at or past the batch's first position was left from before a seek.
        if let (Some(last_record), Some(first)) = (last_record, positions.iter().min())
            && last_record >= *first
        {
            return Ok(None);
        }

        // The read position moves past the last event taken; past the newest visible
        // row when every event read was taken and fewer than the limit were read.
        let mut cursor_at = (cursor.xact_id, cursor.position);
        if let Some((last, _)) = batch_rows.last() {
            cursor_at = cursor_at.max(*last);
        }
        if took_all_read && (batch as i64) < limits.count {
            let end_xact_id: Option<i64> = summary.try_get("visible_end_xact_id")?;
            let end_position: Option<i64> = summary.try_get("visible_end_position")?;
            if let (Some(xact_id), Some(position)) = (end_xact_id, end_position) {
                cursor_at = cursor_at.max((xact_id, position));
            }
        }
        // The remembered transactions still running stay (those finished left no events
        // to take, or the statement declined), with the running ones the read position
        // now passes.
        let running: Vec<i64> = summary.try_get("running_xact_ids")?;
        let remembered = cursor
            .pending_xact_ids
            .iter()
            .copied()
            .zip(cursor.pending_positions.iter().copied());
        let mut pending: Vec<(i64, i64)> = remembered
            .filter(|(xact_id, _)| running.contains(xact_id))
            .collect();
        for &xact_id in &running {
            if xact_id < cursor_at.0 && !cursor.pending_xact_ids.contains(&xact_id) {
                pending.push((xact_id, 0));
            }
        }
        pending.sort_unstable();
        let (pending_xact_ids, pending_positions): (Vec<i64>, Vec<i64>) =
            pending.into_iter().unzip();
        let moved = cursor_at != (cursor.xact_id, cursor.position)
            || pending_xact_ids != cursor.pending_xact_ids
            || pending_positions != cursor.pending_positions;
        if let Sequence::Leading(handover) = sequence {
            let more_waiting = !(took_all_read && (batch as i64) < limits.count);
            if let Some(sender) = (handover.lock().expect("handover lock").take())
                .filter(|_| batch > 0 && more_waiting && limits.already_leased == 0)
            {
                let mut bytes = 0;
                for (_, read) in &batch_rows {
                    bytes += match read {
                        Read::Kept(row) => {
                            Delivery::size_of_payload(columns.event.payload_len(row)?)
                        }
                        Read::Decoded(delivery) => delivery.size(),
                    };
                }
                // Unsent when nobody waits for it any more.
                let _ = sender.send(ClaimHandover {
                    cursor: Cursor {
                        xact_id: cursor_at.0,
                        position: cursor_at.1,
                        pending_xact_ids: pending_xact_ids.clone(),
                        pending_positions: pending_positions.clone(),
                        not_before: cursor.not_before,
                    },
                    leased: batch,
                    bytes,
                });
            }
        }
        let deliveries = batch_rows
            .into_iter()
            .map(|(_, read)| match read {
                Read::Kept(row) => self.delivery_from_row(&row, columns, lease_token),
                Read::Decoded(delivery) => Ok(delivery),
            })
            .collect::<Result<Vec<_>>>()?;
        // What the lease statement checks the read position against: the claim that
        // read it holds the lock since; the one that follows takes it now (having
        // decoded its events while the claim before it committed).
        let read_from = match sequence {
            Sequence::Leading(_) => None,
            // Nothing to lease; the next claim moves the position if it must.
            Sequence::Following if batch == 0 => {
                return Ok(Some(FreshClaim {
                    deliveries,
                    read_full_batch: false,
                }));
            }
            Sequence::Following => {
                lock_subscription(transaction, subscription.id, LockMode::Exclusive).await?;
                Some(cursor)
            }
        };
        if moved || batch > 0 || limits.already_leased > 0 {
            let leased: bool = sqlx::query_scalar(include_str!("queries/lease_fresh.sql"))
                .bind(subscription.id.0)
                .bind(&positions)
                .bind(lease_token)
                .bind(millis(settings.ack_deadline))
                .bind(cursor_at.0)
                .bind(cursor_at.1)
                .bind(pending_xact_ids)
                .bind(pending_positions)
                .bind(limits.already_leased)
                .bind(read_from.map(|cursor| cursor.xact_id))
                .bind(read_from.map(|cursor| cursor.position))
                .bind(read_from.map(|cursor| &cursor.pending_xact_ids))
                .bind(read_from.map(|cursor| &cursor.pending_positions))
                .fetch_one(&mut *transaction)
                .await?;
            if !leased {
                return Ok(None);
            }
        }
        Ok(Some(FreshClaim {
            deliveries,
            read_full_batch: batch as i64 >= limits.count,
        }))
    }

    /// Reads the subscription's position and the events its next claim considers, in a
    /// short read-only transaction of their own without the subscription's lock, and
    /// evaluates `filter` on them once it has ended; `None` when the subscription has no
    /// read position here.
    async fn peek_filtered(
        &self,
        subscription: &Subscription,
        limit: usize,
        filter: &EventFilter,
    ) -> Result<Option<FilteredPeek>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        // On the claim's generic plans, as the claim itself reads.
        let peeked = run_in_transaction!(self.pool, begin = GENERIC_PLANS, |transaction| {
            let Some(cursor) = cursor(transaction, subscription.id).await? else {
                return Ok(None);
            };
            let rows = peek_new(transaction, subscription, &cursor, limit).await?;
            Ok(Some((cursor, rows)))
        });
        let Some((cursor, rows)) = peeked? else {
            return Ok(None);
        };
        let verdicts = evaluate(&self.source, filter, &rows)?;
        Ok(Some(FilteredPeek { cursor, verdicts }))
    }

    /// Acks deliveries in one go (see `ack_groups.rs`) on `connection`, taken from the
    /// pool when there is none and left empty after a failure or when records are to be
    /// settled too; returns the ack ids that settled a lease (the rest were stale).
    pub(crate) async fn ack_together(
        &self,
        connection: &mut Option<PoolConnection<Postgres>>,
        subscription: &Subscription,
        acks: &[AckId],
    ) -> Result<Vec<AckId>> {
        if subscription.settings.ordered {
            return self.ack_records(subscription, acks).await;
        }
        // First leases of unordered subscriptions are mostly held in claim batches; what
        // is not found there (moved out to a record, later attempts, ack ids from before
        // batches) is looked for among the records, in a statement of its own so that it
        // sees a move that a concurrent statement committed meanwhile.
        // Each first lease once: an ack id named twice must count one ack. (These sets
        // hold one call's acks, hashed with a per-process seed: cheaper than SipHash.)
        let first_leases: foldhash::HashSet<LeaseId> = acks
            .iter()
            .filter(|ack| ack.attempt == 1)
            .map(AckId::lease)
            .collect();
        let (positions, tokens): (Vec<i64>, Vec<i64>) = first_leases
            .iter()
            .map(|lease| (lease.position, lease.token))
            .unzip();
        let mut settled = foldhash::HashSet::default();
        if !positions.is_empty() {
            // One statement, committed on its own: the function runs it on a generic plan.
            // The connection is lent to each attempt; it is not given back after a failure.
            let (pool, positions, tokens) = (&self.pool, &positions, &tokens);
            let (held, rows) = run_again_on_conflict(|| {
                let held = connection.take();
                async move {
                    let mut held = match held {
                        Some(held) => held,
                        None => pool.acquire().await?,
                    };
                    let rows = sqlx::query(
                        "SELECT acked_position, acked_lease_token \
                         FROM outbox_ack_batches($1, $2, $3)",
                    )
                    .bind(subscription.id.0)
                    .bind(positions)
                    .bind(tokens)
                    .fetch_all(&mut *held)
                    .await?;
                    Ok::<_, sqlx::Error>((held, rows))
                }
            })
            .await?;
            *connection = Some(held);
            if let Some(first) = rows.first() {
                let (position, token) = (
                    column_at(first, "acked_position")?,
                    column_at(first, "acked_lease_token")?,
                );
                for row in &rows {
                    settled.insert(LeaseId {
                        position: row.try_get(position)?,
                        token: row.try_get(token)?,
                    });
                }
            }
        }
        let (mut acked, rest): (Vec<AckId>, Vec<AckId>) = acks
            .iter()
            .copied()
            .partition(|ack| ack.attempt == 1 && settled.contains(&ack.lease()));
        if !rest.is_empty() {
            // Given back first: settling records takes a connection of its own, and the
            // pool may have no other.
            *connection = None;
            acked.extend(self.ack_records(subscription, &rest).await?);
        }
        Ok(acked)
    }

    /// Settles the subscription's deliveries of the events at `positions` whatever their
    /// lease, as acked: a consumer recorded them consumed (`outbox_consume`) with an ack
    /// id that went stale meanwhile (its stream closed, or its lease expired, before the
    /// gateway saw the commit). Deliveries leased or awaiting a retry are settled; dead
    /// letters are left to operators. The positions settled.
    pub async fn settle_consumed(
        &self,
        subscription: &Subscription,
        positions: &[i64],
    ) -> Result<Vec<i64>> {
        self.split_batches(subscription.id, Moved::Positions(positions))
            .await?;
        let statement = || {
            sqlx::query(
                "WITH settled AS ( \
                     DELETE FROM outbox_deliveries \
                     WHERE subscription_id = $1 AND position = ANY ($2) \
                       AND state IN ('in_flight', 'retry') \
                     RETURNING position, ordering_key), \
                 counted AS ( \
                     INSERT INTO outbox_subscription_counters (subscription_id, shard, acked) \
                     SELECT $1, (pg_backend_pid() % 64)::smallint, count(*) FROM settled \
                     HAVING count(*) > 0 \
                     ON CONFLICT (subscription_id, shard) \
                     DO UPDATE SET acked = outbox_subscription_counters.acked + EXCLUDED.acked) \
                 SELECT position, ordering_key FROM settled",
            )
            .bind(subscription.id.0)
            .bind(positions)
        };
        let rows = self.settle_records(subscription, statement).await?;
        rows.iter()
            .map(|row| Ok(row.try_get("position")?))
            .collect()
    }

    /// Runs `statement`, which deletes settled delivery records of the subscription and
    /// returns them with their `ordering_key`. On an ordered subscription that frees their
    /// aggregates for the next event: it runs in a transaction under the subscription
    /// lock that also promotes those events.
    async fn settle_records<'q>(
        &self,
        subscription: &Subscription,
        statement: impl Fn() -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<Vec<PgRow>> {
        if !subscription.settings.ordered {
            return run_again_on_conflict(|| statement().fetch_all(&self.pool)).await;
        }
        run_in_transaction!(self.pool, |transaction| {
            lock_subscription(transaction, subscription.id, LockMode::Shared).await?;
            let rows = statement().fetch_all(&mut *transaction).await?;
            let mut freed_keys = Vec::new();
            for row in &rows {
                if let Some(key) = row.try_get::<Option<i64>, _>("ordering_key")? {
                    freed_keys.push(key);
                }
            }
            promote_waiting(transaction, subscription.id, &freed_keys).await?;
            Ok(rows)
        })
    }

    /// Acks deliveries that have records of their own.
    async fn ack_records(&self, subscription: &Subscription, acks: &[AckId]) -> Result<Vec<AckId>> {
        let (positions, attempts, tokens) = split_ack_ids(acks);
        let statement = || {
            sqlx::query(concat!(
                include_str!("queries/leased.sql"),
                include_str!("queries/ack.sql")
            ))
            .bind(subscription.id.0)
            .bind(&positions)
            .bind(&attempts)
            .bind(&tokens)
        };
        let rows = self.settle_records(subscription, statement).await?;
        Ok(named_leases(acks, &rows)?
            .into_iter()
            .map(|(ack, _)| ack)
            .collect())
    }

    /// Nacks one delivery; `None` when its lease is stale.
    pub async fn nack(
        &self,
        subscription: &Subscription,
        ack: AckId,
        reason: &str,
        retry_delay: std::time::Duration,
        dead_letter: bool,
    ) -> Result<Option<NackOutcome>> {
        let settings = &subscription.settings;
        if ack.attempt == 1 && !settings.ordered {
            let lease = [ack.lease()];
            self.split_batches(subscription.id, Moved::Leases(&lease))
                .await?;
        }
        run_in_transaction!(self.pool, |transaction| {
            if settings.ordered {
                lock_subscription(transaction, subscription.id, LockMode::Shared).await?;
            }
            let row = sqlx::query(include_str!("queries/nack.sql"))
                .bind(subscription.id.0)
                .bind(ack.position)
                .bind(ack.attempt)
                .bind(ack.lease_token)
                .bind(reason)
                .bind(millis(retry_delay))
                .bind(dead_letter)
                .bind(settings.max_attempts as i32)
                .bind(settings.persistent_event_types.to_regex())
                .fetch_optional(&mut *transaction)
                .await?;
            let Some(row) = row else {
                return Ok(None);
            };
            let dead_lettered: bool = row.try_get("to_dead")?;
            if dead_lettered && let Some(key) = row.try_get::<Option<i64>, _>("ordering_key")? {
                promote_waiting(transaction, subscription.id, &[key]).await?;
            }
            let retry_at = row.try_get("due_at")?;
            Ok(Some(NackOutcome {
                dead_lettered,
                retry_at,
            }))
        })
    }

    /// Moves the deadline of leased deliveries to `extension` from now; returns the
    /// positions extended with their new deadline (the rest were stale).
    pub async fn extend_leases(
        &self,
        subscription_id: SubscriptionId,
        acks: &[AckId],
        extension: std::time::Duration,
    ) -> Result<Vec<(AckId, DateTime<Utc>)>> {
        let first_leases: Vec<LeaseId> = acks
            .iter()
            .filter(|ack| ack.attempt == 1)
            .map(AckId::lease)
            .collect();
        self.split_batches(subscription_id, Moved::Leases(&first_leases))
            .await?;
        let (positions, attempts, tokens) = split_ack_ids(acks);
        let rows = run_again_on_conflict(|| {
            sqlx::query(concat!(
                include_str!("queries/leased.sql"),
                include_str!("queries/extend.sql")
            ))
            .bind(subscription_id.0)
            .bind(&positions)
            .bind(&attempts)
            .bind(&tokens)
            .bind(millis(extension))
            .fetch_all(&self.pool)
        })
        .await?;
        named_leases(acks, &rows)?
            .into_iter()
            .map(|(ack, row)| Ok((ack, row.try_get("due_at")?)))
            .collect()
    }

    /// Makes the given leases deliverable again at once: their stream ended.
    pub async fn release_leases(
        &self,
        subscription_id: SubscriptionId,
        leases: &[LeaseId],
    ) -> Result<u64> {
        self.split_batches(subscription_id, Moved::Leases(leases))
            .await?;
        let (positions, tokens) = lease_columns(leases);
        let result = run_again_on_conflict(|| {
            sqlx::query(include_str!("queries/release.sql"))
                .bind(subscription_id.0)
                .bind(&positions)
                .bind(&tokens)
                .execute(&self.pool)
        })
        .await?;
        Ok(result.rows_affected())
    }

    /// Which of the given leases are still held, as their positions with their
    /// deadlines; acks and extensions may have reached another gateway process.
    pub async fn live_leases(
        &self,
        subscription_id: SubscriptionId,
        leases: &[LeaseId],
    ) -> Result<Vec<(i64, DateTime<Utc>)>> {
        let (positions, tokens) = lease_columns(leases);
        let rows = sqlx::query(
            "SELECT d.position, d.due_at FROM outbox_delivery_records d \
             JOIN UNNEST($2::bigint[], $3::bigint[]) AS l(position, lease_token) \
               ON d.position = l.position AND d.lease_token = l.lease_token \
             WHERE d.subscription_id = $1 AND d.state = 'in_flight' AND d.due_at > now()",
        )
        .bind(subscription_id.0)
        .bind(positions)
        .bind(tokens)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| Ok((row.try_get("position")?, row.try_get("due_at")?)))
            .collect()
    }
}

/// Leases as the `bigint[]` parameters of their positions and tokens.
fn lease_columns(leases: &[LeaseId]) -> (Vec<i64>, Vec<i64>) {
    leases
        .iter()
        .map(|lease| (lease.position, lease.token))
        .unzip()
}

/// Which leased deliveries `split_batches` moves out of their claim batches.
#[derive(Debug, Clone, Copy)]
pub(super) enum Moved<'a> {
    /// These leases, wherever a batch holds them.
    Leases(&'a [LeaseId]),
    /// Every one whose lease expired.
    Expired,
    /// Every one of the subscription's.
    All,
    /// These events', whatever their lease.
    Positions(&'a [i64]),
}

impl Store {
    /// `split_batches` on a connection of its own, run again when it loses a deadlock
    /// to a concurrent ack or move of the same rows.
    async fn split_batches(&self, subscription_id: SubscriptionId, moved: Moved<'_>) -> Result<()> {
        run_again_on_conflict(|| split_batches(&self.pool, subscription_id, moved)).await
    }
}

/// Moves leased deliveries out of claim batches into records of their own, with the
/// same lease (see `queries/split_batches.sql`).
pub(super) async fn split_batches(
    executor: impl sqlx::PgExecutor<'_>,
    subscription_id: SubscriptionId,
    moved: Moved<'_>,
) -> Result<()> {
    let (tokens, positions, only_expired) = match moved {
        Moved::Leases([]) | Moved::Positions([]) => return Ok(()),
        Moved::Leases(leases) => {
            let (positions, tokens) = lease_columns(leases);
            (Some(tokens), Some(positions), false)
        }
        Moved::Expired => (None, None, true),
        Moved::All => (None, None, false),
        Moved::Positions(positions) => (None, Some(positions.to_vec()), false),
    };
    sqlx::query(include_str!("queries/split_batches.sql"))
        .bind(subscription_id.0)
        .bind(tokens)
        .bind(positions)
        .bind(only_expired)
        .execute(executor)
        .await?;
    Ok(())
}

pub(super) async fn promote_waiting(
    connection: &mut PgConnection,
    subscription_id: SubscriptionId,
    ordering_keys: &[i64],
) -> Result<()> {
    if ordering_keys.is_empty() {
        return Ok(());
    }
    sqlx::query(include_str!("queries/promote_waiting.sql"))
        .bind(subscription_id.0)
        .bind(ordering_keys)
        .execute(connection)
        .await?;
    Ok(())
}

/// The events the next claim from `cursor` considers, at most `limit`, with the snapshot
/// they were read in (see `queries/peek_new.sql`).
async fn peek_new(
    connection: &mut PgConnection,
    subscription: &Subscription,
    cursor: &Cursor,
    limit: i64,
) -> Result<Vec<PgRow>> {
    let query = sqlx::query(include_str!("queries/peek_new.sql"))
        .bind(cursor.xact_id)
        .bind(cursor.position)
        .bind(limit);
    Ok(bind_unread(query, &subscription.settings, cursor)
        .fetch_all(connection)
        .await?)
}

/// Evaluates `filter` on the rows [`peek_new`] read.
fn evaluate(source: &SourceName, filter: &EventFilter, rows: &[PgRow]) -> Result<FilterVerdicts> {
    let mut verdicts = FilterVerdicts::default();
    let Some(first) = rows.first() else {
        return Ok(verdicts);
    };
    // Found (and their types checked) once for the result, not for every row.
    let columns = EventColumns::of(first)?;
    let mut evaluate = || -> Result<()> {
        for row in rows {
            verdicts.snapshot = Some(row.try_get("snapshot")?);
            let Some(position) = row.try_get::<Option<i64>, _>("position")? else {
                continue;
            };
            match filter.matches(&columns.event(row, source)?) {
                Ok(true) => {}
                Ok(false) => verdicts.passed.push(position),
                Err(error) => {
                    verdicts.passed.push(position);
                    verdicts.failed.push(position);
                    verdicts.errors.insert(position, error.to_string());
                }
            }
        }
        Ok(())
    };
    // Each evaluation may take up to its cost budget: on a multi-threaded runtime the
    // worker hands its other tasks to another thread meanwhile, so a costly filter slows
    // only its own subscription's claim, never the calls served beside it.
    match tokio::runtime::Handle::current().runtime_flavor() {
        tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(evaluate),
        _ => evaluate(),
    }?;
    Ok(verdicts)
}

fn count(row: &PgRow, column: &str) -> Result<u64> {
    Ok(row.try_get::<i64, _>(column)?.max(0) as u64)
}

/// The ack ids whose lease is one of the rows a statement changed, each with its row. A
/// position alone would not do: one call may name an old lease of an event beside its
/// current one, and only the current one is settled.
fn named_leases<'r>(acks: &[AckId], rows: &'r [PgRow]) -> Result<Vec<(AckId, &'r PgRow)>> {
    let mut changed = HashMap::with_capacity(rows.len());
    for row in rows {
        let lease: (i64, i32, i64) = (
            row.try_get("position")?,
            row.try_get("attempt")?,
            row.try_get("lease_token")?,
        );
        changed.insert(lease, row);
    }
    Ok(acks
        .iter()
        .filter_map(|ack| {
            let row = changed.get(&(ack.position, ack.attempt, ack.lease_token))?;
            Some((*ack, *row))
        })
        .collect())
}

fn split_ack_ids(acks: &[AckId]) -> (Vec<i64>, Vec<i32>, Vec<i64>) {
    let positions = acks.iter().map(|ack| ack.position).collect();
    let attempts = acks.iter().map(|ack| ack.attempt).collect();
    let tokens = acks.iter().map(|ack| ack.lease_token).collect();
    (positions, attempts, tokens)
}

impl Store {
    fn delivery_from_row(
        &self,
        row: &PgRow,
        columns: &DeliveryColumns,
        lease_token: i64,
    ) -> Result<Delivery> {
        let position: i64 = row.try_get_unchecked(columns.position)?;
        let attempt: i32 = row.try_get_unchecked(columns.attempt)?;
        let ack_deadline: Option<DateTime<Utc>> = row.try_get_unchecked(columns.due_at)?;
        Ok(Delivery {
            ack_id: AckId {
                source: self.source_id,
                position,
                attempt,
                lease_token,
            },
            attempt: attempt.max(0) as u32,
            ack_deadline: ack_deadline.ok_or_else(|| {
                StoreError::Corrupt(format!("lease of {position} has no deadline"))
            })?,
            event: columns.event.event(row, &self.source)?,
        })
    }
}

/// Where the columns of a leased delivery sit in the rows of a claim statement's result
/// (see [`EventColumns`]).
struct DeliveryColumns {
    position: usize,
    attempt: usize,
    due_at: usize,
    event: EventColumns,
}

impl DeliveryColumns {
    fn of(row: &PgRow) -> Result<DeliveryColumns> {
        Ok(DeliveryColumns {
            position: typed_column_at::<i64>(row, "position")?,
            attempt: typed_column_at::<i32>(row, "attempt")?,
            due_at: typed_column_at::<DateTime<Utc>>(row, "due_at")?,
            event: EventColumns::of(row)?,
        })
    }
}

/// The row of a claim statement's result that carries the batch's summary: the one
/// without a position (the others are the events leased, and carry no summary).
fn summary_row(rows: &[PgRow]) -> Result<Option<&PgRow>> {
    for row in rows {
        if row.try_get::<Option<i64>, _>("position")?.is_none() {
            return Ok(Some(row));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, time::Duration};

    use outbox_domain::{StartPosition, SubscriptionName, SubscriptionSettings};
    use sqlx::Connection;

    use super::*;
    use crate::{subscriptions::NewDefinition, throwaway_store};

    /// A store on a database of its own, with `max_connections`, holding an unordered
    /// subscription that starts at the earliest event, and `events` events.
    async fn subscription_with_events(
        max_connections: u32,
        events: i64,
    ) -> (outbox_testkit::ThrowawayDatabase, Store, Subscription) {
        let (database, store) = throwaway_store(max_connections, Duration::from_secs(60)).await;
        store.migrate().await.expect("migrate");
        let subscription =
            subscription_from_earliest(&store, "deliveries", SubscriptionSettings::default()).await;
        insert_events(&store, events).await;
        (database, store, subscription)
    }

    /// Creates subscription `name` with `settings`, reading from the earliest event.
    async fn subscription_from_earliest(
        store: &Store,
        name: &str,
        settings: SubscriptionSettings,
    ) -> Subscription {
        store
            .create_subscription(
                &NewDefinition {
                    name: &SubscriptionName::parse("name", name).unwrap(),
                    settings: &settings,
                    sources: &[],
                    start: StartPosition::Earliest,
                    expire_after_idle: None,
                    secrets: &[],
                },
                true,
            )
            .await
            .expect("create the subscription")
    }

    /// Claim limits of at most `count` deliveries, whatever their bytes.
    fn up_to(count: usize) -> ClaimLimits {
        ClaimLimits {
            count,
            bytes: u64::MAX,
        }
    }

    async fn insert_events(store: &Store, events: i64) {
        sqlx::query(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'o-' || n, 'order.created', '\\x7b7d' FROM generate_series(1, $1) n",
        )
        .bind(events)
        .execute(&store.pool)
        .await
        .expect("insert events");
    }

    /// A transaction left open on a connection of its own, with an id: it writes an
    /// event (aggregate id `late`) when `with_event`. Returns the connection and the id.
    async fn open_transaction(
        database: &outbox_testkit::ThrowawayDatabase,
        with_event: bool,
    ) -> (sqlx::PgConnection, i64) {
        let mut connection = sqlx::PgConnection::connect_with(&database.connect_options())
            .await
            .expect("connect");
        sqlx::raw_sql("BEGIN")
            .execute(&mut connection)
            .await
            .unwrap();
        if with_event {
            sqlx::query(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', 'late', 'order.created', '\\x7b7d')",
            )
            .execute(&mut connection)
            .await
            .expect("write the event");
        }
        let id = sqlx::query_scalar("SELECT pg_current_xact_id()::text::bigint")
            .fetch_one(&mut connection)
            .await
            .expect("the transaction's id");
        (connection, id)
    }

    /// A claim whose wait for the subscription's lock fails (here a `lock_timeout`, as a
    /// deadlock or a cancel would) fails alone: the connection it ran on goes back to the
    /// pool usable, and the next claim on it leases the events.
    #[tokio::test]
    async fn a_claim_that_cannot_take_the_lock_leaves_its_connection_usable() {
        let (database, store, subscription) = subscription_with_events(1, 3).await;
        // The pool's one connection gives up waiting for a lock after 100 ms.
        sqlx::raw_sql("SET lock_timeout = '100ms'")
            .execute(&store.pool)
            .await
            .unwrap();
        let (mut holder, _) = open_transaction(&database, false).await;
        lock_subscription(&mut holder, subscription.id, LockMode::Exclusive)
            .await
            .expect("hold the subscription's lock");
        let limits = up_to(10);
        let refused = store.claim(&subscription, 1, limits, false).await;
        assert!(refused.is_err(), "the claim waits past lock_timeout");

        sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();
        let claim = store
            .claim(&subscription, 2, limits, false)
            .await
            .expect("the next claim runs")
            .expect("the subscription reads this database");
        assert_eq!(claim.deliveries.len(), 3);
        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }

    /// A claim of a filtered subscription evaluates the filter before it waits for the
    /// subscription's lock (which acks, other claims and admin calls take too), with no
    /// transaction open, so a costly filter holds none of them up. It then leases what it
    /// evaluated: an event committed while it waited is left to the next claim.
    #[tokio::test]
    async fn a_filtered_claim_evaluates_its_filter_before_it_waits_for_the_lock() {
        let (database, store) = throwaway_store(4, Duration::from_secs(60)).await;
        store.migrate().await.expect("migrate");
        let settings = SubscriptionSettings {
            filter: Some(EventFilter::parse("filter", "event_type == 'order.created'").unwrap()),
            ..SubscriptionSettings::default()
        };
        let subscription = subscription_from_earliest(&store, "filtered", settings).await;
        insert_events(&store, 2).await;
        let (mut holder, _) = open_transaction(&database, false).await;
        lock_subscription(&mut holder, subscription.id, LockMode::Exclusive)
            .await
            .expect("hold the subscription's lock");

        let claim = tokio::spawn({
            let (store, subscription) = (store.clone(), subscription.clone());
            async move { store.claim(&subscription, 1, up_to(10), false).await }
        });
        let waiting = outbox_testkit::poll_until(
            Duration::from_secs(30),
            Duration::from_millis(20),
            || async {
                sqlx::query_scalar::<_, bool>(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks
                                    WHERE locktype = 'advisory' AND NOT granted
                                      AND objid = $1::bigint::oid)",
                )
                .bind(subscription.id.0)
                .fetch_one(&store.pool)
                .await
                .unwrap()
                .then_some(())
            },
        )
        .await;
        assert!(
            waiting.is_some(),
            "the claim waits for the subscription's lock"
        );
        insert_events(&store, 1).await;
        sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();

        let first = claim
            .await
            .unwrap()
            .expect("the claim")
            .expect("a read position");
        assert_eq!(positions_of(Some(first)), vec![1, 2], "what the filter saw");
        let next = store
            .claim(&subscription, 2, up_to(10), false)
            .await
            .unwrap();
        assert_eq!(positions_of(next), vec![3], "the event committed meanwhile");
        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }

    /// Re-leasing due records of an ordered subscription reads those records, not every
    /// record waiting behind them, even on the generic plans a claim's connection made
    /// while the table was empty (as it is whenever the subscriptions have caught up).
    /// Joined by subscription and position, the re-lease read every record of the
    /// subscription: with a backlog that held each claim, and every ack waiting for the
    /// subscription's lock, for seconds.
    #[tokio::test]
    async fn a_claim_of_due_records_reads_them_alone_whatever_its_plan_was_made_on() {
        const AGGREGATES: i64 = 50;
        const WAITING: i64 = 5_000;
        // One connection, so the claims below run on the plans the first one made.
        let (database, store) = throwaway_store(1, Duration::from_secs(60)).await;
        store.migrate().await.expect("migrate");
        let settings = SubscriptionSettings {
            ordered: true,
            ..SubscriptionSettings::default()
        };
        let subscription = subscription_from_earliest(&store, "ordered", settings).await;
        // Statistics that say the table is empty, and no analysis to replace them (and the
        // plans made on them) while the test runs.
        sqlx::raw_sql(
            "ANALYZE outbox_deliveries;
             ALTER TABLE outbox_deliveries SET (autovacuum_enabled = false)",
        )
        .execute(&store.pool)
        .await
        .unwrap();
        let claim = store.claim(&subscription, 1, up_to(10_000), true).await;
        assert_eq!(positions_of(claim.unwrap()), Vec::<i64>::new());

        sqlx::query(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'o-' || (n % $1), 'order.created', '\\x7b7d'
             FROM generate_series(1, $2) n",
        )
        .bind(AGGREGATES)
        .bind(WAITING + AGGREGATES)
        .execute(&store.pool)
        .await
        .unwrap();
        let first = store.claim(&subscription, 2, up_to(10_000), true).await;
        assert_eq!(positions_of(first.unwrap()).len(), AGGREGATES as usize);
        // Every aggregate's lease expires: the next claim re-leases them.
        sqlx::raw_sql(
            "UPDATE outbox_deliveries SET due_at = now() - interval '1 second'
             WHERE state = 'in_flight'",
        )
        .execute(&store.pool)
        .await
        .unwrap();

        let records_read = || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes
                         WHERE relname = 'outbox_deliveries')::bigint
                      + (SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables
                         WHERE relname = 'outbox_deliveries')",
            )
            .fetch_one(&store.pool)
            .await
        };
        let (quiet, within, every) = (
            Duration::from_secs(2),
            Duration::from_secs(60),
            Duration::from_millis(200),
        );
        let before = outbox_testkit::settled(quiet, within, every, records_read)
            .await
            .unwrap();
        let again = store.claim(&subscription, 3, up_to(10_000), true).await;
        assert_eq!(positions_of(again.unwrap()).len(), AGGREGATES as usize);
        let after = outbox_testkit::settled(quiet, within, every, records_read)
            .await
            .unwrap();
        let read = after - before;
        assert!(
            read < WAITING / 2,
            "re-leasing {AGGREGATES} records read {read} with {WAITING} waiting"
        );
        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }

    /// An ack id named twice in one call (two callers' acks applied together, or one
    /// caller's repeated) settles its lease once and counts one ack.
    #[tokio::test]
    async fn an_ack_id_named_twice_counts_once() {
        let (database, store, subscription) = subscription_with_events(2, 3).await;
        let limits = up_to(10);
        let claim = store.claim(&subscription, 7, limits, false).await.unwrap();
        let acks: Vec<AckId> = claim.unwrap().deliveries.iter().map(|d| d.ack_id).collect();
        assert_eq!(acks.len(), 3);

        let named = [acks[0], acks[0], acks[1]];
        let mut connection = None;
        let acked = store
            .ack_together(&mut connection, &subscription, &named)
            .await
            .unwrap();
        assert!(acked.iter().all(|ack| acks[..2].contains(ack)));
        assert!(acked.contains(&acks[0]) && acked.contains(&acks[1]));
        assert!(
            connection.is_some(),
            "the connection is kept for the next round"
        );
        let rest = store
            .ack_together(&mut connection, &subscription, &acks[2..])
            .await
            .unwrap();
        assert_eq!(rest, acks[2..]);
        drop(connection);

        let stats = store
            .subscription_stats(&subscription)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((stats.acked_total, stats.in_flight), (3, 0));
        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }

    /// A batch ack reads the claim batches of the lease tokens it names, found by the
    /// primary key, and no others: its cost must not grow with what else the
    /// subscription has in flight (its first version's plan joined the tokens by hash to
    /// every batch of the subscription, for every ack).
    #[tokio::test]
    async fn a_batch_ack_reads_only_the_batches_it_names() {
        let (database, store, subscription) = subscription_with_events(1, 3).await;
        let claim = store
            .claim(&subscription, 7, up_to(10), false)
            .await
            .unwrap();
        let acks: Vec<AckId> = claim.unwrap().deliveries.iter().map(|d| d.ack_id).collect();
        assert_eq!(acks.len(), 3);
        // A thousand other claims in flight, of one batch row each.
        sqlx::query(
            "INSERT INTO outbox_delivery_batches (subscription_id, lease_token, chunk, due_at, positions)
             SELECT $1, 1000 + n, 0, now() + interval '1 hour', ARRAY[1000000 + n]
             FROM generate_series(1, 1000) n",
        )
        .bind(subscription.id.0)
        .execute(&store.pool)
        .await
        .unwrap();

        // A connection of its own: a backend counts what it read until it reports it,
        // across transactions, and the pool's made the claim.
        let mut connection = sqlx::PgConnection::connect_with(&database.connect_options())
            .await
            .expect("connect");
        let mut transaction = connection.begin().await.unwrap();
        let settled: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox_ack_batches($1, $2, $3)")
                .bind(subscription.id.0)
                .bind(acks.iter().map(|ack| ack.position).collect::<Vec<_>>())
                .bind(acks.iter().map(|ack| ack.lease_token).collect::<Vec<_>>())
                .fetch_one(&mut *transaction)
                .await
                .unwrap();
        // What this transaction read of the table so far.
        let (sequential_scans, rows_fetched): (i64, i64) = sqlx::query_as(
            "SELECT seq_scan, idx_tup_fetch FROM pg_stat_xact_user_tables
             WHERE relname = 'outbox_delivery_batches'",
        )
        .fetch_one(&mut *transaction)
        .await
        .unwrap();
        transaction.commit().await.unwrap();
        connection.close().await.unwrap();
        assert_eq!(settled, 3, "the three acks settle");
        assert_eq!(sequential_scans, 0);
        assert!(
            rows_fetched <= 3,
            "the ack read {rows_fetched} batch rows for a claim of one"
        );
        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }

    /// Claims and batch acks keep one cached plan per connection instead of planning
    /// anew on every call (planning cost PostgreSQL as much as running them), and the
    /// cached claim plan walks the relay-order index to its LIMIT rather than reading
    /// every event past the cursor. That holds for both claim statements: the short one,
    /// and the full one a claim takes when a transaction it remembered has ended with an
    /// event to take.
    #[tokio::test]
    async fn claims_and_batch_acks_run_on_one_cached_plan() {
        // One connection: every claim and ack shares its prepared statements.
        let (database, store, subscription) = subscription_with_events(1, 0).await;
        // A transaction running when the events commit, and older than theirs: the
        // claims remember it, and take its event late, once it commits.
        let (mut older, _) = open_transaction(&database, true).await;
        insert_events(&store, 5000).await;

        const CLAIMS: i64 = 8;
        let mut late_taken = false;
        for claim_number in 1..=CLAIMS {
            if claim_number == CLAIMS / 2 {
                sqlx::raw_sql("COMMIT").execute(&mut older).await.unwrap();
            }
            let limits = up_to(100);
            let claim = store
                .claim(&subscription, claim_number, limits, false)
                .await
                .expect("claim")
                .expect("the subscription reads this database");
            assert_eq!(claim.deliveries.len(), 100, "claim {claim_number}");
            late_taken |= claim
                .deliveries
                .iter()
                .any(|d| d.event.aggregate_id == "late");
            let acks: Vec<AckId> = claim.deliveries.iter().map(|d| d.ack_id).collect();
            let acked = store
                .ack_together(&mut None, &subscription, &acks)
                .await
                .expect("ack");
            assert_eq!(acked.len(), 100, "acks of claim {claim_number}");
        }
        assert!(late_taken, "the older transaction's event was delivered");

        // (generic, custom) plans of the statement starting so; (0, 0) if it never ran.
        let pool = &store.pool;
        let plans = |start: &'static str| async move {
            sqlx::query_as::<_, (i64, i64)>(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements
                 WHERE starts_with(statement, $1)",
            )
            .bind(start)
            .fetch_optional(pool)
            .await
            .unwrap()
            .unwrap_or_default()
        };
        // Each claim ran the short statement, on a generic plan; the full one ran only when
        // the older transaction's event was to be taken, after the short one declined
        // and wrote nothing. (Transactions of other tests' databases are remembered too,
        // but leave no events here to take.)
        let (fresh, fresh_custom) = plans("-- The common claim of an unordered").await;
        let (leased, leased_custom) = plans("-- The common claim's second statement").await;
        let (full, full_custom) = plans("-- Claims the next events of one subscription").await;
        assert_eq!(
            (fresh, leased, full),
            (CLAIMS, CLAIMS - 1, 1),
            "generic plans of the claims"
        );
        assert_eq!(
            (fresh_custom, leased_custom, full_custom),
            (0, 0, 0),
            "custom plans of the claims"
        );
        // The batch ack's statement runs in a function whose settings give it the same
        // cached generic plan, with sequential scans off.
        let settings: Vec<String> = sqlx::query_scalar(
            "SELECT unnest(proconfig) FROM pg_proc WHERE proname = 'outbox_ack_batches'",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        assert_eq!(
            settings,
            ["plan_cache_mode=force_generic_plan", "enable_seqscan=off"],
            "settings of the batch ack"
        );

        // The generic plans of both claim statements read past the cursor by the
        // relay-order index, as far as their LIMIT.
        let id = subscription.id.0;
        for (name, statement, parameters) in [
            (
                "fresh_claim",
                include_str!("queries/claim_fresh.sql"),
                format!(
                    "{id}, 0, 0, 100, NULL, '{{}}', NULL, NULL, '{{}}', '{{}}', 30000, NULL, 1000000"
                ),
            ),
            (
                "full_claim",
                include_str!("queries/claim_new.sql"),
                format!(
                    "{id}, 0, 0, 100, NULL, '{{}}', NULL, NULL, '{{}}', '{{}}', 99, 30000, \
                     1000000, 0, NULL, false, false, NULL, NULL, '{{}}'"
                ),
            ),
        ] {
            let mut transaction = store.pool.begin_with(GENERIC_PLANS).await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "PREPARE {name} AS {statement}"
            )))
            .execute(&mut *transaction)
            .await
            .expect("prepare the claim");
            let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "EXPLAIN EXECUTE {name}({parameters})"
            )))
            .fetch_all(&mut *transaction)
            .await
            .expect("explain the claim");
            transaction.rollback().await.unwrap();
            let plan = plan.join("\n");
            assert!(
                plan.contains("Index Scan using outbox_events_relay_order"),
                "{name} reads past the cursor by the relay-order index:\n{plan}"
            );
            assert!(
                !plan.contains("Bitmap Heap Scan on outbox_events") && !plan.contains("Seq Scan"),
                "{name} neither reads every event past the cursor nor scans a table:\n{plan}"
            );
        }

        older.close().await.expect("close the older connection");
        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }

    /// A remembered transaction that ends without events to take (most are the service's
    /// own, or another database's) is forgotten by the short claim, which carries on.
    #[tokio::test]
    async fn a_remembered_transaction_without_events_is_forgotten_on_the_short_path() {
        let (database, store, subscription) = subscription_with_events(1, 0).await;
        let (mut older, older_id) = open_transaction(&database, false).await;
        insert_events(&store, 20).await;
        let limits = up_to(10);
        let remembered = || async {
            let pending: Vec<i64> = sqlx::query_scalar(
                "SELECT pending_xact_ids FROM outbox_cursors WHERE subscription_id = $1",
            )
            .bind(subscription.id.0)
            .fetch_one(&store.pool)
            .await
            .unwrap();
            pending.contains(&older_id)
        };

        let first = store.claim(&subscription, 1, limits, false).await.unwrap();
        assert_eq!(first.unwrap().deliveries.len(), 10);
        assert!(
            remembered().await,
            "the running older transaction is remembered"
        );
        sqlx::raw_sql("COMMIT").execute(&mut older).await.unwrap();
        let second = store.claim(&subscription, 2, limits, false).await.unwrap();
        assert_eq!(second.unwrap().deliveries.len(), 10);
        assert!(!remembered().await, "the ended transaction is forgotten");

        let full_claims: Option<i64> = sqlx::query_scalar(
            "SELECT generic_plans + custom_plans FROM pg_prepared_statements
             WHERE starts_with(statement, '-- Claims the next events of one subscription')",
        )
        .fetch_optional(&store.pool)
        .await
        .unwrap();
        assert_eq!(full_claims, None, "both claims took the short path");

        older.close().await.expect("close the older connection");
        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }

    /// `late_transactions` counts the remembered transactions that finished with events
    /// to take, not those that wrote none: most remembered ones are the service's own
    /// or another database's.
    #[tokio::test]
    async fn late_transactions_count_only_those_with_events() {
        let (database, store, subscription) = subscription_with_events(1, 0).await;
        let (mut with_event, _) = open_transaction(&database, true).await;
        let (mut without, _) = open_transaction(&database, false).await;
        insert_events(&store, 3).await;
        let limits = up_to(10);
        let claimed = store.claim(&subscription, 1, limits, false).await.unwrap();
        assert_eq!(claimed.unwrap().deliveries.len(), 3);
        for connection in [&mut with_event, &mut without] {
            sqlx::raw_sql("COMMIT").execute(connection).await.unwrap();
        }

        let stats = || async {
            let stats = store.subscription_stats(&subscription).await.unwrap();
            let stats = stats.expect("the subscription reads this database");
            (stats.late_transactions, stats.pending)
        };
        assert_eq!(
            stats().await,
            (1, 1),
            "late transactions and pending events"
        );
        let late = store.claim(&subscription, 2, limits, false).await.unwrap();
        let late: Vec<String> = late
            .unwrap()
            .deliveries
            .into_iter()
            .map(|d| d.event.aggregate_id)
            .collect();
        assert_eq!(late, ["late"]);
        assert_eq!(stats().await, (0, 0), "after the next claim");

        with_event.close().await.unwrap();
        without.close().await.unwrap();
        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }

    /// A claim whose byte budget cuts the events it read leaves the rest for the next
    /// claim, which takes them and nothing twice.
    #[tokio::test]
    async fn a_claim_cut_by_its_bytes_leaves_the_rest_for_the_next() {
        let (database, store, subscription) = subscription_with_events(1, 5).await;
        let claim = |token, limits| store.claim(&subscription, token, limits, false);
        let positions = |claim: Result<Option<Claim>>| positions_of(claim.unwrap());
        // Each event counts its 2-byte payload and 256 bytes more: 600 bytes hold three
        // (the bytes before each stay within the budget).
        let cut = ClaimLimits {
            count: 100,
            bytes: 600,
        };
        let first = positions(claim(1, cut).await);
        assert_eq!(first.len(), 3, "the byte budget holds three: {first:?}");
        let rest = positions(claim(2, up_to(100)).await);
        assert_eq!(
            rest.len(),
            2,
            "the next claim takes the other two: {rest:?}"
        );
        assert!(first.iter().all(|position| !rest.contains(position)));
        insert_events(&store, 1).await;
        let last = positions(claim(3, up_to(100)).await);
        assert_eq!(last.len(), 1, "only the newest is left: {last:?}");

        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }

    /// A scheduled event among those read sends the claim from the short path to the full
    /// statement, on the same connection, part way through the rows: the events due go
    /// out and the scheduled one waits.
    #[tokio::test]
    async fn a_scheduled_event_among_the_rows_sends_the_claim_down_the_full_path() {
        let (database, store, subscription) = subscription_with_events(1, 3).await;
        sqlx::query(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, deliver_at)
             VALUES ('order', 'later', 'order.created', '\\x7b7d', now() + interval '1 hour')",
        )
        .execute(&store.pool)
        .await
        .expect("schedule an event");
        insert_events(&store, 3).await;

        let claim = store.claim(&subscription, 1, up_to(100), false).await;
        let claim = claim.unwrap().expect("the subscription reads here");
        let ids: Vec<&str> = claim
            .deliveries
            .iter()
            .map(|d| d.event.aggregate_id.as_str())
            .collect();
        assert_eq!(ids.len(), 6, "the events due go out: {ids:?}");
        assert!(!ids.contains(&"later"), "the scheduled event waits");
        assert!(
            claim.next_scheduled.is_some(),
            "and is known to be due later"
        );

        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }

    /// Positions of the deliveries a claim leased.
    fn positions_of(claim: Option<Claim>) -> Vec<i64> {
        let claim = claim.expect("the subscription reads here");
        claim.deliveries.iter().map(|d| d.ack_id.position).collect()
    }

    /// A claim hands where it leaves the read position to a claim that follows it, which
    /// reads the next events while the first leases and commits: the two take
    /// consecutive batches, the next claim the rest, nothing twice, and every lease
    /// settles.
    #[tokio::test]
    async fn a_following_claim_takes_the_events_after_the_first() {
        let (database, store, subscription) = subscription_with_events(2, 2500).await;
        let (handover, handed_over) = tokio::sync::oneshot::channel();
        let first = store.claim_handing_over(&subscription, 1, up_to(1000), false, Some(handover));
        let following = async {
            let handover = handed_over.await.expect("the first claim hands over");
            assert_eq!(handover.leased, 1000);
            let bytes = handover.bytes;
            let claim = store
                .claim_following(&subscription, 2, up_to(1000), handover)
                .await;
            (bytes, claim)
        };
        let (first, (handed_over_bytes, following)) = tokio::join!(first, following);
        let first = first.unwrap();
        let first_bytes: u64 = first
            .iter()
            .flat_map(|c| &c.deliveries)
            .map(Delivery::size)
            .sum();
        assert_eq!(
            handed_over_bytes, first_bytes,
            "the handover counts the bytes the first claim's deliveries weigh"
        );
        let (first, following) = (positions_of(first), positions_of(following.unwrap()));
        let rest = positions_of(
            store
                .claim(&subscription, 3, up_to(1000), false)
                .await
                .unwrap(),
        );
        let mut all: Vec<i64> = [&first, &following, &rest]
            .into_iter()
            .flatten()
            .copied()
            .collect();
        assert_eq!(
            (first.len(), following.len(), rest.len()),
            (1000, 1000, 500)
        );
        assert!(
            first.iter().max() < following.iter().min(),
            "in reading order"
        );
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 2500, "no event twice");
        let nothing = store
            .claim(&subscription, 4, up_to(1000), false)
            .await
            .unwrap();
        assert_eq!(positions_of(nothing), Vec::<i64>::new());

        let (handover, handed_over) = tokio::sync::oneshot::channel();
        insert_events(&store, 10).await;
        let last = store.claim_handing_over(&subscription, 5, up_to(1000), false, Some(handover));
        assert_eq!(positions_of(last.await.unwrap()).len(), 10);
        assert!(
            handed_over.await.is_err(),
            "a claim that read every event hands nothing over"
        );

        let stats = store
            .subscription_stats(&subscription)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stats.in_flight, 2510, "every lease is counted");
        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }

    /// A following claim whose read position was moved before it could lease (here by
    /// another gateway's claim, as a seek or a first claim that rolled back would) leases
    /// nothing and writes nothing; the events it read go to the claims after it.
    #[tokio::test]
    async fn a_following_claim_behind_a_moved_position_leases_nothing() {
        let (database, store, subscription) = subscription_with_events(2, 30).await;
        let (handover, handed_over) = tokio::sync::oneshot::channel();
        let first = store.claim_handing_over(&subscription, 1, up_to(10), false, Some(handover));
        assert_eq!(positions_of(first.await.unwrap()).len(), 10);
        let handover = handed_over.await.expect("the first claim hands over");
        let elsewhere = positions_of(
            store
                .claim(&subscription, 2, up_to(10), false)
                .await
                .unwrap(),
        );
        assert_eq!(elsewhere.len(), 10);

        let following = store.claim_following(&subscription, 3, up_to(10), handover);
        assert!(following.await.unwrap().is_none(), "it leases nothing");
        let leased: i64 = sqlx::query_scalar(
            "SELECT coalesce(sum(cardinality(positions)), 0) FROM outbox_delivery_batches
             WHERE subscription_id = $1 AND lease_token = 3",
        )
        .bind(subscription.id.0)
        .fetch_one(&store.pool)
        .await
        .unwrap();
        assert_eq!(leased, 0, "no batch of the following claim");
        let rest = positions_of(
            store
                .claim(&subscription, 4, up_to(100), false)
                .await
                .unwrap(),
        );
        assert_eq!(rest.len(), 10, "the last ten go to the next claim");
        assert!(rest.iter().all(|position| !elsewhere.contains(position)));
        let stats = store
            .subscription_stats(&subscription)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((stats.in_flight, stats.pending), (30, 0));

        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }

    /// After a seek back, a claim reads again events that still have records: one in
    /// flight, one awaiting its retry, one dead. Those keep their state; only the events
    /// without a record go out again.
    #[tokio::test]
    async fn a_claim_after_a_seek_leaves_events_with_records_alone() {
        let (database, store, subscription) = subscription_with_events(2, 10).await;
        let limits = up_to(100);
        let claim = |token| store.claim(&subscription, token, limits, false);

        let first = claim(1).await.unwrap().unwrap().deliveries;
        assert_eq!(first.len(), 10);
        let ack_ids: Vec<AckId> = first.iter().map(|d| d.ack_id).collect();
        let acked = store
            .ack_together(&mut None, &subscription, &ack_ids[..6])
            .await
            .unwrap();
        assert_eq!(acked.len(), 6);
        let hour = Duration::from_secs(3600);
        let retry = store.nack(&subscription, ack_ids[6], "later", hour, false);
        assert!(retry.await.unwrap().is_some_and(|n| !n.dead_lettered));
        let dead = store.nack(&subscription, ack_ids[7], "bad", hour, true);
        assert!(dead.await.unwrap().is_some_and(|n| n.dead_lettered));

        let seek = store.prepare_seek(subscription.id, StartPosition::Earliest);
        seek.await.unwrap().commit().await.unwrap();
        let again: Vec<i64> = claim(2)
            .await
            .unwrap()
            .unwrap()
            .deliveries
            .iter()
            .map(|d| d.ack_id.position)
            .collect();
        let replayed: Vec<i64> = ack_ids[..6].iter().map(|ack| ack.position).collect();
        assert_eq!(again, replayed, "only the acked events go out again");
        let still_leased = store
            .ack_together(&mut None, &subscription, &ack_ids[8..])
            .await;
        assert_eq!(
            still_leased.unwrap().len(),
            2,
            "the first leases still hold"
        );

        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }

    /// Empty metadata is taken without parsing; any other is parsed, even where it holds
    /// `{}` as a value.
    #[tokio::test]
    async fn claims_read_empty_and_other_metadata() {
        let (database, store, subscription) = subscription_with_events(2, 1).await;
        sqlx::query(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, metadata)
             VALUES ('order', 'o-2', 'order.created', '\\x7b7d', '{\"tenant\": \"t-1\", \"note\": \"{}\"}')",
        )
        .execute(&store.pool)
        .await
        .expect("insert an event with metadata");
        let claim = store
            .claim(&subscription, 1, up_to(10), false)
            .await
            .expect("claim")
            .expect("reading");
        let metadata: Vec<_> = claim
            .deliveries
            .iter()
            .map(|delivery| delivery.event.metadata_by_key())
            .collect();
        assert_eq!(
            metadata,
            vec![
                BTreeMap::new(),
                BTreeMap::from([("note", "{}"), ("tenant", "t-1")])
            ]
        );
        store.pool.close().await;
        database.drop_database().await.expect("drop the database");
    }
}
