//! Measurement primitives shared by the scenarios: the phases of a closed-loop timed run
//! (warm-up, measured window, stop), per-interval throughput samples, latency histograms
//! and their summaries, and the CPU time of the processes taking part.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU8, AtomicU64, Ordering},
    },
    time::Duration,
};

use hdrhistogram::Histogram;
use tokio::{task::JoinHandle, time::Instant};
use tokio_util::sync::CancellationToken;

use crate::gateway::{CpuSnapshot, Gateway};

/// Latencies are recorded in microseconds, from 1 µs to one hour, with 3 significant
/// digits.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

/// Records `elapsed` (in µs) into `histogram`.
pub fn record(histogram: &mut Histogram<u64>, elapsed: Duration) {
    histogram.saturating_record(elapsed.as_micros().max(1) as u64);
}

/// Percentiles of a latency histogram, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct LatencySummary {
    pub count: u64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl LatencySummary {
    pub fn of(histogram: &Histogram<u64>) -> LatencySummary {
        let ms = |micros: u64| micros as f64 / 1000.0;
        if histogram.is_empty() {
            return LatencySummary {
                count: 0,
                p50: f64::NAN,
                p90: f64::NAN,
                p99: f64::NAN,
                p999: f64::NAN,
                max: f64::NAN,
            };
        }
        LatencySummary {
            count: histogram.len(),
            p50: ms(histogram.value_at_quantile(0.50)),
            p90: ms(histogram.value_at_quantile(0.90)),
            p99: ms(histogram.value_at_quantile(0.99)),
            p999: ms(histogram.value_at_quantile(0.999)),
            max: ms(histogram.max()),
        }
    }

    pub fn to_json(self) -> serde_json::Value {
        serde_json::json!({
            "count": self.count,
            "p50_ms": round(self.p50, 3),
            "p90_ms": round(self.p90, 3),
            "p99_ms": round(self.p99, 3),
            "p99_9_ms": round(self.p999, 3),
            "max_ms": round(self.max, 3),
        })
    }
}

/// `value` rounded to `digits` decimals (non-finite values pass through; JSON shows them
/// as null).
pub fn round(value: f64, digits: i32) -> f64 {
    let factor = 10f64.powi(digits);
    (value * factor).round() / factor
}

/// One line of a chart: (x, y) points with a label.
#[derive(Debug, Clone)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    pub fn labelled(mut self, label: impl Into<String>) -> Series {
        self.label = label.into();
        self
    }
}

/// Samples event counters every interval and turns them into rates (events/s), one
/// series per counter, x in seconds since the sampler started.
pub struct Sampler {
    stop: CancellationToken,
    task: JoinHandle<Vec<Series>>,
}

impl Sampler {
    pub fn start(counters: Vec<Arc<AtomicU64>>, interval: Duration) -> Sampler {
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let mut ticker = tokio::time::interval_at(started + interval, interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last: Vec<u64> = counters.iter().map(|c| c.load(Ordering::Relaxed)).collect();
            let mut last_at = started;
            let mut series: Vec<Series> = counters
                .iter()
                .map(|_| Series {
                    label: String::new(),
                    points: Vec::new(),
                })
                .collect();
            loop {
                tokio::select! {
                    _ = stopped.cancelled() => break,
                    at = ticker.tick() => {
                        let seconds = (at - last_at).as_secs_f64();
                        for ((counter, previous), line) in counters.iter().zip(&mut last).zip(&mut series) {
                            let now = counter.load(Ordering::Relaxed);
                            let rate = now.saturating_sub(*previous) as f64 / seconds;
                            line.points.push(((at - started).as_secs_f64(), rate));
                            *previous = now;
                        }
                        last_at = at;
                    }
                }
            }
            series
        });
        Sampler { stop, task }
    }

    /// Stops sampling and returns the series (a partial last interval is left out).
    pub async fn finish(self) -> Vec<Series> {
        self.stop.cancel();
        self.task.await.unwrap_or_default()
    }
}

const WARMING: u8 = 0;
const MEASURING: u8 = 1;
const STOPPED: u8 = 2;

/// State shared by the workers of one closed-loop timed run.
pub struct RunShared {
    phase: AtomicU8,
    /// Events completed since the run started (warm-up included).
    pub events: Arc<AtomicU64>,
    errors: AtomicU64,
    first_error: Mutex<Option<String>>,
}

impl RunShared {
    fn new() -> Arc<RunShared> {
        Arc::new(RunShared {
            phase: AtomicU8::new(WARMING),
            events: Arc::new(AtomicU64::new(0)),
            errors: AtomicU64::new(0),
            first_error: Mutex::new(None),
        })
    }

    /// True inside the measured window: latencies are recorded only then.
    pub fn measuring(&self) -> bool {
        self.phase.load(Ordering::Relaxed) == MEASURING
    }

    /// True once the run is over: workers finish the call they are in and return.
    pub fn stopped(&self) -> bool {
        self.phase.load(Ordering::Relaxed) == STOPPED
    }

    pub fn completed(&self, events: u64) {
        self.events.fetch_add(events, Ordering::Relaxed);
    }

    /// Counts a failed call, keeping the first message for the report.
    pub fn failed(&self, error: impl std::fmt::Display) {
        if self.errors.fetch_add(1, Ordering::Relaxed) == 0 {
            *self.first_error.lock().expect("error lock") = Some(error.to_string());
        }
    }
}

/// What a timed run measured in its window.
#[derive(Debug)]
pub struct Throughput {
    pub events: u64,
    pub seconds: f64,
    pub samples: Series,
    /// Latency of each call (merged over the workers), when the workers recorded it.
    pub latency: Histogram<u64>,
    pub errors: u64,
    pub first_error: Option<String>,
    pub cpu: CpuUse,
}

impl Throughput {
    pub fn per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.events as f64 / self.seconds
        } else {
            f64::NAN
        }
    }

    /// Figures of this run for the JSON line.
    pub fn to_json(&self) -> serde_json::Value {
        let mut value = serde_json::json!({
            "events": self.events,
            "seconds": round(self.seconds, 3),
            "events_per_s": round(self.per_second(), 1),
            "errors": self.errors,
            "cpu_s": self.cpu.to_json(),
        });
        if !self.latency.is_empty() {
            value["latency"] = LatencySummary::of(&self.latency).to_json();
        }
        if let Some(error) = &self.first_error {
            value["first_error"] = error.clone().into();
        }
        value
    }
}

/// CPU seconds used during a window by the gateway, PostgreSQL (all its processes) and
/// this benchmark process.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuUse {
    pub gateway: f64,
    pub postgres: f64,
    pub bench: f64,
}

impl CpuUse {
    pub fn between(start: &CpuSnapshot, end: &CpuSnapshot) -> CpuUse {
        CpuUse {
            gateway: end.gateway - start.gateway,
            postgres: end.postgres - start.postgres,
            bench: end.bench - start.bench,
        }
    }

    /// The three processes together.
    pub fn total(&self) -> f64 {
        self.gateway + self.postgres + self.bench
    }

    /// Gateway CPU seconds per million events.
    pub fn gateway_per_million(&self, events: u64) -> f64 {
        self.per_million(events).gateway
    }

    /// Each process's CPU seconds per million events.
    pub fn per_million(&self, events: u64) -> CpuUse {
        let scale = match events {
            0 => f64::NAN,
            events => 1e6 / events as f64,
        };
        CpuUse {
            gateway: self.gateway * scale,
            postgres: self.postgres * scale,
            bench: self.bench * scale,
        }
    }

    pub fn to_json(self) -> serde_json::Value {
        serde_json::json!({
            "gateway": round(self.gateway, 3),
            "postgres": round(self.postgres, 3),
            "bench": round(self.bench, 3),
        })
    }
}

/// How long a closed-loop run warms up and measures, and how often it samples.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub warmup: Duration,
    pub duration: Duration,
    pub sample_interval: Duration,
}

/// Runs `workers` closed-loop workers for the warm-up and then the measured window, and
/// returns what happened inside the window. Each worker loops until
/// [`RunShared::stopped`], reports completed events with [`RunShared::completed`] and
/// returns the latencies it recorded while [`RunShared::measuring`].
pub async fn timed_run<F, Fut>(
    timing: Timing,
    gateway: &Gateway,
    workers: usize,
    mut make_worker: F,
) -> anyhow::Result<Throughput>
where
    F: FnMut(usize, Arc<RunShared>) -> Fut,
    Fut: Future<Output = Histogram<u64>> + Send + 'static,
{
    let shared = RunShared::new();
    let tasks: Vec<JoinHandle<Histogram<u64>>> = (0..workers)
        .map(|index| tokio::spawn(make_worker(index, shared.clone())))
        .collect();

    tokio::time::sleep(timing.warmup).await;
    shared.phase.store(MEASURING, Ordering::Relaxed);
    let cpu_start = gateway.cpu_snapshot();
    let events_start = shared.events.load(Ordering::Relaxed);
    let started = Instant::now();
    let sampler = Sampler::start(vec![shared.events.clone()], timing.sample_interval);

    tokio::time::sleep(timing.duration).await;
    let events_end = shared.events.load(Ordering::Relaxed);
    let seconds = started.elapsed().as_secs_f64();
    let cpu_end = gateway.cpu_snapshot();
    shared.phase.store(STOPPED, Ordering::Relaxed);
    let samples = sampler
        .finish()
        .await
        .pop()
        .expect("one series per counter");

    let mut latency = new_histogram();
    for task in tasks {
        // A call can hang only if the gateway does; bound the wait all the same.
        match tokio::time::timeout(Duration::from_secs(30), task).await {
            Ok(Ok(histogram)) => latency
                .add(&histogram)
                .expect("histograms of one shape add up"),
            Ok(Err(error)) => anyhow::bail!("a load worker panicked: {error}"),
            Err(_) => anyhow::bail!("a load worker did not finish its last call within 30 s"),
        }
    }
    let first_error = shared.first_error.lock().expect("error lock").take();
    Ok(Throughput {
        events: events_end - events_start,
        seconds,
        samples,
        latency,
        errors: shared.errors.load(Ordering::Relaxed),
        first_error,
        cpu: CpuUse::between(&cpu_start, &cpu_end),
    })
}
