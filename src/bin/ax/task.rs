//! `ax task get` and `ax tasks list`.

use crate::conn::Conn;
use anyhow::{bail, Context, Result};
use ax::state::{ListFilter, TaskState};
use ax::Client;
use clap::Subcommand;

#[derive(Subcommand)]
pub(crate) enum TaskCommand {
    /// Print a task's record as JSON.
    Get {
        /// Task id.
        id: String,
        /// Print every stored transition, oldest first.
        #[arg(long, conflicts_with_all = ["result", "wait"])]
        history: bool,
        /// Print the task's output instead of its record (JSON as text, bytes as they are).
        #[arg(long)]
        result: bool,
        /// Wait until the task is finished (`succeeded` or `dead`) first.
        #[arg(long)]
        wait: bool,
        /// With --wait: give up after this long (e.g. `30s`, `5m`).
        #[arg(long, value_parser = humantime::parse_duration, requires = "wait")]
        timeout: Option<std::time::Duration>,
    },
}

#[derive(Subcommand)]
pub(crate) enum TasksCommand {
    /// List task records (reads the whole bucket: an operator command).
    List {
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Only this state.
        #[arg(long)]
        state: Option<TaskState>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
}

fn record_json(rec: &ax::TaskRecord, revision: u64) -> String {
    let mut value = serde_json::to_value(rec).expect("record serializes");
    value["revision"] = revision.into();
    value.to_string()
}

pub(crate) async fn get(command: TaskCommand, conn: &Conn) -> Result<()> {
    let TaskCommand::Get {
        id,
        history,
        result,
        wait,
        timeout,
    } = command;
    let client = Client::new(conn.connect().await?);
    if wait {
        let finished = match timeout {
            Some(limit) => tokio::time::timeout(limit, client.wait(&id))
                .await
                .map_err(|_| anyhow::anyhow!("task {id} not finished after {limit:?}"))??,
            None => client.wait(&id).await?,
        };
        if result {
            print_output(&id, finished.output)?;
        } else {
            println!("{}", record_json(&finished.record, finished.revision));
        }
    } else if result {
        let (rec, _) = client
            .task(&id)
            .await?
            .with_context(|| format!("no task {id}"))?;
        if !rec.state.is_terminal() {
            bail!("task {id} is {}: no result yet (add --wait)", rec.state);
        }
        print_output(&id, client.output(&rec).await?)?;
    } else if history {
        let entries = client.history(&id).await?;
        if entries.is_empty() {
            bail!("no task {id}");
        }
        for (rec, rev) in entries {
            println!("{}", record_json(&rec, rev));
        }
    } else {
        let (rec, rev) = client
            .task(&id)
            .await?
            .with_context(|| format!("no task {id}"))?;
        println!("{}", record_json(&rec, rev));
    }
    Ok(())
}

/// Writes an output to stdout: JSON as text with a newline, bytes as they are.
fn print_output(id: &str, output: Option<ax::TaskOutput>) -> Result<()> {
    use std::io::Write;
    let out = output.with_context(|| format!("task {id} has no output"))?;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(&out.bytes)?;
    if out.is_json {
        stdout.write_all(b"\n")?;
    }
    stdout.flush()?;
    Ok(())
}

pub(crate) async fn list(command: TasksCommand, conn: &Conn) -> Result<()> {
    let TasksCommand::List {
        queue,
        state,
        limit,
    } = command;
    let client = Client::new(conn.connect().await?);
    let records = client
        .list(&ListFilter {
            queue,
            state,
            limit,
        })
        .await?;
    for rec in &records {
        println!("{}", serde_json::to_string(rec)?);
    }
    eprintln!("{} task(s)", records.len());
    Ok(())
}
