//! The gateway's lifecycle: connects to the databases, starts the relay, the pushers,
//! maintenance and the stats gauges, serves the gRPC API, the console and the metrics
//! endpoint, and shuts them down in order.

use std::{future::Future, time::Duration};

use futures_util::StreamExt;
use tokio::net::TcpListener;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic_health::{ServingStatus, server::HealthReporter};

use crate::{
    Config, api,
    api::{AdminApi, PublisherApi, SubscriberApi},
    auth, config, connections, console,
    delivery::{DeliveryConfig, Relay},
    drain, maintenance, metrics, metrics_endpoint,
    operations::Operations,
    proto,
    publish::Publisher,
    push, push_client, rates, sink, sinks, sources,
    sources::{ConnectError, Sources, SourcesError, connect_within},
    storage::{Store, StoreError},
    streams,
    subscriptions::Subscriptions,
    tasks::{RestartDelays, TaskName, keep_running},
    telemetry,
};

/// The health service name that is SERVING for as long as the process serves gRPC.
pub const PROCESS_HEALTH_SERVICE: &str = "outbox.process";

/// Services the health endpoint reports on, besides the server as a whole ("").
const SERVICE_NAMES: [&str; 3] = [
    "outbox.v1.Publisher",
    "outbox.v1.Subscriber",
    "outbox.v1.Admin",
];

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("cannot migrate the database schema: {0}")]
    Migrate(#[source] StoreError),
    #[error("gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("cannot set up TLS: {0}")]
    Tls(String),
    #[error("{0}")]
    Push(String),
    #[error("cannot set up a sink: {0}")]
    Sinks(String),
    #[error("invalid tokens: {0}")]
    Tokens(String),
    #[error(transparent)]
    Sources(#[from] SourcesError),
    #[error(
        "cannot serve metrics on {address}: {source}. Choose another address with --metrics-listen, or turn metrics off with --metrics-listen off"
    )]
    MetricsListen {
        address: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Metrics(String),
    #[error(
        "cannot serve the console on {address}: {source}. Choose another address with --console-listen, or turn it off with --console-listen off"
    )]
    ConsoleListen {
        address: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// Connects to the database (migrating it unless configured not to) and serves gRPC
/// on `listener`, and the web console on `config.console_listen`, until `shutdown`
/// completes; then reports NOT_SERVING, ends the Subscribe streams (giving their leases
/// back), lets in-flight calls finish within the grace period and closes the pool.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RunError> {
    let console = match config.console_listen {
        Some(address) => Some(
            TcpListener::bind(address)
                .await
                .map_err(|source| RunError::ConsoleListen { address, source })?,
        ),
        None => None,
    };
    run_with_console(config, listener, console, shutdown).await
}

/// [`run`] with the console on `console_listener` (whatever `config.console_listen`
/// says), or without a console.
pub async fn run_with_console(
    config: Config,
    listener: TcpListener,
    console_listener: Option<TcpListener>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RunError> {
    let console_tls = match (&console_listener, &config.tls) {
        (Some(_), Some(files)) => Some(console::tls::server_config(files).map_err(RunError::Tls)?),
        _ => None,
    };
    let store = connect(&config).await?;
    if config.migrate {
        store.migrate().await.map_err(RunError::Migrate)?;
    }
    let sources = Sources::new(store.clone(), &config.sources_settings())?;
    sources.prepare().await?;
    // One root token: each subsystem stops on a child of it, in the order the shutdown
    // below follows; cancelled on any return, errors included. Every background task of
    // the server runs on `tasks` (the relay's are counted apart as well, so that its
    // shutdown can wait for them alone).
    let stop = CancellationToken::new();
    let _stop_everything_on_return = stop.clone().drop_guard();
    let tasks = TaskTracker::new();
    let stop_metrics = stop.child_token();
    if let Some(address) = config.metrics_listen {
        let listener = TcpListener::bind(address)
            .await
            .map_err(|source| RunError::MetricsListen { address, source })?;
        let endpoint =
            metrics_endpoint::MetricsEndpoint::install(config.metrics_refresh_interval * 3)
                .map_err(RunError::Metrics)?;
        // The address bound, not the one asked for: with port 0 the log is how whoever
        // started the gateway learns the port.
        let address = listener.local_addr().unwrap_or(address);
        tracing::info!(%address, "serving metrics at /metrics");
        tasks.spawn(endpoint.serve(listener, stop_metrics.clone().cancelled_owned()));
    }
    let relay = Relay::start(
        sources.clone(),
        DeliveryConfig {
            // What a transform may make of a payload: no more than may be published.
            max_payload_bytes: config.limits.max_payload_bytes,
            ..config.delivery.clone()
        },
        stop.child_token(),
        &tasks,
    );
    let publisher = Publisher::new(relay.clone(), config.limits.clone());
    let push_board = push::PushBoard::default();
    let sink_catalog = sinks::connect(&config.sinks)
        .await
        .map_err(RunError::Sinks)?;
    let sink_board = drain::StatusBoard::default();
    let subscriptions = Subscriptions::new(
        relay.clone(),
        config.push.allowed_hosts.clone(),
        push_board.clone(),
        sink_catalog.clone(),
    );
    let push_client = push_client::PushClient::new(&config.push)
        .map_err(|error| RunError::Push(error.to_string()))?;
    push::Pushers::start(
        relay.clone(),
        config.push.clone(),
        push_board.clone(),
        std::sync::Arc::new(push_client),
    );
    sink::Sinkers::start(
        relay.clone(),
        sink_catalog.clone(),
        sink_board.clone(),
        config.push.poll_interval,
    );
    let operations = Operations::new(
        relay.clone(),
        push_board.clone(),
        sink_board,
        sink_catalog.clone(),
    );
    let stop_maintenance = stop.child_token();
    tasks.spawn(keep_running(
        TaskName::single("maintenance"),
        RestartDelays::default(),
        stop_maintenance.clone(),
        {
            let (relay, subscriptions) = (relay.clone(), subscriptions.clone());
            let (settings, stop) = (config.maintenance.clone(), stop_maintenance.clone());
            move || {
                maintenance::run(
                    relay.clone(),
                    subscriptions.clone(),
                    settings.clone(),
                    stop.clone(),
                )
            }
        },
        |_| {},
    ));
    // Stopped with what is left after the relay, so its streams are gone when the
    // record of them is removed.
    let (gateway_id, stop_stream_record) = (uuid::Uuid::new_v4(), stop.child_token());
    tasks.spawn(keep_running(
        TaskName::single("stream_record"),
        RestartDelays::default(),
        stop_stream_record.clone(),
        {
            let (relay, stop) = (relay.clone(), stop_stream_record);
            let poll_interval = config.delivery.poll_interval;
            move || streams::record(relay.clone(), gateway_id, poll_interval, stop.clone())
        },
        |_| {},
    ));
    tasks.spawn(keep_running(
        TaskName::single("source_watch"),
        RestartDelays::default(),
        stop_maintenance.clone(),
        {
            let (sources, stop) = (sources.clone(), stop_maintenance.clone());
            let interval = config.health_check_interval;
            move || sources.clone().watch(interval, stop.clone())
        },
        |_| {},
    ));

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    set_health(&health_reporter, ServingStatus::NotServing).await;
    // For liveness probes: the process answers, whether or not its database does
    // (restarting a gateway does not bring PostgreSQL back).
    health_reporter
        .set_service_status(PROCESS_HEALTH_SERVICE, ServingStatus::Serving)
        .await;
    // Both loop until told to stop; their token also ends a wait to restart.
    if config.metrics_listen.is_some() {
        let (sources, operations) = (sources.clone(), operations.clone());
        let sinks = sink_catalog.clone();
        let (interval, stop_stats) = (config.metrics_refresh_interval, stop.child_token());
        tasks.spawn(keep_running(
            // The task label stays "figures": it is a published metric label.
            TaskName::single("figures"),
            RestartDelays::default(),
            stop_stats.clone(),
            move || {
                let refresh =
                    refresh_stats(sources.clone(), operations.clone(), sinks.clone(), interval);
                let stop = stop_stats.clone();
                async move {
                    stop.run_until_cancelled(refresh).await;
                }
            },
            |_| {},
        ));
    }
    let stop_health = stop.child_token();
    if sink_catalog.iter().next().is_some() {
        tasks.spawn(keep_running(
            TaskName::single("sink_health_monitor"),
            RestartDelays::default(),
            stop_health.clone(),
            {
                let (catalog, reporter) = (sink_catalog.clone(), health_reporter.clone());
                let (interval, stop) = (config.health_check_interval, stop_health.clone());
                move || {
                    let monitor = monitor_sinks(catalog.clone(), reporter.clone(), interval);
                    let stop = stop.clone();
                    async move {
                        stop.run_until_cancelled(monitor).await;
                    }
                }
            },
            |_| {},
        ));
    }
    let health_monitor = tasks.spawn(keep_running(
        TaskName::single("health_monitor"),
        RestartDelays::default(),
        stop_health.clone(),
        {
            let (sources, reporter) = (sources.clone(), health_reporter.clone());
            let (interval, stop) = (config.health_check_interval, stop_health.clone());
            move || {
                let monitor = monitor_health(sources.clone(), reporter.clone(), interval);
                let stop = stop.clone();
                async move {
                    stop.run_until_cancelled(monitor).await;
                }
            }
        },
        |_| {},
    ));
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("descriptor sets are valid");
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .expect("descriptor sets are valid");

    let stop_serving = stop.child_token();
    let address = listener
        .local_addr()
        .map_or_else(|_| config.listen.to_string(), |address| address.to_string());
    let authenticator = (!config.tokens.is_empty())
        .then(|| auth::Authenticator::new(&config.tokens))
        .transpose()
        .map_err(RunError::Tokens)?;
    let console_server = console_listener.map(|listener| {
        let rates = rates::DeliveryRates::start(
            sources.clone(),
            config.console_rate_interval,
            stop_serving.clone(),
        );
        let sessions = console::Sessions::new(config.console_session_ttl, console_tls.is_some());
        let console = console::Console::new(
            subscriptions.clone(),
            operations.clone(),
            relay.clone(),
            rates,
            sessions,
            authenticator.clone(),
            config.console_allowed_hosts.clone(),
        );
        tasks.spawn(console::serve(
            console,
            listener,
            console_tls,
            stop_serving.clone(),
            config.shutdown_grace,
        ))
    });
    let mut builder = tonic::transport::Server::builder()
        .max_concurrent_streams(config.max_concurrent_streams)
        .http2_max_header_list_size(api::MAX_HEADER_LIST_BYTES)
        .http2_keepalive_interval(Some(config.http2_keepalive_interval))
        .http2_keepalive_timeout(Some(config.http2_keepalive_timeout));
    if let Some(tls) = &config.tls {
        builder = builder
            .tls_config(
                tls_config(tls)
                    .await?
                    .timeout(config.connection_idle_timeout),
            )
            .map_err(|error| RunError::Tls(error.to_string()))?;
    }
    let max_message = config.max_message_bytes;
    let connection_idle_timeout = config.connection_idle_timeout;
    let server = builder
        .layer(
            tower::ServiceBuilder::new()
                .layer(telemetry::RpcLayer)
                .layer(api::MessageLimitLayer {
                    max_message_bytes: max_message,
                })
                // Inside the telemetry, which then records the DEADLINE_EXCEEDED.
                .layer(api::RpcTimeoutLayer {
                    rpc_timeout: config.rpc_timeout,
                })
                // Before authentication: an oversized token is refused for its size.
                .layer(api::HeaderLimitLayer)
                .layer(api::AuthLayer::new(authenticator)),
        )
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(
            proto::publisher_server::PublisherServer::new(PublisherApi::new(publisher))
                .max_decoding_message_size(max_message),
        )
        .add_service(
            proto::subscriber_server::SubscriberServer::new(SubscriberApi::new(relay.clone()))
                .max_decoding_message_size(max_message),
        )
        .add_service(
            proto::admin_server::AdminServer::new(AdminApi::new(subscriptions, operations))
                .max_decoding_message_size(max_message),
        )
        .serve_with_incoming_shutdown(
            // Without TCP_NODELAY a unary answer's trailers wait for the client's
            // delayed ACK: about 40 ms per call.
            tonic::transport::server::TcpIncoming::from(listener)
                .with_nodelay(Some(true))
                .with_keepalive(Some(config.tcp_keepalive))
                .map(move |connection| {
                    connection.map(|connection| {
                        connections::IdleTimeout::new(connection, connection_idle_timeout)
                    })
                }),
            stop_serving.clone().cancelled_owned(),
        );
    tracing::info!(%address, "serving gRPC");

    let mut server = Box::pin(server);
    tokio::select! {
        result = &mut server => {
            result?;
        }
        _ = shutdown => {
            tracing::info!("shutting down");
            // Ended before NOT_SERVING is set, so that it cannot report SERVING again.
            stop_health.cancel();
            let _ = health_monitor.await;
            set_health(&health_reporter, ServingStatus::NotServing).await;
            stop_maintenance.cancel();
            relay.shutdown().await;
            stop_serving.cancel();
            match tokio::time::timeout(config.shutdown_grace, &mut server).await {
                Ok(result) => result?,
                Err(_) => tracing::warn!(grace = ?config.shutdown_grace, "calls still running after the grace period were cut"),
            }
        }
    }
    // Even past the grace period the server still holds the services and with them the
    // publish queue; once it is dropped the committers finish and give back the
    // connections they keep, which `store.close()` waits for.
    drop(server);
    if let Some(console_server) = console_server {
        // It stops serving at once and cuts what still runs after the grace period.
        stop_serving.cancel();
        match console_server.await {
            Ok(Err(error)) => tracing::warn!(%error, "the console failed"),
            Ok(Ok(())) => {}
            Err(error) => tracing::error!(%error, "the console's task failed"),
        }
    }
    // What is left — maintenance, the source watch, the stats refresh, the metrics endpoint —
    // stops now and is waited for, before the pools close.
    stop.cancel();
    tasks.close();
    tasks.wait().await;
    sources.close().await;
    tracing::info!("stopped");
    Ok(())
}

async fn tls_config(
    files: &config::TlsFiles,
) -> Result<tonic::transport::ServerTlsConfig, RunError> {
    let read = |path: std::path::PathBuf| async move {
        tokio::fs::read(&path)
            .await
            .map_err(|error| RunError::Tls(format!("cannot read {}: {error}", path.display())))
    };
    let identity = tonic::transport::Identity::from_pem(
        read(files.cert.clone()).await?,
        read(files.key.clone()).await?,
    );
    let mut tls = tonic::transport::ServerTlsConfig::new().identity(identity);
    if let Some(client_ca) = &files.client_ca {
        tls = tls.client_ca_root(tonic::transport::Certificate::from_pem(
            read(client_ca.clone()).await?,
        ));
    }
    Ok(tls)
}

async fn connect(config: &Config) -> Result<Store, RunError> {
    let settings = config.sources_settings();
    let store_config = sources::default_store_config(&settings, config.db_max_connections);
    Ok(connect_within(&store_config, settings.connect_timeout).await?)
}

/// SERVING while the `default` database answers and its schema is current, NOT_SERVING
/// otherwise; each source besides reports on `outbox.source.<name>`, SERVING while it can
/// be reached.
async fn monitor_health(sources: Sources, reporter: HealthReporter, interval: Duration) {
    let mut serving = None;
    let mut source_serving: Vec<Option<bool>> = vec![None; sources.len()];
    let mut last_error = None;
    loop {
        let default = &sources.default_source().store;
        let healthy = match default.is_migrated().await {
            Ok(true) => true,
            Ok(false) => {
                tracing::warn!("the database schema is not migrated; run `outbox-gateway migrate`");
                false
            }
            // Logged once, when the state changes (see Source::record), not every check.
            Err(error) => {
                last_error = Some(error.to_string());
                false
            }
        };
        sources.record_default(if healthy {
            Ok(())
        } else {
            Err(last_error
                .take()
                .unwrap_or_else(|| "its schema is not migrated".into()))
        });
        if serving != Some(healthy) {
            let status = serving_status(healthy);
            tracing::info!(?status, "health changed");
            set_health(&reporter, status).await;
            serving = Some(healthy);
        }
        for (source, reported) in sources.iter().zip(source_serving.iter_mut()) {
            let connected = source.is_connected();
            metrics::source_up(source.name.as_str(), connected);
            if *reported != Some(connected) {
                reporter
                    .set_service_status(
                        format!("outbox.source.{}", source.name),
                        serving_status(connected),
                    )
                    .await;
                *reported = Some(connected);
            }
        }
        tokio::time::sleep(interval).await;
    }
}

/// Each sink reports on `outbox.sink.<name>`: SERVING while its broker answers. A
/// change is logged with the reason. The catalog keeps each answer, for the status of
/// the sink's subscriptions and the `outbox_sink_up` gauge.
async fn monitor_sinks(catalog: sink::SinkCatalog, reporter: HealthReporter, interval: Duration) {
    let mut reported: std::collections::HashMap<String, bool> = Default::default();
    loop {
        for status in catalog.statuses().await {
            let reachable = status.reachable.is_ok();
            if reported.get(&status.name) != Some(&reachable) {
                match &status.reachable {
                    Ok(()) => tracing::info!(sink = %status.name, "the sink's broker answers"),
                    Err(reason) => {
                        tracing::warn!(sink = %status.name, %reason, "the sink's broker cannot be reached; its subscriptions wait")
                    }
                }
                reporter
                    .set_service_status(
                        format!("outbox.sink.{}", status.name),
                        serving_status(reachable),
                    )
                    .await;
                reported.insert(status.name, reachable);
            }
        }
        tokio::time::sleep(interval.max(Duration::from_secs(1))).await;
    }
}

fn serving_status(serving: bool) -> ServingStatus {
    if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

/// Recomputes the per-subscription gauges and the pool gauges. Counting a large backlog
/// takes the database a while, so the refresh never spends more than about 1/20 of the
/// time: with a backlog of millions it comes less often than `interval`.
async fn refresh_stats(
    sources: Sources,
    operations: Operations,
    sinks: sink::SinkCatalog,
    interval: Duration,
) {
    loop {
        let started = std::time::Instant::now();
        match operations.stats(None).await {
            Ok((subscriptions, outbox)) => {
                let now = chrono::Utc::now();
                metrics_endpoint::existing_subscriptions(
                    subscriptions
                        .iter()
                        .map(|report| report.total.name.as_str().to_owned())
                        .collect(),
                );
                for report in &subscriptions {
                    let name = report.total.name.as_str();
                    metrics::subscription_status(name, report.status.kind());
                    metrics::subscription_streams(name, report.streams_here);
                    for stats in &report.per_source {
                        metrics::subscription_counters(
                            stats.name.as_str(),
                            stats.source.as_ref().map_or("", |source| source.as_str()),
                        );
                        metrics::subscription_stats(stats, now);
                    }
                }
                metrics::outbox_stats(&outbox);
            }
            Err(error) => tracing::debug!(%error, "could not refresh metrics"),
        }
        let (size, idle) = sources.default_source().store.pool_usage();
        metrics::pool(size, idle);
        for source in sources.iter() {
            metrics::source_up(source.name.as_str(), source.is_connected());
        }
        // Set on each of these rounds, which the gauges' idle timeout follows (the sink
        // monitor's rounds are another rhythm).
        for (sink, up) in sinks.last_checks() {
            metrics::sink_up(&sink, up);
        }
        metrics::build_and_process(env!("OUTBOX_GIT_COMMIT"));
        tokio::time::sleep(interval.max(started.elapsed() * 20)).await;
    }
}

async fn set_health(reporter: &HealthReporter, status: ServingStatus) {
    reporter.set_service_status("", status).await;
    for name in SERVICE_NAMES {
        reporter.set_service_status(name, status).await;
    }
}
