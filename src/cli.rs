//! Client-side subcommands of the `outbox-gateway` binary: they talk to a running
//! gateway over gRPC.

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

/// Where a client subcommand finds the gateway.
#[derive(Debug, Clone, clap::Args)]
pub struct Connection {
    /// The gateway's gRPC endpoint.
    #[arg(
        long,
        env = "OUTBOX_ENDPOINT",
        default_value = "http://127.0.0.1:50051"
    )]
    pub endpoint: String,
    /// Give up on a call after this long.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

impl Connection {
    pub async fn channel(&self) -> Result<Channel, String> {
        Endpoint::from_shared(self.endpoint.clone())
            .map_err(|error| format!("invalid --endpoint {:?}: {error}", self.endpoint))?
            .connect_timeout(self.timeout)
            .timeout(self.timeout)
            .connect()
            .await
            .map_err(|error| format!("cannot reach the gateway at {}: {error}", self.endpoint))
    }
}

/// Exits 0 when the gateway reports SERVING; for container health checks.
pub async fn health(connection: &Connection) -> Result<(), String> {
    let mut client = HealthClient::new(connection.channel().await?);
    let response = client
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map_err(|status| format!("health check failed: {}", status.message()))?;
    match ServingStatus::try_from(response.into_inner().status) {
        Ok(ServingStatus::Serving) => {
            println!("SERVING");
            Ok(())
        }
        Ok(status) => Err(format!("the gateway reports {}", status.as_str_name())),
        Err(_) => Err("the gateway sent an unknown health status".into()),
    }
}
