//! ax benchmarks against a raw-JetStream baseline, all on one local nats-server.
//!
//! Run: `./dev bench` (or `cargo bench --bench e2e` with AX_NATS_SERVER set).
//! Settings (environment): AX_BENCH_TASKS (default 50000) tasks for the throughput runs,
//! AX_BENCH_DELAYED (default 50000) delayed tasks, AX_BENCH_SPREAD_SECS (default 10) the
//! window their due times are spread over, AX_BENCH_PAYLOAD (default 256) payload bytes;
//! AX_BENCH_KEYS=1 gives every task of (b) its own idempotency key; AX_BENCH_DIRECT=1 makes
//! the producers of (b) and (b2) submit directly (`Client::direct_submits`).
//!
//! (a) raw JetStream: async publish (pipelined) + pull consume + ack of N messages.
//! (b) ax end to end: submit (request/reply) → admission → ready stream → worker with a
//!     no-op handler → state `running` / `succeeded` written → ack, for N tasks.
//! (c) delayed-task lag: N tasks due uniformly over the spread window; lag from due time to
//!     the ready publish (seen by a core subscriber) and to handler start.

mod common;

use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, TaskSpec};
use ax_server::Server;
use common::*;
use futures::stream::StreamExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio_util::sync::CancellationToken;

/// The allocator of the `ax` binary, so the in-process server and worker run as it does.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// AX_BENCH_DIRECT=1: the producers of (b) and (b2) publish their tasks themselves.
fn direct() -> bool {
    std::env::var("AX_BENCH_DIRECT").is_ok_and(|v| v == "1")
}

/// CPU seconds so far of this process (ax server, worker and producer, or the raw
/// client) and of the nats-server.
#[derive(Clone, Copy)]
struct Cpu {
    here: f64,
    nats: f64,
}

impl Cpu {
    fn now(nats_pid: Option<u32>) -> Cpu {
        Cpu {
            here: common::usage(std::process::id()).0,
            nats: nats_pid.map_or(0.0, |p| common::usage(p).0),
        }
    }

    /// CPU seconds per 10,000 of `n` items since `self`, as a table cell.
    fn per_10k(self, nats_pid: Option<u32>, n: usize) -> String {
        let now = Cpu::now(nats_pid);
        let k = 10_000.0 / n as f64;
        format!(
            "CPU s per 10,000: this process {:.2}, nats-server {:.2}",
            (now.here - self.here) * k,
            (now.nats - self.nats) * k
        )
    }
}

async fn raw_jetstream(client: &async_nats::Client, n: usize, payload: &[u8]) -> f64 {
    let js = async_nats::jetstream::new(client.clone());
    let consumer = common::raw::create(&js, 1).await;
    let start = Instant::now();
    let consume = tokio::spawn(async move {
        let mut msgs = consumer
            .stream()
            .max_messages_per_batch(500)
            .messages()
            .await
            .unwrap();
        let mut acked = 0;
        while acked < n {
            let msg = msgs.next().await.unwrap().unwrap();
            msg.ack().await.unwrap();
            acked += 1;
        }
    });
    common::raw::publish(&js, n, bytes::Bytes::copy_from_slice(payload)).await;
    consume.await.unwrap();
    n as f64 / start.elapsed().as_secs_f64()
}

async fn ax_end_to_end(
    client: &async_nats::Client,
    n: usize,
    payload: &[u8],
    batch: bool,
) -> (f64, f64) {
    let done = Arc::new(AtomicUsize::new(0));
    let stop = CancellationToken::new();
    let worker = Worker::builder("bench")
        .concurrency(512)
        .group_commit(group_commit())
        .handler({
            let done = done.clone();
            move |_task: Task| {
                done.fetch_add(1, Ordering::Relaxed);
                async { Ok(()) }
            }
        })
        .build()
        .unwrap();
    let worker = tokio::spawn(worker.run(client.clone(), stop.clone()));
    let ax = Client::new(client.clone()).direct_submits(direct());
    let value = serde_json::Value::String("x".repeat(payload.len().saturating_sub(2)));
    // AX_BENCH_KEYS=1: task i carries its own key (the same on a resubmit after `busy`).
    let keyed = std::env::var("AX_BENCH_KEYS").is_ok_and(|v| v == "1");
    let run = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let spec = move |i: usize, value: &serde_json::Value| {
        let spec = TaskSpec::new("noop").json(value);
        match keyed {
            true => spec.idempotency_key(format!("bench-{run}-{i}")),
            false => spec,
        }
    };
    let start = Instant::now();
    if batch {
        // Batch submits: Client::submit_many, 1,000 tasks a request, 4 requests in flight;
        // a refused task (busy) is sent again.
        let mut left: Vec<usize> = (0..n).collect();
        while !left.is_empty() {
            let specs = left.iter().map(|&i| spec(i, &value));
            let answers = ax.submit_many("bench", specs).await;
            for a in &answers {
                if let Err(e) = a {
                    assert!(e.code.is_retryable(), "submit: {e}");
                }
            }
            left = left
                .iter()
                .zip(&answers)
                .filter(|(_, a)| a.is_err())
                .map(|(&i, _)| i)
                .collect();
        }
    }
    let mut submits = futures::stream::iter(0..if batch { 0 } else { n })
        .map(|i| {
            let ax = ax.clone();
            let value = value.clone();
            async move {
                loop {
                    match ax.submit("bench", spec(i, &value)).await {
                        Ok(_) => return,
                        Err(ax_sdk::ClientError::Refused(e)) if e.code.is_retryable() => {
                            tokio::time::sleep(Duration::from_millis(5)).await
                        }
                        Err(e) => panic!("submit: {e}"),
                    }
                }
            }
        })
        .buffer_unordered(1024);
    let mut submitted = 0;
    while submits.next().await.is_some() {
        submitted += 1;
        if submitted % 10_000 == 0 {
            eprintln!(
                "  ... {submitted} submitted, {} ran",
                done.load(Ordering::Relaxed)
            );
        }
    }
    let submit_rate = n as f64 / start.elapsed().as_secs_f64();
    eprintln!("  ... all {n} submitted in {:?}", start.elapsed());
    // Done when every task ran and was acked (the ready streams are empty).
    let js = async_nats::jetstream::new(client.clone());
    loop {
        if done.load(Ordering::Relaxed) >= n {
            let mut left = 0;
            for p in ax_sdk::Priority::ALL {
                let stream = js.get_stream(p.ready_stream()).await.unwrap();
                let mut consumer: async_nats::jetstream::consumer::PullConsumer = stream
                    .get_consumer(&ax_core::names::consumer_name("bench", p))
                    .await
                    .unwrap();
                let info = consumer.info().await.unwrap();
                left += info.num_pending + info.num_ack_pending as u64;
            }
            if left == 0 {
                break;
            }
            eprintln!("  ... {left} still unacked");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    stop.cancel();
    worker.await.unwrap().unwrap();
    (rate, submit_rate)
}

async fn delayed_lag(client: &async_nats::Client, n: usize, spread: Duration, lead: Duration) {
    let starts: Arc<Mutex<Vec<f64>>> = Arc::default();
    let published: Arc<Mutex<Vec<f64>>> = Arc::default();
    let mut sub = client.subscribe("ax.ready.lag.*").await.unwrap();
    let watcher = tokio::spawn({
        let published = published.clone();
        async move {
            while let Some(msg) = sub.next().await {
                let now = now_ms();
                if let Some(at) = msg
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Ax-Run-At-Ms"))
                    .and_then(|v| v.as_str().parse::<u64>().ok())
                {
                    published.lock().unwrap().push(now as f64 - at as f64);
                }
            }
        }
    });
    let stop = CancellationToken::new();
    let worker = Worker::builder("lag")
        .concurrency(512)
        .handler({
            let starts = starts.clone();
            move |task: Task| {
                if let Some(at) = task.run_at_ms {
                    starts.lock().unwrap().push(now_ms() as f64 - at as f64);
                }
                async { Ok(()) }
            }
        })
        .build()
        .unwrap();
    let worker = tokio::spawn(worker.run(client.clone(), stop.clone()));
    let ax = Client::new(client.clone());
    let base = SystemTime::now() + lead;
    let step = spread.as_secs_f64() / n as f64;
    let t = Instant::now();
    let mut submits = futures::stream::iter(0..n)
        .map(|i| {
            let ax = ax.clone();
            let at = base + Duration::from_secs_f64(step * i as f64);
            async move {
                let text = humantime::format_rfc3339_millis(at).to_string();
                ax.submit("lag", TaskSpec::new("tick").run_at(text))
                    .await
                    .unwrap();
            }
        })
        .buffer_unordered(1024);
    while submits.next().await.is_some() {}
    let submitted_in = t.elapsed();
    if submitted_in > lead {
        println!("  warning: submission took {submitted_in:?}, longer than the {lead:?} lead");
    }
    let deadline = Instant::now() + lead + spread + Duration::from_secs(60);
    while starts.lock().unwrap().len() < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    worker.await.unwrap().unwrap();
    watcher.abort();
    let (p50, p99, max) = percentiles(published.lock().unwrap().clone());
    println!(
        "(c) delayed lag, {n} tasks due over {spread:?}: due -> ready publish  p50 {p50:.1} ms  p99 {p99:.1} ms  max {max:.1} ms"
    );
    let seen = starts.lock().unwrap().len();
    let (p50, p99, max) = percentiles(starts.lock().unwrap().clone());
    println!(
        "(c) delayed lag, {n} tasks due over {spread:?}: due -> handler start  p50 {p50:.1} ms  p99 {p99:.1} ms  max {max:.1} ms  ({seen} ran)"
    );
}

fn main() {
    let n = env_or("AX_BENCH_TASKS", 50_000);
    let n_delayed = env_or("AX_BENCH_DELAYED", 50_000);
    let spread = Duration::from_secs(env_or("AX_BENCH_SPREAD_SECS", 10) as u64);
    let payload = vec![b'x'; env_or("AX_BENCH_PAYLOAD", 256)];
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // AX_BENCH_SYNC=always: every write fsynced, as deploy/nats-server.conf runs it.
        let conf = tempfile::NamedTempFile::new().unwrap();
        let (nats, always) = nats_from_env(&conf);
        println!("machine: {}", machine());
        println!(
            "nats-server: {} (file store, R1, sync: {}), one process for ax + clients",
            nats.url(),
            if always { "always (every write fsynced)" } else { "default (fsync every 2 min)" }
        );
        println!(
            "group commit (submits and worker records): {:?} (AX_BENCH_GROUP_COMMIT=auto|1|0)",
            group_commit()
        );
        println!(
            "(b), (b2) direct submits (no ax server on the path): {} (AX_BENCH_DIRECT=1)",
            direct()
        );
        println!(
            "(b) tasks with an idempotency key each: {} (AX_BENCH_KEYS=1)",
            std::env::var("AX_BENCH_KEYS").is_ok_and(|v| v == "1")
        );
        let client = async_nats::connect(nats.url()).await.unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(
            Server::builder()
                .queues(["bench", "lag"])
                .capacity([100_000, 100_000, 100_000])
                .group_commit(group_commit())
                .build()
                .run(client.clone(), stop.clone()),
        );
        // Wait for the server to answer.
        let ax = Client::new(client.clone());
        while ax.submit("lag", TaskSpec::new("warmup")).await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let pid = nats.pid();
        let cpu = Cpu::now(pid);
        let raw = raw_jetstream(&client, n, &payload).await;
        println!(
            "(a) raw JetStream: {n} msgs of {} B, publish + fetch + ack: {raw:.0} msg/s; {}",
            payload.len(),
            cpu.per_10k(pid, n)
        );
        let cpu = Cpu::now(pid);
        let (axr, submit_rate) = ax_end_to_end(&client, n, &payload, false).await;
        println!(
            "(b) ax end to end: {n} tasks of {} B, submit -> run -> state -> ack: {axr:.0} tasks/s (submit alone {submit_rate:.0}/s); {}",
            payload.len(),
            cpu.per_10k(pid, n)
        );
        println!("ratio ax/raw (single submits): {:.2}", axr / raw);
        let cpu = Cpu::now(pid);
        let (axb, batch_rate) = ax_end_to_end(&client, n, &payload, true).await;
        println!(
            "(b2) ax end to end, batch submits: {n} tasks of {} B: {axb:.0} tasks/s (submit alone {batch_rate:.0}/s); {}",
            payload.len(),
            cpu.per_10k(pid, n)
        );
        println!("ratio ax/raw: {:.2}", axb / raw);
        let lead = Duration::from_secs_f64((2.0 * n_delayed as f64 / submit_rate).max(5.0));
        delayed_lag(&client, n_delayed, spread, lead).await;
        stop.cancel();
        server.await.unwrap().unwrap();
    });
}

/// `AX_BENCH_GROUP_COMMIT`: group commit in the bench's server and worker: `auto` (the
/// default, as in ax), `1` (always) or `0` (never).
fn group_commit() -> ax_core::atomic::GroupCommit {
    use ax_core::atomic::GroupCommit;
    match std::env::var("AX_BENCH_GROUP_COMMIT").as_deref() {
        Ok("0") | Ok("never") => GroupCommit::Never,
        Ok("1") | Ok("always") => GroupCommit::Always,
        _ => GroupCommit::Auto,
    }
}
