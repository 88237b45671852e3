//! How the `ax` command prints: aligned tables for people (the default), JSON for
//! programs (`-o json`).

use clap::ValueEnum;

/// `-o` / `--output`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub(crate) enum Output {
    /// Aligned columns.
    #[default]
    Table,
    /// JSON (one document).
    Json,
}

/// Prints rows under a header, each column as wide as its widest cell.
pub(crate) fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let last = cells.len().saturating_sub(1);
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  "));
            }
        }
        println!("{}", out.trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

/// A time as "12s ago" / "in 3m" (ms since the epoch), or "-".
pub(crate) fn ago(ms: Option<u64>) -> String {
    let Some(ms) = ms else { return "-".into() };
    let now = ax::time::now_ms();
    let (d, future) = if ms > now {
        (ms - now, true)
    } else {
        (now - ms, false)
    };
    let s = d / 1000;
    let text = match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m", s / 60),
        3600..=86_399 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    };
    if future {
        format!("in {text}")
    } else {
        format!("{text} ago")
    }
}

/// Prints a value as pretty JSON.
pub(crate) fn json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}
