//! Transactions held open for seconds, as batch jobs and forgetful sessions do: one that
//! writes only a business row (it must delay no delivery) and, half of the time, one that
//! also writes outbox events (they must go out once it commits, never if it rolls back).
//! Their events belong to aggregates of their own, one event each, so the ordered
//! subscription's checks stay meaningful.

use std::{sync::Arc, time::Duration};

use rand::{Rng, SeedableRng, rngs::StdRng, seq::IndexedRandom};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::{
    database::ChaosDatabase,
    ledger::{Ledger, Published, Route},
    producers::EVENT_TYPES,
};

/// Holds transactions open one after another until `stop`.
pub async fn run(database: ChaosDatabase, ledger: Arc<Ledger>, seed: u64, stop: CancellationToken) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6865_6c64);
    if let Err(error) = sqlx::query(
        "CREATE TABLE IF NOT EXISTS chaos_business (id bigserial PRIMARY KEY, note text)",
    )
    .execute(database.pool())
    .await
    {
        eprintln!("outbox-chaos: cannot create the business table: {error}");
        return;
    }
    let mut held = 0u64;
    while !stop.is_cancelled() {
        let hold = Duration::from_millis(rng.random_range(1000..8000));
        let with_events = rng.random_bool(0.5);
        let commit = rng.random_bool(0.8);
        let events: Vec<Published> = if with_events {
            (0..rng.random_range(1..=3))
                .map(|index| Published {
                    id: Uuid::now_v7(),
                    aggregate: format!("order/held{held}-{index}"),
                    version: 1,
                    event_type: (*EVENT_TYPES.choose(&mut rng).expect("event types")).to_owned(),
                    route: Route::Sql,
                    deliver_at: None,
                    expires_at: None,
                })
                .collect()
        } else {
            Vec::new()
        };
        held += 1;
        match hold_one(&database, &events, hold, commit, &stop).await {
            Ok(true) => ledger.committed(&events),
            Ok(false) => ledger.rolled_back(&events),
            Err(error) => {
                eprintln!("outbox-chaos: held transaction failed: {error}");
                // A commit whose answer was lost: look the rows up.
                if let Some(first) = events.first() {
                    match database.is_stored(first.id).await {
                        Ok(true) => ledger.committed(&events),
                        Ok(false) => ledger.rolled_back(&events),
                        Err(_) => ledger.in_doubt(&events),
                    }
                }
            }
        }
        ledger.state().held_transactions += 1;
    }
}

/// One transaction: a business row, the events, a long pause, then commit or roll back.
/// `Ok(true)` when committed.
async fn hold_one(
    database: &ChaosDatabase,
    events: &[Published],
    hold: Duration,
    commit: bool,
    stop: &CancellationToken,
) -> anyhow::Result<bool> {
    let mut transaction = database.pool().begin().await?;
    sqlx::query("INSERT INTO chaos_business (note) VALUES ('held open')")
        .execute(&mut *transaction)
        .await?;
    for event in events {
        let (aggregate_type, aggregate_id) = event
            .aggregate
            .split_once('/')
            .expect("aggregate keys are type/id");
        sqlx::query(
            "INSERT INTO outbox_events \
             (id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) \
             VALUES ($1, $2, $3, 1, $4, '{}')",
        )
        .bind(event.id)
        .bind(aggregate_type)
        .bind(aggregate_id)
        .bind(&event.event_type)
        .execute(&mut *transaction)
        .await?;
    }
    tokio::select! {
        _ = tokio::time::sleep(hold) => {}
        _ = stop.cancelled() => {}
    }
    if commit {
        transaction.commit().await?;
        Ok(true)
    } else {
        transaction.rollback().await?;
        Ok(false)
    }
}
