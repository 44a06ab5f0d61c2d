//! sink: a backlog inserted straight into the outbox table, drained first by pull (one
//! subscription, four Subscribe streams acking in batches, as in `deliver`) and then by
//! sink subscriptions publishing every event into each broker on this machine: a
//! JetStream stream (file storage, one replica) of the NATS server at 127.0.0.1:4222,
//! and a topic of the Kafka-protocol broker at 127.0.0.1:9092 (tansu, as `.ci/run`
//! starts it: topics in memory). An event counts once the broker holds it. Before the
//! Kafka drain, a raw producer sends the same messages straight into the broker: the
//! ceiling of what the broker takes on this machine. The report gives sink ÷ pull of
//! the same run and the CPU seconds per million events of the gateway and of the broker
//! (it runs on the same cores). Then
//! events are published one per call at 1,000/s into a second sink subscription per
//! broker, and the latency from each call's return to the message's arrival at the
//! broker is measured (a plain subscriber on the stream's subjects sees it as the NATS
//! server routes it; a consumer polling the topic sees it once Kafka appended it).

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use async_nats::jetstream::{self, stream};
use futures_util::StreamExt;
use outbox_client::proto;
use rdkafka::{
    ClientConfig, ClientContext, Message, Offset, TopicPartitionList,
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    client::DefaultClientContext,
    consumer::{BaseConsumer, Consumer},
    error::{KafkaError, RDKafkaErrorCode},
    message::{BorrowedMessage, Header, OwnedHeaders},
    producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext},
};

use super::{BASELINE_STREAMS, Bench, latency, progress, pull_baseline, yes_no};
use crate::{
    gateway::{Gateway, processes_cpu_seconds},
    measure::{CpuUse, Sampler, Series, round},
    report::{LATENCY_HEADERS, Report, Table, Target, format_number, latency_cells},
    workload,
};

const NATS_URL: &str = "nats://127.0.0.1:4222";
const KAFKA_BROKERS: &str = "127.0.0.1:9092";
/// The gateway settings the scenario needs: a sink on each local broker.
pub const GATEWAY_CONFIG: &str = "[[sinks]]\nname = \"bench-js\"\nkind = \"nats\"\nservers = [\"nats://127.0.0.1:4222\"]\n\n\
     [[sinks]]\nname = \"bench-kafka\"\nkind = \"kafka\"\nbrokers = [\"127.0.0.1:9092\"]\n";
const STREAM: &str = "OUTBOX_BENCH_SINK";
const BACKLOG_TOPIC: &str = "outbox-bench-backlog";
const LATENCY_TOPIC: &str = "outbox-bench-latency";
/// The topic of the raw producer's run.
const RAW_TOPIC: &str = "outbox-bench-raw";
const TOPICS: [&str; 3] = [BACKLOG_TOPIC, LATENCY_TOPIC, RAW_TOPIC];
/// Partitions of each topic: the backlog's aggregates spread over them.
const PARTITIONS: i32 = 4;
/// Publish calls per second of the latency run.
const LATENCY_RATE: u64 = 1_000;
/// How often the broker's count is checked for completion.
const CHECK_INTERVAL: Duration = Duration::from_millis(50);

/// A broker the scenario publishes into.
pub(super) enum Broker {
    JetStream(Box<jetstream::Context>),
    Kafka,
}

impl Broker {
    async fn connect_jetstream() -> anyhow::Result<Broker> {
        let client = async_nats::connect(NATS_URL).await.with_context(|| {
            format!("the sink scenario needs NATS with JetStream at {NATS_URL}")
        })?;
        Ok(Broker::JetStream(Box::new(jetstream::new(client))))
    }

    pub(super) fn label(&self) -> &'static str {
        match self {
            Broker::JetStream(_) => "JetStream",
            Broker::Kafka => "Kafka",
        }
    }

    /// The broker's process, whose CPU time is reported.
    fn process(&self) -> &'static str {
        match self {
            Broker::JetStream(_) => "nats-server",
            Broker::Kafka => "tansu",
        }
    }

    /// A sink into this broker: the backlog's destination or the latency run's.
    pub(super) fn sink(&self, latency: bool) -> proto::SinkConfig {
        match (self, latency) {
            (Broker::JetStream(_), false) => proto::SinkConfig {
                name: "bench-js".into(),
                subject: "outbox-bench.backlog.{aggregate_type}".into(),
                ..Default::default()
            },
            (Broker::JetStream(_), true) => proto::SinkConfig {
                name: "bench-js".into(),
                subject: "outbox-bench.latency.{aggregate_type}".into(),
                ..Default::default()
            },
            (Broker::Kafka, false) => proto::SinkConfig {
                name: "bench-kafka".into(),
                topic: BACKLOG_TOPIC.into(),
                ..Default::default()
            },
            (Broker::Kafka, true) => proto::SinkConfig {
                name: "bench-kafka".into(),
                topic: LATENCY_TOPIC.into(),
                ..Default::default()
            },
        }
    }

    /// A fresh stream or topics for the run.
    async fn prepare(&self) -> anyhow::Result<()> {
        match self {
            Broker::JetStream(context) => {
                let _ = context.delete_stream(STREAM).await;
                context
                    .create_stream(stream::Config {
                        name: STREAM.into(),
                        subjects: vec!["outbox-bench.>".into()],
                        storage: stream::StorageType::File,
                        num_replicas: 1,
                        ..Default::default()
                    })
                    .await
                    .context("cannot create the benchmark's JetStream stream")?;
            }
            Broker::Kafka => {
                let admin = kafka_admin()?;
                let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
                let _ = admin.delete_topics(&TOPICS, &options).await;
                let topics =
                    TOPICS.map(|name| NewTopic::new(name, PARTITIONS, TopicReplication::Fixed(1)));
                for result in admin
                    .create_topics(&topics, &options)
                    .await
                    .with_context(|| {
                        format!("the sink scenario needs a Kafka broker at {KAFKA_BROKERS}")
                    })?
                {
                    result.map_err(|(topic, code)| {
                        anyhow::anyhow!("cannot create topic {topic}: {code}")
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Messages of the backlog the broker holds: those the stream holds; in Kafka,
    /// those a consumer of the topic counted so far (`counted`, see
    /// [`count_kafka_backlog`]: tansu's high watermarks trail large batches, so its
    /// offsets cannot tell).
    async fn stored(&self, counted: &AtomicU64) -> anyhow::Result<u64> {
        match self {
            Broker::JetStream(context) => Ok(context
                .get_stream(STREAM)
                .await
                .context("cannot read the stream's state")?
                .cached_info()
                .state
                .messages),
            Broker::Kafka => Ok(counted.load(Ordering::Relaxed)),
        }
    }

    async fn clean_up(&self) {
        match self {
            Broker::JetStream(context) => {
                let _ = context.delete_stream(STREAM).await;
            }
            Broker::Kafka => {
                if let Ok(admin) = kafka_admin() {
                    let _ = admin.delete_topics(&TOPICS, &AdminOptions::new()).await;
                }
            }
        }
    }

    /// Calls `arrived` with the sequence of every latency probe reaching the broker,
    /// until the watch is stopped.
    pub(super) async fn watch_arrivals(
        &self,
        arrived: impl Fn(u64) + Send + 'static,
    ) -> anyhow::Result<ArrivalWatch> {
        let stop = Arc::new(AtomicBool::new(false));
        let task = match self {
            Broker::JetStream(context) => {
                let mut messages = context.client().subscribe("outbox-bench.latency.>").await?;
                tokio::spawn(async move {
                    while let Some(message) = messages.next().await {
                        let metadata = message
                            .headers
                            .as_ref()
                            .and_then(|headers| headers.get("outbox-metadata"));
                        if let Some(sequence) =
                            metadata.and_then(|value| workload::sink_probe_sequence(value.as_str()))
                        {
                            arrived(sequence);
                        }
                    }
                })
            }
            Broker::Kafka => {
                return watch_kafka_topic(LATENCY_TOPIC, Offset::End, move |message| {
                    let metadata = message.headers().and_then(|headers| {
                        use rdkafka::message::Headers;
                        headers
                            .iter()
                            .find(|header| header.key == "outbox-metadata")?
                            .value
                    });
                    if let Some(sequence) = metadata
                        .and_then(|value| std::str::from_utf8(value).ok())
                        .and_then(workload::sink_probe_sequence)
                    {
                        arrived(sequence);
                    }
                });
            }
        };
        Ok(ArrivalWatch { stop, task })
    }
}

/// Counts the messages of the backlog topic into `counted` as a consumer reads them,
/// until stopped.
fn count_kafka_backlog(counted: Arc<AtomicU64>) -> anyhow::Result<ArrivalWatch> {
    watch_kafka_topic(BACKLOG_TOPIC, Offset::Beginning, move |_| {
        counted.fetch_add(1, Ordering::Relaxed);
    })
}

/// Calls `seen` with every message of `topic` from `start` on, as a consumer reads
/// them, until the watch is stopped.
fn watch_kafka_topic(
    topic: &str,
    start: Offset,
    mut seen: impl FnMut(&BorrowedMessage<'_>) + Send + 'static,
) -> anyhow::Result<ArrivalWatch> {
    let consumer = kafka_consumer()?;
    let mut assignment = TopicPartitionList::new();
    for partition in 0..PARTITIONS {
        assignment.add_partition_offset(topic, partition, start)?;
    }
    consumer.assign(&assignment)?;
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let task = tokio::task::spawn_blocking(move || {
        while !stopped.load(Ordering::Relaxed) {
            if let Some(Ok(message)) = consumer.poll(Duration::from_millis(100)) {
                seen(&message);
            }
        }
    });
    Ok(ArrivalWatch { stop, task })
}

/// What sees a latency run's probes reach a broker.
pub(super) struct ArrivalWatch {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl ArrivalWatch {
    /// Stops watching, and waits until the watcher let go of its client: a Kafka
    /// consumer still polling while the process exits can crash it.
    pub(super) async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.abort();
        let _ = self.task.await;
    }
}

fn kafka_admin() -> anyhow::Result<AdminClient<DefaultClientContext>> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", KAFKA_BROKERS)
        .create()?)
}

/// A consumer that reads with little delay: the latency run sees a message as soon as
/// the broker appended it.
fn kafka_consumer() -> anyhow::Result<BaseConsumer> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", KAFKA_BROKERS)
        .set("group.id", "outbox-bench")
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "5")
        .create()?)
}

/// The ceiling of the Kafka run: `backlog` messages like the sink's (same key, value
/// and headers) produced straight into the broker by one idempotent, acks=all
/// producer as fast as it takes them. Returns the seconds until the broker held all.
async fn raw_kafka_producer(backlog: u64) -> anyhow::Result<f64> {
    let started = Instant::now();
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let producer: BaseProducer<Confirmations> = ClientConfig::new()
            .set("bootstrap.servers", KAFKA_BROKERS)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "2")
            .create_with_context(Confirmations::default())?;
        for index in 0..backlog {
            let id = uuid::Uuid::now_v7().to_string();
            let aggregate_id = format!("o-{}", index % 1000);
            let headers = [
                ("ce_specversion", "1.0"),
                ("ce_id", id.as_str()),
                ("ce_type", workload::EVENT_TYPE),
                ("ce_source", "/sources/default/aggregates/order"),
                ("ce_subject", aggregate_id.as_str()),
                ("ce_time", "2026-12-04T12:00:00.000000Z"),
                ("ce_tenant", workload::METADATA_VALUE),
                ("content-type", workload::CONTENT_TYPE),
                ("outbox-event-id", id.as_str()),
                ("outbox-source", "default"),
                ("outbox-aggregate-type", workload::AGGREGATE_TYPE),
                ("outbox-aggregate-id", aggregate_id.as_str()),
                ("outbox-metadata", workload::METADATA_JSON),
            ]
            .into_iter()
            .fold(
                OwnedHeaders::new_with_capacity(13),
                |headers, (key, value)| {
                    headers.insert(Header {
                        key,
                        value: Some(value),
                    })
                },
            );
            let key = format!("{}/{aggregate_id}", workload::AGGREGATE_TYPE);
            let mut record = BaseRecord::to(RAW_TOPIC)
                .key(&key)
                .payload(workload::PAYLOAD)
                .headers(headers);
            loop {
                match producer.send(record) {
                    Ok(()) => break,
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), returned)) => {
                        producer.poll(Duration::from_millis(5));
                        record = returned;
                    }
                    Err((error, _)) => return Err(error.into()),
                }
            }
        }
        producer.flush(Duration::from_secs(120))?;
        let context = producer.context();
        let confirmed = context.confirmed.load(Ordering::Relaxed);
        anyhow::ensure!(
            confirmed == backlog,
            "the broker confirmed {confirmed} of the raw producer's {backlog} messages: {}",
            context
                .first_error
                .lock()
                .expect("error lock")
                .clone()
                .unwrap_or_default()
        );
        Ok(())
    })
    .await??;
    Ok(started.elapsed().as_secs_f64())
}

/// Counts the raw producer's confirmed messages, and keeps its first failure.
#[derive(Default)]
struct Confirmations {
    confirmed: AtomicU64,
    first_error: std::sync::Mutex<Option<String>>,
}

impl ClientContext for Confirmations {}

impl ProducerContext for Confirmations {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        match result {
            Ok(_) => {
                self.confirmed.fetch_add(1, Ordering::Relaxed);
            }
            Err((error, _)) => {
                self.first_error
                    .lock()
                    .expect("error lock")
                    .get_or_insert_with(|| error.to_string());
            }
        }
    }
}

/// One broker's drain of the backlog.
struct SinkDrain {
    broker: &'static str,
    /// Kafka: seconds the raw producer took for the same messages, and the broker's
    /// CPU seconds meanwhile.
    raw: Option<(f64, f64)>,
    sent: u64,
    seconds: f64,
    drained: bool,
    cpu: CpuUse,
    broker_cpu: f64,
    series: Series,
    latency: latency::LatencyRun,
}

impl SinkDrain {
    fn rate(&self) -> f64 {
        self.sent as f64 / self.seconds
    }
}

async fn drain_into(
    bench: &Bench,
    gateway: &Gateway,
    broker: &Broker,
    backlog: u64,
    pull_rate: f64,
) -> anyhow::Result<SinkDrain> {
    let scenario = "sink";
    broker.prepare().await?;
    let raw = match broker {
        Broker::JetStream(_) => None,
        Broker::Kafka => {
            let broker_before = processes_cpu_seconds(broker.process());
            let seconds = raw_kafka_producer(backlog).await?;
            let cpu = processes_cpu_seconds(broker.process()) - broker_before;
            progress(
                scenario,
                format!(
                    "raw producer into Kafka: {} messages/s",
                    format_number(backlog as f64 / seconds)
                ),
            );
            Some((seconds, cpu))
        }
    };
    let subscription = format!("sink-{}", broker.label().to_lowercase());
    let before = gateway.cpu_snapshot();
    let broker_before = processes_cpu_seconds(broker.process());
    let stored_counter = Arc::new(AtomicU64::new(0));
    let kafka_counted = Arc::new(AtomicU64::new(0));
    let counting = match broker {
        Broker::JetStream(_) => None,
        Broker::Kafka => Some(count_kafka_backlog(kafka_counted.clone())?),
    };
    let sampler = Sampler::start(
        vec![stored_counter.clone()],
        bench.settings.timing.sample_interval,
    );
    let started = Instant::now();
    create_sink_subscription(gateway, &subscription, broker.sink(false), true).await?;
    let limit = started + bench.settings.deliver_limit;
    let mut stored = 0;
    while stored < backlog && Instant::now() < limit {
        tokio::time::sleep(CHECK_INTERVAL).await;
        stored = broker.stored(&kafka_counted).await?;
        stored_counter.store(stored, Ordering::Relaxed);
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = CpuUse::between(&before, &gateway.cpu_snapshot());
    let broker_cpu = processes_cpu_seconds(broker.process()) - broker_before;
    let series = sampler.finish().await.remove(0);
    if let Some(counting) = counting {
        counting.stop().await;
    }
    let sent = stored.min(backlog);
    progress(
        scenario,
        format!(
            "sink into {}: {} events/s ({:.2}x pull)",
            broker.label(),
            format_number(sent as f64 / seconds),
            sent as f64 / seconds / pull_rate
        ),
    );
    gateway.delete_subscription(&subscription).await?;

    let latency = latency::measure_sink_run(bench, gateway, LATENCY_RATE, broker).await?;
    let commit_to_broker = latency.commit_to_delivery();
    progress(
        scenario,
        format!(
            "into {} at {LATENCY_RATE}/s: commit-to-broker p50 {:.2} ms, p99 {:.2} ms",
            broker.label(),
            commit_to_broker.p50,
            commit_to_broker.p99
        ),
    );
    broker.clean_up().await;
    Ok(SinkDrain {
        broker: broker.label(),
        raw,
        sent,
        seconds,
        drained: sent >= backlog,
        cpu,
        broker_cpu,
        series,
        latency,
    })
}

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "sink";
    let (backlog, pull, pull_cpu) = pull_baseline(bench, gateway, scenario).await?;
    let mut drains = Vec::new();
    for broker in [Broker::connect_jetstream().await?, Broker::Kafka] {
        drains.push(drain_into(bench, gateway, &broker, backlog, pull.per_second()).await?);
    }

    let mut report = Report::new(
        scenario,
        format!(
            "a backlog of {} events pulled (4 streams) and published into a JetStream stream (file storage, one replica) and a Kafka topic ({PARTITIONS} partitions, tansu keeping it in memory) on this machine, beside a raw producer sending the same messages into Kafka",
            format_number(backlog as f64)
        ),
    );
    let mut table = Table::new(
        "delivered and acked (pull), stored by the broker (sink)",
        &[
            "delivery",
            "events",
            "seconds",
            "events/s",
            "drained",
            "gateway CPU s/M ev",
            "PostgreSQL CPU s/M ev",
            "broker CPU s/M ev",
        ],
    );
    let per_million = |seconds: f64, events: u64| seconds / events.max(1) as f64 * 1e6;
    table.row(vec![
        format!("pull, {BASELINE_STREAMS} streams"),
        format_number(pull.acked() as f64),
        format!("{:.2}", pull.seconds),
        format_number(pull.per_second()),
        yes_no(pull.completed()),
        format!("{:.1}", pull_cpu.gateway_per_million(pull.acked())),
        format!("{:.1}", per_million(pull_cpu.postgres, pull.acked())),
        "-".into(),
    ]);
    let mut headers = vec!["run", "events", "lost"];
    headers.extend(LATENCY_HEADERS);
    let mut latency_table = Table::new(
        "commit-to-broker (from the Publish call's return to the message's arrival at the broker)",
        &headers,
    );
    let mut series = Vec::new();
    let mut histograms = Vec::new();
    for drain in &drains {
        let key = drain.broker.to_lowercase();
        let ratio = drain.rate() / pull.per_second();
        if let Some((raw_seconds, raw_broker_cpu)) = drain.raw {
            table.row(vec![
                format!("raw producer into {} (ceiling)", drain.broker),
                format_number(backlog as f64),
                format!("{raw_seconds:.2}"),
                format_number(backlog as f64 / raw_seconds),
                yes_no(true),
                "-".into(),
                "-".into(),
                format!("{:.1}", per_million(raw_broker_cpu, backlog)),
            ]);
            report.figure(
                &format!("{key}_raw_producer_events_per_s"),
                round(backlog as f64 / raw_seconds, 1),
            );
            report.figure(
                &format!("{key}_to_raw_producer"),
                round(drain.rate() * raw_seconds / backlog as f64, 3),
            );
        }
        table.row(vec![
            format!("sink into {}", drain.broker),
            format_number(drain.sent as f64),
            format!("{:.2}", drain.seconds),
            format_number(drain.rate()),
            yes_no(drain.drained),
            format!("{:.1}", drain.cpu.gateway_per_million(drain.sent)),
            format!("{:.1}", per_million(drain.cpu.postgres, drain.sent)),
            format!("{:.1}", per_million(drain.broker_cpu, drain.sent)),
        ]);
        let mut cells = vec![
            drain.latency.label(),
            format_number(drain.latency.measured as f64),
            drain.latency.lost.to_string(),
        ];
        cells.extend(latency_cells(&drain.latency.commit_to_delivery()));
        latency_table.row(cells);
        if !drain.drained {
            report.notes.push(format!(
                "the sink run into {} was cut off after {:.0} s with {} events stored; the rate covers that time",
                drain.broker,
                drain.seconds,
                format_number(drain.sent as f64)
            ));
        }
        report.figure(&format!("{key}_latency"), drain.latency.to_json());
        report.figure(&format!("{key}_events"), drain.sent);
        report.figure(&format!("{key}_seconds"), round(drain.seconds, 3));
        report.figure(&format!("{key}_events_per_s"), round(drain.rate(), 1));
        report.figure(&format!("{key}_drained"), drain.drained);
        report.figure(&format!("{key}_cpu_s"), drain.cpu.to_json());
        report.figure(
            &format!("{key}_gateway_cpu_s_per_million"),
            round(drain.cpu.gateway_per_million(drain.sent), 2),
        );
        report.figure(
            &format!("{key}_broker_cpu_s_per_million"),
            round(per_million(drain.broker_cpu, drain.sent), 2),
        );
        report.figure(&format!("{key}_to_pull"), round(ratio, 3));
        report.targets.push(Target::at_least(
            format!("sink into {} ÷ pull deliver rate", drain.broker),
            ratio,
            0.8,
            "x",
        ));
        series.push(
            drain
                .series
                .clone()
                .labelled(format!("sink into {}", drain.broker)),
        );
        histograms.push((
            drain.latency.label(),
            drain.latency.commit_to_delivery_histogram(),
        ));
    }
    report.tables.push(table);
    report.tables.push(latency_table);
    report.figure("backlog", backlog);
    report.figure("pull_events_per_s", round(pull.per_second(), 1));
    report.figure("pull_cpu_s", pull_cpu.to_json());
    series.push(
        pull.total_samples
            .clone()
            .labelled(format!("pull, {BASELINE_STREAMS} streams")),
    );
    bench.time_chart(
        &mut report,
        "sink-throughput.svg",
        "sink: events/s stored by each broker, beside pull",
        "events/s",
        &series,
    )?;
    bench.latency_chart(
        &mut report,
        "sink-latency.svg",
        "sink: commit-to-broker at 1,000/s",
        &histograms,
    )?;
    Ok(report)
}

/// A sink subscription into `sink`, from the earliest event or the latest.
pub(super) async fn create_sink_subscription(
    gateway: &Gateway,
    name: &str,
    sink: proto::SinkConfig,
    earliest: bool,
) -> anyhow::Result<()> {
    let boundary = if earliest {
        proto::Boundary::Earliest
    } else {
        proto::Boundary::Latest
    };
    gateway
        .admin()
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                name: name.into(),
                start: Some(proto::StartPosition {
                    position: Some(proto::start_position::Position::Boundary(boundary as i32)),
                }),
                sink: Some(sink),
                ..Default::default()
            }),
            validate_only: false,
        })
        .await
        .with_context(|| format!("CreateSubscription {name:?} (sink) failed"))?;
    Ok(())
}
