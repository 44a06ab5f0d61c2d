//! Security: token authentication and role scopes, TLS with client certificates,
//! resource limits, and the least-privilege writer role.

use std::time::Duration;

use crate::common::*;
use outbox_client::{ClientError, Connection, Publisher};
use outbox_gateway::{
    auth::{Role, TokenConfig, token_digest},
    config::SourceConfig,
    proto::{
        self, admin_client::AdminClient, publisher_client::PublisherClient,
        subscriber_client::SubscriberClient,
    },
};
use sqlx::{Connection as _, Executor, PgConnection};
use tonic::{Code, Request};

fn token(name: &str, roles: Vec<Role>) -> TokenConfig {
    TokenConfig {
        name: name.into(),
        sha256: token_digest(&format!("{name}-secret")),
        roles,
        event_types: Vec::new(),
        aggregate_types: Vec::new(),
        subscriptions: Vec::new(),
        sources: Vec::new(),
    }
}

fn with_token<T>(message: T, name: &str) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {name}-secret").parse().unwrap(),
    );
    request
}

fn publish_request(event_type: &str) -> proto::PublishRequest {
    proto::PublishRequest {
        events: vec![event("b-1", event_type)],
        ..Default::default()
    }
}

#[tokio::test]
async fn the_authorization_scheme_is_matched_in_any_case() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.tokens = vec![token("operator", vec![Role::Admin])];
    let gateway = TestGateway::start_with(&database, config).await;
    let mut admin = AdminClient::new(gateway.channel().await);
    let list = |authorization: &str| {
        let mut request = Request::new(proto::ListSubscriptionsRequest {});
        request
            .metadata_mut()
            .insert("authorization", authorization.parse().unwrap());
        request
    };
    // RFC 7235: the scheme is a case-insensitive token.
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
        admin
            .list_subscriptions(list(&format!("{scheme} operator-secret")))
            .await
            .unwrap_or_else(|status| panic!("scheme {scheme:?}: {status:?}"));
    }
    for authorization in ["Basic operator-secret", "Bearer", "Beareroperator-secret"] {
        assert_status(
            admin.list_subscriptions(list(authorization)).await,
            Code::Unauthenticated,
            "",
        );
    }
}

#[tokio::test]
async fn tokens_authenticate_and_roles_with_scopes_authorize() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.tokens = vec![
        TokenConfig {
            event_types: vec!["billing.**".into()],
            aggregate_types: vec!["order".into()],
            ..token("billing-publisher", vec![Role::Publisher])
        },
        TokenConfig {
            subscriptions: vec!["billing-*".into()],
            ..token("billing-reader", vec![Role::Subscriber])
        },
        token("operator", vec![Role::Admin]),
    ];
    let gateway = TestGateway::start_with(&database, config).await;
    let channel = gateway.channel().await;
    let mut publisher = PublisherClient::new(channel.clone());
    let mut subscriber = SubscriberClient::new(channel.clone());
    let mut admin = AdminClient::new(channel);

    // Health stays open; everything else needs a known token.
    assert!(gateway.health().await.is_some());
    assert_status(
        publisher.publish(publish_request("billing.paid")).await,
        Code::Unauthenticated,
        "bearer token",
    );
    assert_status(
        publisher
            .publish(with_token(publish_request("billing.paid"), "stranger"))
            .await,
        Code::Unauthenticated,
        "unknown token",
    );

    // The publisher's scope: billing.** events of order aggregates.
    assert_status(
        publisher
            .publish(with_token(
                publish_request("order.created"),
                "billing-publisher",
            ))
            .await,
        Code::PermissionDenied,
        "events[0].event_type",
    );
    publisher
        .publish(with_token(
            publish_request("billing.paid"),
            "billing-publisher",
        ))
        .await
        .unwrap();
    assert_eq!(
        count_events(&database.pool().await).await,
        1,
        "the refused call wrote nothing"
    );
    assert_status(
        publisher
            .publish(with_token(
                publish_request("billing.paid"),
                "billing-reader",
            ))
            .await,
        Code::PermissionDenied,
        "publisher role",
    );

    // Admin calls need the admin role.
    let create = |name: &str| proto::CreateSubscriptionRequest {
        subscription: Some(subscription(name)),
        validate_only: false,
    };
    assert_status(
        admin
            .create_subscription(with_token(create("billing-eu"), "billing-publisher"))
            .await,
        Code::PermissionDenied,
        "admin role",
    );
    admin
        .create_subscription(with_token(create("billing-eu"), "operator"))
        .await
        .unwrap();
    admin
        .create_subscription(with_token(create("orders"), "operator"))
        .await
        .unwrap();
    assert_status(
        admin
            .list_subscriptions(with_token(
                proto::ListSubscriptionsRequest {},
                "billing-reader",
            ))
            .await,
        Code::PermissionDenied,
        "admin",
    );

    // The subscriber's scope: subscriptions named billing-*.
    let subscribe = |name: &str| proto::SubscribeRequest {
        subscription: name.into(),
        max_in_flight: 0,
        ..Default::default()
    };
    assert_status(
        subscriber
            .subscribe(with_token(subscribe("orders"), "billing-reader"))
            .await,
        Code::PermissionDenied,
        "\"orders\"",
    );
    let mut stream = subscriber
        .subscribe(with_token(subscribe("billing-eu"), "billing-reader"))
        .await
        .unwrap()
        .into_inner();
    let delivery = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let ack = proto::AckRequest {
        subscription: "billing-eu".into(),
        ack_ids: vec![delivery.ack_id],
    };
    assert_status(
        subscriber.ack(with_token(ack.clone(), "operator")).await,
        Code::PermissionDenied,
        "subscriber role",
    );
    assert!(
        subscriber
            .ack(with_token(ack, "billing-reader"))
            .await
            .unwrap()
            .into_inner()
            .stale_ack_ids
            .is_empty()
    );
}

/// The publisher scope's `sources` and `aggregate_types` bound Publish, the one call they
/// govern: outside them PERMISSION_DENIED naming the field and nothing written, inside
/// them the events land in the source they were sent to.
#[tokio::test]
async fn publisher_scopes_of_sources_and_aggregate_types_bound_publish() {
    let (default, orders) = (TestDatabase::create().await, TestDatabase::create().await);
    let mut config = test_config(default.url());
    config.sources = vec![SourceConfig {
        name: "orders".into(),
        database_url: orders.url(),
        max_connections: None,
        migrate: None,
    }];
    config.tokens = vec![
        TokenConfig {
            sources: vec!["orders".into()],
            ..token("orders-service", vec![Role::Publisher])
        },
        TokenConfig {
            aggregate_types: vec!["invoice".into(), "refund".into()],
            ..token("billing-service", vec![Role::Publisher])
        },
    ];
    let gateway = TestGateway::start_with(&default, config).await;
    let mut publisher = PublisherClient::new(gateway.channel().await);
    let (default_pool, orders_pool) = (default.pool().await, orders.pool().await);
    let publish_to = |source: &str, events: Vec<proto::EventInput>, token: &str| {
        with_token(
            proto::PublishRequest {
                events,
                source: source.into(),
            },
            token,
        )
    };
    let of_aggregate = |aggregate_type: &str, aggregate_id: &str| proto::EventInput {
        aggregate_type: aggregate_type.into(),
        ..event(aggregate_id, "billing.changed")
    };

    // `sources`: the default source, named or left empty, is outside the scope.
    for source in ["", "default"] {
        assert_status(
            publisher
                .publish(publish_to(
                    source,
                    vec![event("o-1", "order.created")],
                    "orders-service",
                ))
                .await,
            Code::PermissionDenied,
            "source",
        );
    }
    publisher
        .publish(publish_to(
            "orders",
            vec![event("o-1", "order.created")],
            "orders-service",
        ))
        .await
        .expect("a token scoped to orders publishes to orders");
    assert_eq!(count_events(&orders_pool).await, 1);
    assert_eq!(
        count_events(&default_pool).await,
        0,
        "the refused calls wrote nothing"
    );

    // `aggregate_types`: every event of the batch must be within it, whatever the source.
    assert_status(
        publisher
            .publish(publish_to(
                "",
                vec![of_aggregate("order", "o-2")],
                "billing-service",
            ))
            .await,
        Code::PermissionDenied,
        "events[0].aggregate_type",
    );
    assert_status(
        publisher
            .publish(publish_to(
                "orders",
                vec![of_aggregate("invoice", "i-1"), of_aggregate("order", "o-2")],
                "billing-service",
            ))
            .await,
        Code::PermissionDenied,
        "events[1].aggregate_type",
    );
    assert_eq!(
        count_events(&orders_pool).await,
        1,
        "a batch with one event outside the scope writes none of it"
    );
    publisher
        .publish(publish_to(
            "",
            vec![
                of_aggregate("invoice", "i-1"),
                of_aggregate("refund", "r-1"),
            ],
            "billing-service",
        ))
        .await
        .expect("aggregate types within the scope are published");
    publisher
        .publish(publish_to(
            "orders",
            vec![of_aggregate("refund", "r-2")],
            "billing-service",
        ))
        .await
        .expect("a token without a sources scope publishes to any source");
    assert_eq!(count_events(&default_pool).await, 2);
    assert_eq!(count_events(&orders_pool).await, 2);
}

#[test]
fn listening_beyond_loopback_without_tokens_is_refused() {
    use outbox_gateway::config::{Config, Settings};
    let open = Settings {
        listen: Some("0.0.0.0:50051".parse().unwrap()),
        ..Default::default()
    };
    let error = Config::from_settings(open.clone()).unwrap_err().to_string();
    assert!(error.contains("--insecure-no-auth"), "{error}");
    Config::from_settings(Settings {
        insecure_no_auth: Some(true),
        ..open.clone()
    })
    .unwrap();
    Config::from_settings(Settings {
        tokens: Some(vec![token("svc", vec![Role::Admin])]),
        ..open
    })
    .unwrap();
}

struct Pki {
    ca: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
}

fn pki() -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
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
    let client_key = KeyPair::generate().unwrap();
    let client_cert = CertificateParams::new(vec!["billing-service".into()])
        .unwrap()
        .signed_by(&client_key, &issuer)
        .unwrap();
    Pki {
        ca: ca_cert.pem(),
        server_cert: server_cert.pem(),
        server_key: server_key.serialize_pem(),
        client_cert: client_cert.pem(),
        client_key: client_key.serialize_pem(),
    }
}

/// An error with all its sources, for matching the cause of a failure.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// What a server answers a plaintext HTTP/2 client: the connection preface and an empty
/// SETTINGS frame, then whatever comes back until the server closes the connection.
async fn plaintext_reply(address: std::net::SocketAddr) -> Vec<u8> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    stream
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .expect("send the HTTP/2 preface");
    let mut reply = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut reply)).await;
    reply
}

#[tokio::test]
async fn mutual_tls_admits_only_clients_with_a_trusted_certificate() {
    let pki = pki();
    let dir = std::env::temp_dir().join(format!("outbox-tls-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, pem: &str| {
        let path = dir.join(name);
        std::fs::write(&path, pem).unwrap();
        path
    };
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    let ca = write("ca.pem", &pki.ca);
    config.tls = Some(outbox_gateway::config::TlsFiles {
        cert: write("server.pem", &pki.server_cert),
        key: write("server.key", &pki.server_key),
        client_ca: Some(ca.clone()),
    });
    let gateway = TestGateway::spawn(&database, config).await;
    let endpoint = format!("https://localhost:{}", gateway.address.port());
    let client_cert = write("client.pem", &pki.client_cert);
    let client_key = write("client.key", &pki.client_key);
    // One event id for every attempt: however often it is tried, it is stored once.
    let event = proto::EventInput {
        id: uuid::Uuid::now_v7().to_string(),
        ..event("o-1", "order.created")
    };
    let publish = |connection: Connection| {
        let event = event.clone();
        async move {
            Publisher::new(connection)
                .max_attempts(1)
                .publish(vec![event])
                .await
        }
    };

    // With a client certificate: served, once the gateway is up.
    let trusted = Connection::new(&endpoint)
        .ca_certificate(&ca)
        .identity(&client_cert, &client_key);
    let published = poll_until(Duration::from_secs(20), POLL, || {
        let trusted = trusted.clone();
        async { publish(trusted).await.ok() }
    })
    .await;
    assert!(published.is_some(), "a trusted client is served over TLS");

    // Without a client certificate, or in plaintext: refused.
    let anonymous = Connection::new(&endpoint).ca_certificate(&ca);
    let refused = chain(
        &publish(anonymous)
            .await
            .expect_err("a client without a certificate"),
    );
    assert!(
        refused.contains("CertificateRequired"),
        "the TLS handshake refuses a client without a certificate: {refused}"
    );
    let plaintext = Connection::new(format!("http://127.0.0.1:{}", gateway.address.port()));
    let refused = chain(&publish(plaintext).await.expect_err("a plaintext client"));
    assert!(
        refused.contains("transport error"),
        "a plaintext client fails at the transport, not with an answer: {refused}"
    );
    // What the plaintext client met: a TLS alert record (content type 21), no HTTP/2.
    let reply = plaintext_reply(gateway.address).await;
    assert_eq!(
        reply.first(),
        Some(&21),
        "the port answers plaintext HTTP/2 with a TLS alert: {reply:?}"
    );
    // A CA file that cannot be read is reported as such, before any call.
    let missing = dir.join("missing.pem");
    assert!(matches!(
        publish(Connection::new(&endpoint).ca_certificate(&missing)).await,
        Err(ClientError::ReadFile { path, .. }) if path == missing
    ));
    assert_eq!(count_events(&database.pool().await).await, 1);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn limits_are_answered_with_resource_exhausted() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.max_message_bytes = 64 * 1024;
    config.limits.max_payload_bytes = 1024 * 1024;
    config.delivery.max_streams = 1;
    let gateway = TestGateway::start_with(&database, config).await;

    let mut big = event("o-1", "order.created");
    big.content_type = "application/octet-stream".into();
    big.payload = vec![7; 100 * 1024];
    let result = gateway
        .publisher()
        .await
        .publish(proto::PublishRequest {
            events: vec![big],
            ..Default::default()
        })
        .await;
    assert_status(result, Code::ResourceExhausted, "message");

    create_subscription(&gateway, subscription("orders")).await;
    let _first = Consumer::open(&gateway, "orders", 0).await;
    let second = gateway
        .subscriber()
        .await
        .subscribe(proto::SubscribeRequest {
            subscription: "orders".into(),
            max_in_flight: 0,
            ..Default::default()
        })
        .await;
    assert_status(second, Code::ResourceExhausted, "Subscribe streams");
}

/// Publish request for `event_type` carrying `bytes` of metadata in one entry.
fn with_metadata_of(bytes: usize, aggregate_id: &str) -> Request<proto::PublishRequest> {
    let mut request = Request::new(proto::PublishRequest {
        events: vec![event(aggregate_id, "order.created")],
        ..Default::default()
    });
    request
        .metadata_mut()
        .insert("x-note", "n".repeat(bytes).parse().unwrap());
    request
}

#[tokio::test]
async fn oversized_request_metadata_is_answered_with_the_limit_named() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut publisher = gateway.publisher().await;

    // Past the limit, yet within what the transport reads: a gRPC status naming it.
    let refused = publisher.publish(with_metadata_of(20 * 1024, "o-1")).await;
    assert_status(refused, Code::ResourceExhausted, "the limit is 16 KiB");
    let refused = publisher.publish(with_metadata_of(60 * 1024, "o-2")).await;
    assert_status(refused, Code::ResourceExhausted, "request metadata is 61");
    assert_eq!(count_events(&database.pool().await).await, 0);

    // Under it the call goes through, on the same connection.
    publisher
        .publish(with_metadata_of(12 * 1024, "o-3"))
        .await
        .expect("12 KiB of metadata is within the limit");
    assert_eq!(count_events(&database.pool().await).await, 1);
}

/// A gateway that closes connections silent for 1 s and pings after 200 ms.
async fn gateway_with_short_idle_timeout(database: &std::sync::Arc<TestDatabase>) -> TestGateway {
    let mut config = test_config(database.url());
    config.connection_idle_timeout = Duration::from_secs(1);
    config.http2_keepalive_interval = Duration::from_millis(200);
    config.http2_keepalive_timeout = Duration::from_millis(300);
    TestGateway::start_with(database, config).await
}

/// Reads what the gateway sends on a raw connection until it closes it, for at most
/// `within`; returns the bytes read and how long the connection stayed open.
async fn read_until_closed(
    connection: &mut tokio::net::TcpStream,
    within: Duration,
) -> (Vec<u8>, Duration) {
    use tokio::io::AsyncReadExt;
    let opened = std::time::Instant::now();
    let mut received = Vec::new();
    let closed = tokio::time::timeout(within, async {
        let mut buffer = [0; 1024];
        // EOF or a reset: either way the gateway closed it.
        while let Ok(read @ 1..) = connection.read(&mut buffer).await {
            received.extend_from_slice(&buffer[..read]);
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the connection was still open after {within:?} (received {received:?})"
    );
    (received, opened.elapsed())
}

/// The types of the HTTP/2 frames in `bytes`, a server's side of a connection.
fn frame_types(bytes: &[u8]) -> Vec<u8> {
    let mut types = Vec::new();
    let mut rest = bytes;
    while rest.len() >= 9 {
        let length = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        types.push(rest[3]);
        rest = &rest[(9 + length).min(rest.len())..];
    }
    types
}

#[tokio::test]
async fn connections_that_send_nothing_or_only_the_preface_are_closed() {
    use tokio::io::AsyncWriteExt;
    const PING: u8 = 0x6;
    let database = TestDatabase::create().await;
    let gateway = gateway_with_short_idle_timeout(&database).await;

    let mut silent = tokio::net::TcpStream::connect(gateway.address)
        .await
        .unwrap();
    let mut preface_only = tokio::net::TcpStream::connect(gateway.address)
        .await
        .unwrap();
    preface_only
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();

    let ((_, silent_for), (received, preface_only_for)) = tokio::join!(
        read_until_closed(&mut silent, Duration::from_secs(15)),
        read_until_closed(&mut preface_only, Duration::from_secs(15)),
    );
    // Closed by the idle timeout, not before it.
    assert!(silent_for >= Duration::from_millis(900), "{silent_for:?}");
    // The gateway pinged the connection that completed the preface; unanswered, the
    // ping closed it.
    assert!(
        frame_types(&received).contains(&PING),
        "no PING among the frames {:?} (open {preface_only_for:?})",
        frame_types(&received)
    );

    // The gateway still serves.
    publish(&gateway, vec![event("o-1", "order.created")]).await;
}

#[tokio::test]
async fn a_quiet_subscribe_stream_outlives_many_idle_timeouts() {
    let database = TestDatabase::create().await;
    let gateway = gateway_with_short_idle_timeout(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    let mut stream = gateway
        .subscriber()
        .await
        .subscribe(proto::SubscribeRequest {
            subscription: "orders".into(),
            ..Default::default()
        })
        .await
        .expect("subscribe")
        .into_inner();

    // Nothing to deliver for four idle timeouts: the stream stays open all along.
    let quiet = tokio::time::timeout(Duration::from_secs(4), stream.message()).await;
    assert!(quiet.is_err(), "the quiet stream ended: {quiet:?}");

    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let delivery = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("a delivery on the stream that stayed open")
        .expect("the stream is healthy")
        .expect("the stream is open");
    assert_eq!(delivery.event.unwrap().aggregate_id, "o-1");
}

#[tokio::test]
async fn the_writer_role_may_only_add_events() {
    let database = TestDatabase::create().await;
    let _gateway = TestGateway::start(&database).await;
    as_writer(&database, |url| async move {
        let mut service = PgConnection::connect(&url).await.unwrap();
        service
            .execute("INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'o-1', 'order.created', '{}')")
            .await
            .expect("a writer may insert events");
        service
            .execute("SELECT outbox_publish('order', 'o-2', 'order.created', '{}')")
            .await
            .expect("a writer may call the publish function");
        assert_forbidden(
            &mut service,
            &[
                "SELECT * FROM outbox_events",
                "SELECT * FROM outbox_deliveries",
                "SELECT * FROM outbox_delivery_batches",
                "SELECT * FROM outbox_delivery_records",
                "SELECT * FROM outbox_subscriptions",
                "UPDATE outbox_events SET payload = '{}'",
                "DELETE FROM outbox_events",
                "INSERT INTO outbox_events (xact_id, aggregate_type, aggregate_id, event_type, payload) VALUES (1, 'a', 'b', 'c', '{}')",
            ],
        )
        .await;
        service.close().await.unwrap();
    })
    .await;
    assert_eq!(count_events(&database.pool().await).await, 2);
}

#[tokio::test]
async fn viewers_may_read_the_admin_figures_and_change_nothing() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.tokens = vec![
        token("operator", vec![Role::Admin]),
        token("watcher", vec![Role::Viewer]),
    ];
    let gateway = TestGateway::start_with(&database, config).await;
    let mut admin = AdminClient::new(gateway.channel().await);
    admin
        .create_subscription(with_token(
            proto::CreateSubscriptionRequest {
                subscription: Some(subscription("orders")),
                validate_only: false,
            },
            "operator",
        ))
        .await
        .unwrap();

    let stats = admin
        .get_stats(with_token(proto::GetStatsRequest::default(), "watcher"))
        .await
        .unwrap();
    assert_eq!(stats.into_inner().subscriptions.len(), 1);
    for result in [
        admin
            .list_dead_letters(with_token(
                proto::ListDeadLettersRequest {
                    subscription: "orders".into(),
                    ..Default::default()
                },
                "watcher",
            ))
            .await
            .map(|_| ()),
        admin
            .summarize_dead_letters(with_token(
                proto::SummarizeDeadLettersRequest {
                    subscription: "orders".into(),
                    ..Default::default()
                },
                "watcher",
            ))
            .await
            .map(|_| ()),
        admin
            .get_subscription(with_token(
                proto::GetSubscriptionRequest {
                    name: "orders".into(),
                },
                "watcher",
            ))
            .await
            .map(|_| ()),
    ] {
        result.expect("a viewer may read");
    }
    assert_status(
        admin
            .get_event(with_token(
                proto::GetEventRequest {
                    id: uuid::Uuid::nil().to_string(),
                    ..Default::default()
                },
                "watcher",
            ))
            .await,
        Code::NotFound,
        "does not exist",
    );
    assert_status(
        admin
            .requeue_dead_letters(with_token(
                proto::RequeueDeadLettersRequest {
                    subscription: "orders".into(),
                    all: true,
                    ..Default::default()
                },
                "watcher",
            ))
            .await,
        Code::PermissionDenied,
        "admin role",
    );
    assert_status(
        admin
            .delete_subscription(with_token(
                proto::DeleteSubscriptionRequest {
                    name: "orders".into(),
                },
                "watcher",
            ))
            .await,
        Code::PermissionDenied,
        "admin role",
    );
    assert_status(
        admin
            .pause_subscription(with_token(
                proto::PauseSubscriptionRequest {
                    name: "orders".into(),
                    ..Default::default()
                },
                "watcher",
            ))
            .await,
        Code::PermissionDenied,
        "admin role",
    );
    assert_status(
        admin
            .resume_subscription(with_token(
                proto::ResumeSubscriptionRequest {
                    name: "orders".into(),
                },
                "watcher",
            ))
            .await,
        Code::PermissionDenied,
        "admin role",
    );
    assert_status(
        admin
            .rotate_push_secret(with_token(
                proto::RotatePushSecretRequest {
                    name: "orders".into(),
                    keep_previous_for: None,
                },
                "watcher",
            ))
            .await,
        Code::PermissionDenied,
        "admin role",
    );
    assert_status(
        PublisherClient::new(gateway.channel().await)
            .publish(with_token(publish_request("order.created"), "watcher"))
            .await,
        Code::PermissionDenied,
        "publisher role",
    );
}

/// grpcurl and health probes work before a token is at hand: reflection and health are
/// open, the API is not.
#[tokio::test]
async fn reflection_and_health_need_no_token() {
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.tokens = vec![token("svc", vec![Role::Admin])];
    let gateway = TestGateway::start_with(&database, config).await;
    let mut responses = ServerReflectionClient::new(gateway.channel().await)
        .server_reflection_info(tokio_stream::iter(vec![ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        }]))
        .await
        .expect("reflection answers without a token")
        .into_inner();
    let answer = tokio_stream::StreamExt::next(&mut responses)
        .await
        .unwrap()
        .expect("reflection answers without a token");
    assert!(
        matches!(
            answer.message_response,
            Some(MessageResponse::ListServicesResponse(_))
        ),
        "{answer:?}"
    );
    assert_eq!(
        gateway.health().await,
        Some(tonic_health::pb::health_check_response::ServingStatus::Serving)
    );
    let refused = gateway
        .admin()
        .await
        .list_subscriptions(proto::ListSubscriptionsRequest {})
        .await;
    assert_status(refused, Code::Unauthenticated, "");
}

/// The CLI says which side of a TLS mismatch the user is on.
#[tokio::test]
async fn the_cli_names_tls_mismatches() {
    let pki = pki();
    let dir = std::env::temp_dir().join(format!("outbox-tls-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, pem: &str| {
        let path = dir.join(name);
        std::fs::write(&path, pem).unwrap();
        path
    };
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    let ca = write("ca.pem", &pki.ca);
    config.tls = Some(outbox_gateway::config::TlsFiles {
        cert: write("server.pem", &pki.server_cert),
        key: write("server.key", &pki.server_key),
        client_ca: None,
    });
    let gateway = TestGateway::spawn(&database, config).await;
    let port = gateway.address.port();
    let cli = |endpoint: String, ca: Option<std::path::PathBuf>| async move {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-gateway"));
        command
            .args(["health", "--timeout", "5s", "--endpoint", &endpoint])
            .env(
                "XDG_CONFIG_HOME",
                std::env::temp_dir().join("outbox-cli-tests-no-contexts"),
            )
            .env_remove("OUTBOX_CONTEXT")
            .env_remove("OUTBOX_CA");
        if let Some(ca) = ca {
            command.arg("--ca").arg(ca);
        }
        let output = command.output().await.unwrap();
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    // host:port with --ca means TLS.
    let served = poll_until(Duration::from_secs(20), POLL, || {
        let attempt = cli(format!("localhost:{port}"), Some(ca.clone()));
        async move { attempt.await.0.then_some(()) }
    })
    .await;
    assert!(served.is_some(), "served over TLS with --ca");
    let (plain, stderr) = cli(format!("http://localhost:{port}"), None).await;
    assert!(!plain && stderr.contains("use https://"), "{stderr}");
    let (untrusted, stderr) = cli(format!("https://localhost:{port}"), None).await;
    assert!(
        !untrusted && stderr.contains("not trusted") && stderr.contains("--ca"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--rpc-timeout` bounds a unary call: one held up longer (here by a lock on the outbox
/// table) is answered DEADLINE_EXCEEDED. Subscribe streams are not unary and outlive it.
#[tokio::test]
async fn a_unary_call_slower_than_the_rpc_timeout_is_cut() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.rpc_timeout = Duration::from_millis(500);
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(&gateway, subscription("orders")).await;
    let mut stream = Consumer::open(&gateway, "orders", 10).await;

    let mut locker = PgConnection::connect(&database.url()).await.unwrap();
    locker.execute("BEGIN").await.unwrap();
    locker
        .execute("LOCK TABLE outbox_events IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let held_up = tokio::time::timeout(
        Duration::from_secs(20),
        gateway
            .publisher()
            .await
            .publish(publish_request("order.created")),
    )
    .await
    .expect("the call is cut well before the test gives up");
    assert!(
        started.elapsed() >= Duration::from_millis(450),
        "cut after {:?}, before the timeout",
        started.elapsed()
    );
    assert_status(held_up, Code::DeadlineExceeded, "");
    locker.execute("ROLLBACK").await.unwrap();

    // Well past the timeout, the stream opened before it still delivers. (Like any
    // DEADLINE_EXCEEDED, the cut call's outcome is unknown: its insert may have been
    // under way, and it may be delivered too.)
    publish(&gateway, vec![event("o-2", "order.created")]).await;
    loop {
        let delivered = stream
            .next(Duration::from_secs(20))
            .await
            .expect("the stream outlives the rpc timeout");
        match aggregate_of(&delivered).as_str() {
            "o-2" => break,
            other => assert_eq!(other, "b-1"),
        }
    }
    assert!(started.elapsed() > Duration::from_millis(500));
}

/// `--max-concurrent-streams` bounds the calls open at once on one connection: the
/// client's next call waits until one of them ends, then goes through.
#[tokio::test]
async fn calls_beyond_max_concurrent_streams_wait_for_a_free_one() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.max_concurrent_streams = 2;
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(&gateway, subscription("orders")).await;
    // Both streams and the third call share one connection.
    let channel = gateway.channel().await;
    let open = || {
        let mut subscriber = SubscriberClient::new(channel.clone());
        async move {
            subscriber
                .subscribe(proto::SubscribeRequest {
                    subscription: "orders".into(),
                    ..Default::default()
                })
                .await
                .expect("subscribe")
                .into_inner()
        }
    };
    let first = open().await;
    let _second = open().await;
    let mut admin = AdminClient::new(channel.clone());
    let mut third = Box::pin(admin.list_subscriptions(proto::ListSubscriptionsRequest {}));
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut third)
            .await
            .is_err(),
        "a third call went through while two streams were open"
    );
    drop(first);
    let listed = tokio::time::timeout(Duration::from_secs(20), third)
        .await
        .expect("the third call goes through once a stream ended")
        .expect("list subscriptions");
    assert_eq!(listed.into_inner().subscriptions.len(), 1);
}
