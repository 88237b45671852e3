//! `ax trigger …` and `ax apply -f`.

use crate::conn::Conn;
use anyhow::{Context, Result};
use ax_sdk::Client;
use clap::Subcommand;
use std::path::{Path, PathBuf};

#[derive(Subcommand)]
pub(crate) enum TriggerCommand {
    /// Create or update one trigger from a YAML or JSON file.
    Put {
        /// The file.
        #[arg(short = 'f', long)]
        file: PathBuf,
    },
    /// Definition, state, next 5 fire times, running tasks.
    Get {
        /// Trigger name.
        name: String,
    },
    /// All triggers with their next fire time.
    List,
    /// The server whose trigger engine fires now (its `--id`), or null.
    Leader,
    /// Stop firing (state is kept).
    Pause {
        /// Trigger name.
        name: String,
    },
    /// Fire again.
    Resume {
        /// Trigger name.
        name: String,
    },
    /// Delete the definition and state (tasks already created are not touched).
    Delete {
        /// Trigger name.
        name: String,
    },
    /// Run now (trigger_source=manual); refused while a run is in progress unless --force.
    Run {
        /// Trigger name.
        name: String,
        /// Run even if the previous run is still running.
        #[arg(long)]
        force: bool,
    },
}

/// Reads a YAML or JSON file into JSON.
pub(crate) fn read_definitions(path: &Path) -> Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    // JSON is YAML, but the JSON parser reads a large file several times faster.
    if let Ok(doc) = serde_json::from_str(&text) {
        return Ok(doc);
    }
    serde_yaml::from_str(&text)
        .with_context(|| format!("{} is not valid YAML or JSON", path.display()))
}

pub(crate) async fn run(command: TriggerCommand, conn: &Conn) -> Result<()> {
    let client = Client::new(conn.connect().await?);
    let named = |name: String| serde_json::json!({ "name": name });
    let (op, body) = match command {
        TriggerCommand::Put { file } => ("put", read_definitions(&file)?),
        TriggerCommand::Get { name } => ("get", named(name)),
        TriggerCommand::List => ("list", serde_json::json!({})),
        TriggerCommand::Leader => ("leader", serde_json::json!({})),
        TriggerCommand::Pause { name } => ("pause", named(name)),
        TriggerCommand::Resume { name } => ("resume", named(name)),
        TriggerCommand::Delete { name } => ("delete", named(name)),
        TriggerCommand::Run { name, force } => {
            ("run", serde_json::json!({ "name": name, "force": force }))
        }
    };
    let answer = client.trigger(op, &body).await?;
    println!("{}", serde_json::to_string_pretty(&answer)?);
    Ok(())
}

/// The `triggers:` part of `ax apply -f FILE [--no-prune]`: one request, or parts under the
/// server's max payload with a progress bar (`Client::apply_triggers`).
pub(crate) async fn apply(doc: &serde_json::Value, no_prune: bool, client: &Client) -> Result<()> {
    let Some(triggers) = doc["triggers"].as_array() else {
        anyhow::bail!("`triggers:` must be a list of definitions");
    };
    let bar = indicatif::ProgressBar::new(triggers.len() as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} triggers {msg}",
        )
        .expect("a valid template"),
    );
    let report = client
        .apply_triggers(triggers, !no_prune, |stage, done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(match stage {
                ax_sdk::trigger::ApplyStage::Checking => "checked",
                ax_sdk::trigger::ApplyStage::Storing => "stored",
                ax_sdk::trigger::ApplyStage::Pruning => "deleted (not in the file)",
            });
        })
        .await;
    bar.finish_and_clear();
    for line in report? {
        println!("{:<10} {}", line.outcome, line.name);
    }
    Ok(())
}
