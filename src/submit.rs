//! `ax submit`: one task, or many from a JSON-lines file in batch requests.

use crate::conn::Conn;
use anyhow::{bail, Context, Result};
use ax_core::protocol::{SubmitRequest, WireError};
use ax_sdk::{Client, Priority, TaskSpec};
use clap::Args;
use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Args)]
pub(crate) struct SubmitArgs {
    /// Queue.
    #[arg(long, default_value = "default")]
    queue: String,
    /// Task name.
    #[arg(long, required_unless_present = "file", conflicts_with = "file")]
    name: Option<String>,
    /// Submit every line of this file (`-`: standard input) as one task: each line is a
    /// submit request (docs/PROTOCOL.md §2), e.g. {"name":"resize","payload":{"id":7}}.
    /// Prints one answer per line, in order, on standard output; a progress bar and a
    /// summary on standard error; exits 1 if any task was refused.
    #[arg(long)]
    file: Option<PathBuf>,
    /// JSON payload.
    #[arg(long)]
    json: Option<String>,
    /// high, normal or low.
    #[arg(long)]
    priority: Option<Priority>,
    /// Run after this long, e.g. 90s, 5m.
    #[arg(long, value_parser = humantime::parse_duration)]
    delay: Option<Duration>,
    /// Run at this RFC 3339 time, e.g. 2026-12-01T08:00:00Z or 2026-12-01T09:00:00+01:00.
    #[arg(long, value_parser = parse_time)]
    run_at: Option<String>,
    /// Idempotency key.
    #[arg(long)]
    key: Option<String>,
    /// The key per-key limits count this task under (`ax limits`).
    #[arg(long)]
    limit_key: Option<String>,
    /// The tenant whose fair share this task is dispatched in (`ax limits fair`).
    #[arg(long)]
    fair_key: Option<String>,
    /// A singleton key: at most one task of it waits or runs at a time in the queue
    /// (docs/guides/limits.md, "Singleton keys").
    #[arg(long, conflicts_with_all = ["debounce_key", "batch_key"])]
    singleton: Option<String>,
    /// What a submit whose singleton key is held does: cancel_new (refuse it; exit 1 with
    /// the holder's id) or cancel_in_progress (cancel the holder, accept this one).
    #[arg(long, requires = "singleton", default_value = "cancel_new",
          value_parser = ["cancel_new", "cancel_in_progress"])]
    on_collision: String,
    /// W3C trace context (`00-<trace id>-<parent id>-<flags>`), logged with every attempt.
    #[arg(long, env = "TRACEPARENT")]
    traceparent: Option<String>,
    /// The business id the task works for (an order number), in its record and logs.
    #[arg(long)]
    business_id: Option<String>,
    /// Attempts in all.
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Hard timeout of one attempt.
    #[arg(long, value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
    /// Debounce under this key: the submits of one key become one task, run once the key
    /// has been quiet for `--debounce` (docs/guides/limits.md, "Debounce").
    #[arg(long, requires = "debounce")]
    debounce_key: Option<String>,
    /// The quiet time of `--debounce-key`, e.g. 2s.
    #[arg(long, value_parser = humantime::parse_duration, requires = "debounce_key")]
    debounce: Option<Duration>,
    /// The longest wait after a burst's first submit (default 10 × `--debounce`).
    #[arg(long, value_parser = humantime::parse_duration, requires = "debounce_key")]
    debounce_max_wait: Option<Duration>,
    /// Run with the burst's first submit's payload instead of the last's.
    #[arg(long, requires = "debounce_key")]
    debounce_keep_first: bool,
    /// Add this submit as an item of a batch key: the items of one key become one task whose
    /// payload is their JSON list (docs/guides/limits.md, "Batching").
    #[arg(long, requires_all = ["batch_size", "batch_timeout"], conflicts_with = "debounce_key")]
    batch_key: Option<String>,
    /// Items per batch at most: a batch is due once this many arrived.
    #[arg(long, requires = "batch_key")]
    batch_size: Option<usize>,
    /// The longest wait after a batch's first item, e.g. 5s.
    #[arg(long, value_parser = humantime::parse_duration, requires = "batch_key")]
    batch_timeout: Option<Duration>,
}

/// Checks the flag as the server will, so a typo fails before anything is sent.
fn parse_time(text: &str) -> Result<String, String> {
    ax_core::time::parse_rfc3339_ms(text)
        .map(|_| text.to_string())
        .map_err(|e| e.to_string())
}

pub(crate) async fn run(args: SubmitArgs, conn: &Conn) -> Result<()> {
    if let Some(file) = &args.file {
        if args.json.is_some()
            || args.priority.is_some()
            || args.delay.is_some()
            || args.run_at.is_some()
            || args.key.is_some()
            || args.limit_key.is_some()
            || args.fair_key.is_some()
            || args.singleton.is_some()
            || args.traceparent.is_some()
            || args.business_id.is_some()
            || args.max_attempts.is_some()
            || args.timeout.is_some()
            || args.debounce_key.is_some()
            || args.batch_key.is_some()
        {
            bail!("with --file, every option comes from the file's lines");
        }
        let client = Client::new(conn.connect().await?);
        return submit_file(&client, &args.queue, file).await;
    }
    let client = Client::new(conn.connect().await?);
    let mut spec = TaskSpec::new(args.name.expect("clap requires it"));
    if let Some(json) = args.json {
        let value: serde_json::Value =
            serde_json::from_str(&json).context("--json is not valid JSON")?;
        spec = spec.json(&value);
    }
    if let Some(p) = args.priority {
        spec = spec.priority(p);
    }
    if let Some(d) = args.delay {
        spec = spec.delay(d);
    }
    if let Some(at) = args.run_at {
        spec = spec.run_at(at);
    }
    if let Some(k) = args.key {
        spec = spec.idempotency_key(k);
    }
    if let Some(k) = args.limit_key {
        spec = spec.limit_key(k);
    }
    if let Some(k) = args.fair_key {
        spec = spec.fair_key(k);
    }
    if let Some(key) = args.singleton {
        let on_collision = match args.on_collision.as_str() {
            "cancel_in_progress" => ax_sdk::Collision::CancelInProgress,
            _ => ax_sdk::Collision::CancelNew,
        };
        spec = spec.singleton(key, on_collision);
    }
    if let Some(t) = args.traceparent {
        spec = spec.traceparent(t);
    }
    if let Some(id) = args.business_id {
        spec = spec.business_id(id);
    }
    if let Some(n) = args.max_attempts {
        spec = spec.max_attempts(n);
    }
    if let Some(t) = args.timeout {
        spec = spec.timeout(t);
    }
    if let (Some(key), Some(period)) = (args.debounce_key, args.debounce) {
        spec = spec.debounce(key, period);
        if let Some(w) = args.debounce_max_wait {
            spec = spec.debounce_max_wait(w);
        }
        if args.debounce_keep_first {
            spec = spec.debounce_keep_first();
        }
    }
    if let (Some(key), Some(size), Some(timeout)) =
        (args.batch_key, args.batch_size, args.batch_timeout)
    {
        spec = spec.batch(key, size, timeout);
    }
    let accepted = client.submit(&args.queue, spec).await?;
    println!("{}", serde_json::to_string(&accepted)?);
    Ok(())
}

/// Tasks handed to the client at a time: big enough to keep four batches in flight,
/// small enough for a live progress bar.
const CHUNK: usize = 8 * ax_server::submit::MAX_BATCH;

/// A line of the file: a request to send, or why it cannot be sent.
type Line = Result<SubmitRequest, WireError>;

fn read_lines(file: &PathBuf) -> Result<Vec<Line>> {
    let reader: Box<dyn BufRead> = if file.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        let f = std::fs::File::open(file).with_context(|| format!("open {}", file.display()))?;
        Box::new(std::io::BufReader::new(f))
    };
    let mut lines = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("read {} line {}", file.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        lines.push(serde_json::from_str::<SubmitRequest>(&line).map_err(|e| {
            WireError::new(
                ax_core::protocol::ErrorCode::BadRequest,
                format!("line {}: {e}", i + 1),
            )
        }));
    }
    Ok(lines)
}

async fn submit_file(client: &Client, queue: &str, file: &PathBuf) -> Result<()> {
    let lines = read_lines(file)?;
    let total = lines.len() as u64;
    let bar = indicatif::ProgressBar::new(total).with_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} tasks  {per_sec}  eta {eta}",
        )
        .expect("a valid template"),
    );
    let started = Instant::now();
    let (mut accepted, mut duplicates) = (0u64, 0u64);
    let mut refused: BTreeMap<String, u64> = BTreeMap::new();
    let mut shown = 0;
    let mut out = std::io::stdout().lock();
    for chunk in lines.chunks(CHUNK) {
        // Lines that did not parse are answered here; the rest go to the server.
        let send: Vec<TaskSpec> = chunk
            .iter()
            .filter_map(|l| l.as_ref().ok().cloned().map(TaskSpec::from_request))
            .collect();
        let mut answers = client.submit_many(queue, send).await.into_iter();
        for line in chunk {
            let answer = match line {
                Ok(_) => answers.next().expect("one answer per task"),
                Err(e) => Err(e.clone()),
            };
            let json = match &answer {
                Ok(a) => {
                    accepted += 1;
                    duplicates += u64::from(a.duplicate);
                    serde_json::to_string(a)?
                }
                Err(e) => {
                    *refused.entry(e.code.as_str().to_string()).or_default() += 1;
                    if shown < 10 {
                        bar.suspend(|| eprintln!("refused: {}", crate::out::refusal_text(e)));
                        shown += 1;
                    }
                    serde_json::to_string(&serde_json::json!({ "error": e }))?
                }
            };
            use std::io::Write;
            writeln!(out, "{json}")?;
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    let refused_n: u64 = refused.values().sum();
    eprintln!(
        "{total} tasks in {secs:.1} s ({:.0}/s): {accepted} accepted ({duplicates} duplicates), {refused_n} refused{}",
        total as f64 / secs.max(1e-9),
        if refused.is_empty() {
            String::new()
        } else {
            format!(" ({refused:?})")
        }
    );
    if refused_n > 0 {
        std::process::exit(1);
    }
    Ok(())
}
