//! Kafka sinks, on rdkafka (librdkafka): an idempotent producer with `acks=all`, so a
//! message settles only once every in-sync replica has it, and the producer's own
//! retries neither duplicate nor reorder it within its partition. What cannot succeed
//! by retrying — the topic does not exist, the message is larger than the broker takes,
//! the gateway may not write there — is a permanent failure; anything else (a broker
//! unreachable or restarting, no confirmation in time) is transient.
//!
//! Why librdkafka rather than a pure-Rust client: it is the reference implementation
//! the other Kafka clients are measured against, with the idempotent producer, TLS and
//! SASL (PLAIN, SCRAM) that the pure-Rust clients lack or leave unfinished, and it is
//! maintained with Kafka itself.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use futures_util::{FutureExt, future::BoxFuture};
use rdkafka::{
    ClientConfig, ClientContext,
    config::RDKafkaLogLevel,
    error::{KafkaError, RDKafkaErrorCode},
    message::{Header, OwnedHeaders},
    producer::{FutureProducer, FutureRecord, Producer, PurgeConfig},
};

use super::SinkSettings;
use crate::{
    domain::SinkKind,
    sink::{SINK_TIMEOUT, SinkClient, SinkFailure, SinkMessage},
};

/// Longest wait for the brokers' answer when checking whether they are reachable.
const CHECK_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the producer waits for a topic it does not know to appear before it calls
/// it missing: long enough for a topic just created, short beside [`SINK_TIMEOUT`].
const TOPIC_APPEARANCE_WAIT: Duration = Duration::from_secs(2);
/// The SASL mechanisms librdkafka offers without Kerberos.
const SASL_MECHANISMS: [&str; 3] = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"];

/// Checks a `kind = "kafka"` sink's settings.
pub(super) fn validate(sink: &SinkSettings) -> Result<(), String> {
    if sink.brokers.is_empty() {
        return Err("brokers must name at least one Kafka broker (host:port)".into());
    }
    for (index, broker) in sink.brokers.iter().enumerate() {
        let well_formed = broker.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty()
                && !host.contains([',', ' ', '/'])
                && port.parse::<u16>().is_ok_and(|port| port > 0)
        });
        if !well_formed {
            return Err(format!(
                "brokers[{index}] {broker:?} is not host:port (a Kafka bootstrap broker)"
            ));
        }
    }
    if sink.user.is_some() != sink.password.is_some() {
        return Err("user and password go together".into());
    }
    if let Some(mechanism) = &sink.sasl_mechanism {
        if !SASL_MECHANISMS.contains(&mechanism.as_str()) {
            return Err(format!(
                "sasl_mechanism {mechanism:?} is not one of {}",
                SASL_MECHANISMS.join(", ")
            ));
        }
        if sink.user.is_none() {
            return Err("sasl_mechanism needs user and password".into());
        }
    }
    Ok(())
}

pub(super) struct KafkaSink {
    producers: Arc<Producers>,
    /// The brokers, for messages.
    brokers: Arc<str>,
}

/// The sink's producer, and its replacement when it cannot go on.
///
/// A message not confirmed within [`SINK_TIMEOUT`] (the brokers unreachable or too
/// slow) fails as transient, and its producer is replaced by a new one, which starts
/// with a new producer id from the brokers; the old one drops what it still holds.
/// librdkafka's own message timeout is off: an idempotent producer that gives up on a
/// message bumps its epoch itself, which not every Kafka-protocol broker accepts (tansu
/// 0.6 stops serving when it sees one). A producer that hit a fatal error can send no
/// more and is replaced too.
struct Producers {
    settings: SinkSettings,
    current: Mutex<Generation>,
}

#[derive(Clone)]
struct Generation {
    number: u64,
    producer: FutureProducer<SinkContext>,
}

impl KafkaSink {
    /// Creates the producer; it connects in the background, so a broker that is down at
    /// start is connected to once it is up.
    pub(super) fn connect(sink: &SinkSettings) -> Result<KafkaSink, String> {
        Ok(KafkaSink {
            producers: Arc::new(Producers {
                current: Mutex::new(Generation {
                    number: 0,
                    producer: producer(sink)?,
                }),
                settings: sink.clone(),
            }),
            brokers: sink.brokers.join(", ").into(),
        })
    }
}

impl Producers {
    fn current(&self) -> Generation {
        self.current.lock().expect("producer lock").clone()
    }

    /// Replaces the producer of generation `failed`, unless that was done already (its
    /// other messages fail alike).
    fn replace(&self, failed: u64, why: &str) {
        let name = &self.settings.name;
        let mut current = self.current.lock().expect("producer lock");
        if current.number != failed {
            return;
        }
        let renewed = match producer(&self.settings) {
            Ok(renewed) => renewed,
            Err(error) => {
                tracing::error!(sink = %name, %error, "cannot start a new Kafka producer");
                return;
            }
        };
        tracing::debug!(sink = %name, %why, "replacing the Kafka producer");
        let old = std::mem::replace(
            &mut *current,
            Generation {
                number: failed + 1,
                producer: renewed,
            },
        );
        // Its queued and in-flight messages fail at once (and are retried by their
        // sinker through the new producer); closing it blocks for a moment.
        tokio::task::spawn_blocking(move || {
            old.producer
                .purge(PurgeConfig::default().queue().inflight());
        });
    }
}

fn producer(sink: &SinkSettings) -> Result<FutureProducer<SinkContext>, String> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", sink.brokers.join(","))
        .set("client.id", format!("outbox-gateway-{}", sink.name))
        .set("enable.idempotence", "true")
        .set("acks", "all")
        // Never: a message the producer gave up on would make it bump its epoch
        // itself (see `Producers`); the sink's own deadline replaces the producer.
        .set("message.timeout.ms", "0")
        .set(
            "request.timeout.ms",
            (SINK_TIMEOUT / 2).as_millis().to_string(),
        )
        .set(
            "topic.metadata.propagation.max.ms",
            TOPIC_APPEARANCE_WAIT.as_millis().to_string(),
        )
        .set("linger.ms", "2");
    let tls = sink.tls_required || sink.tls_ca_file.is_some();
    let sasl = sink.user.is_some();
    let protocol = match (tls, sasl) {
        (false, false) => "plaintext",
        (true, false) => "ssl",
        (false, true) => "sasl_plaintext",
        (true, true) => "sasl_ssl",
    };
    config.set("security.protocol", protocol);
    if let Some(path) = &sink.tls_ca_file {
        config.set("ssl.ca.location", path.display().to_string());
    }
    if let (Some(user), Some(password)) = (&sink.user, &sink.password) {
        config
            .set(
                "sasl.mechanism",
                sink.sasl_mechanism.as_deref().unwrap_or("PLAIN"),
            )
            .set("sasl.username", user)
            .set("sasl.password", password);
    }
    config
        .create_with_context(SinkContext {
            name: sink.name.clone(),
        })
        .map_err(|error| format!("cannot create a Kafka producer: {error}"))
}

impl SinkClient for KafkaSink {
    fn kind(&self) -> SinkKind {
        SinkKind::Kafka
    }

    fn send(&self, message: SinkMessage) -> BoxFuture<'static, Result<(), SinkFailure>> {
        let (producers, brokers) = (self.producers.clone(), self.brokers.clone());
        async move {
            let mut headers = OwnedHeaders::new_with_capacity(message.headers.len());
            for (name, value) in &message.headers {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_bytes()),
                });
            }
            let mut record = FutureRecord::to(&message.destination)
                .payload(&message.payload)
                .headers(headers);
            if let Some(key) = &message.key {
                record = record.key(key);
            }
            let generation = producers.current();
            // Both a full local queue and the brokers' answer are waited for within
            // SINK_TIMEOUT; the producer itself never gives up on a message.
            let sent = generation.producer.send(record, SINK_TIMEOUT);
            let error = match tokio::time::timeout(SINK_TIMEOUT, sent).await {
                Ok(Ok(_delivery)) => return Ok(()),
                Ok(Err((error, _message))) => error,
                Err(_elapsed) => {
                    producers.replace(generation.number, "no confirmation in time");
                    return Err(SinkFailure::Transient(format!(
                        "no confirmation from Kafka at {brokers} within {SINK_TIMEOUT:?}"
                    )));
                }
            };
            if error.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal) {
                producers.replace(generation.number, &error.to_string());
            }
            Err(classify(&message.destination, &brokers, &error))
        }
        .boxed()
    }

    fn check(&self) -> BoxFuture<'static, Result<(), String>> {
        let (producer, brokers) = (self.producers.current().producer, self.brokers.clone());
        async move {
            // librdkafka's metadata request blocks its caller.
            let answer = tokio::task::spawn_blocking(move || {
                producer
                    .client()
                    .fetch_metadata(None, CHECK_TIMEOUT)
                    .map(|metadata| metadata.brokers().len())
            })
            .await;
            match answer {
                Ok(Ok(known)) if known > 0 => Ok(()),
                Ok(Ok(_)) => Err(format!("Kafka at {brokers} names no brokers")),
                Ok(Err(error)) => Err(format!("Kafka at {brokers} does not answer: {error}")),
                Err(error) => Err(format!("checking Kafka at {brokers} failed: {error}")),
            }
        }
        .boxed()
    }
}

/// Tells a failure that retrying can cure from one it cannot.
fn classify(topic: &str, brokers: &str, error: &KafkaError) -> SinkFailure {
    use RDKafkaErrorCode::*;
    let Some(code) = error.rdkafka_error_code() else {
        return SinkFailure::Transient(format!("Kafka did not take the message: {error}"));
    };
    match code {
        UnknownTopicOrPartition | UnknownTopic | UnknownPartition => {
            SinkFailure::Permanent(format!("Kafka at {brokers} has no topic {topic:?}: {code}"))
        }
        MessageSizeTooLarge | InvalidMessageSize | MessageBatchTooLarge => {
            SinkFailure::Permanent(format!("the message is larger than Kafka accepts: {code}"))
        }
        TopicAuthorizationFailed
        | ClusterAuthorizationFailed
        | InvalidTopic
        | InvalidRecord
        | InvalidMessage => SinkFailure::Permanent(format!(
            "Kafka refused the message for topic {topic:?}: {code}"
        )),
        _ => SinkFailure::Transient(format!("Kafka did not confirm the message: {code}")),
    }
}

/// librdkafka's log and errors, into the gateway's log with the sink's name. A broker
/// that is down is reported by the sink subscriptions' stats and health, so the
/// client's own complaints about it go to the debug log.
struct SinkContext {
    name: String,
}

impl ClientContext for SinkContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        match level {
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical => {
                tracing::warn!(sink = %self.name, facility, "Kafka client: {message}");
            }
            _ => tracing::debug!(sink = %self.name, facility, "Kafka client: {message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        match error.rdkafka_error_code() {
            // Reported as they happen to every send, and by health.
            Some(
                RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::Resolve,
            ) => tracing::debug!(sink = %self.name, %error, "Kafka: {reason}"),
            _ => tracing::warn!(sink = %self.name, %error, "Kafka: {reason}"),
        }
    }
}
