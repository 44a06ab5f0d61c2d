//! What a scenario reports: human-readable tables and target verdicts on stdout, then one
//! JSON line (`{"scenario": ..., ...figures}`) that tools can pick out of the output.

use serde_json::{Map, Value, json};

use crate::measure::{LatencySummary, round};

/// The report of one scenario.
pub struct Report {
    pub scenario: &'static str,
    /// One line saying what was measured.
    pub title: String,
    pub tables: Vec<Table>,
    pub targets: Vec<Target>,
    pub notes: Vec<String>,
    /// Figures for the JSON line (the scenario name, targets and charts are added).
    pub figures: Map<String, Value>,
    /// File names of the charts written.
    pub charts: Vec<String>,
}

impl Report {
    pub fn new(scenario: &'static str, title: impl Into<String>) -> Report {
        Report {
            scenario,
            title: title.into(),
            tables: Vec::new(),
            targets: Vec::new(),
            notes: Vec::new(),
            figures: Map::new(),
            charts: Vec::new(),
        }
    }

    pub fn figure(&mut self, key: &str, value: impl Into<Value>) {
        self.figures.insert(key.to_owned(), value.into());
    }

    /// The human-readable part.
    pub fn render(&self) -> String {
        let mut text = format!("\n== {} — {}\n", self.scenario, self.title);
        for table in &self.tables {
            text.push('\n');
            text.push_str(&table.render());
        }
        if !self.targets.is_empty() {
            text.push_str("\ntargets:\n");
            for target in &self.targets {
                text.push_str(&format!("  {}\n", target.render()));
            }
        }
        for note in &self.notes {
            text.push_str(&format!("note: {note}\n"));
        }
        if !self.charts.is_empty() {
            text.push_str(&format!("charts: {}\n", self.charts.join(", ")));
        }
        text
    }

    /// The machine-readable line, `scenario` first.
    pub fn json_line(&self) -> String {
        let mut object = self.figures.clone();
        object.insert(
            "targets".into(),
            self.targets.iter().map(Target::to_json).collect(),
        );
        object.insert("charts".into(), self.charts.clone().into());
        scenario_first(self.scenario, object)
    }
}

/// The JSON line of a scenario that failed.
pub fn error_line(scenario: &str, error: &anyhow::Error) -> String {
    let mut object = Map::new();
    object.insert("error".into(), format!("{error:#}").into());
    scenario_first(scenario, object)
}

/// `{"scenario": ..., rest}`: JSON maps here sort their keys, so the scenario name is
/// written ahead of them for people scanning the output.
fn scenario_first(scenario: &str, rest: Map<String, Value>) -> String {
    let rest = Value::Object(rest).to_string();
    let scenario = Value::from(scenario);
    match rest.strip_prefix('{').filter(|fields| *fields != "}") {
        Some(fields) => format!(r#"{{"scenario":{scenario},{fields}"#),
        None => format!(r#"{{"scenario":{scenario}}}"#),
    }
}

/// A text table with a title and right-aligned numeric columns.
pub struct Table {
    pub title: String,
    pub headers: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(title: impl Into<String>, headers: &[&str]) -> Table {
        Table {
            title: title.into(),
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn render(&self) -> String {
        let columns = self.headers.len();
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let line = |cells: &[String]| -> String {
            let mut text = String::from(" ");
            for (index, width) in widths.iter().enumerate().take(columns) {
                let cell = cells.get(index).map_or("", String::as_str);
                let padding = width - cell.chars().count();
                if index == 0 {
                    text.push_str(&format!(" {cell}{}", " ".repeat(padding)));
                } else {
                    text.push_str(&format!("  {}{cell}", " ".repeat(padding)));
                }
            }
            text.push('\n');
            text
        };
        let mut text = format!("{}\n", self.title);
        text.push_str(&line(&self.headers));
        let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
        text.push_str(&line(&rule));
        for row in &self.rows {
            text.push_str(&line(row));
        }
        text
    }
}

/// A performance target from the project's performance issue: reported as met or not,
/// never a reason to fail.
pub struct Target {
    pub label: String,
    /// None when the figure could not be measured.
    pub value: Option<f64>,
    pub bound: Bound,
    pub unit: &'static str,
}

#[derive(Debug, Clone, Copy)]
pub enum Bound {
    AtLeast(f64),
    AtMost(f64),
}

impl Target {
    pub fn at_least(
        label: impl Into<String>,
        value: f64,
        limit: f64,
        unit: &'static str,
    ) -> Target {
        Target::new(label, value, Bound::AtLeast(limit), unit)
    }

    pub fn at_most(label: impl Into<String>, value: f64, limit: f64, unit: &'static str) -> Target {
        Target::new(label, value, Bound::AtMost(limit), unit)
    }

    fn new(label: impl Into<String>, value: f64, bound: Bound, unit: &'static str) -> Target {
        Target {
            label: label.into(),
            value: value.is_finite().then_some(value),
            bound,
            unit,
        }
    }

    pub fn met(&self) -> Option<bool> {
        let value = self.value?;
        Some(match self.bound {
            Bound::AtLeast(limit) => value >= limit,
            Bound::AtMost(limit) => value <= limit,
        })
    }

    fn bound_text(&self) -> String {
        match self.bound {
            Bound::AtLeast(limit) => format!(">= {}{}", format_number(limit), self.unit),
            Bound::AtMost(limit) => format!("<= {}{}", format_number(limit), self.unit),
        }
    }

    /// `label: value (target bound) — verdict`.
    pub fn render(&self) -> String {
        let value = self.value.map_or("not measured".to_owned(), |v| {
            format!("{}{}", format_number(v), self.unit)
        });
        let verdict = match self.met() {
            Some(true) => "met",
            Some(false) => "NOT met",
            None => "not measured",
        };
        format!(
            "{}: {value} (target {}) — {verdict}",
            self.label,
            self.bound_text()
        )
    }

    fn to_json(&self) -> Value {
        json!({
            "target": self.label,
            "value": self.value.map(|v| round(v, 3)),
            "bound": self.bound_text(),
            "met": self.met(),
        })
    }
}

/// A number for people: thousands separated, two decimals below 100.
pub fn format_number(value: f64) -> String {
    if !value.is_finite() {
        return "-".to_owned();
    }
    if value.abs() < 100.0 && value.fract() != 0.0 {
        return format!("{value:.2}");
    }
    let rounded = value.round() as i64;
    let digits = rounded.unsigned_abs().to_string();
    let mut grouped = String::new();
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    if rounded < 0 {
        grouped.insert(0, '-');
    }
    grouped
}

/// A ratio for people.
pub fn format_ratio(value: f64) -> String {
    if value.is_finite() {
        format!("{value:.2}")
    } else {
        "-".to_owned()
    }
}

/// Latency columns: p50, p90, p99, p99.9, max (ms).
pub fn latency_cells(summary: &LatencySummary) -> Vec<String> {
    [
        summary.p50,
        summary.p90,
        summary.p99,
        summary.p999,
        summary.max,
    ]
    .iter()
    .map(|ms| {
        if ms.is_finite() {
            format!("{ms:.2}")
        } else {
            "-".to_owned()
        }
    })
    .collect()
}

pub const LATENCY_HEADERS: [&str; 5] = ["p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_numbers_for_people() {
        assert_eq!(format_number(1234567.4), "1,234,567");
        assert_eq!(format_number(999.0), "999");
        assert_eq!(format_number(0.626), "0.63");
        assert_eq!(format_number(f64::NAN), "-");
    }

    #[test]
    fn puts_the_scenario_first() {
        let mut report = Report::new("deliver", "title");
        report.figure("backlog", 5);
        let line = report.json_line();
        assert!(line.starts_with(r#"{"scenario":"deliver","#), "{line}");
        let value: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["backlog"], 5);
        let error = error_line("fanout", &anyhow::anyhow!("boom"));
        let value: Value = serde_json::from_str(&error).unwrap();
        assert_eq!(value["scenario"], "fanout");
        assert_eq!(value["error"], "boom");
    }

    #[test]
    fn judges_targets() {
        assert_eq!(Target::at_least("r", 0.7, 0.6, "").met(), Some(true));
        assert_eq!(Target::at_most("p", 20.0, 15.0, " ms").met(), Some(false));
        assert_eq!(Target::at_most("p", f64::NAN, 15.0, " ms").met(), None);
    }
}
