//! Runs the `outbox-chaos` program for a short chaos phase: three gateway processes are
//! killed, restarted and cut off from PostgreSQL while events (some scheduled, some
//! expiring) are published, consumed and pushed, consumed exactly once in transactions
//! by consumers that crash, and subscriptions are paused, sought and dead-lettered; no
//! delivery guarantee may break.

use std::{
    io::Read,
    path::Path,
    process::{Child, Command, ExitStatus, Stdio},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use outbox_testkit::gateway;

/// 35 s of chaos and at most a minute of draining, plus starting and stopping three
/// gateways on a loaded machine; past this the run is stuck, not slow.
const TIME_LIMIT: Duration = Duration::from_secs(600);

#[test]
fn no_event_is_lost_duplicated_after_ack_or_reordered_under_chaos() {
    let server = outbox_testkit::test_server_url();
    let gateway = gateway::binary_beside(Path::new(env!("CARGO_BIN_EXE_outbox-chaos")))
        .unwrap_or_else(|error| panic!("{error}"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox-chaos"))
        .args(["--postgres-url", &server])
        .arg("--gateway-bin")
        .arg(&gateway)
        .args(["--duration", "35s", "--drain-timeout", "60s"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run outbox-chaos");
    let stdout = read_in_background(child.stdout.take().expect("piped stdout"));
    let stderr = read_in_background(child.stderr.take().expect("piped stderr"));
    let status = wait_within(&mut child, TIME_LIMIT);
    let stdout = stdout.join().expect("stdout reader");
    let stderr = stderr.join().expect("stderr reader");
    let report = format!("stdout:\n{stdout}\nstderr:\n{stderr}");
    let status =
        status.unwrap_or_else(|| panic!("outbox-chaos ran longer than {TIME_LIMIT:?}\n{report}"));
    assert!(
        status.success(),
        "outbox-chaos exited with {status}\n{report}"
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
        // The features: scheduled and expiring events, dead letters and their requeue, a
        // seek's replay, pauses and pushes.
        "scheduled_delivered",
        "expiring_delivered",
        "expired",
        "dead_letters",
        "requeued_redelivered",
        "seek_replayed",
        "delivered_after_pause",
        "pushed_events",
    ] {
        assert!(totals[key].as_u64() > Some(0), "{key} is 0\n{report}");
    }
    // The exactly-once consumers crashed on both sides of the commit, found events that
    // came again consumed, published reactions, and saw requeued events again.
    let exactly_once = (totals["subscriptions"].as_array().into_iter().flatten())
        .find_map(|subscription| subscription.get("exactly_once"))
        .unwrap_or_else(|| panic!("no exactly-once figures\n{report}"));
    for key in [
        "side_effects",
        "reactions",
        "consumed_again",
        "crashes_before_commit",
        "crashes_after_commit",
        "requeued_redelivered",
    ] {
        assert!(
            exactly_once[key].as_u64() > Some(0),
            "exactly_once.{key} is 0\n{report}"
        );
    }
    assert_eq!(totals["graceful_restarts"], 1, "{report}");
    assert_eq!(totals["pauses"], 2, "{report}");
    assert_eq!(totals["seeks"], 1, "{report}");
}

fn read_in_background(mut pipe: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    })
}

/// The exit status, or `None` after killing a run that took longer than `limit` (its
/// gateway processes are set to die with it).
fn wait_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait for outbox-chaos") {
            return Some(status);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
