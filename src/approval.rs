//! `ax approval …`: list, approve and reject the flows' approvals (docs/PROTOCOL.md §6,
//! "Approvals").

use crate::conn::Conn;
use crate::out::{self, Output};
use anyhow::{bail, Result};
use ax_sdk::flow::{ApprovalCompletion, Decision};
use ax_sdk::Client;
use clap::{Args, Subcommand};
use serde_json::Value;

#[derive(Subcommand)]
pub(crate) enum ApprovalCommand {
    /// List the approvals waiting (their tokens are not shown).
    List,
    /// Approve: the step succeeds with {"decision": "approved", "payload"}.
    Approve {
        #[command(flatten)]
        which: Which,
        /// The payload: JSON text, `@FILE` or `-` (standard input); default null.
        #[arg(long)]
        payload: Option<String>,
    },
    /// Reject: the step fails, class approval_rejected (its on_failure applies).
    Reject {
        #[command(flatten)]
        which: Which,
        /// Why (the step's error message).
        #[arg(long)]
        reason: Option<String>,
    },
}

/// The approval: its token, or (as an operator) its wait task id.
#[derive(Args)]
pub(crate) struct Which {
    /// The token its announcement gave (`ax.events.approval.requested`).
    token: Option<String>,
    /// Its wait task id instead (`ax approval list` shows it; needs the admin's rights).
    #[arg(long, conflicts_with = "token")]
    task: Option<String>,
}

pub(crate) async fn run(command: ApprovalCommand, conn: &Conn, output: Output) -> Result<()> {
    let client = Client::new(conn.connect().await?);
    let (which, decision, payload, reason) = match command {
        ApprovalCommand::List => return list(&client, output).await,
        ApprovalCommand::Approve { which, payload } => {
            let payload = payload.as_deref().map(crate::flow::json_arg).transpose()?;
            (which, Decision::Approve, payload, None)
        }
        ApprovalCommand::Reject { which, reason } => (which, Decision::Reject, None, reason),
    };
    if which.token.is_none() && which.task.is_none() {
        bail!("give the approval's token, or --task with its wait task id");
    }
    let done = client
        .complete_approval(&ApprovalCompletion {
            token: which.token,
            task: which.task,
            decision,
            payload,
            reason,
        })
        .await?;
    if output == Output::Json {
        return out::json(&done);
    }
    let text = |k: &str| done[k].as_str().unwrap_or("?").to_string();
    println!(
        "{} step {} of run {} ({})",
        text("decision"),
        text("step"),
        text("run"),
        text("flow")
    );
    Ok(())
}

async fn list(client: &Client, output: Output) -> Result<()> {
    let list = client.approvals().await?;
    if output == Output::Json {
        return out::json(&list);
    }
    let time = |v: &Value| {
        v.as_u64()
            .map(ax_core::time::format_rfc3339_ms)
            .unwrap_or_default()
    };
    let rows: Vec<Vec<String>> = list
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| {
            let text = |k: &str| a[k].as_str().unwrap_or_default().to_string();
            vec![
                text("run"),
                text("flow"),
                text("step"),
                time(&a["until_ms"]),
                text("task"),
                text("message"),
            ]
        })
        .collect();
    out::table(
        &["RUN", "FLOW", "STEP", "TIMES OUT", "TASK", "MESSAGE"],
        &rows,
    );
    Ok(())
}
