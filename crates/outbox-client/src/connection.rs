//! Where the gateway is and how to reach it: [`Connection`] builds the one kind of
//! channel every part of the client uses (endpoint, timeouts, TLS, bearer token), and
//! [`GatewayChannel`] hands out the generated stubs over it.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use tonic::{
    Request, Status,
    metadata::{Ascii, MetadataValue},
    service::{Interceptor, interceptor::InterceptedService},
    transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity},
};

use crate::{
    ClientError,
    health::{health_check_response::ServingStatus, health_client::HealthClient},
    proto::{
        admin_client::AdminClient, publisher_client::PublisherClient,
        subscriber_client::SubscriberClient,
    },
};

const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the gateway is and how to authenticate. Cheap to clone.
///
/// TLS is used when a CA certificate or a client identity is set, or the endpoint is
/// `https://`.
///
/// ```no_run
/// use outbox_client::Connection;
/// use std::time::Duration;
///
/// # async fn example() -> Result<(), outbox_client::ClientError> {
/// let gateway = Connection::new("https://outbox.internal:50051")
///     .token("s3cret")
///     .ca_certificate("/etc/outbox/ca.pem")
///     .identity("/etc/outbox/client.pem", "/etc/outbox/client.key")
///     .timeout(Duration::from_secs(10))
///     .connect()
///     .await?;
/// let subscriptions = gateway
///     .admin()
///     .list_subscriptions(outbox_client::proto::ListSubscriptionsRequest {})
///     .await
///     .map_err(outbox_client::ClientError::Refused)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Connection {
    endpoint: String,
    token: Option<String>,
    ca_certificate: Option<PathBuf>,
    identity: Option<(PathBuf, PathBuf)>,
    connect_timeout: Duration,
    timeout: Option<Duration>,
}

impl Connection {
    /// A connection to `endpoint`, e.g. `http://127.0.0.1:50051`: no token, no TLS
    /// unless the endpoint is `https://`, a 5 s connect timeout and no per-call timeout.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Connection {
            endpoint: endpoint.into(),
            token: None,
            ca_certificate: None,
            identity: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            timeout: None,
        }
    }

    /// Sends `authorization: Bearer <token>` with every call.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Trusts the CA in this PEM file to have signed the gateway's certificate.
    pub fn ca_certificate(mut self, pem_file: impl Into<PathBuf>) -> Self {
        self.ca_certificate = Some(pem_file.into());
        self
    }

    /// Presents this PEM certificate and key, for gateways that require mutual TLS.
    pub fn identity(mut self, cert_file: impl Into<PathBuf>, key_file: impl Into<PathBuf>) -> Self {
        self.identity = Some((cert_file.into(), key_file.into()));
        self
    }

    /// Gives up connecting after this long (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Gives up on each call after this long (default: no limit). Not for long-lived
    /// streams such as `Subscribe`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The endpoint as given.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Connects now; fails when the gateway cannot be reached.
    pub async fn connect(&self) -> Result<GatewayChannel, ClientError> {
        let (endpoint, token) = self.prepare()?;
        let channel = endpoint
            .connect()
            .await
            .map_err(|source| ClientError::Connect {
                endpoint: self.endpoint.clone(),
                source,
            })?;
        Ok(GatewayChannel::new(channel, token))
    }

    /// A channel that connects on its first call, and reconnects by itself after the
    /// gateway went away. Must be called inside a Tokio runtime.
    pub fn connect_lazy(&self) -> Result<GatewayChannel, ClientError> {
        let (endpoint, token) = self.prepare()?;
        Ok(GatewayChannel::new(endpoint.connect_lazy(), token))
    }

    /// Validates the settings and reads the TLS files.
    fn prepare(&self) -> Result<(Endpoint, BearerToken), ClientError> {
        let mut endpoint = Endpoint::from_shared(self.endpoint.clone())
            .map_err(|error| ClientError::InvalidEndpoint {
                endpoint: self.endpoint.clone(),
                reason: error.to_string(),
            })?
            .connect_timeout(self.connect_timeout);
        if let Some(timeout) = self.timeout {
            endpoint = endpoint.timeout(timeout);
        }
        if self.ca_certificate.is_some()
            || self.identity.is_some()
            || self.endpoint.starts_with("https://")
        {
            endpoint = endpoint.tls_config(self.tls()?).map_err(ClientError::Tls)?;
        }
        let token = BearerToken::new(self.token.as_deref())?;
        Ok((endpoint, token))
    }

    fn tls(&self) -> Result<ClientTlsConfig, ClientError> {
        let mut tls = ClientTlsConfig::new();
        if let Some(ca) = &self.ca_certificate {
            tls = tls.ca_certificate(Certificate::from_pem(read(ca)?));
        }
        if let Some((cert, key)) = &self.identity {
            tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        Ok(tls)
    }
}

fn read(path: &Path) -> Result<Vec<u8>, ClientError> {
    std::fs::read(path).map_err(|source| ClientError::ReadFile {
        path: path.to_owned(),
        source,
    })
}

/// A channel that sends the bearer token, if any, with every call.
pub type AuthenticatedChannel = InterceptedService<Channel, BearerToken>;

/// Adds `authorization: Bearer <token>` to every request (nothing without a token).
#[derive(Debug, Clone)]
pub struct BearerToken(Option<MetadataValue<Ascii>>);

impl BearerToken {
    fn new(token: Option<&str>) -> Result<Self, ClientError> {
        let value = token
            .map(|token| format!("Bearer {token}").parse())
            .transpose()
            .map_err(|_| ClientError::InvalidToken)?;
        Ok(BearerToken(value))
    }
}

impl Interceptor for BearerToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(token) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", token.clone());
        }
        Ok(request)
    }
}

/// A channel to the gateway, with the generated stubs of each service over it. Cheap to
/// clone; every stub shares the one HTTP/2 connection.
#[derive(Debug, Clone)]
pub struct GatewayChannel {
    channel: AuthenticatedChannel,
}

impl GatewayChannel {
    fn new(channel: Channel, token: BearerToken) -> Self {
        GatewayChannel {
            channel: InterceptedService::new(channel, token),
        }
    }

    /// The channel itself, for other generated stubs.
    pub fn channel(&self) -> AuthenticatedChannel {
        self.channel.clone()
    }

    /// The `outbox.v1.Publisher` stub.
    pub fn publisher(&self) -> PublisherClient<AuthenticatedChannel> {
        PublisherClient::new(self.channel())
    }

    /// The `outbox.v1.Subscriber` stub.
    pub fn subscriber(&self) -> SubscriberClient<AuthenticatedChannel> {
        SubscriberClient::new(self.channel())
    }

    /// The `outbox.v1.Admin` stub.
    pub fn admin(&self) -> AdminClient<AuthenticatedChannel> {
        AdminClient::new(self.channel())
    }

    /// The `grpc.health.v1.Health` stub.
    pub fn health(&self) -> HealthClient<AuthenticatedChannel> {
        HealthClient::new(self.channel())
    }

    /// Whether the gateway as a whole reports SERVING: it does once its database answers
    /// and its schema is current.
    pub async fn is_serving(&self) -> Result<bool, Status> {
        let response = self
            .health()
            .check(crate::health::HealthCheckRequest {
                service: String::new(),
            })
            .await?;
        Ok(response.into_inner().status == ServingStatus::Serving as i32)
    }
}
