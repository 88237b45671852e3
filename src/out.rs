//! How the `ax` command prints: aligned tables for people (the default), JSON for
//! programs (`-o json`); errors as one line naming what was refused (never a backtrace);
//! and nothing more, quietly and with success, once its reader has gone (`ax … | head`).

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
    let now = ax_core::time::now_ms();
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

/// An error as the operator reads it: one line, its causes joined by ": ", a refusal by
/// what it refused — `invalid concurrency: must be 1..=1000` (the field, which is the
/// option of the same name) rather than the wire's `InvalidField: …` — and never a
/// backtrace, whatever `RUST_BACKTRACE` says.
pub(crate) fn error_text(error: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in error.chain() {
        let refusal = match cause.downcast_ref::<ax_sdk::ClientError>() {
            Some(ax_sdk::ClientError::Refused(w)) => Some(w),
            _ => cause.downcast_ref::<ax_core::protocol::WireError>(),
        };
        if let Some(w) = refusal {
            parts.push(refusal_text(w));
            break; // its source is the refusal itself
        }
        parts.push(cause.to_string());
    }
    parts.join(": ")
}

/// A refusal: `invalid <field>: <why>`, or `<code>: <why>` (`not_found: no limit …`).
pub(crate) fn refusal_text(w: &ax_core::protocol::WireError) -> String {
    match &w.field {
        Some(field) => format!("invalid {field}: {}", w.message),
        None => format!("{}: {}", w.code.as_str(), w.message),
    }
}

/// True if the error comes from writing to a reader that has gone (a broken pipe).
pub(crate) fn broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Makes a print to a reader that has gone (`println!` panics on a broken pipe) end the
/// process quietly with success, as `ax … | head` expects; any other panic is reported
/// as before.
pub(crate) fn quiet_on_broken_pipe() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let text = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        let pipe = std::io::Error::from(std::io::ErrorKind::BrokenPipe).to_string();
        if text.starts_with("failed printing to stdout")
            && (text.contains("Broken pipe")
                || text.contains("os error 32")
                || text.contains(&pipe))
        {
            std::process::exit(0);
        }
        report(info);
    }));
}
