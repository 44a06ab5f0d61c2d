//! Closed-loop publishers: N concurrent callers, each sending its next call as soon as the
//! previous one returned, either through the gateway's Publish RPC or straight into
//! PostgreSQL (the ceiling the gateway is compared with).

use std::{sync::Arc, time::Duration};

use tokio::time::Instant;

use crate::{
    database::{BenchDatabase, Notify},
    gateway::Gateway,
    measure::{self, RunShared, Throughput, Timing},
    workload::{self, RawBatch},
};

/// Pause after a failed call, so a broken gateway or database is not hammered.
const AFTER_ERROR: Duration = Duration::from_millis(10);

/// Who writes the events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    /// The gateway's Publish RPC.
    Gateway,
    /// sqlx, straight into `outbox_events` (single-row INSERT for a batch of 1, one
    /// `INSERT ... SELECT FROM UNNEST` per batch otherwise), one connection per caller.
    Sql,
}

impl Writer {
    pub fn name(self) -> &'static str {
        match self {
            Writer::Gateway => "gateway",
            Writer::Sql => "sql",
        }
    }
}

/// `callers` concurrent callers publish `batch` events per call for the run's duration.
pub async fn run(
    writer: Writer,
    timing: Timing,
    gateway: &Gateway,
    database: &BenchDatabase,
    callers: usize,
    batch: usize,
) -> anyhow::Result<Throughput> {
    match writer {
        Writer::Gateway => gateway_run(timing, gateway, callers, batch).await,
        Writer::Sql => sql_run(timing, gateway, database, callers, batch).await,
    }
}

async fn gateway_run(
    timing: Timing,
    gateway: &Gateway,
    callers: usize,
    batch: usize,
) -> anyhow::Result<Throughput> {
    measure::timed_run(
        timing,
        gateway,
        callers,
        |caller, shared: Arc<RunShared>| {
            let mut client = gateway.publisher();
            let template = workload::publish_request(caller, batch);
            async move {
                let mut latency = measure::new_histogram();
                while !shared.stopped() {
                    // Publish takes its request by value: a clone of the template per call.
                    let request = template.clone();
                    let started = Instant::now();
                    match client.publish(request).await {
                        Ok(response) => {
                            let elapsed = started.elapsed();
                            shared.completed(response.get_ref().results.len() as u64);
                            if shared.measuring() {
                                measure::record(&mut latency, elapsed);
                            }
                        }
                        Err(status) => {
                            shared.failed(format!("Publish: {status}"));
                            tokio::time::sleep(AFTER_ERROR).await;
                        }
                    }
                }
                latency
            }
        },
    )
    .await
}

async fn sql_run(
    timing: Timing,
    gateway: &Gateway,
    database: &BenchDatabase,
    callers: usize,
    batch: usize,
) -> anyhow::Result<Throughput> {
    let pool = database.pool(callers as u32, Notify::Suppress).await?;
    let result = measure::timed_run(
        timing,
        gateway,
        callers,
        |caller, shared: Arc<RunShared>| {
            let pool = pool.clone();
            let mut rows = RawBatch::new(caller, batch);
            let aggregate_id = workload::aggregate_id(caller, 0);
            async move {
                let mut latency = measure::new_histogram();
                // A connection of its own, used statement after statement as a producer
                // service's request handler would: no pool hand-off per call.
                let mut connection = match pool.acquire().await {
                    Ok(connection) => connection,
                    Err(error) => {
                        shared.failed(format!("connect: {error}"));
                        return latency;
                    }
                };
                while !shared.stopped() {
                    let started = Instant::now();
                    let inserted = if batch == 1 {
                        workload::insert_one(
                            &mut *connection,
                            &aggregate_id,
                            workload::METADATA_JSON,
                        )
                        .await
                        .map(|()| 1)
                    } else {
                        rows.insert(&mut *connection).await
                    };
                    match inserted {
                        Ok(events) => {
                            let elapsed = started.elapsed();
                            shared.completed(events);
                            if shared.measuring() {
                                measure::record(&mut latency, elapsed);
                            }
                        }
                        Err(error) => {
                            shared.failed(format!("INSERT: {error}"));
                            tokio::time::sleep(AFTER_ERROR).await;
                        }
                    }
                }
                latency
            }
        },
    )
    .await;
    pool.close().await;
    result
}
