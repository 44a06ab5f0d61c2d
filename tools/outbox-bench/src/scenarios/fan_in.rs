//! fan-in: the `deliver` drain with the same total backlog split evenly over 1, 2 and 4
//! source databases (services' databases on the benchmark's server), one subscription
//! over all of them, four streams. Each run gets its own gateway whose database holds no
//! events and whose `[[sources]]` are the services' databases, so the runs differ only in
//! how many sources feed the subscription. On one server the ratio to one source shows
//! what spreading the work over sources costs, not scale-out: every source shares the
//! same cores. docs/design.md works out the arithmetic for sources on their own servers.

use serde_json::json;

use super::{Bench, DELIVER_BACKLOG, progress};
use crate::{
    database::BenchDatabase,
    gateway::GatewayLauncher,
    measure::{CpuUse, round},
    report::{Report, Table, format_number},
};

const SOURCE_COUNTS: [usize; 3] = [1, 2, 4];
const STREAMS: usize = 4;

pub async fn run(bench: &Bench) -> anyhow::Result<Report> {
    let home = bench.database.sibling().await?;
    let mut services = Vec::new();
    let result = async {
        bench.launcher.for_database(home.url(), &[]).migrate()?;
        for _ in 0..SOURCE_COUNTS[SOURCE_COUNTS.len() - 1] {
            let service = bench.database.sibling().await?;
            let migrated = bench.launcher.for_database(service.url(), &[]).migrate();
            services.push(service);
            migrated?;
        }
        measure(bench, &home, &services).await
    }
    .await;
    for database in services.iter().chain([&home]) {
        if let Err(error) = database.drop_database().await {
            eprintln!("[fan-in] note: {error:#}");
        }
    }
    result
}

async fn measure(
    bench: &Bench,
    home: &BenchDatabase,
    services: &[BenchDatabase],
) -> anyhow::Result<Report> {
    let scenario = "fan-in";
    let backlog = bench.settings.events(DELIVER_BACKLOG);
    let mut report = Report::new(
        scenario,
        format!(
            "draining {} events split evenly over 1, 2 and 4 source databases, one subscription, {STREAMS} streams",
            format_number(backlog as f64)
        ),
    );
    let mut table = Table::new(
        "delivered and acked",
        &[
            "sources",
            "events",
            "seconds",
            "events/s",
            "÷ 1 source",
            "drained",
            "gateway CPU s/M ev",
        ],
    );
    let mut runs = Vec::new();
    let mut series = Vec::new();
    let mut one_source_rate = None;
    for sources in SOURCE_COUNTS {
        let per_source = backlog / sources as u64;
        progress(
            scenario,
            format!(
                "{sources} source(s): inserting {} events into each",
                format_number(per_source as f64)
            ),
        );
        home.reset().await?;
        for service in services {
            service.reset().await?;
        }
        for service in &services[..sources] {
            service.fill_backlog(per_source).await?;
        }
        let config = write_sources_config(home, &services[..sources])?;
        let launcher = gateway_with_sources(bench, home, &config);
        let outcome = async {
            let gateway = launcher.start(bench.settings.channels).await?;
            let before = gateway.cpu_snapshot();
            let outcome = bench
                .deliver(
                    &gateway,
                    &format!("fan-in-{sources}"),
                    1,
                    STREAMS,
                    per_source * sources as u64,
                    bench.settings.deliver_limit,
                )
                .await?;
            let cpu = CpuUse::between(&before, &gateway.cpu_snapshot());
            gateway.stop().await?;
            anyhow::Ok((outcome, cpu))
        }
        .await;
        let _ = std::fs::remove_file(&config);
        let (outcome, cpu) = outcome?;

        let rate = outcome.per_second();
        let ratio = rate / *one_source_rate.get_or_insert(rate);
        progress(
            scenario,
            format!(
                "{sources} source(s): {} events/s ({ratio:.2}x one source)",
                format_number(rate)
            ),
        );
        table.row(vec![
            sources.to_string(),
            format_number(outcome.acked() as f64),
            format!("{:.2}", outcome.seconds),
            format_number(rate),
            format!("{ratio:.2}"),
            if outcome.completed() { "yes" } else { "no" }.to_owned(),
            format!("{:.1}", cpu.gateway_per_million(outcome.acked())),
        ]);
        series.push(
            outcome
                .total_samples
                .clone()
                .labelled(format!("{sources} source(s)")),
        );
        runs.push(json!({
            "sources": sources,
            "events": outcome.acked(),
            "seconds": round(outcome.seconds, 3),
            "events_per_s": round(rate, 1),
            "to_one_source": round(ratio, 3),
            "drained": outcome.completed(),
            "cpu_s": cpu.to_json(),
            "gateway_cpu_s_per_million": round(cpu.gateway_per_million(outcome.acked()), 2),
        }));
    }
    report.tables.push(table);
    report.notes.push(
        "every source is a database on the same PostgreSQL server and the same cores, so more \
         sources cannot add capacity here; the figures show what splitting the work costs"
            .to_owned(),
    );
    report.figure("backlog", backlog);
    report.figure("runs", runs);
    bench.time_chart(
        &mut report,
        "fan-in-throughput.svg",
        "fan-in: acked events/s with the backlog split over sources",
        "events/s",
        &series,
    )?;
    Ok(report)
}

/// A configuration file naming `services` as `[[sources]]` of the gateway of `home`.
fn write_sources_config(
    home: &BenchDatabase,
    services: &[BenchDatabase],
) -> anyhow::Result<std::path::PathBuf> {
    let mut text = String::new();
    for (index, service) in services.iter().enumerate() {
        text.push_str(&format!(
            "[[sources]]\nname = \"service-{}\"\ndatabase_url = {:?}\n\n",
            index + 1,
            service.url()
        ));
    }
    let path = std::env::temp_dir().join(format!("{}-sources.toml", home.name()));
    std::fs::write(&path, text)?;
    Ok(path)
}

fn gateway_with_sources(
    bench: &Bench,
    home: &BenchDatabase,
    config: &std::path::Path,
) -> GatewayLauncher {
    bench.launcher.for_database(
        home.url(),
        &["--config".to_owned(), config.display().to_string()],
    )
}
