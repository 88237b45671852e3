//! Flow control: debounce, priority aging, batching and fair shares.
//!
//! - **debounce**: AX_BENCH_TASKS (default 100,000) debounced submits over AX_BENCH_KEYS
//!   (default 1,000) keys, 512 in flight, quiet period 500 ms (max wait 60 s); beside it
//!   the same number of plain submits. Prints submits per second of each, the runs made
//!   (one per key when every key's burst stays within its period), and how long after
//!   its key went quiet (its last answered submit + the period) each run started.
//! - **aging**: one worker (concurrency 8, 5 ms handlers) under a high-priority backlog
//!   that never runs out (AX_BENCH_SECS, default 10 s), and 200 low tasks submitted at
//!   the start: how long the low tasks waited (p50 / p99 / max) with weights 6 / 3 / 1,
//!   without and with aging after 1 s.
//!
//! - **batching**: AX_BENCH_TASKS items over AX_BENCH_BATCH_KEYS (default 16) batch keys
//!   in batches of AX_BENCH_BATCH_SIZE (default 500, timeout 2 s), 512 in flight, and the
//!   same number of single tasks: items (tasks) per second from the first submit to the
//!   last handled, the batches run and their mean length. `AX_BENCH_ITEM_KEYS=1` runs the
//!   items once more, each with an idempotency key of its own.
//!
//! - **fairness**: backlogs of AX_BENCH_TASKS (`a`, weight 1) and a tenth of it (`c`,
//!   weight 2), then 10 tasks of `b`, through one worker of 64 — once without fair keys,
//!   once with: end-to-end tasks per second (the ratio), `b`'s waits from its submit, and
//!   `c` : `a` starts while `c` ran; then `b`'s 10 alone on the idle fair queue (20 times).
//!
//! `AX_BENCH_ONLY=debounce|aging|batching|fairness` runs one part.
//!
//! Run: `./dev bench flowcontrol`. Server and workers in this process; printed, not
//! asserted (docs/PERFORMANCE.md).

mod common;

use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, Priority, TaskSpec};
use ax_server::Server;
use ax_testkit::LocalNats;
use common::*;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The allocator of the `ax` binary, which runs the server and workers as deployed.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Handler starts: (task id, name, ms since the epoch).
type Starts = Arc<Mutex<Vec<(String, String, u64)>>>;

fn recording(
    queue: &str,
    starts: Starts,
    concurrency: usize,
    sleep: Duration,
) -> ax_sdk::worker::WorkerBuilder {
    Worker::builder(queue)
        .concurrency(concurrency)
        .handler(move |task: Task| {
            let starts = starts.clone();
            async move {
                starts
                    .lock()
                    .unwrap()
                    .push((task.id.clone(), task.name.clone(), now_ms()));
                if !sleep.is_zero() {
                    tokio::time::sleep(sleep).await;
                }
                Ok(())
            }
        })
}

async fn debounce(ax: &Client, nats: &async_nats::Client, n: usize, keys: usize) {
    let starts: Starts = Arc::default();
    let stop = CancellationToken::new();
    let worker = recording("deb", starts.clone(), 256, Duration::ZERO)
        .build()
        .unwrap();
    let w = tokio::spawn(worker.run(nats.clone(), stop.clone()));
    let period = Duration::from_millis(500);
    // Plain submits first: the cost of a debounced submit beside an ordinary one.
    let t = Instant::now();
    futures::stream::iter(0..n)
        .map(|_| ax.submit("deb", TaskSpec::new("plain")))
        .buffer_unordered(512)
        .for_each(|r| async move {
            r.unwrap();
        })
        .await;
    let plain = n as f64 / t.elapsed().as_secs_f64();
    let last: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let t = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let spec = TaskSpec::new("debounced")
                .json(&serde_json::json!({ "i": i }))
                .debounce(format!("key-{}", i % keys), period)
                .debounce_max_wait(Duration::from_secs(60));
            let (ax, last) = (ax.clone(), last.clone());
            async move {
                let a = ax.submit("deb", spec).await.unwrap();
                let mut last = last.lock().unwrap();
                let at = last.entry(a.id).or_default();
                *at = (*at).max(now_ms());
            }
        })
        .buffer_unordered(512)
        .collect::<Vec<()>>()
        .await;
    let debounced = n as f64 / t.elapsed().as_secs_f64();
    let windows = last.lock().unwrap().clone();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let ran = starts
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.1 == "debounced")
            .count();
        if ran >= windows.len() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let starts = starts.lock().unwrap().clone();
    let runs: Vec<&(String, String, u64)> = starts.iter().filter(|s| s.1 == "debounced").collect();
    let after_quiet: Vec<f64> = runs
        .iter()
        .filter_map(|(id, _, at)| {
            windows
                .get(id)
                .map(|last| *at as f64 - (*last + period.as_millis() as u64) as f64)
        })
        .collect();
    let (p50, p99, max) = percentiles(after_quiet);
    println!(
        "debounce: {n} submits over {keys} keys: {debounced:.0} submits/s (plain submits {plain:.0}/s, ratio {:.2}); {} windows answered, {} runs; start after the key went quiet (last answer + 500 ms): p50 {p50:.0} ms, p99 {p99:.0} ms, max {max:.0} ms",
        debounced / plain,
        windows.len(),
        runs.len()
    );
    stop.cancel();
    let _ = w.await;
}

async fn aging(ax: &Client, nats: &async_nats::Client, secs: u64, after: Option<Duration>) {
    let queue = if after.is_some() { "aged" } else { "plain" };
    let starts: Starts = Arc::default();
    let lows: Vec<TaskSpec> = (0..200)
        .map(|_| TaskSpec::new("low").priority(Priority::Low))
        .collect();
    let submitted = now_ms();
    for a in ax.submit_many(queue, lows).await {
        a.unwrap();
    }
    let stop = CancellationToken::new();
    // Keeps the high backlog at about 2,000 tasks for `secs`.
    let feeder = {
        let (ax, stop) = (ax.clone(), stop.clone());
        tokio::spawn(async move {
            let until = Instant::now() + Duration::from_secs(secs);
            while Instant::now() < until && !stop.is_cancelled() {
                let highs: Vec<TaskSpec> = (0..500)
                    .map(|_| TaskSpec::new("high").priority(Priority::High))
                    .collect();
                for a in ax.submit_many(queue, highs).await {
                    let _ = a;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let mut worker = recording(queue, starts.clone(), 8, Duration::from_millis(5));
    if let Some(after) = after {
        worker = worker.aging(after);
    }
    let w = tokio::spawn(worker.build().unwrap().run(nats.clone(), stop.clone()));
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let _ = feeder.await;
    stop.cancel();
    let _ = w.await;
    let starts = starts.lock().unwrap().clone();
    let waits: Vec<f64> = starts
        .iter()
        .filter(|s| s.1 == "low")
        .map(|s| (s.2 - submitted) as f64)
        .collect();
    let highs = starts.iter().filter(|s| s.1 == "high").count();
    let done = waits.len();
    let (p50, p99, max) = percentiles(waits);
    println!(
        "aging {}: {done} of 200 low tasks started in {secs} s beside {highs} high ones; waited p50 {p50:.0} ms, p99 {p99:.0} ms, max {max:.0} ms",
        after.map_or("off".to_string(), |a| format!("after {} ms", a.as_millis())),
    );
}

/// Handled items: (task id, items in its list).
type Handled = Arc<Mutex<Vec<(String, usize)>>>;

/// `n` items over `keys` batch keys in batches of `size`, beside `n` single tasks: items
/// per second end to end.
async fn batching(ax: &Client, nats: &async_nats::Client, n: usize, keys: usize, size: usize) {
    let handled: Handled = Arc::default();
    let stop = CancellationToken::new();
    let worker = {
        let handled = handled.clone();
        Worker::builder("bat")
            .concurrency(256)
            .handler(move |task: Task| {
                let handled = handled.clone();
                async move {
                    let items = match task.name.as_str() {
                        "batched" => task.json::<Vec<serde_json::Value>>()?.len(),
                        _ => 1,
                    };
                    handled.lock().unwrap().push((task.id, items));
                    Ok(())
                }
            })
            .build()
            .unwrap()
    };
    let w = tokio::spawn(worker.run(nats.clone(), stop.clone()));
    let wait_items = |name_items: usize| {
        let handled = handled.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(300);
            loop {
                let got: usize = handled.lock().unwrap().iter().map(|h| h.1).sum();
                if got >= name_items || Instant::now() > deadline {
                    return got;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let t = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            ax.submit(
                "bat",
                TaskSpec::new("single").json(&serde_json::json!({ "i": i })),
            )
        })
        .buffer_unordered(512)
        .for_each(|r| async move {
            r.unwrap();
        })
        .await;
    wait_items(n).await;
    let single = n as f64 / t.elapsed().as_secs_f64();
    // Without item keys, then (AX_BENCH_ITEM_KEYS=1) with one per item, on keys of their own.
    let keyed_too = env_or("AX_BENCH_ITEM_KEYS", 0) == 1;
    let mut unkeyed = 0.0;
    for keyed in [false, true].into_iter().filter(|k| !k || keyed_too) {
        handled.lock().unwrap().clear();
        let t = Instant::now();
        futures::stream::iter(0..n)
            .map(|i| {
                let spec = TaskSpec::new("batched")
                    .json(&serde_json::json!({ "i": i }))
                    .batch(
                        format!("key-{keyed}-{}", i % keys),
                        size,
                        Duration::from_secs(2),
                    );
                let spec = match keyed {
                    true => spec.idempotency_key(format!("item-{i}")),
                    false => spec,
                };
                ax.submit("bat", spec)
            })
            .buffer_unordered(512)
            .for_each(|r| async move {
                assert!(!r.unwrap().duplicate, "every item is a new one");
            })
            .await;
        let submitted = n as f64 / t.elapsed().as_secs_f64();
        let got = wait_items(n).await;
        let batched = got as f64 / t.elapsed().as_secs_f64();
        let runs = handled.lock().unwrap().len();
        let against = match keyed {
            true => format!(", {:.2} × without item keys", batched / unkeyed),
            false => String::new(),
        };
        unkeyed = batched;
        println!(
            "batching{}: {n} items over {keys} keys in batches of {size}: {submitted:.0} items submitted/s; end to end {batched:.0} items/s (single tasks {single:.0}/s, ratio {:.2}{against}); {runs} batches run, {got} items handled, mean {:.0} per batch",
            if keyed { " (an idempotency key per item)" } else { "" },
            batched / single,
            got as f64 / runs.max(1) as f64,
        );
    }
    stop.cancel();
    let _ = w.await;
}

/// Submits `n` tasks of `tenant` (its task name; its fair key too if `fair`), 512 in
/// flight; answers the submit time of each, ms.
async fn submit_tenant(ax: &Client, queue: &str, tenant: &str, n: usize, fair: bool) -> Vec<u64> {
    futures::stream::iter(0..n)
        .map(|_| {
            let mut spec = TaskSpec::new(tenant);
            if fair {
                spec = spec.fair_key(tenant);
            }
            async move {
                let at = now_ms();
                ax.submit(queue, spec).await.unwrap();
                at
            }
        })
        .buffer_unordered(512)
        .collect()
        .await
}

/// Backlogs of 100,000 (`a`, weight 1) and 10,000 (`c`, weight 2) tasks (scaled by
/// `n` / 100,000), then 10 of `b`, through one worker of 64: end-to-end throughput, `b`'s
/// waits (submit to start) and `c` : `a` starts while both were held, with and without
/// fair keys; and `b`'s waits alone on an idle fair queue.
async fn fairness(ax: &Client, nats: &async_nats::Client, n: usize) {
    ax.limits(
        "fair_put",
        &serde_json::json!({"queue": "fair", "weights": {"c": 2},
                            "depth": env_or("AX_BENCH_FAIR_DEPTH", 256)}),
    )
    .await
    .unwrap();
    let (big, mid) = (n, n / 10);
    let mut ratio_plain = 0.0;
    for (queue, fair) in [("unfair", false), ("fair", true)] {
        let starts: Starts = Arc::default();
        let stop = CancellationToken::new();
        let worker = recording(queue, starts.clone(), 64, Duration::ZERO)
            .build()
            .unwrap();
        let w = tokio::spawn(worker.run(nats.clone(), stop.clone()));
        let t = Instant::now();
        submit_tenant(ax, queue, "a", big, fair).await;
        submit_tenant(ax, queue, "c", mid, fair).await;
        let b_at = submit_tenant(ax, queue, "b", 10, fair).await;
        let total = big + mid + 10;
        let submitted = (t.elapsed(), starts.lock().unwrap().len());
        while starts.lock().unwrap().len() < total && t.elapsed() < Duration::from_secs(600) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let rate = total as f64 / t.elapsed().as_secs_f64();
        let rest = (total - submitted.1) as f64 / (t.elapsed() - submitted.0).as_secs_f64();
        println!(
            "fairness {queue}: every submit answered after {:.1} s, {} tasks started by then; the rest {rest:.0}/s",
            submitted.0.as_secs_f64(),
            submitted.1
        );
        stop.cancel();
        let _ = w.await;
        let starts = starts.lock().unwrap().clone();
        let b_first_submit = b_at.iter().min().copied().unwrap_or(0);
        let mut b_waits: Vec<u64> = starts
            .iter()
            .filter(|s| s.1 == "b")
            .map(|s| s.2.saturating_sub(b_first_submit))
            .collect();
        b_waits.sort();
        let first_c = starts.iter().position(|s| s.1 == "c").unwrap_or(0);
        let last_c = starts.iter().rposition(|s| s.1 == "c").unwrap_or(0);
        let span = &starts[first_c..=last_c];
        let count = |t: &str| span.iter().filter(|s| s.1 == t).count();
        let ratio = count("c") as f64 / count("a").max(1) as f64;
        if !fair {
            ratio_plain = rate;
        }
        println!(
            "fairness {queue}: {total} tasks (a {big}, c {mid}, b 10) end to end {rate:.0}/s{}; b's waits after its submit p50 {} ms, max {} ms; c : a starts while c ran {ratio:.3} ({} : {})",
            if fair { format!(" = {:.2} × without fair keys", rate / ratio_plain) } else { String::new() },
            b_waits.get(b_waits.len() / 2).copied().unwrap_or(0),
            b_waits.last().copied().unwrap_or(0),
            count("c"),
            count("a"),
        );
    }
    // b alone on an idle fair queue.
    let starts: Starts = Arc::default();
    let stop = CancellationToken::new();
    let worker = recording("fair", starts.clone(), 64, Duration::ZERO)
        .build()
        .unwrap();
    let w = tokio::spawn(worker.run(nats.clone(), stop.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut waits = Vec::new();
    for _ in 0..20 {
        let at = submit_tenant(ax, "fair", "b", 10, true).await;
        let first = at.iter().min().copied().unwrap_or(0);
        let t = Instant::now();
        while starts.lock().unwrap().len() < 10 && t.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        waits.extend(
            starts
                .lock()
                .unwrap()
                .drain(..)
                .map(|s| s.2.saturating_sub(first)),
        );
    }
    waits.sort();
    println!(
        "fairness alone: b's 10 tasks on an idle fair queue, 20 times: waits p50 {} ms, p99 {} ms, max {} ms",
        waits.get(waits.len() / 2).copied().unwrap_or(0),
        waits.get(waits.len() * 99 / 100).copied().unwrap_or(0),
        waits.last().copied().unwrap_or(0),
    );
    stop.cancel();
    let _ = w.await;
}

fn main() {
    let n = env_or("AX_BENCH_TASKS", 100_000);
    let keys = env_or("AX_BENCH_KEYS", 1_000);
    let secs = env_or("AX_BENCH_SECS", 10) as u64;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let nats = LocalNats::start().expect("nats-server (run via ./dev bench flowcontrol)");
        let client = async_nats::connect(nats.url()).await.unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(
            Server::builder()
                .queues(["deb", "plain", "aged", "bat", "fair", "unfair"])
                .capacity([200_000, 200_000, 200_000])
                .build()
                .run(client.clone(), stop.clone()),
        );
        let ax = Client::new(client.clone());
        while ax.submit("deb", TaskSpec::new("warmup")).await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        println!("{}", machine());
        let only = std::env::var("AX_BENCH_ONLY").unwrap_or_default();
        let runs = |part: &str| only.is_empty() || only == part;
        if runs("debounce") {
            debounce(&ax, &client, n, keys).await;
        }
        if runs("aging") {
            aging(&ax, &client, secs, None).await;
            aging(&ax, &client, secs, Some(Duration::from_secs(1))).await;
        }
        if runs("batching") {
            let (keys, size) = (
                env_or("AX_BENCH_BATCH_KEYS", 16),
                env_or("AX_BENCH_BATCH_SIZE", 500),
            );
            batching(&ax, &client, n, keys, size).await;
        }
        if runs("fairness") {
            fairness(&ax, &client, n).await;
        }
        stop.cancel();
        let _ = server.await;
    });
}
