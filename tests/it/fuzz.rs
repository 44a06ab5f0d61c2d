//! Bad input at scale: properties of the validation of events, subscription names,
//! event-type patterns and ack ids over generated input (with the database as the
//! oracle for the regular expressions it evaluates), and malformed protobuf bytes and
//! gRPC frames sent to every RPC of a running gateway.

use std::{collections::BTreeMap, time::Duration};

use crate::common::*;
use outbox_gateway::{
    domain::{
        AckId, EventTypePattern, NewEvent, PatternSet, PublishLimits, SourceId, SourceName,
        SubscriptionName,
    },
    proto,
};
use proptest::{
    prelude::*,
    strategy::ValueTree,
    test_runner::{Config as ProptestConfig, TestRunner},
};
use prost::{
    Message,
    bytes::{Buf, BufMut, Bytes},
};
use rand::{Rng, SeedableRng, rngs::StdRng};
use sqlx::{Connection, PgConnection};
use tonic::{
    Code, Status,
    client::Grpc,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    transport::Channel,
};
use tonic_health::pb::health_check_response::ServingStatus;

/// The outbox table's CHECK on event types, `^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$`, as a
/// hand-written automaton over bytes.
fn check_regex_accepts(event_type: &str) -> bool {
    #[derive(PartialEq)]
    enum State {
        /// At the start of a segment: one segment byte needed.
        SegmentStart,
        /// Inside a segment: more segment bytes, a dot, or the end.
        InSegment,
    }
    let mut state = State::SegmentStart;
    for byte in event_type.bytes() {
        let segment_byte = matches!(byte, b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-');
        state = match (state, byte) {
            (_, _) if segment_byte => State::InSegment,
            (State::InSegment, b'.') => State::SegmentStart,
            _ => return false,
        };
    }
    state == State::InSegment
}

/// `^[a-z0-9][a-z0-9._-]{0,127}$`, the documented subscription name, by hand.
fn is_documented_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    let first = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let rest = |b: &u8| first(b) || matches!(b, b'.' | b'_' | b'-');
    !bytes.is_empty() && bytes.len() <= 128 && first(&bytes[0]) && bytes[1..].iter().all(rest)
}

fn valid_event() -> NewEvent {
    NewEvent {
        id: None,
        aggregate_type: "order".into(),
        aggregate_id: "o-1".into(),
        aggregate_version: Some(1),
        event_type: "order.created".into(),
        payload: b"{}".to_vec(),
        content_type: "application/json".into(),
        metadata: BTreeMap::new(),
        occurred_at: None,
        deliver_at: None,
        expires_at: None,
    }
}

/// Event types: mostly near the valid shape, with some arbitrary text.
fn event_type_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        "[A-Za-z0-9_.-]{0,12}",
        "[a-z]{1,4}(\\.[A-Za-z0-9_-]{1,4}){0,4}",
        "[a-z.]{0,3}[ \\n\\t*/é\\\\$^]?[a-z.]{0,3}",
        ".{0,20}",
        "[a-z]{250,260}",
    ]
}

/// Segments drawn from a small alphabet so patterns and event types often meet.
fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("a".to_owned()),
        Just("b".to_owned()),
        Just("order".to_owned()),
        Just("x-y".to_owned()),
        Just("A_1".to_owned()),
    ]
}

fn generated_event_type() -> impl Strategy<Value = String> {
    proptest::collection::vec(segment(), 1..5).prop_map(|segments| segments.join("."))
}

fn generated_pattern() -> impl Strategy<Value = String> {
    let part = prop_oneof![3 => segment(), 1 => Just("*".to_owned())];
    (proptest::collection::vec(part, 0..4), any::<bool>()).prop_map(|(mut parts, globstar)| {
        if globstar || parts.is_empty() {
            parts.push("**".to_owned());
        }
        parts.join(".")
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn event_validation_never_panics_and_agrees_with_the_table(
        aggregate_type in ".{0,8}|[a-z]{250,260}",
        aggregate_id in ".{0,8}",
        version in proptest::option::of(any::<i64>()),
        event_type in event_type_strategy(),
        payload in proptest::collection::vec(any::<u8>(), 0..24),
        content_type in "application/json|application/[a-z+]{0,8}json|text/plain|.{0,6}",
        metadata in proptest::collection::btree_map(".{0,4}", ".{0,4}", 0..4),
    ) {
        let event = NewEvent {
            id: None,
            aggregate_type,
            aggregate_id,
            aggregate_version: version,
            event_type,
            payload,
            content_type,
            metadata,
            occurred_at: None,
            deliver_at: None,
            expires_at: None,
        };
        if event.validate(0, &PublishLimits::default()).is_ok() {
            prop_assert!(check_regex_accepts(&event.event_type), "{:?}", event.event_type);
            prop_assert!(event.event_type.len() <= 255);
            prop_assert!(!event.aggregate_type.is_empty() && event.aggregate_type.len() <= 255);
            prop_assert!(event.aggregate_version.is_none_or(|v| v >= 1));
        }
    }

    #[test]
    fn event_types_are_accepted_exactly_when_the_table_accepts_them(
        event_type in event_type_strategy(),
    ) {
        let event = NewEvent { event_type: event_type.clone(), ..valid_event() };
        let table_accepts = check_regex_accepts(&event_type) && event_type.len() <= 255;
        prop_assert_eq!(event.validate(0, &PublishLimits::default()).is_ok(), table_accepts);
    }

    #[test]
    fn subscription_names_follow_the_documented_shape(
        name in "[a-z0-9._-]{0,130}|[A-Za-z0-9._ -]{0,6}|.{0,8}",
    ) {
        match SubscriptionName::parse("name", &name) {
            Ok(parsed) => {
                prop_assert!(is_documented_name(&name), "{:?}", name);
                prop_assert_eq!(parsed.as_str(), name.as_str());
            }
            Err(_) => prop_assert!(!is_documented_name(&name), "{:?}", name),
        }
    }

    #[test]
    fn pattern_parsing_never_panics(pattern in "[a-z*.]{0,12}|.{0,16}") {
        if let Ok(parsed) = EventTypePattern::parse(&pattern) {
            prop_assert_eq!(parsed.as_str(), pattern.as_str());
            let set = PatternSet::parse(&[pattern.as_str()]).expect("a valid pattern");
            let regex = set.to_regex().expect("a regex for a non-empty set");
            prop_assert!(regex.starts_with("^(") && regex.ends_with(")$"));
        } else {
            prop_assert!(PatternSet::parse(&["a", pattern.as_str()]).is_err());
        }
    }

    #[test]
    fn every_pattern_matches_event_types_made_from_it(
        pattern in generated_pattern(),
        filler in proptest::collection::vec(segment(), 1..3),
    ) {
        // Replace each wildcard by segments it stands for: the result must match.
        let parsed = EventTypePattern::parse(&pattern).expect("generated patterns are valid");
        let event_type = pattern
            .split('.')
            .map(|part| match part {
                "*" => filler[0].clone(),
                "**" => filler.join("."),
                literal => literal.to_owned(),
            })
            .collect::<Vec<_>>()
            .join(".");
        prop_assert!(parsed.matches(&event_type), "{} vs {}", pattern, event_type);
    }

    #[test]
    fn ack_ids_round_trip(
        position in 1..i64::MAX,
        attempt in 1..i32::MAX,
        token in any::<i64>(),
        source in prop_oneof![Just("default"), Just("billing")],
    ) {
        let name = SourceName::parse("source", source).unwrap();
        let ack = AckId { source: source_id(source).unwrap(), position, attempt, lease_token: token };
        prop_assert_eq!(AckId::parse(&ack.to_text(&name), source_id), Some(ack));
    }

    #[test]
    fn ack_id_parsing_never_panics_and_is_canonical(
        text in "((default|billing|nope|)/)?[0-9+-]{0,22}-[0-9+-]{0,12}-[0-9a-fA-F+-]{0,18}|.{0,40}",
    ) {
        if let Some(ack) = AckId::parse(&text, source_id) {
            prop_assert!(ack.position > 0 && ack.attempt > 0);
            let name = if ack.source == SourceId(0) { "default" } else { "billing" };
            let name = SourceName::parse("source", name).unwrap();
            prop_assert_eq!(AckId::parse(&ack.to_text(&name), source_id), Some(ack));
        }
    }
}

/// Two sources, as a gateway with one `[[sources]]` table has them.
fn source_id(name: &str) -> Option<SourceId> {
    match name {
        "default" => Some(SourceId(0)),
        "billing" => Some(SourceId(1)),
        _ => None,
    }
}

/// Generates `count` values of `strategy` with a fixed seed.
fn sample<S: Strategy>(strategy: S, count: usize) -> Vec<S::Value> {
    let mut runner = TestRunner::deterministic();
    (0..count)
        .map(|_| {
            strategy
                .new_tree(&mut runner)
                .expect("strategy generates")
                .current()
        })
        .collect()
}

/// `PatternSet::matches` agrees with PostgreSQL evaluating `to_regex()`, and event-type
/// validation with the table's CHECK, on many generated cases in one query each.
#[tokio::test]
async fn the_database_agrees_with_the_matchers() {
    let database = TestDatabase::create().await;
    let mut connection = PgConnection::connect(&database.url()).await.unwrap();

    let sets = sample(proptest::collection::vec(generated_pattern(), 1..4), 400);
    let event_types = sample(generated_event_type(), 400);
    let mut regexes = Vec::new();
    let mut types = Vec::new();
    let mut expected = Vec::new();
    for (patterns, event_type) in sets.iter().zip(&event_types) {
        let set = PatternSet::parse(patterns).expect("generated patterns are valid");
        // Each set against its own event type and against one made to match its first
        // pattern's shape often enough.
        for candidate in [event_type.as_str(), "order.a", "a", "a.b.x-y"] {
            regexes.push(set.to_regex().expect("non-empty set"));
            types.push(candidate.to_owned());
            expected.push(set.matches(candidate));
        }
    }
    let matched: Vec<bool> = sqlx::query_scalar(
        "SELECT t ~ r FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS c(t, r, i) ORDER BY i",
    )
    .bind(&types)
    .bind(&regexes)
    .fetch_all(&mut connection)
    .await
    .unwrap();
    assert_eq!(matched.len(), expected.len());
    let disagreements: Vec<String> = (0..expected.len())
        .filter(|&i| matched[i] != expected[i])
        .map(|i| format!("{:?} ~ {:?}: database {}", types[i], regexes[i], matched[i]))
        .collect();
    assert!(disagreements.is_empty(), "{disagreements:#?}");
    assert!(expected.iter().any(|m| *m) && expected.iter().any(|m| !*m));

    // The CHECK constraint of the outbox table, on arbitrary text (PostgreSQL text holds
    // no NUL).
    let candidates: Vec<String> = sample(event_type_strategy(), 1500)
        .into_iter()
        .filter(|candidate| !candidate.contains('\0'))
        .collect();
    let accepted: Vec<bool> = sqlx::query_scalar(
        r"SELECT octet_length(t) <= 255 AND t ~ '^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$'
          FROM unnest($1::text[]) WITH ORDINALITY AS c(t, i) ORDER BY i",
    )
    .bind(&candidates)
    .fetch_all(&mut connection)
    .await
    .unwrap();
    for (candidate, table_accepts) in candidates.iter().zip(accepted) {
        let event = NewEvent {
            event_type: candidate.clone(),
            ..valid_event()
        };
        assert_eq!(
            event.validate(0, &PublishLimits::default()).is_ok(),
            table_accepts,
            "{candidate:?}"
        );
    }
}

/// A codec that sends and receives raw message bytes, unchecked.
#[derive(Debug, Clone, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// Every RPC: its path, whether it streams, a well-formed request, and whether given
/// bytes decode as its request message.
struct Rpc {
    path: &'static str,
    streaming: bool,
    valid: Vec<u8>,
    decodes: fn(&[u8]) -> bool,
}

macro_rules! rpc {
    ($path:literal, $message:ty, $valid:expr) => {
        rpc!($path, $message, $valid, false)
    };
    ($path:literal, $message:ty, $valid:expr, $streaming:expr) => {
        Rpc {
            path: $path,
            streaming: $streaming,
            valid: $valid.encode_to_vec(),
            decodes: |bytes| <$message>::decode(bytes).is_ok(),
        }
    };
}

fn every_rpc() -> Vec<Rpc> {
    let ack_id = "1-1-0000000000000001".to_owned();
    vec![
        rpc!(
            "/outbox.v1.Publisher/Publish",
            proto::PublishRequest,
            proto::PublishRequest {
                events: vec![event("o-1", "order.created")],
                ..Default::default()
            }
        ),
        rpc!(
            "/outbox.v1.Subscriber/Subscribe",
            proto::SubscribeRequest,
            proto::SubscribeRequest {
                subscription: "orders".into(),
                max_in_flight: 10,
                ..Default::default()
            },
            true
        ),
        rpc!(
            "/outbox.v1.Subscriber/Ack",
            proto::AckRequest,
            proto::AckRequest {
                subscription: "orders".into(),
                ack_ids: vec![ack_id.clone()],
            }
        ),
        rpc!(
            "/outbox.v1.Subscriber/Nack",
            proto::NackRequest,
            proto::NackRequest {
                subscription: "orders".into(),
                ack_id: ack_id.clone(),
                reason: "bad".into(),
                retry_after: seconds(1),
                dead_letter: false,
            }
        ),
        rpc!(
            "/outbox.v1.Subscriber/ExtendAckDeadline",
            proto::ExtendAckDeadlineRequest,
            proto::ExtendAckDeadlineRequest {
                subscription: "orders".into(),
                ack_ids: vec![ack_id],
                extension: seconds(10),
            }
        ),
        rpc!(
            "/outbox.v1.Admin/CreateSubscription",
            proto::CreateSubscriptionRequest,
            proto::CreateSubscriptionRequest {
                subscription: Some(proto::Subscription {
                    event_types: vec!["order.*".into()],
                    ..subscription("fuzzed")
                }),
                validate_only: false,
            }
        ),
        rpc!(
            "/outbox.v1.Admin/GetSubscription",
            proto::GetSubscriptionRequest,
            proto::GetSubscriptionRequest {
                name: "orders".into()
            }
        ),
        rpc!(
            "/outbox.v1.Admin/ListSubscriptions",
            proto::ListSubscriptionsRequest,
            proto::ListSubscriptionsRequest {}
        ),
        rpc!(
            "/outbox.v1.Admin/UpdateSubscription",
            proto::UpdateSubscriptionRequest,
            proto::UpdateSubscriptionRequest {
                subscription: Some(subscription("orders")),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec!["ack_deadline".into()],
                }),
                validate_only: false,
            }
        ),
        rpc!(
            "/outbox.v1.Admin/DeleteSubscription",
            proto::DeleteSubscriptionRequest,
            proto::DeleteSubscriptionRequest {
                name: "missing".into()
            }
        ),
        rpc!(
            "/outbox.v1.Admin/SeekSubscription",
            proto::SeekSubscriptionRequest,
            proto::SeekSubscriptionRequest {
                subscription: "orders".into(),
                to: subscription("x").start,
            }
        ),
        rpc!(
            "/outbox.v1.Admin/RequeueEvent",
            proto::RequeueEventRequest,
            proto::RequeueEventRequest {
                id: uuid::Uuid::nil().to_string(),
                subscription: "orders".into(),
                ..Default::default()
            }
        ),
        rpc!(
            "/outbox.v1.Admin/RequeueLatest",
            proto::RequeueLatestRequest,
            proto::RequeueLatestRequest {
                aggregate_type: "order".into(),
                aggregate_id: "o-1".into(),
                event_type: "order.created".into(),
                subscription: String::new(),
                ..Default::default()
            }
        ),
        rpc!(
            "/outbox.v1.Admin/ListDeadLetters",
            proto::ListDeadLettersRequest,
            proto::ListDeadLettersRequest {
                subscription: "orders".into(),
                page_size: 10,
                ..Default::default()
            }
        ),
        rpc!(
            "/outbox.v1.Admin/RequeueDeadLetters",
            proto::RequeueDeadLettersRequest,
            proto::RequeueDeadLettersRequest {
                subscription: "orders".into(),
                event_types: vec!["order.*".into()],
                ..Default::default()
            }
        ),
        rpc!(
            "/outbox.v1.Admin/ResolveDeadLetter",
            proto::ResolveDeadLetterRequest,
            proto::ResolveDeadLetterRequest {
                subscription: "orders".into(),
                id: uuid::Uuid::nil().to_string(),
                resolved_by: "fuzz".into(),
                notes: String::new(),
                ..Default::default()
            }
        ),
        rpc!(
            "/outbox.v1.Admin/GetStats",
            proto::GetStatsRequest,
            proto::GetStatsRequest {
                subscription: String::new()
            }
        ),
        rpc!(
            "/outbox.v1.Admin/ListSources",
            proto::ListSourcesRequest,
            proto::ListSourcesRequest {}
        ),
        rpc!(
            "/outbox.v1.Admin/ResolveDeadLetters",
            proto::ResolveDeadLettersRequest,
            proto::ResolveDeadLettersRequest {
                subscription: "orders".into(),
                last_error: "boom".into(),
                resolved_by: "fuzz".into(),
                validate_only: true,
                ..Default::default()
            }
        ),
        rpc!(
            "/outbox.v1.Admin/SummarizeDeadLetters",
            proto::SummarizeDeadLettersRequest,
            proto::SummarizeDeadLettersRequest {
                subscription: "orders".into(),
                ..Default::default()
            }
        ),
        rpc!(
            "/outbox.v1.Admin/PauseSubscription",
            proto::PauseSubscriptionRequest,
            proto::PauseSubscriptionRequest {
                name: "orders".into(),
                reason: "deploy".into(),
                ..Default::default()
            }
        ),
        rpc!(
            "/outbox.v1.Admin/ResumeSubscription",
            proto::ResumeSubscriptionRequest,
            proto::ResumeSubscriptionRequest {
                name: "orders".into()
            }
        ),
        rpc!(
            "/outbox.v1.Admin/GetEvent",
            proto::GetEventRequest,
            proto::GetEventRequest {
                id: uuid::Uuid::nil().to_string(),
                ..Default::default()
            }
        ),
        rpc!(
            "/outbox.v1.Admin/RotatePushSecret",
            proto::RotatePushSecretRequest,
            proto::RotatePushSecretRequest {
                name: "orders".into(),
                keep_previous_for: None,
            }
        ),
    ]
}

/// Malformed variants of a valid request: random bytes, truncations, flipped bytes and
/// wrong wire types, plus the valid bytes themselves.
fn malformed_bodies(valid: &[u8], rng: &mut StdRng) -> Vec<Vec<u8>> {
    let mut bodies = vec![valid.to_vec()];
    for _ in 0..24 {
        let length = rng.random_range(1..48);
        bodies.push((0..length).map(|_| rng.random()).collect());
    }
    for cut in 1..valid.len() {
        bodies.push(valid[..cut].to_vec());
    }
    for _ in 0..12 {
        let mut flipped = valid.to_vec();
        if !flipped.is_empty() {
            let index = rng.random_range(0..flipped.len());
            flipped[index] ^= 1 << rng.random_range(0..8);
        }
        bodies.push(flipped);
    }
    // A length-delimited field 1 claiming more bytes than follow; a varint that never
    // ends; a field number 0; an unknown wire type (6); a group that never ends.
    bodies.extend([
        vec![0x0a, 0x7f, b'a'],
        vec![
            0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
        ],
        vec![0x00, 0x01],
        vec![0x0e, 0x01],
        vec![0x0b, 0x08, 0x01],
        vec![0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f],
    ]);
    bodies
}

/// How one call with raw bytes ended.
async fn call_raw(channel: Channel, rpc: &Rpc, body: Vec<u8>) -> Result<(), Status> {
    let mut grpc = Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|error| Status::unavailable(error.to_string()))?;
    let path = http::uri::PathAndQuery::from_static(rpc.path);
    let request = tonic::Request::new(Bytes::from(body));
    if rpc.streaming {
        let mut stream = grpc
            .server_streaming(request, path, RawCodec)
            .await?
            .into_inner();
        // A decodable request may open a real stream: its first message, its end or a
        // short wait without either tells how it went. An error sent in the stream
        // counts like one sent in its place.
        match tokio::time::timeout(Duration::from_millis(100), stream.message()).await {
            Ok(Err(status)) => Err(status),
            Ok(Ok(_)) | Err(_) => Ok(()),
        }
    } else {
        grpc.unary(request, path, RawCodec).await.map(|_| ())
    }
}

#[tokio::test]
async fn malformed_protobuf_is_refused_promptly_by_every_rpc() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    let channel = gateway.channel().await;
    let seed = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut calls = 0;
    for rpc in every_rpc() {
        for body in malformed_bodies(&rpc.valid, &mut rng) {
            let decodes = (rpc.decodes)(&body);
            let outcome = tokio::time::timeout(
                Duration::from_secs(10),
                call_raw(channel.clone(), &rpc, body.clone()),
            )
            .await
            .unwrap_or_else(|_| panic!("{} hung on {body:02x?} (seed {seed})", rpc.path));
            calls += 1;
            if decodes {
                // Well-formed protobuf (perhaps by chance): served, or refused for what
                // the request says — never a failure of the gateway's own.
                if let Err(status) = &outcome {
                    assert!(
                        matches!(
                            status.code(),
                            Code::InvalidArgument
                                | Code::NotFound
                                | Code::AlreadyExists
                                | Code::FailedPrecondition
                        ),
                        "{} failed on decodable {body:02x?}: {status:?} (seed {seed})",
                        rpc.path
                    );
                }
            } else {
                let status = outcome.expect_err("undecodable bytes must be refused");
                assert!(
                    status.code() == Code::InvalidArgument,
                    "{} answered {status:?} to undecodable {body:02x?} (seed {seed})",
                    rpc.path
                );
            }
        }
    }
    assert!(calls > 17 * 30, "only {calls} calls");
    assert_eq!(gateway.health().await, Some(ServingStatus::Serving));
    // Still fully working: publish and receive an event.
    publish(&gateway, vec![event("o-after", "order.created")]).await;
    let mut consumer = Consumer::open(&gateway, "orders", 1000).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let delivery = consumer
            .next(deadline - tokio::time::Instant::now())
            .await
            .expect("the event published after the fuzzing is delivered");
        if aggregate_of(&delivery) == "o-after" {
            break;
        }
    }
}

/// A gRPC request with a hand-made body (frame header included) over `channel`.
async fn send_frame(channel: Channel, path: &str, frame: &'static str) -> Result<Code, String> {
    use tower::{Service, ServiceExt};
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(frame.to_owned()))
        .map_err(|error| error.to_string())?;
    let mut service = channel;
    let response = service
        .ready()
        .await
        .map_err(|error| error.to_string())?
        .call(request)
        .await
        .map_err(|error| error.to_string())?;
    // The status is in the headers (trailers-only) or in the trailers after the body.
    let status = match Status::from_header_map(response.headers()) {
        Some(status) => status,
        None => {
            use http_body::Body as _;
            let mut body = std::pin::pin!(response.into_body());
            let mut trailers = None;
            while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
                let frame = frame.map_err(|error| error.to_string())?;
                if let Ok(map) = frame.into_trailers() {
                    trailers = Some(map);
                }
            }
            trailers
                .as_ref()
                .and_then(Status::from_header_map)
                .ok_or("no grpc-status")?
        }
    };
    Ok(status.code())
}

#[tokio::test]
async fn malformed_grpc_frames_are_refused_promptly() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let channel = gateway.channel().await;
    // The frame header is a compression flag and a 4-byte big-endian length.
    let frames: [(&str, &'static str); 4] = [
        ("length beyond the body", "\u{0}\u{0}\u{0}\u{0}\u{7f}abc"),
        (
            "compressed without an encoding",
            "\u{1}\u{0}\u{0}\u{0}\u{3}abc",
        ),
        ("unknown compression flag", "\u{2}\u{0}\u{0}\u{0}\u{0}"),
        ("header cut short", "\u{0}\u{0}\u{0}"),
    ];
    for path in [
        "/outbox.v1.Publisher/Publish",
        "/outbox.v1.Subscriber/Ack",
        "/outbox.v1.Subscriber/Subscribe",
        "/outbox.v1.Admin/GetStats",
    ] {
        for (what, frame) in frames {
            let code = tokio::time::timeout(
                Duration::from_secs(10),
                send_frame(channel.clone(), path, frame),
            )
            .await
            .unwrap_or_else(|_| panic!("{path} hung on a frame with {what}"))
            .unwrap_or_else(|error| panic!("{path}, frame with {what}: {error}"));
            assert_ne!(code, Code::Ok, "{path} accepted a frame with {what}");
            assert_ne!(code, Code::Unknown, "{path}: frame with {what}");
        }
    }
    assert_eq!(gateway.health().await, Some(ServingStatus::Serving));
}
