//! `ax task get|cancel|retry|run-now` and `ax tasks list|replay`.

use crate::conn::Conn;
use crate::out::{self, Output};
use anyhow::{bail, Context, Result};
use ax_core::state::TaskState;
use ax_sdk::ops::{ListRequest, PageCursor, TaskQuery};
use ax_sdk::Client;
use clap::{Args, Subcommand};
use std::time::Duration;

#[derive(Subcommand)]
pub(crate) enum TaskCommand {
    /// Show a task: its record and every stored transition (`-o json`: the record).
    Get {
        /// Task id.
        id: String,
        /// Print every stored transition as JSON, oldest first.
        #[arg(long, conflicts_with_all = ["result", "wait"])]
        history: bool,
        /// Print the task's output instead of its record (JSON as text, bytes as they are).
        #[arg(long)]
        result: bool,
        /// Wait until the task is finished (`succeeded`, `dead` or `cancelled`) first.
        #[arg(long)]
        wait: bool,
        /// With --wait: give up after this long (e.g. `30s`, `5m`).
        #[arg(long, value_parser = humantime::parse_duration, requires = "wait")]
        timeout: Option<std::time::Duration>,
    },
    /// Cancel a task: not started, it never runs; running, its handler is stopped.
    Cancel {
        /// Task id.
        id: String,
    },
    /// Run a dead task again (one more attempt, or --reset-attempts for all of them).
    Retry {
        /// Task id.
        id: String,
        /// Start its attempts from zero.
        #[arg(long)]
        reset_attempts: bool,
    },
    /// Start a scheduled or retrying task now.
    RunNow {
        /// Task id.
        id: String,
    },
    /// Every change of a task, oldest first, with who did it and why (kept 30 days).
    Events {
        /// Task id.
        id: String,
    },
}

/// Filters of `ax tasks list` and `ax tasks replay` (all must match).
#[derive(Args)]
pub(crate) struct Filters {
    /// Only this state.
    #[arg(long)]
    state: Option<TaskState>,
    /// Only this queue.
    #[arg(long)]
    queue: Option<String>,
    /// Only this task name.
    #[arg(long)]
    name: Option<String>,
    /// Only tasks whose last error has this class.
    #[arg(long)]
    error_class: Option<String>,
    /// Only tasks of this trigger.
    #[arg(long)]
    trigger: Option<String>,
    /// Only step tasks of this flow run.
    #[arg(long)]
    flow_run: Option<String>,
    /// Only the task with this idempotency key.
    #[arg(long)]
    key: Option<String>,
    /// Only tasks whose last error (class or message) contains this text, ignoring case.
    #[arg(long)]
    error_text: Option<String>,
    /// Only tasks changed within this long (e.g. `1h`).
    #[arg(long, value_parser = humantime::parse_duration)]
    since: Option<Duration>,
    /// Only tasks last changed longer ago than this (e.g. `10m`).
    #[arg(long, value_parser = humantime::parse_duration)]
    older_than: Option<Duration>,
}

impl Filters {
    fn query(self) -> TaskQuery {
        let now = ax_core::time::now_ms();
        TaskQuery {
            state: self.state,
            queue: self.queue,
            name: self.name,
            error_class: self.error_class,
            trigger: self.trigger,
            flow_run: self.flow_run,
            idempotency_key: self.key,
            id: None,
            error_text: self.error_text,
            from_ms: self.since.map(|d| now.saturating_sub(d.as_millis() as u64)),
            to_ms: self
                .older_than
                .map(|d| now.saturating_sub(d.as_millis() as u64)),
        }
    }
}

#[derive(Subcommand)]
pub(crate) enum TasksCommand {
    /// Find tasks (through the servers' index), most recently changed first.
    List {
        #[command(flatten)]
        filters: Filters,
        /// At most this many (up to 1,000 per page).
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Continue after this task (the `next` the previous page printed: `<ms>:<id>`).
        #[arg(long)]
        after: Option<String>,
    },
    /// Cancel every unfinished task matching the filters.
    Cancel {
        #[command(flatten)]
        filters: Filters,
        /// At most this many (up to 10,000).
        #[arg(long)]
        limit: Option<usize>,
        /// Only print which tasks would be cancelled.
        #[arg(long)]
        dry_run: bool,
    },
    /// Retry every dead task matching the filters.
    Replay {
        #[command(flatten)]
        filters: Filters,
        /// At most this many (up to 10,000).
        #[arg(long)]
        limit: Option<usize>,
        /// Start each task's attempts from zero.
        #[arg(long)]
        reset_attempts: bool,
        /// Only print which tasks would be retried.
        #[arg(long)]
        dry_run: bool,
    },
    /// Settings of a task name stored apart from code (retries, timeouts, backoff,
    /// retry lists, concurrency, alert group), applied by every worker to its next
    /// attempts: get, set, list, unset.
    Options {
        #[command(subcommand)]
        command: crate::options::OptionsCommand,
    },
}

fn record_json(rec: &ax_sdk::TaskRecord, revision: u64) -> String {
    let mut value = serde_json::to_value(rec).expect("record serializes");
    value["revision"] = revision.into();
    value.to_string()
}

pub(crate) async fn get(command: TaskCommand, conn: &Conn, output: Output) -> Result<()> {
    let client = Client::new(conn.connect().await?);
    let (id, history, result, wait, timeout) = match command {
        TaskCommand::Get {
            id,
            history,
            result,
            wait,
            timeout,
        } => (id, history, result, wait, timeout),
        TaskCommand::Cancel { id } => {
            let done = client.cancel_task(&id).await?;
            return print_outcome(&done, output, "cancel");
        }
        TaskCommand::Retry { id, reset_attempts } => {
            let done = client.retry_task(&id, reset_attempts).await?;
            return print_outcome(&done, output, "retry");
        }
        TaskCommand::RunNow { id } => {
            let done = client.run_now(&id).await?;
            return print_outcome(&done, output, "run now");
        }
        TaskCommand::Events { id } => {
            let (events, complete) = client.task_events(&id).await?;
            if output == Output::Json {
                return out::json(&serde_json::json!({"events": events, "complete": complete}));
            }
            if !complete {
                eprintln!("(the record's last 16 changes: keep them all with `--task-events`)");
            }
            let text = |v: &serde_json::Value| v.as_str().unwrap_or("-").to_string();
            let rows: Vec<Vec<String>> = events
                .iter()
                .map(|e| {
                    vec![
                        out::ago(e["at_ms"].as_u64()),
                        text(&e["event"]),
                        e["attempt"].to_string(),
                        text(&e["actor"]),
                        text(&e["reason"]),
                    ]
                })
                .collect();
            out::table(&["WHEN", "EVENT", "ATTEMPT", "ACTOR", "REASON"], &rows);
            return Ok(());
        }
    };
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
        match output {
            Output::Json => println!("{}", record_json(&rec, rev)),
            Output::Table => show(&client, &rec, rev).await?,
        }
    }
    Ok(())
}

fn print_outcome(done: &ax_sdk::ops::OpOutcome, output: Output, op: &str) -> Result<()> {
    if output == Output::Json {
        return out::json(done);
    }
    let mut line = format!("{op}: {} is {}", done.id, done.state);
    if let Some(w) = &done.worker {
        line.push_str(&format!(" (stopped on worker {w})"));
    }
    if done.cancel_requested {
        line.push_str(" (no worker answered: cancelled at its next delivery)");
    }
    println!("{line}");
    Ok(())
}

/// A task for people: its fields, then one line per stored transition.
async fn show(client: &Client, rec: &ax_sdk::TaskRecord, rev: u64) -> Result<()> {
    let mut rows = vec![
        ("id", rec.id.clone()),
        ("queue / name", format!("{} / {}", rec.queue, rec.name)),
        ("state", rec.state.to_string()),
        (
            "attempt",
            format!("{} of {}", rec.attempt, rec.max_attempts),
        ),
        ("priority", rec.priority.to_string()),
        ("created", out::ago(Some(rec.created_at_ms))),
        (
            "updated",
            format!("{} (revision {rev})", out::ago(Some(rec.updated_at_ms))),
        ),
    ];
    let mut opt = |k: &'static str, v: Option<String>| {
        if let Some(v) = v {
            rows.push((k, v));
        }
    };
    opt("run at", rec.run_at_ms.map(|t| out::ago(Some(t))));
    opt(
        "next retry",
        rec.next_retry_at_ms.map(|t| out::ago(Some(t))),
    );
    opt(
        "last error",
        rec.last_error
            .as_ref()
            .map(|e| format!("{}: {}", e.class, e.message)),
    );
    opt("worker", rec.worker.clone());
    opt("idempotency key", rec.idempotency_key.clone());
    opt(
        "trigger",
        rec.trigger.as_ref().map(|t| {
            format!(
                "{t} ({}, for {})",
                rec.trigger_source.as_deref().unwrap_or("?"),
                out::ago(rec.scheduled_at_ms)
            )
        }),
    );
    opt(
        "waiting",
        rec.waiting
            .as_ref()
            .map(|w| format!("{} {}", w.reason, w.limit)),
    );
    opt(
        "operator",
        rec.op
            .as_ref()
            .map(|o| format!("{} by {} {}", o.op, o.by, out::ago(Some(o.at_ms)))),
    );
    opt("traceparent", rec.traceparent.clone());
    opt("business id", rec.business_id.clone());
    for (k, v) in &rows {
        println!("{k:<16} {v}");
    }
    let history = client.history(&rec.id).await?;
    println!();
    let lines: Vec<Vec<String>> = history
        .iter()
        .map(|(r, rev)| {
            vec![
                rev.to_string(),
                r.state.to_string(),
                r.attempt.to_string(),
                r.worker.clone().unwrap_or_else(|| "-".into()),
                out::ago(Some(r.updated_at_ms)),
                r.last_error
                    .as_ref()
                    .map_or("-".into(), |e| format!("{}: {}", e.class, e.message)),
            ]
        })
        .collect();
    out::table(
        &["REVISION", "STATE", "ATTEMPT", "WORKER", "WHEN", "ERROR"],
        &lines,
    );
    Ok(())
}

/// Writes an output to stdout: JSON as text with a newline, bytes as they are.
fn print_output(id: &str, output: Option<ax_sdk::TaskOutput>) -> Result<()> {
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

pub(crate) async fn list(command: TasksCommand, conn: &Conn, output: Output) -> Result<()> {
    let client = Client::new(conn.connect().await?);
    match command {
        TasksCommand::Options { command } => crate::options::run(command, &client, output).await?,
        TasksCommand::List {
            filters,
            limit,
            after,
        } => {
            let after = match after {
                Some(c) => {
                    let (ms, id) = c.split_once(':').context("--after is <ms>:<id>")?;
                    Some(PageCursor {
                        updated_at_ms: ms.parse().context("--after is <ms>:<id>")?,
                        id: id.to_string(),
                    })
                }
                None => None,
            };
            let req = ListRequest {
                query: filters.query(),
                limit: Some(limit),
                after,
            };
            let reply = client.find_tasks(&req).await?;
            if output == Output::Json {
                return out::json(&reply);
            }
            let rows: Vec<Vec<String>> = reply
                .tasks
                .iter()
                .map(|t| {
                    vec![
                        t.id.clone(),
                        t.name.clone(),
                        t.state.to_string(),
                        t.attempt.to_string(),
                        t.error_class.clone().unwrap_or_else(|| "-".into()),
                        out::ago(Some(t.updated_at_ms)),
                    ]
                })
                .collect();
            out::table(
                &["ID", "NAME", "STATE", "ATTEMPT", "ERROR", "UPDATED"],
                &rows,
            );
            let total = reply
                .total
                .map_or("over 100000".to_string(), |n| n.to_string());
            eprintln!(
                "{} of {total} task(s){}",
                rows.len(),
                if reply.complete {
                    ""
                } else {
                    " (index still loading: partial)"
                }
            );
            if let Some(next) = reply.next {
                eprintln!("next page: --after {}:{}", next.updated_at_ms, next.id);
            }
        }
        TasksCommand::Cancel {
            filters,
            limit,
            dry_run,
        } => {
            let done = client
                .cancel_matching(&filters.query(), limit, dry_run)
                .await?;
            if output == Output::Json {
                return out::json(&done);
            }
            let matched = done["matched"]
                .as_u64()
                .map_or("over 100000".into(), |n| n.to_string());
            if dry_run {
                for id in done["ids"].as_array().into_iter().flatten() {
                    println!("{}", id.as_str().unwrap_or_default());
                }
                eprintln!(
                    "{} of {matched} task(s) would be cancelled",
                    done["would_cancel"]
                );
            } else {
                for f in done["failed"].as_array().into_iter().flatten() {
                    eprintln!("not cancelled: {f}");
                }
                println!("cancelled {} of {matched} task(s)", done["cancelled"]);
            }
        }
        TasksCommand::Replay {
            filters,
            limit,
            reset_attempts,
            dry_run,
        } => {
            let q = filters.query();
            if q.state.is_some_and(|s| s != TaskState::Dead) {
                bail!("replay retries dead tasks only");
            }
            let done = client
                .replay_dead(&q, limit, reset_attempts, dry_run)
                .await?;
            if output == Output::Json {
                return out::json(&done);
            }
            let matched = done.matched.map_or("over 100000".into(), |n| n.to_string());
            if dry_run {
                for id in &done.ids {
                    println!("{id}");
                }
                eprintln!(
                    "{} of {matched} dead task(s) would be retried",
                    done.would_retry
                );
            } else {
                for f in &done.failed {
                    eprintln!("not retried: {f}");
                }
                println!("retried {} of {matched} dead task(s)", done.retried);
            }
        }
    }
    Ok(())
}
