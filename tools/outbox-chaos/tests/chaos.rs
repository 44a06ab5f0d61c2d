//! Runs the `outbox-chaos` program for a short chaos phase: three gateway processes are
//! killed, restarted and cut off from PostgreSQL while events are published and
//! consumed, and no delivery guarantee may break.

use std::{path::Path, process::Command};

use outbox_testkit::gateway;

#[test]
fn no_event_is_lost_duplicated_after_ack_or_reordered_under_chaos() {
    let server = outbox_testkit::test_server_url();
    let gateway = gateway::binary_beside(Path::new(env!("CARGO_BIN_EXE_outbox-chaos")))
        .unwrap_or_else(|error| panic!("{error}"));
    let output = Command::new(env!("CARGO_BIN_EXE_outbox-chaos"))
        .args(["--postgres-url", &server])
        .arg("--gateway-bin")
        .arg(&gateway)
        .args(["--duration", "35s", "--drain-timeout", "60s"])
        .output()
        .expect("run outbox-chaos");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let report = format!("stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        output.status.success(),
        "outbox-chaos exited with {}\n{report}",
        output.status
    );
    let totals: serde_json::Value = stdout
        .lines()
        .rev()
        .find(|line| line.starts_with('{'))
        .and_then(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("no JSON totals line\n{report}"));
    assert_eq!(totals["lost"], 0, "{report}");
    assert_eq!(totals["violations"], 0, "{report}");
    assert_eq!(totals["drained"], true, "{report}");
    // The run did inject faults and move events through every path.
    for key in [
        "published_rpc",
        "published_sql",
        "rolled_back",
        "acked",
        "gateway_kills",
        "connection_cuts",
        "identical_republishes",
        "conflicting_republishes",
        "bad_inputs_refused",
        "held_transactions",
        "idle_in_transaction_checks",
        "settled_elsewhere",
        "source_outages",
    ] {
        assert!(totals[key].as_u64() > Some(0), "{key} is 0\n{report}");
    }
    assert_eq!(totals["graceful_restarts"], 1, "{report}");
}
