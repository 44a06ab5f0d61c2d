//! The scenarios of the benchmark, what they share (the run context, backlog delivery,
//! chart output) and the order they run in. Each scenario gets a freshly started gateway
//! and an empty database, so its figures do not depend on what ran before it.

mod backlog;
mod batch_consumer;
mod consume_in_transaction;
mod cost;
mod deliver;
mod delivery_cost;
mod fan_in;
mod filtered;
mod held;
mod held_horizon;
mod latency;
mod many_subscriptions;
mod memory;
mod ordered_backlog;
mod publish;
mod push;
mod replicas;
mod scheduled;
mod sink;
mod source_outage;
mod stalled;

use std::{path::PathBuf, time::Duration};

use crate::{
    charts,
    consume::{ConsumerConfig, ConsumerGroup, GroupOutcome, SubscriptionLoad},
    database::BenchDatabase,
    gateway::{Gateway, GatewayLauncher},
    measure::{Series, Timing},
    report::Report,
};

/// Base backlog of the deliver, fanout, memory and cost scenarios (scaled by `--scale`).
pub const DELIVER_BACKLOG: u64 = 200_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    PublishBatch,
    PublishSingle,
    Deliver,
    DeliverScheduled,
    Fanout,
    FanIn,
    Latency,
    HeldTransaction,
    HeldHorizon,
    StalledConsumers,
    BatchConsumer,
    OrderedBacklog,
    SourceOutage,
    ManySubscriptions,
    Replicas,
    BacklogScaling,
    Memory,
    Cost,
    DeliveryCost,
    Push,
    Sink,
    ConsumeInTransaction,
    Filtered,
}

impl Scenario {
    pub const ALL: [Scenario; 23] = [
        Scenario::PublishBatch,
        Scenario::PublishSingle,
        Scenario::Deliver,
        Scenario::DeliverScheduled,
        Scenario::Fanout,
        Scenario::FanIn,
        Scenario::Latency,
        Scenario::HeldTransaction,
        Scenario::HeldHorizon,
        Scenario::StalledConsumers,
        Scenario::BatchConsumer,
        Scenario::OrderedBacklog,
        Scenario::SourceOutage,
        Scenario::ManySubscriptions,
        Scenario::Replicas,
        Scenario::BacklogScaling,
        Scenario::Memory,
        Scenario::Cost,
        Scenario::DeliveryCost,
        Scenario::Push,
        Scenario::Sink,
        Scenario::ConsumeInTransaction,
        Scenario::Filtered,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::PublishBatch => "publish-batch",
            Scenario::PublishSingle => "publish-single",
            Scenario::Deliver => "deliver",
            Scenario::DeliverScheduled => "deliver-scheduled",
            Scenario::Fanout => "fanout",
            Scenario::FanIn => "fan-in",
            Scenario::Latency => "latency",
            Scenario::HeldTransaction => "held-transaction",
            Scenario::HeldHorizon => "held-horizon",
            Scenario::StalledConsumers => "stalled-consumers",
            Scenario::BatchConsumer => "batch-consumer",
            Scenario::OrderedBacklog => "ordered-backlog",
            Scenario::SourceOutage => "source-outage",
            Scenario::ManySubscriptions => "many-subscriptions",
            Scenario::Replicas => "replicas",
            Scenario::BacklogScaling => "backlog-scaling",
            Scenario::Memory => "memory",
            Scenario::Cost => "cost",
            Scenario::DeliveryCost => "delivery-cost",
            Scenario::Push => "push",
            Scenario::Sink => "sink",
            Scenario::ConsumeInTransaction => "consume-in-transaction",
            Scenario::Filtered => "filtered",
        }
    }

    /// Settings the scenario's gateway needs from a configuration file, if any.
    pub fn gateway_config(self) -> Option<&'static str> {
        match self {
            Scenario::Push => Some(push::GATEWAY_CONFIG),
            Scenario::Sink => Some(sink::GATEWAY_CONFIG),
            Scenario::PublishBatch
            | Scenario::PublishSingle
            | Scenario::Deliver
            | Scenario::DeliverScheduled
            | Scenario::Fanout
            | Scenario::FanIn
            | Scenario::Latency
            | Scenario::HeldTransaction
            | Scenario::HeldHorizon
            | Scenario::StalledConsumers
            | Scenario::BatchConsumer
            | Scenario::OrderedBacklog
            | Scenario::SourceOutage
            | Scenario::ManySubscriptions
            | Scenario::Replicas
            | Scenario::BacklogScaling
            | Scenario::Memory
            | Scenario::Cost
            | Scenario::DeliveryCost
            | Scenario::ConsumeInTransaction
            | Scenario::Filtered => None,
        }
    }

    /// Runs the scenario against `gateway` (started for it) and an empty database.
    pub async fn run(self, bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
        match self {
            Scenario::PublishBatch => publish::batch(bench, gateway).await,
            Scenario::PublishSingle => publish::single(bench, gateway).await,
            Scenario::Deliver => deliver::deliver(bench, gateway).await,
            Scenario::DeliverScheduled => scheduled::run(bench, gateway).await,
            Scenario::Fanout => deliver::fanout(bench, gateway).await,
            Scenario::FanIn => fan_in::run(bench).await,
            Scenario::Latency => latency::run(bench, gateway).await,
            Scenario::HeldTransaction => held::run(bench, gateway).await,
            Scenario::HeldHorizon => held_horizon::run(bench, gateway).await,
            Scenario::StalledConsumers => stalled::run(bench, gateway).await,
            Scenario::BatchConsumer => batch_consumer::run(bench, gateway).await,
            Scenario::OrderedBacklog => ordered_backlog::run(bench, gateway).await,
            Scenario::SourceOutage => source_outage::run(bench).await,
            Scenario::ManySubscriptions => many_subscriptions::run(bench, gateway).await,
            Scenario::Replicas => replicas::run(bench, gateway).await,
            Scenario::BacklogScaling => backlog::run(bench, gateway).await,
            Scenario::Memory => memory::run(bench, gateway).await,
            Scenario::Cost => cost::run(bench, gateway).await,
            Scenario::DeliveryCost => delivery_cost::run(bench, gateway).await,
            Scenario::Push => push::run(bench, gateway).await,
            Scenario::Sink => sink::run(bench, gateway).await,
            Scenario::ConsumeInTransaction => consume_in_transaction::run(bench, gateway).await,
            Scenario::Filtered => filtered::run(bench, gateway).await,
        }
    }
}

/// Sizes and durations of a run.
#[derive(Debug, Clone)]
pub struct Settings {
    pub quick: bool,
    /// Warm-up, measured window and sampling interval of every closed-loop timed run.
    pub timing: Timing,
    /// Multiplies every backlog size.
    pub scale: f64,
    /// Length of backlog-scaling's sustained deliver run.
    pub sustain: Duration,
    /// Longest a delivery run may take before it is cut off (and reported incomplete).
    pub deliver_limit: Duration,
    /// Pause before a memory reading, so the gateway settles.
    pub settle: Duration,
    /// gRPC connections to each gateway.
    pub channels: usize,
}

impl Settings {
    /// `base` events scaled by `--scale`.
    pub fn events(&self, base: u64) -> u64 {
        ((base as f64 * self.scale).round() as u64).max(100)
    }
}

/// Everything a scenario needs besides its gateway.
pub struct Bench {
    pub settings: Settings,
    pub database: BenchDatabase,
    pub out_dir: PathBuf,
    /// Starts gateways: each scenario's own, and any more a scenario needs.
    pub launcher: GatewayLauncher,
}

impl Bench {
    /// Creates `subscriptions` subscriptions starting at the earliest event, consumes
    /// them with `streams` streams each until each has acked `target` events (or `limit`
    /// passes), and deletes them again.
    pub async fn deliver(
        &self,
        gateway: &Gateway,
        name: &str,
        subscriptions: usize,
        streams: usize,
        target: u64,
        limit: Duration,
    ) -> anyhow::Result<GroupOutcome> {
        let names = subscription_names(name, subscriptions);
        self.deliver_to(
            gateway,
            &names,
            streams,
            target,
            limit,
            ConsumerConfig::default(),
        )
        .await
    }

    /// [`Bench::deliver`] within the deliver limit, with consumers that read and ack as
    /// `config` says.
    pub async fn deliver_with(
        &self,
        gateway: &Gateway,
        name: &str,
        subscriptions: usize,
        streams: usize,
        target: u64,
        config: ConsumerConfig,
    ) -> anyhow::Result<GroupOutcome> {
        let names = subscription_names(name, subscriptions);
        let limit = self.settings.deliver_limit;
        self.deliver_to(gateway, &names, streams, target, limit, config)
            .await
    }

    async fn deliver_to(
        &self,
        gateway: &Gateway,
        names: &[String],
        streams: usize,
        target: u64,
        limit: Duration,
        config: ConsumerConfig,
    ) -> anyhow::Result<GroupOutcome> {
        for name in names {
            gateway.create_subscription(name, true).await?;
        }
        let outcome = self
            .consume_with(gateway, names, streams, target, limit, config)
            .await?;
        for name in names {
            gateway.delete_subscription(name).await?;
        }
        Ok(outcome)
    }

    /// Consumes existing subscriptions with `streams` streams each until each has acked
    /// `target` events (or `limit` passes).
    pub async fn consume(
        &self,
        gateway: &Gateway,
        names: &[String],
        streams: usize,
        target: u64,
        limit: Duration,
    ) -> anyhow::Result<GroupOutcome> {
        self.consume_with(
            gateway,
            names,
            streams,
            target,
            limit,
            ConsumerConfig::default(),
        )
        .await
    }

    async fn consume_with(
        &self,
        gateway: &Gateway,
        names: &[String],
        streams: usize,
        target: u64,
        limit: Duration,
        config: ConsumerConfig,
    ) -> anyhow::Result<GroupOutcome> {
        let loads: Vec<SubscriptionLoad> = names
            .iter()
            .map(|name| SubscriptionLoad {
                name: name.clone(),
                streams,
                target,
            })
            .collect();
        let group = ConsumerGroup::start(
            gateway,
            &loads,
            config,
            self.settings.timing.sample_interval,
            |_| {},
        )
        .await?;
        group.wait(limit).await;
        group.finish().await
    }

    /// Where a chart file goes.
    pub fn chart_path(&self, file: &str) -> PathBuf {
        self.out_dir.join(file)
    }

    /// Draws a time chart into the output directory and lists it in the report.
    pub fn time_chart(
        &self,
        report: &mut Report,
        file: &str,
        title: &str,
        y_label: &str,
        series: &[Series],
    ) -> anyhow::Result<()> {
        charts::time_chart(&self.chart_path(file), title, y_label, series)?;
        report.charts.push(file.to_owned());
        Ok(())
    }

    /// Draws a latency-distribution chart into the output directory and lists it.
    pub fn latency_chart(
        &self,
        report: &mut Report,
        file: &str,
        title: &str,
        curves: &[(String, &hdrhistogram::Histogram<u64>)],
    ) -> anyhow::Result<()> {
        charts::latency_chart(&self.chart_path(file), title, curves)?;
        report.charts.push(file.to_owned());
        Ok(())
    }
}

/// Progress for the person watching (stderr, so stdout stays tables and JSON).
pub fn progress(scenario: &str, message: impl std::fmt::Display) {
    eprintln!("[{scenario}] {message}");
}

/// Inserts a backlog of `events` directly, saying so first.
pub async fn insert_backlog(bench: &Bench, scenario: &str, events: u64) -> anyhow::Result<()> {
    progress(
        scenario,
        format!(
            "inserting a backlog of {} events",
            crate::report::format_number(events as f64)
        ),
    );
    bench.database.fill_backlog(events).await
}

/// `name-1`, `name-2`, … `name-<count>`.
fn subscription_names(name: &str, count: usize) -> Vec<String> {
    (1..=count).map(|index| format!("{name}-{index}")).collect()
}

/// Streams of the pull drain the push and sink scenarios compare with.
const BASELINE_STREAMS: usize = 4;

/// The pull drain a gateway-drained scenario compares with: the deliver backlog inserted,
/// then drained by one subscription with [`BASELINE_STREAMS`] streams; the backlog, the
/// outcome and the CPU it took.
async fn pull_baseline(
    bench: &Bench,
    gateway: &Gateway,
    scenario: &str,
) -> anyhow::Result<(u64, GroupOutcome, crate::measure::CpuUse)> {
    let backlog = bench.settings.events(DELIVER_BACKLOG);
    insert_backlog(bench, scenario, backlog).await?;
    let before = gateway.cpu_snapshot();
    let pull = bench
        .deliver(
            gateway,
            &format!("{scenario}-baseline-pull"),
            1,
            BASELINE_STREAMS,
            backlog,
            bench.settings.deliver_limit,
        )
        .await?;
    let cpu = crate::measure::CpuUse::between(&before, &gateway.cpu_snapshot());
    bench.database.settle().await?;
    progress(
        scenario,
        format!(
            "pull with {BASELINE_STREAMS} streams: {} events/s",
            crate::report::format_number(pull.per_second())
        ),
    );
    Ok((backlog, pull, cpu))
}

fn yes_no(value: bool) -> String {
    if value { "yes" } else { "no" }.to_owned()
}
