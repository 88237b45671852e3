//! `ax queue list|pause|resume`.

use crate::conn::Conn;
use crate::out::{self, Output};
use anyhow::Result;
use ax_sdk::Client;
use clap::Subcommand;

#[derive(Subcommand)]
pub(crate) enum QueueCommand {
    /// Every declared queue and every queue with tasks: paused or not (by whom, why,
    /// since when), ready tasks per priority, tasks by state.
    List,
    /// Stop workers taking the queue's tasks (running ones finish; submits are accepted).
    Pause {
        /// Queue.
        queue: String,
        /// Why (shown by `ax queue list`).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Let workers take the queue's tasks again.
    Resume {
        /// Queue.
        queue: String,
    },
}

pub(crate) async fn run(command: QueueCommand, conn: &Conn, output: Output) -> Result<()> {
    let client = Client::new(conn.connect().await?);
    match command {
        QueueCommand::Pause { queue, reason } => {
            client.pause_queue(&queue, reason.as_deref()).await?;
            println!("queue {queue} paused");
        }
        QueueCommand::Resume { queue } => {
            client.resume_queue(&queue).await?;
            println!("queue {queue} resumed");
        }
        QueueCommand::List => {
            let answer = client.queues().await?;
            if output == Output::Json {
                return out::json(&answer);
            }
            let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0).to_string();
            let rows: Vec<Vec<String>> = answer["queues"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|q| {
                    let t = &q["tasks"];
                    let r = &q["ready"];
                    vec![
                        q["queue"].as_str().unwrap_or("?").to_string(),
                        status(q),
                        format!("{}/{}/{}", n(&r["high"]), n(&r["normal"]), n(&r["low"])),
                        n(&t["scheduled"]),
                        n(&t["pending"]),
                        n(&t["running"]),
                        n(&t["retrying"]),
                        n(&t["succeeded"]),
                        n(&t["dead"]),
                        n(&t["cancelled"]),
                    ]
                })
                .collect();
            out::table(
                &[
                    "QUEUE",
                    "STATUS",
                    "READY H/N/L",
                    "SCHEDULED",
                    "PENDING",
                    "RUNNING",
                    "RETRYING",
                    "SUCCEEDED",
                    "DEAD",
                    "CANCELLED",
                ],
                &rows,
            );
        }
    }
    Ok(())
}

/// `active`, or `paused by <who> <when> ago: <why>`.
fn status(q: &serde_json::Value) -> String {
    if !q["paused"].as_bool().unwrap_or(false) {
        return "active".into();
    }
    let p = &q["pause"];
    let mut s = format!("paused by {}", p["by"].as_str().unwrap_or("?"));
    if let Some(at) = p["paused_at_ms"].as_u64() {
        let secs = ax_core::time::now_ms().saturating_sub(at) / 1000;
        s.push_str(&format!(
            " {} ago",
            humantime::format_duration(std::time::Duration::from_secs(secs))
        ));
    }
    if let Some(why) = p["reason"].as_str() {
        s.push_str(&format!(": {why}"));
    }
    s
}
