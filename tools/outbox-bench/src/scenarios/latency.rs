//! latency: open-loop publishing at fixed rates (each event is sent at its scheduled time,
//! whether or not earlier calls have returned) with a live consumer, through the gateway's
//! Publish RPC and, for comparison, by direct autocommit INSERTs that the gateway hears
//! about through NOTIFY.
//!
//! Every event carries its sequence number in its metadata. The benchmark notes when its
//! Publish call (or INSERT) returned and when the consumer received it, both on this
//! process's monotonic clock:
//! - commit-to-delivery: receipt minus the moment the call returned (the commit happened
//!   just before); a delivery that overtakes the call's reply counts as 0;
//! - end-to-end: receipt minus the event's scheduled send time, which also covers the
//!   call itself and is free of coordinated omission.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use hdrhistogram::Histogram;
use serde_json::json;
use tokio::{sync::Semaphore, time::Instant};

use super::{
    Bench, progress,
    sink::{ArrivalWatch, Broker, create_sink_subscription},
};
use crate::{
    consume::{ConsumerConfig, ConsumerGroup, SubscriptionLoad},
    database::Notify,
    gateway::Gateway,
    measure::{self, LatencySummary, Series},
    publish::Writer,
    report::{LATENCY_HEADERS, Report, Table, Target, format_number, latency_cells},
    workload,
};

const RATES: [u64; 2] = [1_000, 5_000];
/// Calls in flight at once; an event due while all are taken is skipped (and counted).
const MAX_OUTSTANDING: usize = 1_000;
/// Connections of the direct-SQL writer.
const SQL_CONNECTIONS: u32 = 16;
/// Lead time between opening the consumer and the first scheduled event.
const LEAD: Duration = Duration::from_millis(100);

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "latency";
    let mut runs = Vec::new();
    for rate in RATES {
        for writer in [Writer::Gateway, Writer::Sql] {
            let run = measure_run(bench, gateway, writer, rate).await?;
            progress(
                scenario,
                format!(
                    "{} at {rate}/s: commit-to-delivery p50 {:.2} ms, p99 {:.2} ms",
                    writer.name(),
                    run.commit_to_delivery().p50,
                    run.commit_to_delivery().p99
                ),
            );
            runs.push(run);
        }
    }

    let mut report = Report::new(
        scenario,
        "open-loop publishing at fixed rates with a live consumer: commit-to-delivery latency",
    );
    let mut headers = vec!["run", "events", "lost", "overtook reply"];
    headers.extend(LATENCY_HEADERS);
    let mut commit_table = Table::new(
        "commit-to-delivery (from the call's return to receipt)",
        &headers,
    );
    let mut headers = vec!["run", "skipped", "failed"];
    headers.extend(LATENCY_HEADERS);
    let mut end_to_end_table = Table::new(
        "end-to-end (from the scheduled send time to receipt)",
        &headers,
    );
    for run in &runs {
        let mut cells = vec![
            run.label(),
            format_number(run.measured as f64),
            run.lost.to_string(),
            run.overtook_reply.to_string(),
        ];
        cells.extend(latency_cells(&run.commit_to_delivery()));
        commit_table.row(cells);
        let mut cells = vec![run.label(), run.skipped.to_string(), run.failed.to_string()];
        cells.extend(latency_cells(&LatencySummary::of(&run.end_to_end)));
        end_to_end_table.row(cells);
        if let Some(error) = &run.first_error {
            report.notes.push(format!(
                "{}: {} failed calls, first: {error}",
                run.label(),
                run.failed
            ));
        }
    }
    report.tables.push(commit_table);
    report.tables.push(end_to_end_table);
    report.figure(
        "measured_from",
        "commit_to_delivery: return of the Publish call (or INSERT) to receipt; \
         end_to_end: scheduled send time to receipt",
    );
    report.figure(
        "runs",
        runs.iter().map(LatencyRun::to_json).collect::<Vec<_>>(),
    );

    for run in runs.iter().filter(|run| run.writer == Writer::Gateway) {
        let summary = run.commit_to_delivery();
        if run.rate == 1_000 {
            report.targets.push(Target::at_most(
                "gateway at 1,000/s, p50",
                summary.p50,
                5.0,
                " ms",
            ));
            report.targets.push(Target::at_most(
                "gateway at 1,000/s, p99",
                summary.p99,
                15.0,
                " ms",
            ));
        } else if run.rate == 5_000 {
            report.targets.push(Target::at_most(
                "gateway at 5,000/s, p99",
                summary.p99,
                50.0,
                " ms",
            ));
        }
    }

    let curves: Vec<(String, &Histogram<u64>)> = runs
        .iter()
        .map(|run| (run.label(), &run.commit_to_delivery))
        .collect();
    bench.latency_chart(
        &mut report,
        "latency-commit-to-delivery.svg",
        "latency: commit-to-delivery",
        &curves,
    )?;
    let curves: Vec<(String, &Histogram<u64>)> = runs
        .iter()
        .map(|run| (run.label(), &run.end_to_end))
        .collect();
    bench.latency_chart(
        &mut report,
        "latency-end-to-end.svg",
        "latency: end-to-end from the scheduled send time",
        &curves,
    )?;
    let series: Vec<Series> = runs
        .iter()
        .map(|run| run.delivered.clone().labelled(run.label()))
        .collect();
    bench.time_chart(
        &mut report,
        "latency-throughput.svg",
        "latency: acked events/s during the open-loop runs",
        "events/s",
        &series,
    )?;
    Ok(report)
}

/// Timestamps of one run's events, in nanoseconds since `origin` plus one (zero: not
/// yet), indexed by sequence number.
struct Probe {
    origin: Instant,
    rate: u64,
    returned: Vec<AtomicU64>,
    received: Vec<AtomicU64>,
    returned_count: AtomicU64,
    received_count: AtomicU64,
    failed: AtomicU64,
    first_error: Mutex<Option<String>>,
}

impl Probe {
    fn new(origin: Instant, rate: u64, events: u64) -> Probe {
        let slots = || (0..events).map(|_| AtomicU64::new(0)).collect();
        Probe {
            origin,
            rate,
            returned: slots(),
            received: slots(),
            returned_count: AtomicU64::new(0),
            received_count: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            first_error: Mutex::new(None),
        }
    }

    fn scheduled_nanos(&self, sequence: u64) -> u64 {
        sequence * 1_000_000_000 / self.rate
    }

    fn now(&self) -> u64 {
        (Instant::now() - self.origin).as_nanos() as u64 + 1
    }

    fn call_returned(&self, sequence: u64) {
        self.returned[sequence as usize].store(self.now(), Ordering::Relaxed);
        self.returned_count.fetch_add(1, Ordering::Relaxed);
    }

    fn call_failed(&self, error: impl std::fmt::Display) {
        if self.failed.fetch_add(1, Ordering::Relaxed) == 0 {
            *self.first_error.lock().expect("error lock") = Some(error.to_string());
        }
    }

    /// Notes the first receipt of an event (a redelivery keeps the first time).
    fn received(&self, sequence: u64) {
        let Some(slot) = self.received.get(sequence as usize) else {
            return;
        };
        if slot
            .compare_exchange(0, self.now(), Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.received_count.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Figures of one open-loop run.
pub(super) struct LatencyRun {
    writer: Writer,
    /// The broker a sink published into, where it was measured; `None`: measured at a
    /// consumer.
    into_sink: Option<&'static str>,
    rate: u64,
    /// Events scheduled in the measured window (after the warm-up).
    scheduled: u64,
    /// Of those, events whose call returned successfully.
    pub(super) measured: u64,
    /// Returned but never received within the grace period.
    pub(super) lost: u64,
    /// Received before the call's reply reached the benchmark.
    overtook_reply: u64,
    skipped: u64,
    failed: u64,
    first_error: Option<String>,
    commit_to_delivery: Histogram<u64>,
    end_to_end: Histogram<u64>,
    call: Histogram<u64>,
    delivered: Series,
    /// Commit-to-delivery of the measured window's successive parts, when asked for
    /// ([`measure_windows`]), by when each event was scheduled.
    pub(super) by_window: Vec<Histogram<u64>>,
}

impl LatencyRun {
    pub(super) fn label(&self) -> String {
        format!(
            "{}{} at {}/s",
            self.writer.name(),
            self.into_sink
                .map(|broker| format!(" into {broker}"))
                .unwrap_or_default(),
            format_number(self.rate as f64)
        )
    }

    pub(super) fn commit_to_delivery(&self) -> LatencySummary {
        LatencySummary::of(&self.commit_to_delivery)
    }

    /// The commit-to-delivery histogram, for charts.
    pub(super) fn commit_to_delivery_histogram(&self) -> &Histogram<u64> {
        &self.commit_to_delivery
    }

    pub(super) fn to_json(&self) -> serde_json::Value {
        json!({
            "writer": self.writer.name(),
            "into_sink": self.into_sink,
            "rate_per_s": self.rate,
            "scheduled": self.scheduled,
            "measured": self.measured,
            "lost": self.lost,
            "overtook_reply": self.overtook_reply,
            "skipped": self.skipped,
            "failed": self.failed,
            "commit_to_delivery": self.commit_to_delivery().to_json(),
            "end_to_end": LatencySummary::of(&self.end_to_end).to_json(),
            "call": LatencySummary::of(&self.call).to_json(),
        })
    }
}

/// Where a run's events are seen arriving.
enum Arrival<'a> {
    /// A Subscribe stream on a subscription of the run's own.
    Consumer,
    /// The broker a sink subscription of the run's own publishes into.
    Sink(&'a Broker),
}

/// What sees a run's events arrive.
enum Observer {
    Consumers(ConsumerGroup),
    Broker(ArrivalWatch),
}

/// How long a run publishes, and in which parts its latency is told apart.
#[derive(Clone, Copy)]
struct Shape {
    warmup: Duration,
    duration: Duration,
    window: Option<Duration>,
}

impl Shape {
    fn of(bench: &Bench) -> Shape {
        Shape {
            warmup: bench.settings.timing.warmup,
            duration: bench.settings.timing.duration,
            window: None,
        }
    }
}

pub(super) async fn measure_run(
    bench: &Bench,
    gateway: &Gateway,
    writer: Writer,
    rate: u64,
) -> anyhow::Result<LatencyRun> {
    measure(
        bench,
        gateway,
        writer,
        rate,
        Arrival::Consumer,
        Shape::of(bench),
    )
    .await
}

/// Publishes through the gateway at `rate` for `duration` after the usual warm-up, and
/// keeps the commit-to-delivery latency of each successive `window` apart
/// ([`LatencyRun::by_window`]).
pub(super) async fn measure_windows(
    bench: &Bench,
    gateway: &Gateway,
    rate: u64,
    duration: Duration,
    window: Duration,
) -> anyhow::Result<LatencyRun> {
    let shape = Shape {
        duration,
        window: Some(window),
        ..Shape::of(bench)
    };
    measure(
        bench,
        gateway,
        Writer::Gateway,
        rate,
        Arrival::Consumer,
        shape,
    )
    .await
}

/// Publishes through the gateway at `rate` into a sink subscription, and measures from
/// each Publish call's return to the event's arrival at `broker`.
pub(super) async fn measure_sink_run(
    bench: &Bench,
    gateway: &Gateway,
    rate: u64,
    broker: &Broker,
) -> anyhow::Result<LatencyRun> {
    let shape = Shape::of(bench);
    measure(
        bench,
        gateway,
        Writer::Gateway,
        rate,
        Arrival::Sink(broker),
        shape,
    )
    .await
}

async fn measure(
    bench: &Bench,
    gateway: &Gateway,
    writer: Writer,
    rate: u64,
    arrival: Arrival<'_>,
    shape: Shape,
) -> anyhow::Result<LatencyRun> {
    let timing = bench.settings.timing;
    let warmup_events = (rate as f64 * shape.warmup.as_secs_f64()) as u64;
    let total = warmup_events + (rate as f64 * shape.duration.as_secs_f64()).max(1.0) as u64;
    let into_sink = match arrival {
        Arrival::Consumer => None,
        Arrival::Sink(broker) => Some(broker.label()),
    };
    let subscription = match into_sink {
        None => format!("latency-{}-{rate}", writer.name()),
        Some(broker) => format!("latency-{}-{rate}", broker.to_lowercase()),
    };
    match arrival {
        Arrival::Consumer => gateway.create_subscription(&subscription, false).await?,
        Arrival::Sink(broker) => {
            create_sink_subscription(gateway, &subscription, broker.sink(true), false).await?
        }
    }
    let sql_pool = match writer {
        Writer::Sql => Some(bench.database.pool(SQL_CONNECTIONS, Notify::Send).await?),
        Writer::Gateway => None,
    };

    let probe = Arc::new(Probe::new(Instant::now() + LEAD, rate, total));
    let receiver = probe.clone();
    let observer = match arrival {
        Arrival::Consumer => Observer::Consumers(
            ConsumerGroup::start(
                gateway,
                &[SubscriptionLoad {
                    name: subscription.clone(),
                    streams: 1,
                    target: u64::MAX,
                }],
                ConsumerConfig::default(),
                timing.sample_interval,
                move |delivery| {
                    if let Some(sequence) = workload::probe_sequence(delivery) {
                        receiver.received(sequence);
                    }
                },
            )
            .await?,
        ),
        Arrival::Sink(broker) => Observer::Broker(
            broker
                .watch_arrivals(move |sequence| receiver.received(sequence))
                .await?,
        ),
    };

    let skipped = match &sql_pool {
        None => {
            open_loop(&probe, total, |sequence| {
                let mut client = gateway.publisher();
                let request = workload::probe_request(sequence);
                let probe = probe.clone();
                async move {
                    match client.publish(request).await {
                        Ok(_) => probe.call_returned(sequence),
                        Err(status) => probe.call_failed(format!("Publish: {status}")),
                    }
                }
            })
            .await
        }
        Some(pool) => {
            open_loop(&probe, total, |sequence| {
                let pool = pool.clone();
                let probe = probe.clone();
                let aggregate_id = workload::aggregate_id(0, sequence as usize);
                let metadata = workload::probe_metadata_json(sequence);
                async move {
                    match workload::insert_one(&pool, &aggregate_id, &metadata).await {
                        Ok(()) => probe.call_returned(sequence),
                        Err(error) => probe.call_failed(format!("INSERT: {error}")),
                    }
                }
            })
            .await
        }
    };

    // Give the last events time to arrive.
    let grace = if bench.settings.quick {
        Duration::from_secs(2)
    } else {
        Duration::from_secs(10)
    };
    let deadline = Instant::now() + grace;
    while probe.received_count.load(Ordering::Relaxed)
        < probe.returned_count.load(Ordering::Relaxed)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let delivered = match observer {
        Observer::Consumers(consumers) => consumers.finish().await?.total_samples,
        Observer::Broker(watch) => {
            watch.stop().await;
            Series {
                label: String::new(),
                points: Vec::new(),
            }
        }
    };
    gateway.delete_subscription(&subscription).await?;
    if let Some(pool) = sql_pool {
        pool.close().await;
    }

    let mut run = LatencyRun {
        writer,
        into_sink,
        rate,
        scheduled: total - warmup_events,
        measured: 0,
        lost: 0,
        overtook_reply: 0,
        skipped,
        failed: probe.failed.load(Ordering::Relaxed),
        first_error: probe.first_error.lock().expect("error lock").take(),
        commit_to_delivery: measure::new_histogram(),
        end_to_end: measure::new_histogram(),
        call: measure::new_histogram(),
        delivered,
        by_window: Vec::new(),
    };
    let window_nanos = shape.window.map(|window| window.as_nanos().max(1) as u64);
    let warmup_nanos = probe.scheduled_nanos(warmup_events);
    let nanos = |value: u64| Duration::from_nanos(value);
    for sequence in warmup_events..total {
        let returned = probe.returned[sequence as usize].load(Ordering::Relaxed);
        if returned == 0 {
            continue;
        }
        run.measured += 1;
        let scheduled = probe.scheduled_nanos(sequence);
        let returned = returned - 1;
        measure::record(&mut run.call, nanos(returned.saturating_sub(scheduled)));
        let received = probe.received[sequence as usize].load(Ordering::Relaxed);
        if received == 0 {
            run.lost += 1;
            continue;
        }
        let received = received - 1;
        if received < returned {
            run.overtook_reply += 1;
        }
        measure::record(
            &mut run.commit_to_delivery,
            nanos(received.saturating_sub(returned)),
        );
        if let Some(window_nanos) = window_nanos {
            let index = ((scheduled - warmup_nanos) / window_nanos) as usize;
            if run.by_window.len() <= index {
                run.by_window.resize_with(index + 1, measure::new_histogram);
            }
            measure::record(
                &mut run.by_window[index],
                nanos(received.saturating_sub(returned)),
            );
        }
        measure::record(
            &mut run.end_to_end,
            nanos(received.saturating_sub(scheduled)),
        );
    }
    Ok(run)
}

/// Starts one call per event at its scheduled time, never waiting for earlier calls;
/// returns how many events were skipped because `MAX_OUTSTANDING` calls were still out.
/// Waits (at most 30 s) for the calls still out before returning.
async fn open_loop<F, Fut>(probe: &Probe, total: u64, mut call: F) -> u64
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(MAX_OUTSTANDING));
    let mut skipped = 0;
    for sequence in 0..total {
        let due = probe.origin + Duration::from_nanos(probe.scheduled_nanos(sequence));
        if due > Instant::now() {
            tokio::time::sleep_until(due).await;
        }
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            skipped += 1;
            continue;
        };
        let call = call(sequence);
        tokio::spawn(async move {
            call.await;
            drop(permit);
        });
    }
    let _ = tokio::time::timeout(
        Duration::from_secs(30),
        permits.acquire_many(MAX_OUTSTANDING as u32),
    )
    .await;
    skipped
}
