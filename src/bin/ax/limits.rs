//! `ax limits …`: rate limits and concurrency caps shared by every worker.

use crate::conn::Conn;
use anyhow::Result;
use ax::Client;
use clap::Subcommand;
use serde_json::json;

#[derive(Subcommand)]
pub(crate) enum LimitsCommand {
    /// Create or replace a limit (applies within a second on every worker, to queued tasks
    /// too).
    Set {
        /// Limit name (unique in its queue).
        name: String,
        /// The queue it limits.
        #[arg(long)]
        queue: String,
        /// Only tasks of this name (default: every task of the queue).
        #[arg(long)]
        task: Option<String>,
        /// One limit per task `limit_key` (a customer, a tenant) instead of one for all.
        #[arg(long)]
        per_key: bool,
        /// Only tasks with this limit key.
        #[arg(long)]
        key: Option<String>,
        /// Starts per second.
        #[arg(long)]
        rate: Option<f64>,
        /// Starts allowed at once above the rate (default: the rate rounded up).
        #[arg(long)]
        burst: Option<u32>,
        /// Attempts running at once (1: a singleton).
        #[arg(long)]
        concurrency: Option<u32>,
    },
    /// Print one limit.
    Get {
        /// Limit name.
        name: String,
        /// Its queue.
        #[arg(long)]
        queue: String,
    },
    /// All limits (of one queue).
    List {
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
    },
    /// Remove a limit.
    Delete {
        /// Limit name.
        name: String,
        /// Its queue.
        #[arg(long)]
        queue: String,
    },
}

pub(crate) async fn run(command: LimitsCommand, conn: &Conn) -> Result<()> {
    let client = Client::new(conn.connect().await?);
    match command {
        LimitsCommand::Set {
            name,
            queue,
            task,
            per_key,
            key,
            rate,
            burst,
            concurrency,
        } => {
            let def = json!({"name": name, "queue": queue, "task": task, "per_key": per_key, "key": key,
                             "rate": rate, "burst": burst, "concurrency": concurrency});
            let stored = client.limits("put", &def).await?;
            println!("{}", serde_json::to_string(&stored)?);
        }
        LimitsCommand::Get { name, queue } => {
            let def = client
                .limits("get", &json!({"queue": queue, "name": name}))
                .await?;
            println!("{}", serde_json::to_string_pretty(&def)?);
        }
        LimitsCommand::List { queue } => {
            let all = client.limits("list", &json!({ "queue": queue })).await?;
            println!(
                "{:<16} {:<24} {:<16} {:<8} {:>10} {:>6} {:>12}",
                "QUEUE", "NAME", "TASK", "PER_KEY", "RATE/S", "BURST", "CONCURRENCY"
            );
            for d in all.as_array().into_iter().flatten() {
                let or_dash = |v: &serde_json::Value| {
                    if v.is_null() {
                        "-".to_string()
                    } else {
                        v.to_string()
                    }
                };
                println!(
                    "{:<16} {:<24} {:<16} {:<8} {:>10} {:>6} {:>12}",
                    d["queue"].as_str().unwrap_or("?"),
                    d["name"].as_str().unwrap_or("?"),
                    d["task"].as_str().unwrap_or("*"),
                    d["per_key"].as_bool().unwrap_or(false),
                    or_dash(&d["rate"]),
                    or_dash(&d["burst"]),
                    or_dash(&d["concurrency"])
                );
            }
        }
        LimitsCommand::Delete { name, queue } => {
            client
                .limits("delete", &json!({"queue": queue, "name": name}))
                .await?;
            println!("deleted limit {name} of queue {queue}");
        }
    }
    Ok(())
}
