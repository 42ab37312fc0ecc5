//! Rows, and how they are shown: a table per group for people, JSON Lines for machines.
//!
//! Every row is one JSON object on one line: `group`, `name`, `status` (`ok`, `FAIL`,
//! `OOM`, `ERR`, `SKIP`), `note`, then the row's fields (numbers, or null where a figure
//! does not exist). With `--json` these lines go to stdout as each row completes and the
//! tables to stderr; without it, the tables go to stdout. Progress always goes to stderr.

use serde_json::Value;
use std::io::Write;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Checked and timed.
    Ok,
    /// Its output did not match the reference: not timed.
    Fail,
    /// Ran out of device memory (recorded, the run goes on).
    Oom,
    /// Another error.
    Err,
    /// Not run (unsupported shape, over the time budget).
    Skip,
}

impl Status {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Fail => "FAIL",
            Self::Oom => "OOM",
            Self::Err => "ERR",
            Self::Skip => "SKIP",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Row {
    pub group: &'static str,
    /// Rows of one group are shown in one table per `table` (e.g. e2e's prefill and decode).
    pub table: &'static str,
    pub name: String,
    pub status: Status,
    pub note: String,
    pub fields: Vec<(&'static str, Value)>,
}

impl Row {
    pub fn new(group: &'static str, name: &str) -> Self {
        Self {
            group,
            table: "",
            name: name.to_string(),
            status: Status::Ok,
            note: String::new(),
            fields: vec![],
        }
    }

    /// A number (NaN and infinities become null).
    pub fn num(mut self, key: &'static str, v: f64) -> Self {
        let v = serde_json::Number::from_f64(v)
            .map(Value::Number)
            .unwrap_or(Value::Null);
        self.fields.push((key, v));
        self
    }

    /// A number, or null.
    pub fn opt(self, key: &'static str, v: Option<f64>) -> Self {
        self.num(key, v.unwrap_or(f64::NAN))
    }

    pub fn text(mut self, key: &'static str, v: impl Into<String>) -> Self {
        self.fields.push((key, Value::String(v.into())));
        self
    }

    pub fn table(mut self, table: &'static str) -> Self {
        self.table = table;
        self
    }

    pub fn status(mut self, status: Status, note: impl Into<String>) -> Self {
        self.status = status;
        self.note = note.into();
        self
    }

    pub fn get(&self, key: &str) -> Option<f64> {
        self.fields
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, v)| v.as_f64())
    }

    pub fn to_json(&self) -> Value {
        let mut m = serde_json::Map::new();
        m.insert("group".into(), Value::String(self.group.into()));
        m.insert("name".into(), Value::String(self.name.clone()));
        m.insert("status".into(), Value::String(self.status.as_str().into()));
        m.insert("note".into(), Value::String(self.note.clone()));
        for (k, v) in &self.fields {
            m.insert((*k).into(), v.clone());
        }
        Value::Object(m)
    }
}

/// Every row of the run, in order.
pub struct Report {
    pub json: bool,
    pub rows: Vec<Row>,
    printed: Vec<String>,
    start: Instant,
}

impl Report {
    pub fn new(json: bool) -> Self {
        Self {
            json,
            rows: vec![],
            printed: vec![],
            start: Instant::now(),
        }
    }

    pub fn elapsed_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Record a row: a progress line to stderr, and its JSON line to stdout with `--json`.
    pub fn push(&mut self, row: Row) {
        let brief: Vec<String> = row
            .fields
            .iter()
            .map(|(k, v)| format!("{k}={}", fmt_value(v)))
            .collect();
        let note = if row.note.is_empty() {
            String::new()
        } else {
            format!(" ({})", row.note)
        };
        eprintln!(
            "[{:6.1}s] {} {}{note}: {}",
            self.elapsed_s(),
            row.status.as_str(),
            row.name,
            brief.join(" ")
        );
        if self.json {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{}", row.to_json());
            let _ = out.flush();
        }
        self.rows.push(row);
    }

    /// The tables of one group (stdout, or stderr with `--json`), once.
    pub fn print_group(&mut self, group: &str) {
        if self.printed.iter().any(|g| g == group) {
            return;
        }
        let mut tables: Vec<&'static str> = vec![];
        for r in self.rows.iter().filter(|r| r.group == group) {
            if !tables.contains(&r.table) {
                tables.push(r.table);
            }
        }
        let mut text = String::new();
        for t in tables {
            let rows: Vec<&Row> = self
                .rows
                .iter()
                .filter(|r| r.group == group && r.table == t)
                .collect();
            let title = if t.is_empty() {
                group.to_string()
            } else {
                format!("{group}: {t}")
            };
            text.push_str(&table(&title, group, &rows));
        }
        if text.is_empty() {
            return;
        }
        if self.json {
            eprintln!("{text}");
        } else {
            println!("{text}");
            let _ = std::io::stdout().flush();
        }
        self.printed.push(group.to_string());
    }
}

fn fmt_value(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        Value::Number(n) => match n.as_f64() {
            Some(x) => fmt_num(x),
            None => n.to_string(),
        },
        v => v.to_string(),
    }
}

/// Numbers with three significant figures or so; tiny values in scientific notation.
pub fn fmt_num(x: f64) -> String {
    let a = x.abs();
    if (x == x.trunc() && a < 1e9) || a >= 100.0 {
        format!("{x:.0}")
    } else if a >= 10.0 {
        format!("{x:.1}")
    } else if a >= 0.1 {
        format!("{x:.2}")
    } else if a >= 0.001 {
        format!("{x:.4}")
    } else {
        format!("{x:.1e}")
    }
}

fn table(title: &str, group: &str, rows: &[&Row]) -> String {
    let mut keys: Vec<&'static str> = vec![];
    for r in rows {
        for (k, _) in &r.fields {
            if !keys.contains(k) {
                keys.push(k);
            }
        }
    }
    let mut header: Vec<String> = vec!["name".into()];
    header.extend(keys.iter().map(|k| k.to_string()));
    header.push("status".into());
    let prefix = format!("{group}/");
    let mut cells: Vec<Vec<String>> = vec![header];
    for r in rows {
        let mut line = vec![r.name.strip_prefix(&prefix).unwrap_or(&r.name).to_string()];
        for k in &keys {
            let v = r
                .fields
                .iter()
                .find(|(kk, _)| kk == k)
                .map(|(_, v)| fmt_value(v));
            line.push(v.unwrap_or_else(|| "-".into()));
        }
        let note = if r.note.is_empty() {
            String::new()
        } else {
            format!(" {}", r.note)
        };
        line.push(format!("{}{note}", r.status.as_str()));
        cells.push(line);
    }
    let n_cols = cells[0].len();
    let widths: Vec<usize> = (0..n_cols)
        .map(|c| {
            cells
                .iter()
                .map(|l| l[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = format!("\n## {title}\n");
    for (i, line) in cells.iter().enumerate() {
        let padded: Vec<String> = line
            .iter()
            .enumerate()
            .map(|(c, s)| {
                if c + 1 == n_cols {
                    s.clone()
                } else {
                    format!("{s:<w$}", w = widths[c])
                }
            })
            .collect();
        out.push_str(&format!("| {} |\n", padded.join(" | ")));
        if i == 0 {
            let rule: Vec<String> = widths.iter().map(|w| "-".repeat((*w).max(3))).collect();
            out.push_str(&format!("|-{}-|\n", rule.join("-|-")));
        }
    }
    out
}
