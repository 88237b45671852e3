//! `ax worker --example`: the example handler, for demos, smoke tests and the fault
//! campaign.
//!
//! The handler sleeps (50–300 ms, or `--sleep`), then succeeds, or fails retryably at
//! `--fail-rate`. A JSON object payload can steer it: `sleep_ms` (how long),
//! `fail_attempts` (fail with class `flaky` while the attempt is at most this),
//! `permanent: true` (fail for good with class `validation`, as a task named `poison`
//! does). With `--journal FILE` every invocation appends one JSON line when it starts and
//! one when it ends (outcome `ok`, `err:<class>`, or `stopped` when the worker dropped the
//! handler: a cancel, a lost concurrency slot, a shutdown), so an outside checker can see
//! every run, how long it ran, and its fencing token.

use crate::conn::Conn;
use anyhow::{Context, Result};
use ax_sdk::{Task, TaskError, Worker};
use clap::Args;
use rand::Rng;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Args)]
pub(crate) struct WorkerArgs {
    /// Queue to work on.
    #[arg(long, default_value = "default")]
    queue: String,
    /// Use the example handler (the only one this binary has).
    #[arg(long)]
    example: bool,
    /// Tasks run at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Share of attempts the example handler fails (retryably).
    #[arg(long, default_value_t = 0.2)]
    fail_rate: f64,
    /// Example handler run time, a duration with its unit: `250ms`, `2s`, `1m 30s` (a bare
    /// number is refused). Default: random 50-300 ms; a payload's `sleep_ms` wins.
    #[arg(long, value_parser = humantime::parse_duration)]
    sleep: Option<Duration>,
    /// Append one JSON line per handler start and one per end to this file (created if
    /// missing; never truncated). A start: `{"event": "start", "id", "attempt", "token"
    /// (the fencing token, 0 when the handler did not ask for one), "worker", "name",
    /// "at_ms"}`; an end: `{"event": "end", "id", "attempt", "token", "worker", "outcome", "at_ms"}`,
    /// `outcome` being `ok`, `err:<class>`, or `stopped` (the worker dropped the handler:
    /// a cancel, a lost concurrency slot, a shutdown). For checkers counting every run.
    #[arg(long)]
    journal: Option<PathBuf>,
    /// Worker id stored in task records.
    #[arg(long)]
    id: Option<String>,
    /// Priority aging: a priority whose oldest waiting task has waited this long is picked
    /// as the one above it (`low` as `normal`; twice as long: as `high`), e.g. `30s`.
    /// Default: off.
    #[arg(long, value_parser = humantime::parse_duration)]
    aging: Option<Duration>,
    /// Serve Prometheus metrics here ("off" to disable).
    #[arg(long, default_value = "127.0.0.1:9465")]
    metrics_addr: String,
}

/// An append-only file of JSON lines, one `write` per line.
#[derive(Clone)]
pub(crate) struct Journal(Arc<Mutex<std::fs::File>>);

impl Journal {
    fn open(path: &PathBuf) -> Result<Journal> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening journal {}", path.display()))?;
        Ok(Journal(Arc::new(Mutex::new(file))))
    }

    fn line(&self, value: serde_json::Value) {
        let mut text = value.to_string();
        text.push('\n');
        let mut file = self.0.lock().expect("not poisoned");
        if let Err(e) = file.write_all(text.as_bytes()) {
            tracing::warn!(cause = %e, "journal write failed");
        }
    }
}

/// Writes the `end` line of a run whose handler is dropped before it finishes.
struct Stopped {
    journal: Journal,
    worker: String,
    id: String,
    attempt: u32,
    token: u64,
    done: bool,
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if !self.done {
            self.journal.line(serde_json::json!({
                "event": "end", "id": self.id, "token": self.token, "attempt": self.attempt,
                "worker": self.worker, "outcome": "stopped", "at_ms": ax_core::time::now_ms(),
            }));
        }
    }
}

/// The example worker (see the module docs).
pub(crate) fn example_worker(
    queue: &str,
    concurrency: usize,
    fail_rate: f64,
    sleep: Option<Duration>,
    id: Option<String>,
    journal: Option<Journal>,
) -> ax_sdk::worker::WorkerBuilder {
    // The fault tests' AX_TEST_* variables (none in production: see ax_core::faults).
    let mut builder = Worker::builder(queue)
        .concurrency(concurrency)
        .faults(ax_core::faults::Faults::from_env());
    let worker_id = id.unwrap_or_else(|| format!("{}-{}", std::process::id(), nuid::next()));
    builder = builder.id(worker_id.clone());
    builder.handler(move |task: Task| {
        let (journal, worker_id) = (journal.clone(), worker_id.clone());
        async move {
            // With a journal, tasks whose id ends in an even byte ask for their fencing
            // token (a `running` write before the work); the others run without one and
            // journal token 0, so a fault campaign checks both kinds of first attempt.
            let mut token = 0;
            if let Some(j) = &journal {
                if task.id.as_bytes().last().is_some_and(|b| b % 2 == 0) {
                    token = task.fencing_token().await?;
                }
                let mut start = serde_json::json!({
                    "event": "start", "id": task.id, "attempt": task.attempt,
                    "token": token, "worker": worker_id, "name": task.name,
                    "at_ms": ax_core::time::now_ms(),
                });
                // A batch's list: the `item` of each element, so a campaign checks that
                // every item ran in one batch only (docs/PROTOCOL.md §2, "Batching").
                if let Ok(list) = serde_json::from_slice::<Vec<serde_json::Value>>(&task.payload) {
                    start["items"] = list.iter().map(|v| v["item"].clone()).collect();
                }
                j.line(start);
            }
            let mut stopped = journal.as_ref().map(|j| Stopped {
                journal: j.clone(),
                worker: worker_id.clone(),
                id: task.id.clone(),
                attempt: task.attempt,
                token,
                done: false,
            });
            let result = example(&task, fail_rate, sleep).await;
            if let Some(s) = &mut stopped {
                s.done = true;
            }
            if let Some(j) = &journal {
                let outcome = match &result {
                    Ok(()) => "ok".to_string(),
                    Err(e) => format!("err:{}", e.class),
                };
                j.line(serde_json::json!({
                    "event": "end", "id": task.id, "token": token, "attempt": task.attempt,
                    "worker": worker_id, "outcome": outcome, "at_ms": ax_core::time::now_ms(),
                }));
            }
            result
        }
    })
}

async fn example(task: &Task, fail_rate: f64, sleep: Option<Duration>) -> Result<(), TaskError> {
    let steer: serde_json::Value = serde_json::from_slice(&task.payload).unwrap_or_default();
    let pause = steer["sleep_ms"]
        .as_u64()
        .map(Duration::from_millis)
        .or(sleep)
        .unwrap_or_else(|| Duration::from_millis(rand::rng().random_range(50..300)));
    tokio::time::sleep(pause).await;
    if task.name == "poison" || steer["permanent"].as_bool() == Some(true) {
        return Err(TaskError::permanent(
            "validation",
            "poison task: never retried",
        ));
    }
    if let Some(n) = steer["fail_attempts"].as_u64() {
        if u64::from(task.attempt) <= n {
            return Err(TaskError::new(
                "flaky",
                format!("planned failure on attempt {}", task.attempt),
            ));
        }
        return Ok(());
    }
    if rand::rng().random_bool(fail_rate.clamp(0.0, 1.0)) {
        return Err(TaskError::new(
            "flaky",
            format!("simulated transient failure on attempt {}", task.attempt),
        ));
    }
    Ok(())
}

pub(crate) async fn run(args: WorkerArgs, conn: &Conn) -> Result<()> {
    if !args.example {
        anyhow::bail!("this binary only has the example handler: pass --example, or build a worker with the ax library");
    }
    crate::metrics_at(&args.metrics_addr)?;
    let journal = args.journal.as_ref().map(Journal::open).transpose()?;
    let worker = example_worker(
        &args.queue,
        args.concurrency,
        args.fail_rate,
        args.sleep,
        args.id,
        journal,
    );
    let worker = match args.aging {
        Some(after) => worker.aging(after),
        None => worker,
    }
    .build()?;
    let shutdown = crate::shutdown_on_signal();
    let Some(client) = conn.connect_waiting(&shutdown).await? else {
        return Ok(());
    };
    worker.run(client, shutdown).await?;
    Ok(())
}
