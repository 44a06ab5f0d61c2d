//! The Python client package's own tests (`clients/python/tests`, run with pytest), in
//! which the package starts, kills and restarts gateway processes from this build's
//! binary, on a database of their own. The test installs what they need: a virtual
//! environment under the target directory with the pinned packages of
//! `clients/python/requirements-dev.txt` (reused while that file is unchanged), into
//! which it installs the package, editable, on every run. A missing python3 or pip fails
//! the test; `PYTHON` names another Python 3 to build the environment with.

use std::{path::Path, time::Duration};

use tokio::process::Command;

use crate::common::*;

const INSTALL_TIME: Duration = Duration::from_secs(300);
/// The whole suite, which waits out ack deadlines and a gateway restart: generous, for a
/// loaded machine.
const SUITE_TIME: Duration = Duration::from_secs(600);

#[tokio::test]
async fn python_client_passes_its_tests_against_live_gateways() {
    let client = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python");
    let packages = requirements("clients/python/requirements-dev.txt");
    let python = python_venv(
        "python-client",
        &packages.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;
    // On every run, not only with a new environment: the package's metadata (its version,
    // say) may have changed since the environment was made.
    run(
        "pip install --editable clients/python",
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--editable",
            ])
            .arg(&client),
        INSTALL_TIME,
    )
    .await;

    let database = TestDatabase::create().await;
    let output = run(
        "pytest clients/python/tests",
        Command::new(&python)
            .args(["-m", "pytest", "tests", "-q", "-p", "no:cacheprovider"])
            .current_dir(&client)
            .env("OUTBOX_GATEWAY_BIN", env!("CARGO_BIN_EXE_outbox-gateway"))
            .env("OUTBOX_TEST_DATABASE_URL", database.url())
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("RUST_LOG"),
        SUITE_TIME,
    )
    .await;
    println!("{output}");
    assert!(
        output.contains(" passed") && !output.contains(" skipped"),
        "pytest ran no tests, or skipped some:\n{output}"
    );
}
