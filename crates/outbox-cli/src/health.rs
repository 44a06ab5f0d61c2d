//! `health`: whether the gateway answers and serves.

use outbox_client::health::{HealthCheckRequest, health_check_response::ServingStatus};
use serde_json::json;

use crate::{Target, describe};

/// Exits 0 when the gateway reports SERVING; for container health checks.
pub async fn health(target: &Target) -> Result<(), String> {
    let mut client = target.connect(true).await?.health();
    let response = client
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map_err(|status| format!("health check failed: {}", describe(status)))?;
    match ServingStatus::try_from(response.into_inner().status) {
        Ok(ServingStatus::Serving) => {
            target.print(json!({ "status": "SERVING" }), || println!("SERVING"));
            Ok(())
        }
        Ok(status) => Err(format!("the gateway reports {}", status.as_str_name())),
        Err(_) => Err("the gateway sent an unknown health status".into()),
    }
}
