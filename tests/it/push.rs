//! Push subscriptions against a real HTTP receiver on 127.0.0.1 that checks every
//! request's Standard Webhooks signature with its own HMAC code and reads the CloudEvents
//! attributes in both modes; scheduled, expiring and other sources' events are pushed as
//! they are delivered.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::common::*;
use axum::{
    Router,
    body::Bytes,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use base64::{Engine, engine::general_purpose::STANDARD as BASE64};
use outbox_gateway::{domain::AllowedHosts, proto};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tonic::Code;

/// Generous: a busy machine slows everything down.
const WAIT: Duration = Duration::from_secs(20);

/// What the receiver answers to one request.
#[derive(Clone, Debug)]
struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: String,
    delay: Duration,
}

impl Reply {
    fn status(status: u16) -> Reply {
        Reply {
            status,
            headers: Vec::new(),
            body: String::new(),
            delay: Duration::ZERO,
        }
    }
}

#[derive(Clone, Debug)]
struct Received {
    headers: HeaderMap,
    body: Vec<u8>,
    at: Instant,
    /// Every signing key the test expects had a matching signature.
    signed: bool,
    /// When the answer went out.
    answered: Option<Instant>,
}

impl Received {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(|value| value.to_str().unwrap())
            .unwrap_or("")
    }
}

type Script = Box<dyn Fn(&Received, usize) -> Reply + Send + Sync>;

struct ReceiverState {
    received: Mutex<Vec<Received>>,
    /// Keys (decoded) whose signatures every request must carry.
    keys: Mutex<Vec<Vec<u8>>>,
    script: Mutex<Script>,
}

#[derive(Clone)]
struct Receiver {
    address: SocketAddr,
    state: Arc<ReceiverState>,
}

impl Receiver {
    async fn start() -> Receiver {
        Self::start_on(TcpListener::bind("127.0.0.1:0").await.unwrap()).await
    }

    async fn start_on(listener: TcpListener) -> Receiver {
        let state = Arc::new(ReceiverState {
            received: Mutex::new(Vec::new()),
            keys: Mutex::new(Vec::new()),
            script: Mutex::new(Box::new(|_, _| Reply::status(204))),
        });
        let address = listener.local_addr().unwrap();
        let app = Router::new()
            .route("/hook", post(receive))
            .with_state(state.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Receiver { address, state }
    }

    fn endpoint(&self) -> String {
        format!("http://{}/hook", self.address)
    }

    fn answer(&self, script: impl Fn(&Received, usize) -> Reply + Send + Sync + 'static) {
        *self.state.script.lock().unwrap() = Box::new(script);
    }

    fn expect_keys(&self, secrets: &[&str]) {
        *self.state.keys.lock().unwrap() = secrets.iter().map(|s| decode_secret(s)).collect();
    }

    fn received(&self) -> Vec<Received> {
        self.state.received.lock().unwrap().clone()
    }

    async fn wait_for(&self, count: usize) -> Vec<Received> {
        eventually(&format!("{count} requests arrive"), WAIT, || async {
            self.received().len() >= count
        })
        .await;
        self.received()
    }
}

async fn receive(
    State(state): State<Arc<ReceiverState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let keys = state.keys.lock().unwrap().clone();
    let received = Received {
        signed: verify(&keys, &headers, &body),
        headers,
        body: body.to_vec(),
        at: Instant::now(),
        answered: None,
    };
    let index = {
        let mut all = state.received.lock().unwrap();
        all.push(received.clone());
        all.len() - 1
    };
    let reply = (state.script.lock().unwrap())(&received, index);
    tokio::time::sleep(reply.delay).await;
    state.received.lock().unwrap()[index].answered = Some(Instant::now());
    let mut response = (StatusCode::from_u16(reply.status).unwrap(), reply.body).into_response();
    for (name, value) in reply.headers {
        response.headers_mut().insert(name, value.parse().unwrap());
    }
    response
}

fn decode_secret(secret: &str) -> Vec<u8> {
    BASE64
        .decode(secret.strip_prefix("whsec_").expect("whsec_ prefix"))
        .unwrap()
}

/// HMAC-SHA256 (RFC 2104) written out here, independent of the gateway's code.
fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(block.map(|b| b ^ 0x36));
    inner.update(message);
    let mut outer = Sha256::new();
    outer.update(block.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// Every key has a `v1,` signature of `id.timestamp.body` in the header, and the
/// timestamp is recent.
fn verify(keys: &[Vec<u8>], headers: &HeaderMap, body: &[u8]) -> bool {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let (Some(id), Some(timestamp), Some(signatures)) = (
        get("webhook-id"),
        get("webhook-timestamp"),
        get("webhook-signature"),
    ) else {
        return false;
    };
    let Ok(seconds) = timestamp.parse::<i64>() else {
        return false;
    };
    if (chrono::Utc::now().timestamp() - seconds).abs() > 300 {
        return false;
    }
    let mut message = format!("{id}.{timestamp}.").into_bytes();
    message.extend_from_slice(body);
    let given: Vec<&str> = signatures.split(' ').collect();
    !keys.is_empty()
        && keys.iter().all(|key| {
            let expected = format!("v1,{}", BASE64.encode(hmac_sha256(key, &message)));
            given.contains(&expected.as_str())
        })
}

fn push_gateway_config(database: &Arc<TestDatabase>) -> outbox_gateway::Config {
    let mut config = test_config(database.url());
    config.push.allowed_hosts = AllowedHosts::parse(&["127.0.0.1".to_owned()]).unwrap();
    config.push.poll_interval = Duration::from_millis(500);
    config.delivery.poll_interval = Duration::from_millis(500);
    config
}

fn millis(ms: u64) -> Option<prost_types::Duration> {
    Some(prost_types::Duration {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    })
}

fn push_subscription(name: &str, endpoint: &str) -> proto::Subscription {
    proto::Subscription {
        push: Some(proto::PushConfig {
            endpoint: endpoint.to_owned(),
            ..Default::default()
        }),
        retry_backoff_min: millis(200),
        retry_backoff_max: seconds(5),
        max_attempts: Some(5),
        ..subscription(name)
    }
}

async fn create_push(gateway: &TestGateway, subscription: proto::Subscription) -> String {
    let created = create_subscription(gateway, subscription).await;
    let secret = created.push.expect("push config").signing_secret;
    assert!(secret.starts_with("whsec_"), "{secret:?}");
    secret
}

async fn update_push(
    gateway: &TestGateway,
    name: &str,
    push: Option<proto::PushConfig>,
) -> Result<proto::Subscription, tonic::Status> {
    gateway
        .admin()
        .await
        .update_subscription(proto::UpdateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                name: name.into(),
                push,
                ..Default::default()
            }),
            update_mask: Some(prost_types::FieldMask {
                paths: vec!["push".into()],
            }),
            validate_only: false,
        })
        .await
        .map(|response| response.into_inner())
}

#[tokio::test]
async fn pushes_every_event_once_as_signed_binary_cloudevents() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    let mut subscription = push_subscription("hooks", &receiver.endpoint());
    subscription.push.as_mut().unwrap().headers = [(
        "authorization".to_owned(),
        "Bearer receiver-token".to_owned(),
    )]
    .into();
    let secret = create_push(&gateway, subscription).await;
    receiver.expect_keys(&[&secret]);

    let mut inputs: Vec<proto::EventInput> = (0..5)
        .map(|i| event(&format!("o-{i}"), "order.created"))
        .collect();
    inputs[0].aggregate_version = Some(7);
    inputs[0].metadata = [
        ("tenant".to_owned(), "acme".to_owned()),
        (
            "traceparent".to_owned(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
        ),
    ]
    .into();
    let published = publish(&gateway, inputs).await;

    let received = receiver.wait_for(5).await;
    eventually("every delivery is acked", WAIT, || async {
        delivery_records(&database.pool().await, "hooks")
            .await
            .is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let received = if receiver.received().len() > received.len() {
        receiver.received()
    } else {
        received
    };
    assert_eq!(received.len(), 5, "each event exactly once");
    assert!(
        received.iter().all(|r| r.signed),
        "every signature verifies"
    );
    let by_id: HashMap<&str, &Received> = received.iter().map(|r| (r.header("ce-id"), r)).collect();
    for (index, result) in published.iter().enumerate() {
        let request = by_id[result.id.as_str()];
        assert_eq!(request.header("webhook-id"), result.id);
        assert_eq!(request.header("ce-specversion"), "1.0");
        assert_eq!(request.header("ce-type"), "order.created");
        assert_eq!(
            request.header("ce-source"),
            "/sources/default/aggregates/order"
        );
        assert_eq!(request.header("ce-subject"), format!("o-{index}"));
        assert!(!request.header("ce-time").is_empty());
        assert_eq!(request.header("content-type"), "application/json");
        assert_eq!(request.header("authorization"), "Bearer receiver-token");
        assert_eq!(
            request.body,
            format!(r#"{{"aggregate":"o-{index}"}}"#).as_bytes()
        );
    }
    // One Publish call: one transaction.
    let transactions: std::collections::HashSet<&str> = received
        .iter()
        .map(|r| r.header("ce-transactionid"))
        .collect();
    assert_eq!(transactions.len(), 1, "{transactions:?}");
    assert!(
        transactions
            .iter()
            .all(|id| id.parse::<u64>().is_ok_and(|id| id > 0)),
        "{transactions:?}"
    );
    let first = by_id[published[0].id.as_str()];
    assert_eq!(first.header("ce-aggregateversion"), "7");
    assert_eq!(first.header("ce-tenant"), "acme");
    assert_eq!(
        first.header("traceparent"),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    );

    // The secret and header values are never shown again; Subscribe is refused.
    let shown = stored_subscription(&gateway, "hooks").await;
    let push = shown.push.expect("push config");
    assert!(push.signing_secret.is_empty());
    assert!(push.headers["authorization"].starts_with("sha256:"));
    assert_eq!(push.max_concurrency, 16);
    assert_eq!(push.timeout, seconds(10));
    let refused = gateway
        .subscriber()
        .await
        .subscribe(proto::SubscribeRequest {
            subscription: "hooks".into(),
            ..Default::default()
        })
        .await;
    assert_status(
        refused.map(|_| ()),
        Code::FailedPrecondition,
        "push subscription",
    );
    // A gateway with a pusher shuts down cleanly.
    tokio::time::timeout(WAIT, gateway.stop())
        .await
        .expect("the gateway stops")
        .expect("cleanly");
}

#[tokio::test]
async fn structured_mode_sends_one_cloudevents_json_document() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    let mut subscription = push_subscription("structured", &receiver.endpoint());
    subscription.push.as_mut().unwrap().format = proto::PushFormat::CloudeventsStructured as i32;
    let secret = create_push(&gateway, subscription).await;
    receiver.expect_keys(&[&secret]);
    let mut binary = event("o-2", "blob.stored");
    binary.content_type = "application/octet-stream".into();
    binary.payload = vec![0, 159, 255];
    let published = publish(&gateway, vec![event("o-1", "order.created"), binary]).await;

    let received = receiver.wait_for(2).await;
    assert!(received.iter().all(|r| r.signed));
    let documents: HashMap<String, serde_json::Value> = received
        .iter()
        .map(|r| {
            assert_eq!(r.header("content-type"), "application/cloudevents+json");
            let document: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(r.header("webhook-id"), document["id"]);
            (document["id"].as_str().unwrap().to_owned(), document)
        })
        .collect();
    let json = &documents[&published[0].id];
    assert_eq!(json["specversion"], "1.0");
    assert_eq!(json["type"], "order.created");
    assert_eq!(json["subject"], "o-1");
    assert_eq!(json["source"], "/sources/default/aggregates/order");
    assert_eq!(json["datacontenttype"], "application/json");
    assert_eq!(json["data"]["aggregate"], "o-1");
    let blob = &documents[&published[1].id];
    assert_eq!(blob["data_base64"], BASE64.encode([0u8, 159, 255]));
    assert!(blob.get("data").is_none());
}

/// A binary-mode header value as the CloudEvents HTTP binding has the receiver read it:
/// every `%XX` decoded, the result UTF-8.
fn decode_header(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut decoded = Vec::new();
    let mut index = 0;
    while index < bytes.len() {
        if bytes[index] == b'%' {
            let hex = std::str::from_utf8(&bytes[index + 1..index + 3]).unwrap();
            decoded.push(u8::from_str_radix(hex, 16).unwrap());
            index += 3;
        } else {
            decoded.push(bytes[index]);
            index += 1;
        }
    }
    String::from_utf8(decoded).unwrap()
}

#[tokio::test]
async fn both_modes_give_the_receiver_the_same_attributes() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let binary = Receiver::start().await;
    let structured = Receiver::start().await;
    create_push(&gateway, push_subscription("binary", &binary.endpoint())).await;
    let mut subscription = push_subscription("structured", &structured.endpoint());
    subscription.push.as_mut().unwrap().format = proto::PushFormat::CloudeventsStructured as i32;
    create_push(&gateway, subscription).await;
    let mut odd = event("o 1/%\"ü", "order.created");
    odd.aggregate_type = "a/b c%".into();
    odd.payload = b"{}".to_vec();
    odd.metadata = [("tenant".to_owned(), "100% \"acme\" ü".to_owned())].into();
    publish(&gateway, vec![odd]).await;

    let headers = binary.wait_for(1).await.remove(0);
    let document: serde_json::Value =
        serde_json::from_slice(&structured.wait_for(1).await[0].body).unwrap();
    assert_eq!(
        document["source"],
        "/sources/default/aggregates/a%2Fb%20c%25"
    );
    for attribute in ["source", "subject", "type", "tenant"] {
        assert_eq!(
            decode_header(headers.header(&format!("ce-{attribute}"))),
            document[attribute].as_str().unwrap(),
            "{attribute}"
        );
    }
}

#[tokio::test]
async fn server_errors_retry_with_backoff_until_accepted() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    receiver.answer(|_, index| Reply::status(if index < 2 { 500 } else { 200 }));
    let secret = create_push(&gateway, push_subscription("flaky", &receiver.endpoint())).await;
    receiver.expect_keys(&[&secret]);
    let published = publish(&gateway, vec![event("o-1", "order.created")]).await;

    let received = receiver.wait_for(3).await;
    assert!(received.iter().all(|r| r.signed));
    assert!(
        received
            .iter()
            .all(|r| r.header("webhook-id") == published[0].id)
    );
    // Backoff: 200 ms, then 400 ms.
    assert!(received[1].at - received[0].at >= Duration::from_millis(150));
    assert!(received[2].at - received[1].at >= Duration::from_millis(300));
    eventually("the 200 acks it", WAIT, || async {
        delivery_records(&database.pool().await, "flaky")
            .await
            .is_empty()
    })
    .await;
}

#[tokio::test]
async fn too_many_requests_waits_for_retry_after() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    receiver.answer(|_, index| {
        if index == 0 {
            Reply {
                headers: vec![("retry-after", "2".into())],
                ..Reply::status(429)
            }
        } else {
            Reply::status(204)
        }
    });
    create_push(
        &gateway,
        push_subscription("slow-down", &receiver.endpoint()),
    )
    .await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let received = receiver.wait_for(2).await;
    let waited = received[1].at - received[0].at;
    assert!(
        waited >= Duration::from_millis(1900),
        "retried after {waited:?}, not after Retry-After: 2"
    );
}

#[tokio::test]
async fn gone_stops_pushing_until_push_is_set_again() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    receiver.answer(|_, _| Reply::status(410));
    create_push(&gateway, push_subscription("gone", &receiver.endpoint())).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    receiver.wait_for(1).await;
    eventually("the subscription shows why it stopped", WAIT, || async {
        stored_subscription(&gateway, "gone")
            .await
            .push_stopped
            .is_some_and(|stopped| stopped.reason.contains("410"))
    })
    .await;
    let stats = subscription_stats(&gateway, "gone").await;
    assert!(stats.push_stopped_reason.contains("410 Gone"));
    // The one status to show, ahead of the events that now wait.
    assert_eq!(stats.status(), proto::SubscriptionStatus::PushStopped);
    assert!(
        stats.status_detail.contains("410 Gone"),
        "{}",
        stats.status_detail
    );
    // What happened stays to be seen: the answer, and the event's own last error.
    assert_eq!(stats.push_last_status, 410, "{stats:?}");
    assert!(stats.push_requests_total >= 1, "{stats:?}");
    let last_error: Option<String> = sqlx::query_scalar(
        "SELECT d.last_error FROM outbox_delivery_records d \
         JOIN outbox_subscriptions s ON s.id = d.subscription_id WHERE s.name = 'gone'",
    )
    .fetch_one(&database.pool().await)
    .await
    .unwrap();
    assert_eq!(
        last_error.as_deref(),
        Some("the endpoint answered 410 Gone")
    );
    publish(&gateway, vec![event("o-2", "order.created")]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        receiver.received().len(),
        1,
        "nothing is pushed once stopped"
    );

    receiver.answer(|_, _| Reply::status(204));
    let resumed = update_push(
        &gateway,
        "gone",
        Some(proto::PushConfig {
            endpoint: receiver.endpoint(),
            ..Default::default()
        }),
    )
    .await
    .unwrap();
    assert!(resumed.push_stopped.is_none());
    assert!(
        resumed.push.unwrap().signing_secret.is_empty(),
        "resuming keeps the key"
    );
    receiver.wait_for(3).await;
    eventually("both events are acked after resuming", WAIT, || async {
        delivery_records(&database.pool().await, "gone")
            .await
            .is_empty()
    })
    .await;
}

#[tokio::test]
async fn a_client_error_dead_letters_at_once_with_the_body() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    receiver.answer(|_, _| Reply {
        body: format!("unknown field 'aggregate'{}", "!".repeat(2000)),
        ..Reply::status(400)
    });
    create_push(&gateway, push_subscription("strict", &receiver.endpoint())).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    receiver.wait_for(1).await;
    eventually("the event is dead-lettered", WAIT, || async {
        !list_dead_letters(&gateway, "strict").await.is_empty()
    })
    .await;
    let dead = list_dead_letters(&gateway, "strict").await;
    assert_eq!(dead[0].attempts, 1, "no retries for a 400");
    assert!(
        dead[0]
            .last_error
            .starts_with("HTTP 400 Bad Request: unknown field 'aggregate'"),
        "{:?}",
        dead[0].last_error
    );
    assert!(
        dead[0].last_error.len() <= 1100,
        "only the first KiB of the body"
    );
    let stats = subscription_stats(&gateway, "strict").await;
    assert_eq!(stats.push_last_status, 400);
    assert!(stats.push_last_error.contains("unknown field"));
    assert!(stats.push_last_error_at.is_some());
    assert_eq!(stats.push_requests_total, 1);
    assert_eq!(stats.push_in_flight, 0);
    assert!(stats.push_rate > 0.0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(receiver.received().len(), 1);
}

#[tokio::test]
async fn a_timeout_retries() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    receiver.answer(|_, index| Reply {
        delay: if index == 0 {
            Duration::from_secs(4)
        } else {
            Duration::ZERO
        },
        ..Reply::status(204)
    });
    let mut subscription = push_subscription("patient", &receiver.endpoint());
    subscription.push.as_mut().unwrap().timeout = seconds(1);
    create_push(&gateway, subscription).await;
    let published = publish(&gateway, vec![event("o-1", "order.created")]).await;
    let received = receiver.wait_for(2).await;
    assert_eq!(received[1].header("webhook-id"), published[0].id);
    assert!(received[1].at - received[0].at >= Duration::from_millis(900));
    eventually("the retry is acked", WAIT, || async {
        delivery_records(&database.pool().await, "patient")
            .await
            .is_empty()
    })
    .await;
}

#[tokio::test]
async fn connection_refused_retries_until_the_receiver_is_up() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    drop(listener);
    let endpoint = format!("http://{address}/hook");
    let mut subscription = push_subscription("refused", &endpoint);
    subscription.max_attempts = Some(0);
    create_push(&gateway, subscription).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    eventually("a refused connection counts an attempt", WAIT, || async {
        delivery_records(&database.pool().await, "refused")
            .await
            .first()
            .is_some_and(|(_, _, attempt)| *attempt >= 2)
    })
    .await;
    let receiver = Receiver::start_on(TcpListener::bind(address).await.unwrap()).await;
    receiver.wait_for(1).await;
    eventually(
        "the event is acked once the receiver is up",
        WAIT,
        || async {
            delivery_records(&database.pool().await, "refused")
                .await
                .is_empty()
        },
    )
    .await;
}

#[tokio::test]
async fn ordered_push_waits_for_each_answer_per_aggregate() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    // The first event of aggregate "a" is answered late: "b" must not wait for it, the
    // next event of "a" must.
    receiver.answer(|request, _| {
        let body = String::from_utf8_lossy(&request.body).into_owned();
        Reply {
            delay: if body.contains("\"a\"") && request.header("ce-type") == "step.1" {
                Duration::from_millis(1500)
            } else {
                Duration::ZERO
            },
            ..Reply::status(204)
        }
    });
    let mut subscription = push_subscription("ordered", &receiver.endpoint());
    subscription.ordered = true;
    create_push(&gateway, subscription).await;
    let mut events = Vec::new();
    for step in 1..=3 {
        events.push(event("a", &format!("step.{step}")));
    }
    events.push(event("b", "step.1"));
    publish(&gateway, events).await;

    let received = receiver.wait_for(4).await;
    let of = |aggregate: &str| -> Vec<Received> {
        received
            .iter()
            .filter(|r| r.header("ce-subject") == aggregate)
            .cloned()
            .collect()
    };
    let a = of("a");
    let b = of("b");
    let types: Vec<&str> = a.iter().map(|r| r.header("ce-type")).collect();
    assert_eq!(types, ["step.1", "step.2", "step.3"]);
    for pair in a.windows(2) {
        let answered = pair[0].answered.expect("answered before the next was sent");
        assert!(
            pair[1].at >= answered,
            "one request per aggregate in flight"
        );
    }
    assert!(
        b[0].at < a[0].answered.unwrap(),
        "other aggregates keep flowing"
    );
}

#[tokio::test]
async fn refuses_disallowed_hosts_and_reserved_headers() {
    let database = TestDatabase::create().await;
    let mut config = push_gateway_config(&database);
    config.push.allowed_hosts =
        AllowedHosts::parse(&["*.example.com".to_owned(), "127.0.0.1".to_owned()]).unwrap();
    let gateway = TestGateway::start_with(&database, config).await;
    let mut admin = gateway.admin().await;
    let create = |endpoint: &str, headers: Vec<(&str, &str)>| proto::CreateSubscriptionRequest {
        subscription: Some(proto::Subscription {
            push: Some(proto::PushConfig {
                endpoint: endpoint.into(),
                headers: headers
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect(),
                ..Default::default()
            }),
            ..subscription("refused")
        }),
        validate_only: false,
    };
    assert_status(
        admin
            .create_subscription(create("https://evil.test/hook", vec![]))
            .await,
        Code::InvalidArgument,
        "subscription.push.endpoint",
    );
    assert_status(
        admin
            .create_subscription(create("http://127.0.0.2/hook", vec![]))
            .await,
        Code::InvalidArgument,
        "not allowed",
    );
    assert_status(
        admin
            .create_subscription(create(
                "https://hooks.example.com/hook",
                vec![("webhook-signature", "v1,forged")],
            ))
            .await,
        Code::InvalidArgument,
        "subscription.push.headers",
    );
    assert_status(
        admin
            .create_subscription(create("ftp://hooks.example.com/", vec![]))
            .await,
        Code::InvalidArgument,
        "http",
    );
    // A URL parser drops a trailing NUL and strips tabs and newlines: the endpoint
    // stored would not be the one given, so control characters are refused.
    for endpoint in [
        "https://hooks.example.com/hook\0",
        "https://hooks.example.com/ho\tok",
        "https://hooks.example.com/hook\n",
        "\u{1}https://hooks.example.com/hook",
    ] {
        assert_status(
            admin.create_subscription(create(endpoint, vec![])).await,
            Code::InvalidArgument,
            "subscription.push.endpoint",
        );
    }
    // Nothing was created by the refused calls.
    let listed = admin
        .list_subscriptions(proto::ListSubscriptionsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(listed.subscriptions.is_empty());
    // An allowed wildcard host is accepted.
    admin
        .create_subscription(create("https://hooks.example.com/hook", vec![]))
        .await
        .unwrap();
}

#[tokio::test]
async fn pushing_is_off_without_allowed_hosts() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let result = gateway
        .admin()
        .await
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(push_subscription("off", "http://127.0.0.1:9/hook")),
            validate_only: false,
        })
        .await;
    assert_status(result, Code::InvalidArgument, "allowed_hosts");
}

#[tokio::test]
async fn update_switches_between_pull_and_push() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    create_subscription(&gateway, subscription("switch")).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;

    // Pull to push: a new key, shown once, and the backlog is pushed.
    let switched = update_push(
        &gateway,
        "switch",
        Some(proto::PushConfig {
            endpoint: receiver.endpoint(),
            headers: [("x-api-key".to_owned(), "k1".to_owned())].into(),
            ..Default::default()
        }),
    )
    .await
    .unwrap();
    let secret = switched.push.unwrap().signing_secret;
    assert!(secret.starts_with("whsec_"));
    receiver.expect_keys(&[&secret]);
    let received = receiver.wait_for(1).await;
    assert!(received[0].signed);
    assert_eq!(received[0].header("x-api-key"), "k1");

    // Sending back the fingerprint Get showed keeps the stored header value.
    let shown = stored_subscription(&gateway, "switch").await.push.unwrap();
    let updated = update_push(
        &gateway,
        "switch",
        Some(proto::PushConfig {
            endpoint: receiver.endpoint(),
            headers: shown.headers.clone(),
            timeout: seconds(5),
            ..Default::default()
        }),
    )
    .await
    .unwrap();
    assert!(updated.push.as_ref().unwrap().signing_secret.is_empty());
    assert_eq!(updated.push.unwrap().headers, shown.headers);
    eventually(
        "the pusher restarted with the new settings",
        WAIT,
        || async {
            delivery_records(&database.pool().await, "switch")
                .await
                .is_empty()
        },
    )
    .await;
    publish(&gateway, vec![event("o-2", "order.created")]).await;
    let received = receiver.wait_for(2).await;
    assert_eq!(received[1].header("x-api-key"), "k1");
    assert!(received[1].signed);

    // Push to pull: Subscribe works again and gets the next event.
    let pulled = update_push(&gateway, "switch", None).await.unwrap();
    assert!(pulled.push.is_none());
    publish(&gateway, vec![event("o-3", "order.created")]).await;
    let mut consumer = Consumer::open(&gateway, "switch", 0).await;
    let deliveries = consumer.take(1, WAIT).await;
    assert_eq!(aggregate_of(&deliveries[0]), "o-3");
}

#[tokio::test]
async fn a_gateway_killed_mid_push_pushes_again_after_the_lease() {
    let database = TestDatabase::create().await;
    let receiver = Receiver::start().await;
    // The first request for "o-1" is never answered in time: the gateway dies while it
    // waits. "o-2" is answered at once.
    let first_seen = Arc::new(std::sync::atomic::AtomicBool::new(false));
    receiver.answer(move |request, _| {
        let hang = request.header("ce-subject") == "o-1"
            && !first_seen.swap(true, std::sync::atomic::Ordering::SeqCst);
        Reply {
            delay: if hang {
                Duration::from_secs(60)
            } else {
                Duration::ZERO
            },
            ..Reply::status(204)
        }
    });
    let config_file = std::env::temp_dir().join(format!("{}-push.toml", database.name()));
    std::fs::write(&config_file, "[push]\nallowed_hosts = [\"127.0.0.1\"]\n").unwrap();
    let config_argument = config_file.to_str().expect("a UTF-8 path");
    let (mut child, log, _, channel) = start_gateway_process(
        &database,
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--config",
            config_argument,
        ],
    )
    .await;
    let metrics = log.announced("serving metrics", &mut child).await;
    let mut subscription = push_subscription("survivor", &receiver.endpoint());
    // The lease: the request's timeout plus a settling margin, beyond the ack deadline.
    subscription.ack_deadline = seconds(1);
    subscription.push.as_mut().unwrap().timeout = seconds(1);
    let created = proto::admin_client::AdminClient::new(channel.clone())
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(subscription),
            validate_only: false,
        })
        .await
        .unwrap()
        .into_inner();
    receiver.expect_keys(&[&created.push.unwrap().signing_secret]);
    let published = proto::publisher_client::PublisherClient::new(channel)
        .publish(proto::PublishRequest {
            events: vec![event("o-1", "order.created"), event("o-2", "order.created")],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    receiver.wait_for(2).await;
    // The answered request is counted by status, and its duration recorded.
    let scrape_url = format!("http://{metrics}/metrics");
    eventually("the push metrics show the 204", WAIT, || async {
        let Ok(response) = reqwest::get(&scrape_url).await else {
            return false;
        };
        let text = response.text().await.unwrap_or_default();
        text.lines().any(|line| {
            line.starts_with("outbox_push_requests_total{")
                && line.contains("subscription=\"survivor\"")
                && line.contains("code=\"204\"")
                && line.ends_with(" 1")
        }) && text.contains("outbox_push_duration_seconds_count{subscription=\"survivor\"} 1")
    })
    .await;
    child.start_kill().expect("SIGKILL");
    child.wait().await.unwrap();
    let _ = std::fs::remove_file(&config_file);

    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let received = receiver.wait_for(3).await;
    assert!(received.iter().all(|r| r.signed));
    let pushes: Vec<&Received> = received
        .iter()
        .filter(|r| r.header("webhook-id") == published[0].id)
        .collect();
    assert_eq!(pushes.len(), 2, "the interrupted push is made again");
    assert!(
        pushes[1].at - pushes[0].at >= Duration::from_secs(1),
        "pushed again only once the lease expired"
    );
    eventually("the second push is acked", WAIT, || async {
        delivery_records(&database.pool().await, "survivor")
            .await
            .is_empty()
    })
    .await;
    drop(gateway);
}

/// Whether the request carries a valid signature under `secret`, and how many it carries.
fn signatures(request: &Received, secret: &str) -> (bool, usize) {
    let given = request.header("webhook-signature");
    let headers = &request.headers;
    (
        verify(&[decode_secret(secret)], headers, &request.body),
        given.split(' ').count(),
    )
}

#[tokio::test]
async fn rotation_signs_with_both_secrets_during_the_overlap() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    let old = create_push(
        &gateway,
        push_subscription("rotating", &receiver.endpoint()),
    )
    .await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let received = receiver.wait_for(1).await;
    assert_eq!(signatures(&received[0], &old), (true, 1));

    let rotated = gateway
        .admin()
        .await
        .rotate_push_secret(proto::RotatePushSecretRequest {
            name: "rotating".into(),
            keep_previous_for: seconds(3),
        })
        .await
        .unwrap()
        .into_inner();
    let new = rotated.signing_secret;
    assert!(new.starts_with("whsec_") && new != old);
    assert!(rotated.previous_expires_at.is_some());
    publish(&gateway, vec![event("o-2", "order.created")]).await;
    let received = receiver.wait_for(2).await;
    assert!(
        signatures(&received[1], &old).0,
        "the old secret still signs"
    );
    assert!(signatures(&received[1], &new).0, "the new secret signs");
    assert_eq!(signatures(&received[1], &new).1, 2);

    // Once the overlap is over only the new secret signs.
    let overlap_end = Instant::now() + Duration::from_secs(3);
    tokio::time::sleep_until(overlap_end.into()).await;
    publish(&gateway, vec![event("o-3", "order.created")]).await;
    let received = receiver.wait_for(3).await;
    assert_eq!(signatures(&received[2], &new), (true, 1));
    assert!(!signatures(&received[2], &old).0);

    // Neither a pull subscription nor an unknown one can rotate.
    create_subscription(&gateway, subscription("pull")).await;
    let mut admin = gateway.admin().await;
    assert_status(
        admin
            .rotate_push_secret(proto::RotatePushSecretRequest {
                name: "pull".into(),
                keep_previous_for: None,
            })
            .await,
        Code::FailedPrecondition,
        "not a push subscription",
    );
    assert_status(
        admin
            .rotate_push_secret(proto::RotatePushSecretRequest {
                name: "missing".into(),
                keep_previous_for: None,
            })
            .await,
        Code::NotFound,
        "missing",
    );
    assert_status(
        admin
            .rotate_push_secret(proto::RotatePushSecretRequest {
                name: "rotating".into(),
                keep_previous_for: seconds(31 * 24 * 3600),
            })
            .await,
        Code::InvalidArgument,
        "keep_previous_for",
    );
}

/// Runs the CLI against the gateway: (success, stdout, stderr).
async fn cli(gateway: &TestGateway, args: &[&str]) -> (bool, String, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-gateway"))
        .args(args)
        .env("OUTBOX_ENDPOINT", gateway.endpoint())
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("run the CLI");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_cli_creates_push_subscriptions_and_rotates_their_secret() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    let endpoint = receiver.endpoint();
    let (ok, stdout, stderr) = cli(
        &gateway,
        &[
            "subscriptions",
            "create",
            "cli-hooks",
            "--start",
            "earliest",
            "--push-endpoint",
            &endpoint,
            "--push-header",
            "x-api-key=k1",
            "--push-format",
            "structured",
            "--json",
        ],
    )
    .await;
    assert!(ok, "{stderr}");
    let created: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let secret = created["push"]["signing_secret"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(secret.starts_with("whsec_"));
    assert_eq!(created["push"]["format"], "structured");
    assert!(
        created["push"]["headers"]["x-api-key"]
            .as_str()
            .unwrap()
            .starts_with("sha256:")
    );
    receiver.expect_keys(&[&secret]);
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let received = receiver.wait_for(1).await;
    assert!(received[0].signed);
    assert_eq!(received[0].header("x-api-key"), "k1");
    assert_eq!(
        received[0].header("content-type"),
        "application/cloudevents+json"
    );

    let (ok, stdout, stderr) = cli(
        &gateway,
        &[
            "subscriptions",
            "rotate-secret",
            "cli-hooks",
            "--keep-previous-for",
            "1h",
            "--json",
        ],
    )
    .await;
    assert!(ok, "{stderr}");
    let rotated: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let new = rotated["signing_secret"].as_str().unwrap();
    assert!(new.starts_with("whsec_") && new != secret);
    receiver.expect_keys(&[&secret, new]);
    publish(&gateway, vec![event("o-2", "order.created")]).await;
    let received = receiver.wait_for(2).await;
    assert!(received[1].signed, "signed with both secrets");

    let (ok, stdout, stderr) = cli(
        &gateway,
        &["subscriptions", "update", "cli-hooks", "--pull", "--json"],
    )
    .await;
    assert!(ok, "{stderr}");
    let pulled: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(pulled["push"].is_null());

    // Caller mistakes: a non-zero exit naming the flag or field.
    let (ok, _, stderr) = cli(
        &gateway,
        &["subscriptions", "create", "bad", "--push-header", "a=b"],
    )
    .await;
    assert!(!ok);
    assert!(stderr.contains("--push-endpoint"), "{stderr}");
    let (ok, _, stderr) = cli(
        &gateway,
        &[
            "subscriptions",
            "create",
            "bad",
            "--push-endpoint",
            "https://elsewhere.test/hook",
        ],
    )
    .await;
    assert!(!ok);
    assert!(stderr.contains("subscription.push.endpoint"), "{stderr}");
}

#[tokio::test]
async fn a_wildcard_name_resolving_to_loopback_is_not_pushed_to() {
    let database = TestDatabase::create().await;
    let mut config = push_gateway_config(&database);
    // "localhost" is allowed only through the wildcard: its loopback addresses are not.
    config.push.allowed_hosts = AllowedHosts::parse(&["*".to_owned()]).unwrap();
    let gateway = TestGateway::start_with(&database, config).await;
    let receiver = Receiver::start().await;
    let endpoint = format!("http://localhost:{}/hook", receiver.address.port());
    create_push(&gateway, push_subscription("sneaky", &endpoint)).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    eventually(
        "the refused resolution counts as a failed attempt",
        WAIT,
        || async {
            let stats = subscription_stats(&gateway, "sneaky").await;
            stats.push_last_error.contains("allowed_hosts") && stats.push_requests_total >= 2
        },
    )
    .await;
    assert!(receiver.received().is_empty(), "nothing reached loopback");

    // Listed exactly, the same name may reach loopback.
    let database = TestDatabase::create().await;
    let mut config = push_gateway_config(&database);
    config.push.allowed_hosts = AllowedHosts::parse(&["localhost".to_owned()]).unwrap();
    let gateway = TestGateway::start_with(&database, config).await;
    create_push(&gateway, push_subscription("listed", &endpoint)).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    receiver.wait_for(1).await;
}

#[tokio::test]
async fn two_gateways_share_a_push_subscription() {
    let database = TestDatabase::create().await;
    let first = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let second = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    let secret = create_push(&first, push_subscription("shared", &receiver.endpoint())).await;
    receiver.expect_keys(&[&secret]);
    let published: std::collections::BTreeSet<String> =
        publish_ids(&second, orders(40)).await.into_iter().collect();
    receiver.wait_for(40).await;
    eventually("every push is acked", WAIT, || async {
        delivery_records(&database.pool().await, "shared")
            .await
            .is_empty()
    })
    .await;
    let received = receiver.received();
    assert!(received.iter().all(|r| r.signed));
    let ids: std::collections::BTreeSet<String> = received
        .iter()
        .map(|r| r.header("webhook-id").to_owned())
        .collect();
    assert_eq!(ids, published);
    assert_eq!(received.len(), 40, "each event pushed once");
}

/// A receiver speaking HTTPS with a certificate for `localhost` from a CA of its own;
/// returns its port and the CA's PEM.
async fn start_tls_receiver(receiver: &Receiver) -> (u16, String) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let server_key = KeyPair::generate().unwrap();
    let server_cert = CertificateParams::new(vec!["localhost".into()])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
    let tls = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![CertificateDer::from_pem_slice(server_cert.pem().as_bytes()).unwrap()],
        PrivateKeyDer::from_pem_slice(server_key.serialize_pem().as_bytes()).unwrap(),
    )
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = Router::new()
        .route("/hook", post(receive))
        .with_state(receiver.state.clone());
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let app = app.clone();
            tokio::spawn(async move {
                // A client that does not trust the certificate ends the handshake.
                let Ok(stream) = acceptor.accept(socket).await else {
                    return;
                };
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(
                        hyper_util::rt::TokioIo::new(stream),
                        hyper_util::service::TowerToHyperService::new(app),
                    )
                    .await;
            });
        }
    });
    (port, ca_cert.pem())
}

#[tokio::test]
async fn https_endpoints_are_verified_against_the_configured_ca() {
    let receiver = Receiver::start().await;
    let (port, ca) = start_tls_receiver(&receiver).await;
    let endpoint = format!("https://localhost:{port}/hook");
    let allowed = AllowedHosts::parse(&["localhost".to_owned()]).unwrap();

    // Not trusted: the public roots do not include the receiver's CA.
    let database = TestDatabase::create().await;
    let mut config = push_gateway_config(&database);
    config.push.allowed_hosts = allowed.clone();
    let gateway = TestGateway::start_with(&database, config).await;
    create_push(&gateway, push_subscription("untrusted", &endpoint)).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    eventually(
        "the unverified certificate fails the push",
        WAIT,
        || async {
            let stats = subscription_stats(&gateway, "untrusted").await;
            stats.push_last_error.contains("certificate")
        },
    )
    .await;
    assert!(receiver.received().is_empty());
    drop(gateway);

    // Trusted through [push] ca_file.
    let ca_file = std::env::temp_dir().join(format!("{}-push-ca.pem", database.name()));
    std::fs::write(&ca_file, ca).unwrap();
    let database = TestDatabase::create().await;
    let mut config = push_gateway_config(&database);
    config.push.allowed_hosts = allowed;
    config.push.ca_file = Some(ca_file.clone());
    let gateway = TestGateway::start_with(&database, config).await;
    let secret = create_push(&gateway, push_subscription("trusted", &endpoint)).await;
    receiver.expect_keys(&[&secret]);
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let received = receiver.wait_for(1).await;
    assert!(received[0].signed);
    let _ = std::fs::remove_file(&ca_file);
}

#[tokio::test]
async fn redirects_are_not_followed_and_the_rate_limit_paces_requests() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    let elsewhere = format!("{}-moved", receiver.endpoint());
    receiver.answer(move |_, _| Reply {
        headers: vec![("location", elsewhere.clone())],
        ..Reply::status(307)
    });
    create_push(&gateway, push_subscription("moved", &receiver.endpoint())).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    eventually("the redirected event is dead-lettered", WAIT, || async {
        !list_dead_letters(&gateway, "moved").await.is_empty()
    })
    .await;
    let dead = list_dead_letters(&gateway, "moved").await;
    assert!(
        dead[0].last_error.contains("redirects are not followed"),
        "{}",
        dead[0].last_error
    );
    assert_eq!(
        receiver.received().len(),
        1,
        "the redirect was not followed"
    );

    // At most 5 requests a second: 10 events take well over a second.
    let paced = Receiver::start().await;
    let mut subscription = push_subscription("paced", &paced.endpoint());
    subscription.push.as_mut().unwrap().rate_limit = Some(5.0);
    subscription.start = Some(proto::StartPosition {
        position: Some(proto::start_position::Position::Boundary(
            proto::Boundary::Latest as i32,
        )),
    });
    create_push(&gateway, subscription).await;
    publish(
        &gateway,
        (0..10)
            .map(|i| event(&format!("p-{i}"), "order.created"))
            .collect(),
    )
    .await;
    let received = paced.wait_for(10).await;
    let spread = received[9].at - received[0].at;
    assert!(
        spread >= Duration::from_millis(1600),
        "10 requests at 5/s spread over {spread:?}"
    );
}

#[tokio::test]
async fn refuses_out_of_range_push_settings() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let mut admin = gateway.admin().await;
    let with = |change: &dyn Fn(&mut proto::PushConfig)| {
        let mut push = proto::PushConfig {
            endpoint: "http://127.0.0.1:9/hook".into(),
            ..Default::default()
        };
        change(&mut push);
        proto::CreateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                push: Some(push),
                ..subscription("bad")
            }),
            validate_only: false,
        }
    };
    for (request, field) in [
        (
            with(&|push| push.timeout = millis(500)),
            "subscription.push.timeout",
        ),
        (
            with(&|push| push.max_concurrency = 5000),
            "subscription.push.max_concurrency",
        ),
        (
            with(&|push| push.rate_limit = Some(0.0)),
            "subscription.push.rate_limit",
        ),
        // One request in 1e300 s: the pause between requests is no duration at all.
        (
            with(&|push| push.rate_limit = Some(1e-300)),
            "subscription.push.rate_limit",
        ),
        (
            with(&|push| push.rate_limit = Some(0.0009)),
            "subscription.push.rate_limit",
        ),
        (
            with(&|push| push.rate_limit = Some(f64::NAN)),
            "subscription.push.rate_limit",
        ),
        (
            with(&|push| push.rate_limit = Some(f64::INFINITY)),
            "subscription.push.rate_limit",
        ),
        (with(&|push| push.format = 7), "subscription.push.format"),
        (
            with(&|push| {
                push.headers = [("bad header".to_owned(), "x".to_owned())].into();
            }),
            "subscription.push.headers",
        ),
    ] {
        assert_status(
            admin.create_subscription(request).await,
            Code::InvalidArgument,
            field,
        );
    }
    assert!(
        admin
            .list_subscriptions(proto::ListSubscriptionsRequest {})
            .await
            .unwrap()
            .into_inner()
            .subscriptions
            .is_empty()
    );
}

#[tokio::test]
async fn a_rate_stored_before_the_bounds_still_pushes() {
    let database = TestDatabase::create().await;
    let receiver = Receiver::start().await;
    let first = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    create_push(&first, push_subscription("slow", &receiver.endpoint())).await;
    first.stop().await.expect("stops cleanly");
    // As a gateway that took any positive rate stored it.
    sqlx::query(
        "UPDATE outbox_subscriptions SET push = jsonb_set(push, '{rate_limit}', '1e-300') \
         WHERE name = 'slow'",
    )
    .execute(&database.pool().await)
    .await
    .unwrap();

    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let published = publish(&gateway, vec![event("o-1", "order.created")]).await;
    let received = receiver.wait_for(1).await;
    assert_eq!(received[0].header("webhook-id"), published[0].id);
}

#[tokio::test]
async fn failures_dead_letter_after_max_attempts_unless_the_type_is_persistent() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    receiver.answer(|_, _| Reply::status(502));
    let mut subscription = push_subscription("failing", &receiver.endpoint());
    subscription.max_attempts = Some(2);
    subscription.retry_backoff_max = millis(300);
    subscription.persistent_event_types = vec!["payment.*".into()];
    create_push(&gateway, subscription).await;
    publish(
        &gateway,
        vec![
            event("o-1", "order.created"),
            event("p-1", "payment.captured"),
        ],
    )
    .await;
    eventually("the ordinary event is dead-lettered", WAIT, || async {
        !list_dead_letters(&gateway, "failing").await.is_empty()
    })
    .await;
    let dead = list_dead_letters(&gateway, "failing").await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].event.as_ref().unwrap().event_type, "order.created");
    assert_eq!(dead[0].attempts, 2);
    assert!(dead[0].last_error.starts_with("HTTP 502"));
    // The persistent one keeps being pushed well past max_attempts.
    eventually("the persistent event is retried on", WAIT, || async {
        receiver
            .received()
            .iter()
            .filter(|r| r.header("ce-type") == "payment.captured")
            .count()
            >= 4
    })
    .await;
    assert_eq!(list_dead_letters(&gateway, "failing").await.len(), 1);
}

#[tokio::test]
async fn resume_subscription_ends_a_gone_stop_and_a_pause_holds_pushes_back() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    receiver.answer(|_, _| Reply::status(410));
    create_push(&gateway, push_subscription("gone", &receiver.endpoint())).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    receiver.wait_for(1).await;
    eventually("pushing stops on 410", WAIT, || async {
        stored_subscription(&gateway, "gone")
            .await
            .push_stopped
            .is_some()
    })
    .await;

    // The operator's resume ends the stop; the refused event is pushed again.
    receiver.answer(|_, _| Reply::status(204));
    let mut admin = gateway.admin().await;
    let resumed = admin
        .resume_subscription(proto::ResumeSubscriptionRequest {
            name: "gone".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(resumed.push_stopped.is_none() && !resumed.paused);
    receiver.wait_for(2).await;
    eventually("the event is acked after resuming", WAIT, || async {
        delivery_records(&database.pool().await, "gone")
            .await
            .is_empty()
    })
    .await;

    // A pause holds pushes back like it holds streams; resuming sends what waited.
    admin
        .pause_subscription(proto::PauseSubscriptionRequest {
            name: "gone".into(),
            reason: "receiver deploy".into(),
            until: None,
        })
        .await
        .unwrap();
    publish(&gateway, vec![event("o-2", "order.created")]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        receiver.received().len(),
        2,
        "nothing is pushed while paused"
    );
    admin
        .resume_subscription(proto::ResumeSubscriptionRequest {
            name: "gone".into(),
        })
        .await
        .unwrap();
    receiver.wait_for(3).await;
}

/// The aggregate id a pushed event carries in its (binary mode) body, as `event` builds it.
fn pushed_aggregate(request: &Received) -> String {
    let body: serde_json::Value = serde_json::from_slice(&request.body).expect("a JSON payload");
    body["aggregate"].as_str().expect("an aggregate").to_owned()
}

/// Time-controlled events are pushed as they are read: a scheduled event not before its
/// `deliver_at`, an expired one never — dropped and counted, or dead-lettered with
/// "expired" on a subscription with `dead_letter_expired`.
#[tokio::test]
async fn scheduled_events_wait_and_expired_ones_are_not_pushed() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let (dropping, dead_lettering) = (Receiver::start().await, Receiver::start().await);
    create_push(&gateway, push_subscription("drops", &dropping.endpoint())).await;
    create_push(
        &gateway,
        proto::Subscription {
            dead_letter_expired: true,
            ..push_subscription("keeps", &dead_lettering.endpoint())
        },
    )
    .await;

    // Written by a service in its own transaction, already past its expiry.
    sqlx::query(
        "SELECT outbox_publish('order', 'stale', 'order.quote', '{\"aggregate\":\"stale\"}'::jsonb, \
             p_occurred_at => now() - interval '1 hour', p_expires_at => now() - interval '1 minute')",
    )
    .execute(&database.pool().await)
    .await
    .unwrap();
    let due = std::time::SystemTime::now() + Duration::from_secs(2);
    publish(
        &gateway,
        vec![
            proto::EventInput {
                deliver_at: Some(due.into()),
                ..event("later", "order.remind")
            },
            event("now", "order.created"),
        ],
    )
    .await;

    for receiver in [&dropping, &dead_lettering] {
        let received = receiver.wait_for(2).await;
        let by_aggregate: HashMap<String, &Received> = received
            .iter()
            .map(|request| (pushed_aggregate(request), request))
            .collect();
        assert!(
            by_aggregate.contains_key("now"),
            "{:?}",
            by_aggregate.keys()
        );
        let later = by_aggregate.get("later").expect("the scheduled event");
        let now = by_aggregate["now"];
        assert!(
            later.at >= now.at,
            "the scheduled event was pushed before an event due at once"
        );
    }
    for subscription in ["drops", "keeps"] {
        eventually(
            &format!("{subscription} settles the expired event"),
            WAIT,
            || async {
                subscription_stats(&gateway, subscription)
                    .await
                    .expired_total
                    == 1
            },
        )
        .await;
    }
    // Neither the scheduled event's due time nor the expiry were honoured by chance: the
    // scheduled one arrived after it was due, and nothing else arrives.
    for receiver in [&dropping, &dead_lettering] {
        let later = receiver
            .received()
            .into_iter()
            .find(|request| pushed_aggregate(request) == "later")
            .unwrap();
        let pushed_at = std::time::SystemTime::now() - later.at.elapsed();
        assert!(
            pushed_at + Duration::from_millis(100) >= due,
            "pushed {:?} before it was due",
            due.duration_since(pushed_at).unwrap_or_default()
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for receiver in [&dropping, &dead_lettering] {
        let aggregates: Vec<String> = receiver.received().iter().map(pushed_aggregate).collect();
        assert_eq!(aggregates.len(), 2, "{aggregates:?}");
        assert!(!aggregates.contains(&"stale".to_owned()), "{aggregates:?}");
    }
    assert!(list_dead_letters(&gateway, "drops").await.is_empty());
    let kept = list_dead_letters(&gateway, "keeps").await;
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].event.as_ref().unwrap().aggregate_id, "stale");
    assert_eq!(kept[0].last_error, "expired");
}

/// A push subscription spans every source like a pulled one: events of a service's own
/// database, published through the gateway or written there directly, are pushed with
/// their source named in the CloudEvents `source`.
#[tokio::test]
async fn events_of_every_source_are_pushed_naming_their_source() {
    let (default, orders) = (TestDatabase::create().await, TestDatabase::create().await);
    let mut config = push_gateway_config(&default);
    config.sources = vec![outbox_gateway::config::SourceConfig {
        name: "orders".into(),
        database_url: orders.url(),
        max_connections: None,
        migrate: None,
    }];
    let gateway = TestGateway::start_with(&default, config).await;
    let receiver = Receiver::start().await;
    let secret = create_push(&gateway, push_subscription("hooks", &receiver.endpoint())).await;
    receiver.expect_keys(&[&secret]);

    publish(&gateway, vec![event("d-1", "order.created")]).await;
    gateway
        .publisher()
        .await
        .publish(proto::PublishRequest {
            events: vec![event("o-1", "order.created")],
            source: "orders".into(),
        })
        .await
        .unwrap();
    sqlx::query(
        "SELECT outbox_publish('order', 'o-2', 'order.paid', '{\"aggregate\":\"o-2\"}'::jsonb)",
    )
    .execute(&orders.pool().await)
    .await
    .unwrap();

    let received = receiver.wait_for(3).await;
    let sources: HashMap<String, String> = received
        .iter()
        .map(|request| {
            assert!(request.signed, "unsigned push");
            (
                pushed_aggregate(request),
                request.header("ce-source").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        sources,
        HashMap::from([
            (
                "d-1".to_owned(),
                "/sources/default/aggregates/order".to_owned()
            ),
            (
                "o-1".to_owned(),
                "/sources/orders/aggregates/order".to_owned()
            ),
            (
                "o-2".to_owned(),
                "/sources/orders/aggregates/order".to_owned()
            ),
        ])
    );
    eventually("every push is acked", WAIT, || async {
        let hooks = subscription_stats(&gateway, "hooks").await;
        hooks.acked_total == 3 && hooks.in_flight == 0 && hooks.pending == 0
    })
    .await;
    assert_eq!(receiver.received().len(), 3, "each event once");
}

/// The events of a batched request, as the CloudEvents JSON batch format carries them.
fn batch_events(request: &Received) -> Vec<serde_json::Value> {
    assert_eq!(
        request.header("content-type"),
        "application/cloudevents-batch+json"
    );
    serde_json::from_slice(&request.body).expect("a JSON array of CloudEvents")
}

fn batched(name: &str, endpoint: &str, events: u32, wait_ms: u64) -> proto::Subscription {
    let mut subscription = push_subscription(name, endpoint);
    let push = subscription.push.as_mut().unwrap();
    push.max_batch_events = events;
    push.max_batch_wait = millis(wait_ms);
    subscription
}

#[tokio::test]
async fn batched_push_sends_signed_cloudevents_batches() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    let created =
        create_subscription(&gateway, batched("batches", &receiver.endpoint(), 10, 300)).await;
    let push = created.push.expect("push");
    assert_eq!(push.max_batch_events, 10);
    assert_eq!(push.max_batch_wait, millis(300));
    receiver.expect_keys(&[&push.signing_secret]);

    let published = publish_ids(&gateway, orders(25)).await;
    eventually("every event is acked", WAIT, || async {
        subscription_stats(&gateway, "batches").await.acked_total == 25
    })
    .await;
    let received = receiver.received();
    assert!(
        received.len() >= 3 && received.len() < 25,
        "{} requests",
        received.len()
    );
    let mut ids = Vec::new();
    for request in &received {
        assert!(request.signed, "one signature over each batch verifies");
        assert!(request.header("webhook-id").starts_with("batch_"));
        let events = batch_events(request);
        assert!((1..=10).contains(&events.len()), "{} events", events.len());
        for event in events {
            assert_eq!(event["specversion"], "1.0");
            assert_eq!(event["type"], "order.created");
            assert_eq!(event["data"]["aggregate"], event["subject"]);
            assert!(!event["transactionid"].as_str().unwrap().is_empty());
            ids.push(event["id"].as_str().unwrap().to_owned());
        }
    }
    ids.sort();
    let mut expected = published.clone();
    expected.sort();
    assert_eq!(ids, expected, "each event once");
}

#[tokio::test]
async fn an_answer_applies_to_every_event_of_its_batch() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    // The first batch holding "o-3" is refused for now (Retry-After), the first holding
    // "o-7" for good; everything else is taken.
    let refused = Arc::new(Mutex::new(false));
    receiver.answer(move |request, _| {
        let body = String::from_utf8_lossy(&request.body);
        if body.contains("\"o-7\"") {
            return Reply::status(400);
        }
        if body.contains("\"o-3\"") && !std::mem::replace(&mut *refused.lock().unwrap(), true) {
            return Reply {
                headers: vec![("retry-after", "1".to_owned())],
                ..Reply::status(503)
            };
        }
        Reply::status(204)
    });
    // One event per aggregate and batches of two: o-7 shares its batch with one other.
    create_subscription(&gateway, batched("partial", &receiver.endpoint(), 2, 0)).await;
    publish(&gateway, orders(10)).await;

    eventually("every event is settled", WAIT, || async {
        let stats = subscription_stats(&gateway, "partial").await;
        stats.dead_lettered >= 1 && stats.acked_total + stats.dead_lettered == 10
    })
    .await;
    let dead = list_dead_letters(&gateway, "partial").await;
    let stats = subscription_stats(&gateway, "partial").await;
    let dead_aggregates: Vec<String> = dead
        .iter()
        .map(|d| d.event.as_ref().unwrap().aggregate_id.clone())
        .collect();
    assert!(
        dead_aggregates.contains(&"o-7".to_owned()),
        "{dead_aggregates:?}"
    );
    assert!(
        dead.iter().all(|d| d.last_error.starts_with("HTTP 400")),
        "{dead:?}"
    );
    // Everything a 400 refused went together; everything else was acked.
    let refused_with_o7 = receiver
        .received()
        .iter()
        .filter(|r| String::from_utf8_lossy(&r.body).contains("\"o-7\""))
        .map(|r| batch_events(r).len())
        .max()
        .unwrap();
    assert_eq!(dead.len(), refused_with_o7);
    assert_eq!(stats.acked_total, 10 - dead.len() as u64);
    // The batch answered 503 came back whole, after the Retry-After.
    let with_o3: Vec<Received> = receiver
        .received()
        .into_iter()
        .filter(|r| String::from_utf8_lossy(&r.body).contains("\"o-3\""))
        .collect();
    assert!(with_o3.len() >= 2, "{} requests with o-3", with_o3.len());
    assert!(
        with_o3[1].at.duration_since(with_o3[0].at) >= Duration::from_millis(900),
        "Retry-After is honoured"
    );
}

#[tokio::test]
async fn batches_keep_within_max_batch_bytes_and_a_larger_event_goes_alone() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    let mut subscription = batched("bytes", &receiver.endpoint(), 100, 300);
    let push = subscription.push.as_mut().unwrap();
    push.max_batch_bytes = 2000;
    // Leasing two batches per request slot would pass the stream's limit: it is held
    // to it.
    push.max_concurrency = 100;
    create_subscription(&gateway, subscription).await;
    // 600 bytes of payload plus the 256 counted per event: two fit in 2000 bytes.
    let payload = |size: usize| format!(r#"{{"pad":"{}"}}"#, "x".repeat(size)).into_bytes();
    let mut events: Vec<proto::EventInput> = (0..6)
        .map(|i| proto::EventInput {
            payload: payload(600),
            ..event(&format!("o-{i}"), "order.created")
        })
        .collect();
    events.insert(
        3,
        proto::EventInput {
            payload: payload(5000),
            ..event("big", "order.created")
        },
    );
    publish(&gateway, events).await;
    eventually("every event is acked", WAIT, || async {
        subscription_stats(&gateway, "bytes").await.acked_total == 7
    })
    .await;
    for request in receiver.received() {
        let events = batch_events(&request);
        if String::from_utf8_lossy(&request.body).contains("\"big\"") {
            assert_eq!(events.len(), 1, "the large event goes alone");
        } else {
            assert!(events.len() <= 2, "{} events in 2000 bytes", events.len());
            assert!(request.body.len() < 4000);
        }
    }
}

#[tokio::test]
async fn ordered_batched_push_never_has_two_events_of_an_aggregate_in_flight() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    receiver.answer(|_, _| Reply {
        delay: Duration::from_millis(100),
        ..Reply::status(204)
    });
    let mut subscription = batched("ordered-batches", &receiver.endpoint(), 20, 100);
    subscription.ordered = true;
    create_subscription(&gateway, subscription).await;
    let mut events = Vec::new();
    for step in 1..=5 {
        for aggregate in ["a", "b", "c"] {
            events.push(event(aggregate, &format!("step.{step}")));
        }
    }
    publish(&gateway, events).await;
    eventually("every event is acked", WAIT, || async {
        subscription_stats(&gateway, "ordered-batches")
            .await
            .acked_total
            == 15
    })
    .await;
    let received = receiver.received();
    let mut steps: HashMap<String, Vec<String>> = HashMap::new();
    for (index, request) in received.iter().enumerate() {
        let events = batch_events(request);
        let aggregates: Vec<String> = events
            .iter()
            .map(|e| e["subject"].as_str().unwrap().to_owned())
            .collect();
        let mut distinct = aggregates.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(
            distinct.len(),
            aggregates.len(),
            "one event per aggregate a batch"
        );
        for event in &events {
            steps
                .entry(event["subject"].as_str().unwrap().to_owned())
                .or_default()
                .push(event["type"].as_str().unwrap().to_owned());
        }
        // A later request with the same aggregate starts after this one was answered.
        for later in &received[index + 1..] {
            let shares = batch_events(later)
                .iter()
                .any(|e| aggregates.iter().any(|a| e["subject"] == a.as_str()));
            if shares {
                assert!(later.at >= request.answered.expect("answered"));
            }
        }
    }
    for aggregate in ["a", "b", "c"] {
        let expected: Vec<String> = (1..=5).map(|s| format!("step.{s}")).collect();
        assert_eq!(steps[aggregate], expected, "{aggregate} in order");
    }
}

#[tokio::test]
async fn a_transform_shapes_what_is_pushed() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with(&database, push_gateway_config(&database)).await;
    let receiver = Receiver::start().await;
    let subscription = proto::Subscription {
        transform: r#"{"order": aggregate_id}"#.into(),
        ..push_subscription("trimmed", &receiver.endpoint())
    };
    let secret = create_push(&gateway, subscription).await;
    receiver.expect_keys(&[&secret]);
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let received = receiver.wait_for(1).await;
    assert!(
        received[0].signed,
        "the signature covers the transformed body"
    );
    assert_eq!(received[0].header("content-type"), "application/json");
    let body: serde_json::Value = serde_json::from_slice(&received[0].body).expect("JSON");
    assert_eq!(body, serde_json::json!({"order": "o-1"}));
}
