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
        #[arg(long)]
        history: bool,
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
    let TaskCommand::Get { id, history } = command;
    let client = Client::new(conn.connect().await?);
    if history {
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
