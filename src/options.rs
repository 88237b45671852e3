//! `ax tasks options get|set|list|unset`: task settings stored apart from code, and the
//! `tasks:` part of `ax apply -f runtime.yaml`. Every worker of the queue applies them to
//! its next attempts of the name (precedence: the submit's own values > stored settings >
//! the worker's declared options > server defaults).

use crate::out::{self, Output};
use anyhow::{bail, Result};
use ax_sdk::settings::file::{read_tasks, TaskEntry, DEFAULT_QUEUE};
use ax_sdk::settings::{StoredSettings, TaskSettings};
use ax_sdk::Client;
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use std::collections::BTreeSet;

#[derive(Subcommand)]
pub(crate) enum OptionsCommand {
    /// The stored settings of a task name.
    Get {
        /// Task name.
        name: String,
        /// Queue.
        #[arg(long, default_value = DEFAULT_QUEUE)]
        queue: String,
    },
    /// Store settings of a task name (merged into what is stored, unless --replace).
    Set {
        /// Task name.
        name: String,
        /// Queue.
        #[arg(long, default_value = DEFAULT_QUEUE)]
        queue: String,
        #[command(flatten)]
        values: Box<Values>,
        /// Replace what is stored instead of merging into it.
        #[arg(long)]
        replace: bool,
    },
    /// Every stored task setting (of one queue with --queue).
    List {
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
    },
    /// Delete the stored settings of a task name (its workers go back to their declared
    /// options).
    Unset {
        /// Task name.
        name: String,
        /// Queue.
        #[arg(long, default_value = DEFAULT_QUEUE)]
        queue: String,
    },
}

/// The settings, in the settings file's words.
#[derive(Args)]
pub(crate) struct Values {
    /// Attempts after the first.
    #[arg(long)]
    retries: Option<u32>,
    /// Attempts in all (instead of --retries).
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Hard timeout of one attempt ("60s", "2m").
    #[arg(long)]
    timeout: Option<String>,
    /// Soft timeout: no heartbeat for this long fails the attempt.
    #[arg(long)]
    heartbeat_timeout: Option<String>,
    /// First retry delay, doubling each retry.
    #[arg(long)]
    retry_backoff: Option<String>,
    /// Longest retry delay.
    #[arg(long)]
    retry_backoff_max: Option<String>,
    /// Fraction 0..=1 by which a retry delay is randomly shortened.
    #[arg(long)]
    retry_jitter: Option<f64>,
    /// Error classes to retry, comma-separated (others are not).
    #[arg(long, value_delimiter = ',')]
    retry_on: Option<Vec<String>>,
    /// Error classes never retried, comma-separated.
    #[arg(long, value_delimiter = ',')]
    no_retry_on: Option<Vec<String>>,
    /// Most attempts of the name at once per worker.
    #[arg(long)]
    concurrency: Option<u32>,
    /// Label on the name's alerts.
    #[arg(long)]
    alert_group: Option<String>,
}

impl Values {
    /// The settings these flags give, checked as the file's are.
    fn settings(self, name: &str) -> Result<TaskSettings> {
        let entry = TaskEntry {
            queue: None,
            retries: self.retries,
            max_attempts: self.max_attempts,
            timeout: self.timeout.map(Value::String),
            heartbeat_timeout: self.heartbeat_timeout.map(Value::String),
            retry_backoff: self.retry_backoff.map(Value::String),
            retry_backoff_max: self.retry_backoff_max.map(Value::String),
            retry_jitter: self.retry_jitter,
            retry_on: self.retry_on,
            no_retry_on: self.no_retry_on,
            concurrency: self.concurrency,
            alert_group: self.alert_group,
        };
        Ok(entry.settings(name)?)
    }
}

fn print(stored: &[StoredSettings], output: Output) -> Result<()> {
    if output == Output::Json {
        return out::json(&stored);
    }
    let rows: Vec<Vec<String>> = stored
        .iter()
        .map(|s| {
            vec![
                s.queue.clone(),
                s.name.clone(),
                serde_json::to_string(&s.settings).unwrap_or_default(),
            ]
        })
        .collect();
    out::table(&["QUEUE", "NAME", "SETTINGS"], &rows);
    Ok(())
}

pub(crate) async fn run(command: OptionsCommand, client: &Client, output: Output) -> Result<()> {
    match command {
        OptionsCommand::Get { name, queue } => match client.task_settings(&queue, &name).await? {
            Some(settings) => print(
                &[StoredSettings {
                    queue,
                    name,
                    settings,
                }],
                output,
            ),
            None => bail!("no stored settings for task {name:?} of queue {queue:?}"),
        },
        OptionsCommand::Set {
            name,
            queue,
            values,
            replace,
        } => {
            let new = values.settings(&name)?;
            if new.is_empty() && !replace {
                bail!("nothing to set: give at least one of --retries, --timeout, … (see --help)");
            }
            let settings = match replace {
                true => new,
                false => match client.task_settings(&queue, &name).await? {
                    Some(stored) => new.over(&stored),
                    None => new,
                },
            };
            let stored = client.put_task_settings(&queue, &name, &settings).await?;
            print(&[stored], output)
        }
        OptionsCommand::List { queue } => {
            print(&client.list_task_settings(queue.as_deref()).await?, output)
        }
        OptionsCommand::Unset { name, queue } => {
            let deleted = client.delete_task_settings(&queue, &name).await?;
            match output {
                Output::Json => {
                    out::json(&json!({"queue": queue, "name": name, "deleted": deleted}))
                }
                Output::Table if deleted => {
                    println!("deleted the stored settings of {name} on {queue}");
                    Ok(())
                }
                Output::Table => {
                    println!("{name} on {queue} had no stored settings");
                    Ok(())
                }
            }
        }
    }
}

/// The `tasks:` part of `ax apply -f`: stores each task's settings; with `prune`, deletes
/// stored settings of names the file does not list, in the queues it names (a file for
/// one service leaves other queues alone). False if the file has no `tasks:`.
pub(crate) async fn apply(file: &Value, prune: bool, client: &Client) -> Result<bool> {
    let Some(tasks) = read_tasks(file)? else {
        return Ok(false);
    };
    let queues: BTreeSet<&str> = tasks.iter().map(|t| t.queue.as_str()).collect();
    let mut stored = Vec::new();
    for q in &queues {
        stored.extend(client.list_task_settings(Some(q)).await?);
    }
    for t in &tasks {
        let before = stored
            .iter()
            .find(|s| s.queue == t.queue && s.name == t.name)
            .map(|s| &s.settings);
        let outcome = match before {
            Some(s) if *s == t.settings => "unchanged",
            Some(_) => "updated",
            None => "created",
        };
        if outcome != "unchanged" {
            client
                .put_task_settings(&t.queue, &t.name, &t.settings)
                .await?;
        }
        println!("{outcome:<10} task {} on {}", t.name, t.queue);
    }
    if prune {
        for s in &stored {
            if !tasks.iter().any(|t| t.queue == s.queue && t.name == s.name) {
                client.delete_task_settings(&s.queue, &s.name).await?;
                println!("{:<10} task {} on {}", "deleted", s.name, s.queue);
            }
        }
    }
    Ok(true)
}
