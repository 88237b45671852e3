//! `ax submit`: one task.

use crate::conn::Conn;
use anyhow::{Context, Result};
use ax::{Client, Priority, TaskSpec};
use clap::Args;
use std::time::Duration;

#[derive(Args)]
pub(crate) struct SubmitArgs {
    /// Queue.
    #[arg(long, default_value = "default")]
    queue: String,
    /// Task name.
    #[arg(long)]
    name: String,
    /// JSON payload.
    #[arg(long)]
    json: Option<String>,
    /// high, normal or low.
    #[arg(long)]
    priority: Option<Priority>,
    /// Run after this long, e.g. 90s, 5m.
    #[arg(long, value_parser = humantime::parse_duration)]
    delay: Option<Duration>,
    /// Run at this RFC 3339 time, e.g. 2026-12-01T08:00:00Z or 2026-12-01T09:00:00+01:00.
    #[arg(long, value_parser = parse_time)]
    run_at: Option<String>,
    /// Idempotency key.
    #[arg(long)]
    key: Option<String>,
    /// Attempts in all.
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Hard timeout of one attempt.
    #[arg(long, value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
}

/// Checks the flag as the server will, so a typo fails before anything is sent.
fn parse_time(text: &str) -> Result<String, String> {
    ax::time::parse_rfc3339_ms(text)
        .map(|_| text.to_string())
        .map_err(|e| e.to_string())
}

pub(crate) async fn run(args: SubmitArgs, conn: &Conn) -> Result<()> {
    let client = Client::new(conn.connect().await?);
    let mut spec = TaskSpec::new(args.name);
    if let Some(json) = args.json {
        let value: serde_json::Value =
            serde_json::from_str(&json).context("--json is not valid JSON")?;
        spec = spec.json(&value);
    }
    if let Some(p) = args.priority {
        spec = spec.priority(p);
    }
    if let Some(d) = args.delay {
        spec = spec.delay(d);
    }
    if let Some(at) = args.run_at {
        spec = spec.run_at(at);
    }
    if let Some(k) = args.key {
        spec = spec.idempotency_key(k);
    }
    if let Some(n) = args.max_attempts {
        spec = spec.max_attempts(n);
    }
    if let Some(t) = args.timeout {
        spec = spec.timeout(t);
    }
    let accepted = client.submit(&args.queue, spec).await?;
    println!("{}", serde_json::to_string(&accepted)?);
    Ok(())
}
