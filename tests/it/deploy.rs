//! The Kubernetes manifests of deploy/kubernetes: valid against the Kubernetes schemas
//! (scripts/validate-kubernetes.py, run in a Python virtual environment under the target
//! directory holding deploy/kubernetes/requirements.txt, reused while that file is
//! unchanged), and a gateway.toml the gateway itself accepts. A missing python3 (with
//! venv and pip) fails the test; `PYTHON` names another Python 3.

use std::{path::Path, time::Duration};

use crate::common::*;
use outbox_gateway::config::{Config, DEFAULT_DATABASE_URL, LogFormat, Settings};
use tokio::process::Command;

const RUN_TIME: Duration = Duration::from_secs(60);

/// The oldest Kubernetes release the manifests are kept valid for, besides the latest
/// one kubernetes-validate has schemas for; deploy/kubernetes/README.md names both.
const OLDEST_KUBERNETES: &str = "1.29";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[tokio::test]
async fn kubernetes_manifests_validate_against_the_schemas() {
    let packages = requirements("deploy/kubernetes/requirements.txt");
    let packages: Vec<&str> = packages.iter().map(String::as_str).collect();
    let python = python_venv("kubernetes", &packages).await;
    for version in [None, Some(OLDEST_KUBERNETES)] {
        let mut command = Command::new(&python);
        command.arg(repo().join("scripts/validate-kubernetes.py"));
        if let Some(version) = version {
            command.args(["--kubernetes-version", version]);
        }
        // `run` shows the script's output when it fails: each problem names its file.
        let output = run(
            &format!(
                "scripts/validate-kubernetes.py (Kubernetes {})",
                version.unwrap_or("latest")
            ),
            &mut command,
            RUN_TIME,
        )
        .await;
        assert!(output.contains("all manifests are valid"), "{output}");
    }
}

/// The ConfigMap's gateway.toml loads as the gateway loads it (unknown keys, bad token
/// digests or addresses would stop the pods at start), and says what the Deployment
/// relies on.
#[test]
fn the_kubernetes_gateway_toml_is_a_configuration_the_gateway_accepts() {
    let path = repo().join("deploy/kubernetes/base/gateway.toml");
    let config = Config::load(Settings {
        config: Some(path.clone()),
        ..Settings::default()
    })
    .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    // Beyond loopback, which the gateway allows only with tokens.
    assert!(config.listen.ip().is_unspecified(), "{}", config.listen);
    assert!(!config.insecure_no_auth);
    assert!(
        (config.tokens.iter()).any(|token| token.name == "subscriptions-apply"),
        "the subscriptions Job's token is configured"
    );
    // The ports the Deployment declares, probes and the Service target.
    assert_eq!(config.listen.port(), 50051);
    assert_eq!(
        config.metrics_listen.map(|address| address.port()),
        Some(9464)
    );
    assert_eq!(
        config.console_listen.map(|address| address.port()),
        Some(9465)
    );
    assert_eq!(config.log_format, LogFormat::Json);
    // The database URL holds a password: it comes from the Secret, not the ConfigMap.
    assert_eq!(config.database_url, DEFAULT_DATABASE_URL);
}
