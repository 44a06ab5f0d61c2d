//! SVG charts: throughput (or any quantity) over time, one line per run, and latency
//! distributions drawn as percentile curves (x: percentile on a 90% / 99% / 99.9% ...
//! scale, y: latency on a log scale), the usual way to show an HDR histogram.

use std::path::Path;

use anyhow::anyhow;
use hdrhistogram::Histogram;
use plotters::prelude::*;

use crate::measure::Series;

const SIZE: (u32, u32) = (960, 540);

/// Line colours, distinct on white (the Tableau 10 palette).
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

fn color(index: usize) -> RGBColor {
    COLORS[index % COLORS.len()]
}

/// A line chart of `series` over time (x in seconds).
pub fn time_chart(
    path: &Path,
    title: &str,
    y_label: &str,
    series: &[Series],
) -> anyhow::Result<()> {
    let drawn = |error| anyhow!("cannot draw {}: {error}", path.display());
    let x_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .fold(0.0, f64::max);
    let x_max = if x_max > 0.0 { x_max } else { 1.0 };
    let y_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .filter(|y| y.is_finite())
        .fold(0.0, f64::max)
        .max(1.0)
        * 1.1;

    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(drawn)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(84)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(drawn)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc(y_label)
        .y_label_formatter(&|y| format_quantity(*y))
        .draw()
        .map_err(drawn)?;
    for (index, line) in series.iter().enumerate() {
        let color = color(index);
        chart
            .draw_series(LineSeries::new(
                line.points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(drawn)?
            .label(line.label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    draw_legend(&mut chart).map_err(drawn)?;
    root.present().map_err(drawn)?;
    Ok(())
}

/// Percentile curves of latency histograms (recorded in µs), one per label.
pub fn latency_chart(
    path: &Path,
    title: &str,
    curves: &[(String, &Histogram<u64>)],
) -> anyhow::Result<()> {
    let drawn = |error| anyhow!("cannot draw {}: {error}", path.display());
    let curves: Vec<(&String, &Histogram<u64>)> = curves
        .iter()
        .filter(|(_, histogram)| !histogram.is_empty())
        .map(|(label, histogram)| (label, *histogram))
        .collect();
    // The log axis starts at the lowest first percentile but not below 50 µs, so
    // near-zero values (deliveries that overtook their call's reply) do not squash the
    // rest of the chart; lower points are drawn on its floor.
    let y_min = curves
        .iter()
        .map(|(_, histogram)| histogram.value_at_quantile(0.01) as f64 / 1000.0)
        .fold(f64::INFINITY, f64::min)
        .max(0.05)
        * 0.8;
    let curves: Vec<(&String, Vec<(f64, f64)>)> = curves
        .into_iter()
        .map(|(label, histogram)| {
            let points = percentile_curve(histogram)
                .into_iter()
                .map(|(x, y)| (x, y.max(y_min)))
                .collect();
            (label, points)
        })
        .collect();
    let x_max = curves
        .iter()
        .flat_map(|(_, points)| points.last().map(|p| p.0))
        .fold(1.0, f64::max);
    let y_max = curves
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.1))
        .fold(0.0, f64::max);
    let (y_min, y_max) = if y_max > 0.0 {
        (y_min, (y_max * 1.25).max(y_min * 2.0))
    } else {
        (0.01, 1.0)
    };

    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(drawn)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(84)
        .build_cartesian_2d(0.0..x_max, (y_min..y_max).log_scale())
        .map_err(drawn)?;
    chart
        .configure_mesh()
        .x_desc("percentile")
        .y_desc("latency (ms)")
        .x_labels(x_max.ceil() as usize + 1)
        .x_label_formatter(&|x| format_percentile(*x))
        .y_label_formatter(&|y| format_milliseconds(*y))
        .draw()
        .map_err(drawn)?;
    for (index, (label, points)) in curves.iter().enumerate() {
        let color = color(index);
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(drawn)?
            .label(label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    draw_legend(&mut chart).map_err(drawn)?;
    root.present().map_err(drawn)?;
    Ok(())
}

fn draw_legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
}

/// (x, latency in ms) with x = -log10(1 - q), so 90%, 99%, 99.9% ... are evenly spaced;
/// up to the resolution the sample count supports, then the maximum.
fn percentile_curve(histogram: &Histogram<u64>) -> Vec<(f64, f64)> {
    const STEPS_PER_DECADE: u32 = 40;
    let x_last = (histogram.len() as f64).log10().clamp(1.0, 6.0);
    let steps = (x_last * f64::from(STEPS_PER_DECADE)).ceil() as u32;
    let mut points: Vec<(f64, f64)> = (0..=steps)
        .map(|step| {
            let x = (f64::from(step) / f64::from(STEPS_PER_DECADE)).min(x_last);
            let quantile = 1.0 - 10f64.powf(-x);
            (x, histogram.value_at_quantile(quantile) as f64 / 1000.0)
        })
        .collect();
    points.push((x_last, histogram.max() as f64 / 1000.0));
    points
}

fn format_percentile(x: f64) -> String {
    let percent = 100.0 * (1.0 - 10f64.powf(-x));
    let decimals = (x.round() as i32 - 2).clamp(0, 4) as usize;
    format!("{percent:.decimals$}%")
}

fn format_quantity(value: f64) -> String {
    if value >= 1e6 {
        format!("{:.1}M", value / 1e6)
    } else if value >= 1e4 {
        format!("{:.0}k", value / 1e3)
    } else if value >= 1e3 {
        format!("{:.1}k", value / 1e3)
    } else {
        format!("{value:.0}")
    }
}

fn format_milliseconds(value: f64) -> String {
    if value >= 10.0 {
        format!("{value:.0}")
    } else if value >= 1.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}
