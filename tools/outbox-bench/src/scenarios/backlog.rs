//! backlog-scaling: whether the gateway slows down as events pile up.
//! - deliver: the same number of events (the small backlog's size) consumed through a
//!   fresh subscription with 4 streams, once with the small backlog waiting and once with
//!   the large one waiting;
//! - publish: Publish, 100 events per call from 8 callers, into an empty outbox table and
//!   into one retaining the large backlog;
//! - sustained: 4 streams consuming for the sustain period (60 s) from a backlog sized to
//!   last, comparing the rate of the last sixth (10 s) with the first.

use serde_json::json;

use super::{Bench, progress};
use crate::{
    consume::GroupOutcome,
    gateway::Gateway,
    measure::{Series, round},
    publish::{self, Writer},
    report::{Report, Table, Target, format_number, format_ratio},
};

const SMALL_BACKLOG: u64 = 100_000;
const LARGE_BACKLOG: u64 = 1_000_000;
const STREAMS: usize = 4;
const PUBLISH_CALLERS: usize = 8;
const PUBLISH_BATCH: usize = 100;
/// The sustained run's backlog: its expected consumption with this much to spare...
const SUSTAIN_HEADROOM: f64 = 1.25;
/// ... but never more than this many times the large backlog.
const SUSTAIN_MAX_BACKLOGS: u64 = 5;

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "backlog-scaling";
    let settings = &bench.settings;
    let small = settings.events(SMALL_BACKLOG);
    let large = settings.events(LARGE_BACKLOG).max(small);
    let publish_run = || {
        publish::run(
            Writer::Gateway,
            settings.timing,
            gateway,
            &bench.database,
            PUBLISH_CALLERS,
            PUBLISH_BATCH,
        )
    };

    progress(scenario, "publishing into an empty outbox table");
    bench.database.truncate_events().await?;
    let publish_empty = publish_run().await?;

    progress(
        scenario,
        format!(
            "delivering with {} events waiting",
            format_number(small as f64)
        ),
    );
    bench.database.truncate_events().await?;
    bench.database.fill_backlog(small).await?;
    let deliver_small = bench
        .deliver(
            gateway,
            "scaling-small",
            1,
            STREAMS,
            small,
            settings.deliver_limit,
        )
        .await?;

    progress(
        scenario,
        format!(
            "delivering the first {} with {} events waiting",
            format_number(small as f64),
            format_number(large as f64)
        ),
    );
    bench.database.fill_backlog(large - small).await?;
    let deliver_large = bench
        .deliver(
            gateway,
            "scaling-large",
            1,
            STREAMS,
            small,
            settings.deliver_limit,
        )
        .await?;

    progress(
        scenario,
        format!(
            "publishing with {} events retained",
            format_number(large as f64)
        ),
    );
    bench.database.settle().await?;
    let publish_retained = publish_run().await?;

    let retained = bench.database.count_events().await?;
    let wanted = (deliver_large.per_second() * settings.sustain.as_secs_f64() * SUSTAIN_HEADROOM)
        .ceil() as u64;
    let backlog = wanted.min(large * SUSTAIN_MAX_BACKLOGS).max(retained);
    if backlog > retained {
        progress(
            scenario,
            format!(
                "growing the backlog to {} events",
                format_number(backlog as f64)
            ),
        );
        bench.database.fill_backlog(backlog - retained).await?;
    } else {
        bench.database.settle().await?;
    }
    progress(
        scenario,
        format!("delivering for {} s", settings.sustain.as_secs_f64()),
    );
    let sustained = bench
        .deliver(
            gateway,
            "scaling-sustained",
            1,
            STREAMS,
            backlog,
            settings.sustain,
        )
        .await?;
    let windows = Windows::of(&sustained.total_samples);

    let deliver_ratio = deliver_large.per_second() / deliver_small.per_second();
    let publish_ratio = publish_retained.per_second() / publish_empty.per_second();
    let mut report = Report::new(
        scenario,
        "delivery and publish rates as the backlog grows, and over a sustained run",
    );
    let mut table = Table::new(
        "rates (events/s)",
        &[
            "measurement",
            "events waiting / retained",
            "events/s",
            "ratio",
        ],
    );
    let waiting = |events: u64| format_number(events as f64);
    table.row(vec![
        format!("deliver {}, 4 streams", waiting(small)),
        waiting(small),
        format_number(deliver_small.per_second()),
        String::new(),
    ]);
    table.row(vec![
        format!("deliver {}, 4 streams", waiting(small)),
        waiting(large),
        format_number(deliver_large.per_second()),
        format_ratio(deliver_ratio),
    ]);
    table.row(vec![
        "publish, 8 callers × 100".into(),
        "0".into(),
        format_number(publish_empty.per_second()),
        String::new(),
    ]);
    table.row(vec![
        "publish, 8 callers × 100".into(),
        waiting(large),
        format_number(publish_retained.per_second()),
        format_ratio(publish_ratio),
    ]);
    table.row(vec![
        format!("sustained, first {}", seconds(windows.seconds)),
        waiting(backlog),
        format_number(windows.first),
        String::new(),
    ]);
    table.row(vec![
        format!("sustained, last {}", seconds(windows.seconds)),
        String::new(),
        format_number(windows.last),
        format_ratio(windows.ratio()),
    ]);
    report.tables.push(table);
    if sustained.completed() {
        report.notes.push(format!(
            "the sustained run drained its backlog of {} events after {:.1} s, before the end of the run",
            waiting(backlog),
            sustained.seconds
        ));
    }
    for (name, outcome) in [("small", &deliver_small), ("large", &deliver_large)] {
        if !outcome.completed() {
            report.notes.push(format!(
                "the deliver run with the {name} backlog was cut off after {:.0} s",
                outcome.seconds
            ));
        }
    }

    report.figure("small_backlog", small);
    report.figure("large_backlog", large);
    report.figure(
        "deliver",
        json!({
            "events": small,
            "small_events_per_s": round(deliver_small.per_second(), 1),
            "large_events_per_s": round(deliver_large.per_second(), 1),
            "ratio": round(deliver_ratio, 3),
        }),
    );
    report.figure(
        "publish",
        json!({
            "empty_events_per_s": round(publish_empty.per_second(), 1),
            "retained_events": large,
            "retained_events_per_s": round(publish_retained.per_second(), 1),
            "ratio": round(publish_ratio, 3),
        }),
    );
    report.figure(
        "sustained",
        json!({
            "backlog": backlog,
            "seconds": round(sustained.seconds, 3),
            "events": sustained.acked(),
            "events_per_s": round(sustained.per_second(), 1),
            "window_s": round(windows.seconds, 3),
            "first_events_per_s": round(windows.first, 1),
            "last_events_per_s": round(windows.last, 1),
            "ratio": round(windows.ratio(), 3),
            "drained": sustained.completed(),
        }),
    );
    report.targets.push(Target::at_least(
        format!("deliver, {} vs {} waiting", waiting(large), waiting(small)),
        deliver_ratio,
        0.8,
        "×",
    ));
    report.targets.push(Target::at_least(
        format!("publish, {} retained vs empty", waiting(large)),
        publish_ratio,
        0.8,
        "×",
    ));
    report.targets.push(Target::at_least(
        "sustained deliver, last vs first window",
        windows.ratio(),
        0.9,
        "×",
    ));

    let series: Vec<Series> = [
        (
            &deliver_small,
            format!("deliver, {} waiting", waiting(small)),
        ),
        (
            &deliver_large,
            format!("deliver, {} waiting", waiting(large)),
        ),
        (&sustained, "sustained deliver".to_owned()),
    ]
    .into_iter()
    .map(|(outcome, label): (&GroupOutcome, String)| outcome.total_samples.clone().labelled(label))
    .chain([
        publish_empty
            .samples
            .clone()
            .labelled("publish, empty table"),
        publish_retained
            .samples
            .clone()
            .labelled(format!("publish, {} retained", waiting(large))),
    ])
    .collect();
    bench.time_chart(
        &mut report,
        "backlog-scaling-throughput.svg",
        "backlog-scaling: events/s",
        "events/s",
        &series,
    )?;
    Ok(report)
}

fn seconds(value: f64) -> String {
    if value >= 10.0 {
        format!("{value:.0} s")
    } else {
        format!("{value:.1} s")
    }
}

/// Mean rates of the first and last sixth of a sampled run.
struct Windows {
    seconds: f64,
    first: f64,
    last: f64,
}

impl Windows {
    fn of(samples: &Series) -> Windows {
        let points = &samples.points;
        if points.is_empty() {
            return Windows {
                seconds: 0.0,
                first: f64::NAN,
                last: f64::NAN,
            };
        }
        let width = (points.len() / 6).max(1);
        let mean =
            |window: &[(f64, f64)]| window.iter().map(|p| p.1).sum::<f64>() / window.len() as f64;
        let interval = points[0].0;
        Windows {
            seconds: width as f64 * interval,
            first: mean(&points[..width]),
            last: mean(&points[points.len() - width..]),
        }
    }

    fn ratio(&self) -> f64 {
        self.last / self.first
    }
}
