//! `ax flow …`: define, start, watch, cancel and re-run flows.

use crate::conn::Conn;
use crate::out::{self, Output};
use anyhow::{bail, Context, Result};
use ax_sdk::flow::RerunMode;
use ax_sdk::Client;
use clap::{Subcommand, ValueEnum};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Subcommand)]
pub(crate) enum FlowCommand {
    /// Create or replace a flow definition from a YAML or JSON file (checked first).
    Put {
        /// The file.
        #[arg(short = 'f', long)]
        file: PathBuf,
    },
    /// Print a flow definition.
    Def {
        /// Flow name.
        name: String,
    },
    /// List flow definitions.
    Defs,
    /// Start a run; prints its id (or, with --wait, waits for its end and prints it).
    Run {
        /// Flow name.
        name: String,
        /// The run's input: JSON text, `@FILE` (a file holding JSON) or `-` (JSON on
        /// standard input).
        #[arg(long, default_value = "null")]
        input: String,
        /// Wait until the run ends; exit 1 unless it succeeded.
        #[arg(long)]
        wait: bool,
        /// Longest wait with --wait.
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// The business id the run works for (an order number): every step task carries
        /// it, in its record and its logs.
        #[arg(long)]
        business_id: Option<String>,
        /// A singleton key: at most one run of the flow holding it runs at a time
        /// (docs/guides/flows.md, "One run at a time").
        #[arg(long)]
        singleton: Option<String>,
        /// What a start whose singleton key is held does: cancel_new (refuse it; exit 1
        /// naming the holder) or cancel_in_progress (cancel the holder, start this one).
        #[arg(long, requires = "singleton", default_value = "cancel_new",
              value_parser = ["cancel_new", "cancel_in_progress"])]
        on_collision: String,
    },
    /// A run: each step with state, attempts, timings and error.
    Get {
        /// Run id.
        run: String,
        /// Print the graph as Graphviz (steps coloured by state) instead.
        #[arg(long)]
        dot: bool,
        /// Print the run as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Runs, newest first.
    List {
        /// Only this flow.
        #[arg(long)]
        flow: Option<String>,
        /// Only runs in this state (running, succeeded, failed, cancelled).
        #[arg(long)]
        state: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Cancel a run: steps not started never start, queued tasks are cancelled.
    Cancel {
        /// Run id.
        run: String,
    },
    /// The server leading the flow engine now (its `--id`; by default `<pid>-<nuid>`).
    Leader,
    /// Re-run an ended run.
    Rerun {
        /// Run id.
        run: String,
        /// What to run again.
        #[arg(long, value_enum, default_value = "failed")]
        mode: Mode,
        /// A new input (mode whole only): JSON text, `@FILE` or `-`.
        #[arg(long)]
        input: Option<String>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Mode {
    /// The steps that did not succeed (succeeded steps keep their outputs).
    Failed,
    /// Those and every step downstream of a failed one.
    FailedAndDownstream,
    /// The whole run, as a new run linked to this one.
    Whole,
}

/// JSON given inline, as `@FILE`, or as `-` (standard input).
pub(crate) fn json_arg(text: &str) -> Result<Value> {
    let (source, body) = if text == "-" {
        let mut body = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut body)
            .context("reading the input from standard input")?;
        ("standard input".to_string(), body)
    } else if let Some(path) = text.strip_prefix('@') {
        let body = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
        (path.to_string(), body)
    } else {
        return serde_json::from_str(text)
            .with_context(|| format!("{text:?} is not JSON (give JSON text, @FILE or -)"));
    };
    serde_json::from_str(&body).with_context(|| format!("{source} does not hold JSON"))
}

fn ms(v: &Value) -> String {
    v.as_u64()
        .map(|ms| ax_core::time::format_rfc3339_ms(ms)[11..23].to_string())
        .unwrap_or_else(|| "-".into())
}

fn colour(state: &str) -> &'static str {
    match state {
        "succeeded" => "palegreen",
        "failed" => "salmon",
        "upstream_failed" => "orange",
        "running" => "lightblue",
        "sleeping" | "waiting for event" | "waiting for approval" | "waiting for flow" => {
            "lavender"
        }
        "cancelled" | "skipped" => "lightgrey",
        _ => "white",
    }
}

fn print_run(run: &Value) {
    println!(
        "run {}  flow {}  {}{}",
        run["run"].as_str().unwrap_or("?"),
        run["flow"].as_str().unwrap_or("?"),
        run["state"].as_str().unwrap_or("?"),
        run["reason"]
            .as_str()
            .map(|r| format!(" — {r}"))
            .unwrap_or_default()
    );
    if let Some(of) = run["rerun_of"].as_str() {
        println!("re-run of {of}");
    }
    if let Some(parent) = run["parent"]["run"].as_str() {
        let step = run["parent"]["step"].as_str().unwrap_or("?");
        println!("child of run {parent} (step {step})");
    }
    println!(
        "{:<20} {:<16} {:>5} {:>6} {:>8} {:<12} {:<12} error",
        "STEP", "STATE", "EPOCH", "TASKS", "ATTEMPTS", "STARTED", "FINISHED"
    );
    for s in run["steps"].as_array().into_iter().flatten() {
        let error = s["error"]
            .as_object()
            .map(|e| {
                format!(
                    "{}: {}",
                    e["class"].as_str().unwrap_or(""),
                    e["message"].as_str().unwrap_or("")
                )
            })
            .unwrap_or_default();
        // A step that waits shows what for, in place of its state.
        let waiting = &s["waiting"];
        let (state, error) = match (waiting["kind"].as_str(), waiting["until_ms"].as_u64()) {
            (Some("event"), Some(until)) => (
                "waiting",
                format!(
                    "for event {} until {}",
                    waiting["event"].as_str().unwrap_or("?"),
                    ax_core::time::format_rfc3339_ms(until)
                ),
            ),
            (Some("approval"), Some(until)) => (
                "waiting",
                format!(
                    "for approval until {}",
                    ax_core::time::format_rfc3339_ms(until)
                ),
            ),
            (Some("flow"), Some(until)) => (
                "waiting",
                format!(
                    "for flow {} ({} run{}: {}) until {}",
                    waiting["flow"].as_str().unwrap_or("?"),
                    s["items"].as_u64().unwrap_or(0),
                    if s["items"] == 1 { "" } else { "s" },
                    waiting["runs"][0].as_str().unwrap_or("?"),
                    ax_core::time::format_rfc3339_ms(until)
                ),
            ),
            (_, Some(until)) => (
                "sleeping",
                format!("until {}", ax_core::time::format_rfc3339_ms(until)),
            ),
            (_, None) => (s["state"].as_str().unwrap_or("?"), error),
        };
        println!(
            "{:<20} {:<16} {:>5} {:>6} {:>8} {:<12} {:<12} {}",
            s["name"].as_str().unwrap_or("?"),
            state,
            s["epoch"],
            s["items"].as_u64().map_or("-".into(), |n| n.to_string()),
            s["attempts"].as_u64().map_or("-".into(), |n| n.to_string()),
            ms(&s["started_at_ms"]),
            ms(&s["finished_at_ms"]),
            error
        );
    }
}

fn print_dot(run: &Value) {
    println!("digraph {:?} {{", run["flow"].as_str().unwrap_or("flow"));
    println!("  rankdir=LR; node [shape=box, style=filled];");
    for s in run["steps"].as_array().into_iter().flatten() {
        let name = s["name"].as_str().unwrap_or("?");
        let state = match s["waiting"]["kind"].as_str() {
            Some("sleep") => "sleeping",
            Some("event") => "waiting for event",
            Some("approval") => "waiting for approval",
            Some("flow") => "waiting for flow",
            _ => s["state"].as_str().unwrap_or("waiting"),
        };
        println!(
            "  {name:?} [label=\"{name}\\n{state}\", fillcolor={}];",
            colour(state)
        );
        for need in s["needs"].as_array().into_iter().flatten() {
            println!("  {:?} -> {name:?};", need.as_str().unwrap_or("?"));
        }
    }
    println!("}}");
}

pub(crate) async fn run(command: FlowCommand, conn: &Conn, output: Output) -> Result<()> {
    let client = Client::new(conn.connect().await?);
    match command {
        FlowCommand::Put { file } => {
            let def = crate::trigger::read_definitions(&file)?;
            let ok = client.flow("put", &def).await?;
            println!("stored flow {} ({} steps)", ok["name"], ok["steps"]);
        }
        FlowCommand::Def { name } => {
            let def = client.flow("def", &json!({ "name": name })).await?;
            println!("{}", serde_json::to_string_pretty(&def)?);
        }
        FlowCommand::Defs => {
            let defs = client.flow("defs", &json!({})).await?;
            if output == Output::Json {
                return out::json(&defs);
            }
            for d in defs.as_array().into_iter().flatten() {
                println!(
                    "{:<30} {:>4} steps  {}",
                    d["name"].as_str().unwrap_or("?"),
                    d["steps"],
                    d["failure"].as_str().unwrap_or("")
                );
            }
        }
        FlowCommand::Run {
            name,
            input,
            wait,
            timeout,
            business_id,
            singleton,
            on_collision,
        } => {
            let mut start = ax_sdk::flow::FlowStart::new(name, json_arg(&input)?);
            start.business_id = business_id;
            if let Some(key) = singleton {
                let on_collision = match on_collision.as_str() {
                    "cancel_in_progress" => ax_sdk::Collision::CancelInProgress,
                    _ => ax_sdk::Collision::CancelNew,
                };
                start = start.singleton(key, on_collision);
            }
            let id = client.start_flow(start).await?;
            if !wait {
                println!("{id}");
                return Ok(());
            }
            let run = tokio::time::timeout(timeout, client.wait_flow(&id))
                .await
                .with_context(|| format!("run {id} did not end within {timeout:?}"))??;
            let view = client.flow("get", &json!({ "run": id })).await?;
            print_run(&view);
            if run.state != ax_sdk::flow::RunState::Succeeded {
                bail!("run {id} ended {}", run.state);
            }
        }
        FlowCommand::Get { run, dot, json } => {
            let view = client.flow("get", &json!({ "run": run })).await?;
            if dot {
                print_dot(&view);
            } else if json || output == Output::Json {
                println!("{}", serde_json::to_string_pretty(&view)?);
            } else {
                print_run(&view);
            }
        }
        FlowCommand::List { flow, state, limit } => {
            let body = json!({"flow": flow, "state": state, "limit": limit});
            let runs = client.flow("list", &body).await?;
            if output == Output::Json {
                return out::json(&runs);
            }
            println!(
                "{:<24} {:<24} {:<10} {:<24} reason",
                "RUN", "FLOW", "STATE", "CREATED"
            );
            for r in runs.as_array().into_iter().flatten() {
                println!(
                    "{:<24} {:<24} {:<10} {:<24} {}",
                    r["run"].as_str().unwrap_or("?"),
                    r["flow"].as_str().unwrap_or("?"),
                    r["state"].as_str().unwrap_or("?"),
                    r["created_at_ms"]
                        .as_u64()
                        .map(ax_core::time::format_rfc3339_ms)
                        .unwrap_or_default(),
                    r["reason"].as_str().unwrap_or("")
                );
            }
        }
        FlowCommand::Cancel { run } => {
            client.cancel_flow(&run).await?;
            let ended = tokio::time::timeout(Duration::from_secs(30), client.wait_flow(&run))
                .await
                .context("the run did not end within 30 s (is an ax server running?)")??;
            println!("run {run} {}", ended.state);
        }
        FlowCommand::Leader => {
            let lead = client.flow("leader", &json!({})).await?;
            if output == Output::Json {
                return out::json(&lead);
            }
            println!("{}", lead["leader"].as_str().unwrap_or("none"));
        }
        FlowCommand::Rerun { run, mode, input } => {
            let mode = match mode {
                Mode::Failed => RerunMode::Failed,
                Mode::FailedAndDownstream => RerunMode::FailedAndDownstream,
                Mode::Whole => RerunMode::Whole,
            };
            let input = input.as_deref().map(json_arg).transpose()?;
            let id = client.rerun_flow(&run, mode, input).await?;
            println!("{id}");
        }
    }
    Ok(())
}
