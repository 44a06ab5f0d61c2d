//! Smoke test of the benchmark program: `outbox-bench --quick` runs every scenario against
//! a real gateway process and PostgreSQL (at TEST_POSTGRES_URL, like the other tests),
//! exits 0, prints one parsable JSON line per scenario and writes its SVG charts.

use std::{
    io::Read,
    path::Path,
    process::{Child, Command, Stdio},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use outbox_testkit::gateway;
use serde_json::Value;

const SCENARIOS: [&str; 23] = [
    "publish-batch",
    "publish-single",
    "deliver",
    "deliver-scheduled",
    "fanout",
    "fan-in",
    "latency",
    "held-transaction",
    "held-horizon",
    "stalled-consumers",
    "batch-consumer",
    "ordered-backlog",
    "source-outage",
    "many-subscriptions",
    "replicas",
    "backlog-scaling",
    "memory",
    "cost",
    "delivery-cost",
    "push",
    "sink",
    "consume-in-transaction",
    "filtered",
];

/// The quick run takes about a minute on an idle machine; past this it is stuck.
const TIME_LIMIT: Duration = Duration::from_secs(300);

#[test]
fn quick_run_covers_every_scenario() {
    let out = std::env::temp_dir().join(format!(
        "outbox-bench-smoke-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-bench"));
    command
        .arg("--quick")
        .arg("--out")
        .arg(&out)
        .arg("--gateway-bin")
        .arg(
            gateway::binary_beside(Path::new(env!("CARGO_BIN_EXE_outbox-bench")))
                .unwrap_or_else(|error| panic!("{error}")),
        )
        .arg("--postgres-url")
        .arg(outbox_testkit::test_server_url())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().expect("start outbox-bench");
    let stdout = read_in_background(child.stdout.take().expect("piped stdout"));
    let stderr = read_in_background(child.stderr.take().expect("piped stderr"));

    let finished = wait_within(&mut child, TIME_LIMIT);
    let stdout = stdout.join().expect("stdout reader");
    let stderr = stderr.join().expect("stderr reader");
    let status = finished.unwrap_or_else(|| {
        panic!("outbox-bench --quick ran longer than {TIME_LIMIT:?}\nstdout:\n{stdout}\nstderr:\n{stderr}")
    });
    assert!(
        status.success(),
        "outbox-bench --quick failed ({status})\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );

    let reports: Vec<Value> = stdout
        .lines()
        .filter(|line| line.starts_with('{'))
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|error| panic!("bad JSON line {line:?}: {error}"))
        })
        .collect();
    let names: Vec<&str> = reports
        .iter()
        .map(|report| report["scenario"].as_str().expect("a scenario name"))
        .collect();
    assert_eq!(names, SCENARIOS, "one JSON line per scenario, in order");
    let mut measured = 0;
    for report in &reports {
        let scenario = &report["scenario"];
        assert!(report.get("error").is_none(), "{scenario} failed: {report}");
        // A debug build on a shared machine meets few targets: what is checked is
        // that each one is measured and said the same way, not whether it is met.
        let targets = report["targets"].as_array().expect("a list of targets");
        for target in targets {
            assert_target(scenario, target);
            measured += usize::from(!target["value"].is_null());
        }
        let charts = report["charts"].as_array().expect("a list of charts");
        assert!(!charts.is_empty(), "{scenario} draws at least one chart");
        for chart in charts {
            assert_svg(&out.join(chart.as_str().expect("a chart file name")));
        }
    }
    assert!(measured > 0, "no scenario measured any of its targets");
    std::fs::remove_dir_all(&out).expect("remove the chart directory");
}

/// A target as BENCHMARKS.md describes it: a label, the value measured (null when it
/// could not be), the bound with its comparison, and whether the value meets it.
fn assert_target(scenario: &Value, target: &Value) {
    let label = target["target"].as_str().unwrap_or_default();
    assert!(
        !label.is_empty(),
        "{scenario}: a target without a label: {target}"
    );
    let bound = target["bound"].as_str().unwrap_or_default();
    let (comparison, limit) = bound
        .split_once(' ')
        .unwrap_or_else(|| panic!("{scenario}: {label}: bound {bound:?} is not `>= N` or `<= N`"));
    assert!(
        matches!(comparison, ">=" | "<="),
        "{scenario}: {label}: bound {bound:?} compares with {comparison:?}"
    );
    assert!(
        limit.starts_with(|c: char| c.is_ascii_digit()),
        "{scenario}: {label}: bound {bound:?} has no number"
    );
    match (&target["value"], &target["met"]) {
        (Value::Null, Value::Null) => {}
        (Value::Number(value), Value::Bool(_)) => assert!(
            value.as_f64().is_some_and(f64::is_finite),
            "{scenario}: {label}: value {value}"
        ),
        (value, met) => {
            panic!("{scenario}: {label}: value {value} does not go with met {met}")
        }
    }
}

fn assert_svg(path: &Path) {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|error| panic!("cannot read chart {}: {error}", path.display()));
    assert!(
        text.contains("<svg") && text.trim_end().ends_with("</svg>"),
        "{} is not an SVG document",
        path.display()
    );
}

fn read_in_background(mut pipe: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    })
}

/// The exit status, or `None` after interrupting (and, if need be, killing) a run that
/// took longer than `limit`. An interrupted benchmark still drops its database.
fn wait_within(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait for outbox-bench") {
            return Some(status);
        }
        if started.elapsed() > limit {
            // SAFETY: kill(2) on the pid of a child that has not been reaped.
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGINT);
            }
            let interrupted = Instant::now();
            while interrupted.elapsed() < Duration::from_secs(10) {
                if child.try_wait().expect("wait for outbox-bench").is_some() {
                    return None;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
