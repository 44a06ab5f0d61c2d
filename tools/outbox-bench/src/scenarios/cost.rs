//! cost: CPU seconds the gateway spends per million events published (Publish with 100
//! events per call from 8 callers, and with one event per call from 32 callers) and per
//! million delivered (4 streams draining the deliver backlog). PostgreSQL's and the
//! benchmark's own CPU over the same windows are shown beside it: on a small machine the
//! three compete for the same cores.

use serde_json::json;

use super::{Bench, DELIVER_BACKLOG, insert_backlog, progress};
use crate::{
    gateway::Gateway,
    measure::{CpuUse, Series, round},
    publish::{self, Writer},
    report::{Report, Table, format_number},
};

struct Cost {
    workload: String,
    events: u64,
    seconds: f64,
    cpu: CpuUse,
}

impl Cost {
    fn per_million(&self, seconds: f64) -> f64 {
        if self.events == 0 {
            f64::NAN
        } else {
            seconds / self.events as f64 * 1e6
        }
    }

    fn to_json(&self) -> serde_json::Value {
        json!({
            "workload": self.workload,
            "events": self.events,
            "seconds": round(self.seconds, 3),
            "cpu_s": self.cpu.to_json(),
            "gateway_cpu_s_per_million": round(self.per_million(self.cpu.gateway), 2),
            "postgres_cpu_s_per_million": round(self.per_million(self.cpu.postgres), 2),
            "bench_cpu_s_per_million": round(self.per_million(self.cpu.bench), 2),
        })
    }
}

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "cost";
    let settings = &bench.settings;
    let mut costs = Vec::new();
    let mut series: Vec<Series> = Vec::new();

    for (workload, callers, batch) in [
        ("publish, 8 callers × 100 events", 8, 100),
        ("publish, 32 callers × 1 event", 32, 1),
    ] {
        bench.database.truncate_events().await?;
        let run = publish::run(
            Writer::Gateway,
            settings.timing,
            gateway,
            &bench.database,
            callers,
            batch,
        )
        .await?;
        progress(
            scenario,
            format!("{workload}: {} events/s", format_number(run.per_second())),
        );
        series.push(run.samples.clone().labelled(workload));
        costs.push(Cost {
            workload: workload.to_owned(),
            events: run.events,
            seconds: run.seconds,
            cpu: run.cpu,
        });
    }

    let backlog = settings.events(DELIVER_BACKLOG);
    bench.database.truncate_events().await?;
    insert_backlog(bench, scenario, backlog).await?;
    let before = gateway.cpu_snapshot();
    let outcome = bench
        .deliver(gateway, "cost", 1, 4, backlog, settings.deliver_limit)
        .await?;
    let cpu = CpuUse::between(&before, &gateway.cpu_snapshot());
    let workload = "deliver, 4 streams";
    progress(
        scenario,
        format!(
            "{workload}: {} events/s",
            format_number(outcome.per_second())
        ),
    );
    series.push(outcome.total_samples.clone().labelled(workload));
    costs.push(Cost {
        workload: workload.to_owned(),
        events: outcome.acked(),
        seconds: outcome.seconds,
        cpu,
    });

    let mut report = Report::new(scenario, "CPU seconds per million events");
    let mut table = Table::new(
        "CPU seconds per million events",
        &["workload", "events", "gateway", "postgres", "bench"],
    );
    for cost in &costs {
        table.row(vec![
            cost.workload.clone(),
            format_number(cost.events as f64),
            format!("{:.1}", cost.per_million(cost.cpu.gateway)),
            format!("{:.1}", cost.per_million(cost.cpu.postgres)),
            format!("{:.1}", cost.per_million(cost.cpu.bench)),
        ]);
    }
    report.tables.push(table);
    report.notes.push(
        "postgres counts every process named postgres on this machine over the same windows"
            .to_owned(),
    );
    let per_million = |index: usize| round(costs[index].per_million(costs[index].cpu.gateway), 2);
    report.figure("gateway_cpu_s_per_million_published_batch", per_million(0));
    report.figure("gateway_cpu_s_per_million_published_single", per_million(1));
    report.figure("gateway_cpu_s_per_million_delivered", per_million(2));
    report.figure("runs", costs.iter().map(Cost::to_json).collect::<Vec<_>>());
    bench.time_chart(
        &mut report,
        "cost-throughput.svg",
        "cost: events/s of the measured runs",
        "events/s",
        &series,
    )?;
    Ok(report)
}
