//! Subscribe-stream consumers. Each stream collects the ack ids it receives and acks them
//! in batches (one Ack per `ack_batch` deliveries, or sooner when deliveries pause), with
//! several Acks in flight, the way a throughput-minded consumer would. A
//! [`ConsumerGroup`] runs the streams of one or more subscriptions until each
//! subscription has had its target number of events acked, or a time limit passes.

use std::{
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::Context;
use outbox_client::proto::{self, subscriber_client::SubscriberClient};
use tokio::{task::JoinSet, time::Instant};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::{
    gateway::Gateway,
    measure::{Sampler, Series},
};

/// How a stream reads and acks.
#[derive(Debug, Clone, Copy)]
pub struct ConsumerConfig {
    /// `max_in_flight` of each Subscribe call.
    pub max_in_flight: u32,
    /// Ack ids per Ack call.
    pub ack_batch: usize,
    /// Ack calls one stream keeps in flight before it stops reading.
    pub acks_in_flight: usize,
    /// A partial batch is acked once its oldest delivery is this old.
    pub flush_after: Duration,
    /// Time the consumer spends on each delivery before acking it, one batch at a time
    /// and reading nothing meanwhile, as a consumer that does work per event would.
    pub work_per_event: Duration,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        ConsumerConfig {
            max_in_flight: 1000,
            ack_batch: 100,
            acks_in_flight: 4,
            flush_after: Duration::from_millis(5),
            work_per_event: Duration::ZERO,
        }
    }
}

/// One subscription to consume: its name, how many streams and how many acked events
/// complete it.
#[derive(Debug, Clone)]
pub struct SubscriptionLoad {
    pub name: String,
    pub streams: usize,
    pub target: u64,
}

/// What happened to one subscription.
#[derive(Debug, Clone)]
pub struct SubscriptionOutcome {
    pub name: String,
    pub acked: u64,
    pub stale: u64,
    /// From the start of the group until the target was reached (or the group stopped).
    pub seconds: f64,
    pub completed: bool,
    pub samples: Series,
}

impl SubscriptionOutcome {
    pub fn per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.acked as f64 / self.seconds
        } else {
            f64::NAN
        }
    }
}

/// What a consumer group did.
#[derive(Debug, Clone)]
pub struct GroupOutcome {
    pub subscriptions: Vec<SubscriptionOutcome>,
    /// From the start until the last subscription completed (or the group stopped).
    pub seconds: f64,
    /// Acked events per interval over all subscriptions.
    pub total_samples: Series,
}

impl GroupOutcome {
    pub fn acked(&self) -> u64 {
        self.subscriptions.iter().map(|s| s.acked).sum()
    }

    pub fn per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.acked() as f64 / self.seconds
        } else {
            f64::NAN
        }
    }

    pub fn completed(&self) -> bool {
        self.subscriptions.iter().all(|s| s.completed)
    }
}

struct Progress {
    name: String,
    target: u64,
    acked: Arc<AtomicU64>,
    stale: AtomicU64,
    finished_at: OnceLock<Instant>,
    /// Cancelled when the target is reached: the subscription's streams stop.
    done: CancellationToken,
}

impl Progress {
    fn acked(&self, count: u64, stale: u64) {
        self.stale.fetch_add(stale, Ordering::Relaxed);
        let total = self.acked.fetch_add(count, Ordering::Relaxed) + count;
        if total >= self.target && self.finished_at.set(Instant::now()).is_ok() {
            self.done.cancel();
        }
    }
}

/// Streams of one or more subscriptions, consuming concurrently.
pub struct ConsumerGroup {
    started: Instant,
    progress: Vec<Arc<Progress>>,
    stop: CancellationToken,
    streams: JoinSet<()>,
    sampler: Sampler,
    first_error: Arc<Mutex<Option<String>>>,
}

impl ConsumerGroup {
    /// Opens every stream (returning once the gateway has answered each Subscribe call)
    /// and starts consuming. `on_delivery` sees every delivery as it arrives.
    pub async fn start<F>(
        gateway: &Gateway,
        loads: &[SubscriptionLoad],
        config: ConsumerConfig,
        sample_interval: Duration,
        on_delivery: F,
    ) -> anyhow::Result<ConsumerGroup>
    where
        F: Fn(&proto::Delivery) + Clone + Send + Sync + 'static,
    {
        let progress: Vec<Arc<Progress>> = loads
            .iter()
            .map(|load| {
                Arc::new(Progress {
                    name: load.name.clone(),
                    target: load.target,
                    acked: Arc::new(AtomicU64::new(0)),
                    stale: AtomicU64::new(0),
                    finished_at: OnceLock::new(),
                    done: CancellationToken::new(),
                })
            })
            .collect();

        let mut opened = Vec::new();
        for (load, progress) in loads.iter().zip(&progress) {
            for _ in 0..load.streams {
                let mut client = gateway.subscriber();
                let stream = client
                    .subscribe(proto::SubscribeRequest {
                        subscription: load.name.clone(),
                        max_in_flight: config.max_in_flight,
                        ..Default::default()
                    })
                    .await
                    .with_context(|| format!("Subscribe to {:?} failed", load.name))?
                    .into_inner();
                opened.push((client, stream, progress.clone()));
            }
        }

        let started = Instant::now();
        let stop = CancellationToken::new();
        let first_error = Arc::new(Mutex::new(None));
        let mut streams = JoinSet::new();
        for (client, stream, progress) in opened {
            let stream = StreamConsumer {
                client,
                stream,
                progress,
                config,
                stop: stop.clone(),
            };
            let on_delivery = on_delivery.clone();
            let first_error = first_error.clone();
            let group_stop = stop.clone();
            streams.spawn(async move {
                if let Err(error) = stream.run(on_delivery).await {
                    first_error
                        .lock()
                        .expect("error lock")
                        .get_or_insert_with(|| format!("{error:#}"));
                    // One failed stream invalidates the measurement: stop them all.
                    group_stop.cancel();
                }
            });
        }
        let sampler = Sampler::start(
            progress.iter().map(|p| p.acked.clone()).collect(),
            sample_interval,
        );
        Ok(ConsumerGroup {
            started,
            progress,
            stop,
            streams,
            sampler,
            first_error,
        })
    }

    /// Deliveries acked so far, across every subscription.
    pub fn acked(&self) -> u64 {
        self.progress
            .iter()
            .map(|progress| progress.acked.load(Ordering::Relaxed))
            .sum()
    }

    /// Waits until every subscription has reached its target, a stream failed, or
    /// `limit` has passed since the group started.
    pub async fn wait(&self, limit: Duration) {
        let all_done = async {
            for progress in &self.progress {
                progress.done.cancelled().await;
            }
        };
        tokio::select! {
            _ = all_done => {}
            _ = self.stop.cancelled() => {}
            _ = tokio::time::sleep_until(self.started + limit) => {}
        }
    }

    /// Stops every stream and reports; fails when a stream or an Ack failed.
    pub async fn finish(mut self) -> anyhow::Result<GroupOutcome> {
        let stopped_at = Instant::now();
        self.stop.cancel();
        let mut samples = self.sampler.finish().await;
        let drain = async {
            while let Some(result) = self.streams.join_next().await {
                if let Err(error) = result {
                    anyhow::bail!("a consumer stream panicked: {error}");
                }
            }
            Ok(())
        };
        match tokio::time::timeout(Duration::from_secs(10), drain).await {
            Ok(result) => result?,
            Err(_) => {
                self.streams.abort_all();
                anyhow::bail!("consumer streams did not stop within 10 s");
            }
        }
        if let Some(error) = self.first_error.lock().expect("error lock").take() {
            anyhow::bail!(error);
        }

        let total_samples = sum_series(&samples);
        let mut subscriptions = Vec::with_capacity(self.progress.len());
        for (progress, samples) in self.progress.iter().zip(samples.drain(..)) {
            let finished_at = progress.finished_at.get().copied();
            subscriptions.push(SubscriptionOutcome {
                name: progress.name.clone(),
                acked: progress.acked.load(Ordering::Relaxed),
                stale: progress.stale.load(Ordering::Relaxed),
                seconds: (finished_at.unwrap_or(stopped_at) - self.started).as_secs_f64(),
                completed: finished_at.is_some(),
                samples: samples.labelled(progress.name.clone()),
            });
        }
        let last = self
            .progress
            .iter()
            .map(|p| p.finished_at.get().copied().unwrap_or(stopped_at))
            .max()
            .unwrap_or(stopped_at);
        Ok(GroupOutcome {
            subscriptions,
            seconds: (last - self.started).as_secs_f64(),
            total_samples: total_samples.labelled("total"),
        })
    }
}

/// Point-wise sum of series sampled on the same ticks.
fn sum_series(series: &[Series]) -> Series {
    let mut total = Series {
        label: String::new(),
        points: Vec::new(),
    };
    let length = series.iter().map(|s| s.points.len()).min().unwrap_or(0);
    for index in 0..length {
        let x = series[0].points[index].0;
        let y = series.iter().map(|s| s.points[index].1).sum();
        total.points.push((x, y));
    }
    total
}

/// One Subscribe stream and its acks.
struct StreamConsumer {
    client: SubscriberClient<Channel>,
    stream: tonic::Streaming<proto::Delivery>,
    progress: Arc<Progress>,
    config: ConsumerConfig,
    stop: CancellationToken,
}

impl StreamConsumer {
    async fn run<F: Fn(&proto::Delivery)>(mut self, on_delivery: F) -> anyhow::Result<()> {
        let name = self.progress.name.clone();
        let mut pending: Vec<String> = Vec::with_capacity(self.config.ack_batch);
        let mut acks: JoinSet<anyhow::Result<()>> = JoinSet::new();
        let flush = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(flush);

        loop {
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => break,
                _ = self.progress.done.cancelled() => break,
                Some(result) = acks.join_next(), if !acks.is_empty() => {
                    result.context("an Ack task panicked")??;
                }
                _ = &mut flush, if !pending.is_empty() => {
                    self.send_acks(&mut pending, &mut acks).await?;
                }
                message = self.stream.message() => match message {
                    Ok(Some(delivery)) => {
                        on_delivery(&delivery);
                        if pending.is_empty() {
                            flush.as_mut().reset(Instant::now() + self.config.flush_after);
                        }
                        pending.push(delivery.ack_id);
                        if pending.len() >= self.config.ack_batch {
                            self.send_acks(&mut pending, &mut acks).await?;
                        }
                    }
                    Ok(None) => anyhow::bail!("the gateway ended the Subscribe stream of {name:?}"),
                    Err(status) => anyhow::bail!("the Subscribe stream of {name:?} failed: {status}"),
                },
            }
        }
        // Let the Acks already sent land, so the counts are final.
        while let Some(result) = acks.join_next().await {
            result.context("an Ack task panicked")??;
        }
        Ok(())
    }

    /// Sends the pending ack ids in one Ack, first waiting for a free slot when
    /// `acks_in_flight` are already on their way.
    async fn send_acks(
        &self,
        pending: &mut Vec<String>,
        acks: &mut JoinSet<anyhow::Result<()>>,
    ) -> anyhow::Result<()> {
        while acks.len() >= self.config.acks_in_flight {
            if let Some(result) = acks.join_next().await {
                result.context("an Ack task panicked")??;
            }
        }
        let ack_ids = std::mem::replace(pending, Vec::with_capacity(self.config.ack_batch));
        let count = ack_ids.len() as u64;
        if !self.config.work_per_event.is_zero() {
            tokio::time::sleep(self.config.work_per_event * count as u32).await;
        }
        let mut client = self.client.clone();
        let progress = self.progress.clone();
        acks.spawn(async move {
            let response = client
                .ack(proto::AckRequest {
                    subscription: progress.name.clone(),
                    ack_ids,
                })
                .await
                .with_context(|| format!("Ack on {:?} failed", progress.name))?;
            let stale = response.into_inner().stale_ack_ids.len() as u64;
            progress.acked(count - stale, stale);
            Ok(())
        });
        Ok(())
    }
}
