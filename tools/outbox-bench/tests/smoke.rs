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

const SCENARIOS: [&str; 16] = [
    "publish-batch",
    "publish-single",
    "deliver",
    "deliver-scheduled",
    "fanout",
    "fan-in",
    "latency",
    "held-transaction",
    "stalled-consumers",
    "source-outage",
    "many-subscriptions",
    "replicas",
    "backlog-scaling",
    "memory",
    "cost",
    "push",
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
    for report in &reports {
        let scenario = &report["scenario"];
        assert!(report.get("error").is_none(), "{scenario} failed: {report}");
        assert!(report["targets"].is_array(), "{scenario} lists its targets");
        let charts = report["charts"].as_array().expect("a list of charts");
        assert!(!charts.is_empty(), "{scenario} draws at least one chart");
        for chart in charts {
            assert_svg(&out.join(chart.as_str().expect("a chart file name")));
        }
    }
    std::fs::remove_dir_all(&out).expect("remove the chart directory");
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
