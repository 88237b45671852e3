//! Fair shares as deployed (`./dev bench fairness`): an `ax server` process (the fair
//! dispatcher), an `ax worker --example --sleep 0s` process (concurrency 64) and
//! nats-server, this process the producer (512 submits in flight, by request).
//!
//! Backlogs of AX_BENCH_TASKS (default 100,000) tasks of tenant `a` (weight 1), then a
//! tenth of it of `c` (weight 2), then 10 of `b`: once on queue `unfair` (no fair keys)
//! and once on queue `fair` (each task's tenant its fair key; depth AX_BENCH_FAIR_DEPTH,
//! default 64); then `b`'s 10 alone on the idle fair queue, 20 times. Every figure comes
//! from the tasks' records, read after each part: the worker's `started_at_ms`, and the
//! last `finished_at_ms` as the end. Prints per part: tasks per second from the first
//! submit to the last finished (and the ratio), `b`'s waits (submit to start), `c` : `a`
//! starts while `c` had tasks started, and CPU per 10,000 tasks of each process.
//! AX_BENCH_RUNS (1) repeats the parts; AX_BENCH_SYNC=always fsyncs every write. Printed,
//! not asserted (docs/PERFORMANCE.md, "Fair shares").

mod common;

use ax_sdk::{Client, Priority, TaskRecord, TaskSpec};
use common::deployed::{connect, spawn_ax};
use common::*;
use futures::StreamExt;
use std::time::{Duration, Instant};

/// The allocator of the `ax` binary (the producer is ax's client library).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Submits `n` tasks of `tenant` (its name; its fair key too if `fair`), 512 in flight;
/// answers the earliest submit time, ms, and the tasks' ids.
async fn submit_tenant(
    ax: &Client,
    queue: &str,
    tenant: &str,
    n: usize,
    fair: bool,
) -> (u64, Vec<String>) {
    let first = now_ms();
    let ids = futures::stream::iter(0..n)
        .map(|_| async move {
            let mut spec = TaskSpec::new(tenant);
            if fair {
                spec = spec.fair_key(tenant);
            }
            loop {
                match ax.submit(queue, spec.clone()).await {
                    Ok(a) => return a.id,
                    // Busy (a full subject), no answer in time or no server yet: again.
                    Err(e)
                        if matches!(
                            e.kind(),
                            ax_sdk::ErrorKind::Unavailable | ax_sdk::ErrorKind::TimedOut
                        ) =>
                    {
                        eprintln!("submit refused ({e}); sent again");
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err(e) => panic!("submit refused for good: {e}"),
                }
            }
        })
        .buffer_unordered(512)
        .collect()
        .await;
    (first, ids)
}

/// Waits until nothing of `queue` waits or runs: its ready consumer has nothing pending
/// or unacknowledged, and `AX_FAIR` holds nothing (its purges lag up to 250 ms: the end
/// of a part is read from the records, not from this).
async fn drained(js: &async_nats::jetstream::Context, queue: &str) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(900) {
        let ready = js.get_stream("AX_READY_NORMAL").await.unwrap();
        let info = ready
            .consumer_info(ax_core::names::consumer_name(queue, Priority::Normal))
            .await
            .unwrap();
        let mut fair = js.get_stream("AX_FAIR").await.unwrap();
        let held = fair.info().await.unwrap().state.messages;
        if info.num_pending + info.num_ack_pending as u64 == 0 && held == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every finished record of `queue` started at or after `since` (ms), read from
/// `AX_TASKS` through an ordered consumer on its keys: (name, started, finished), by start.
async fn finished(
    js: &async_nats::jetstream::Context,
    queue: &str,
    since: u64,
) -> Vec<(String, u64, u64)> {
    let stream = js.get_stream("KV_AX_TASKS").await.unwrap();
    let config = async_nats::jetstream::consumer::pull::OrderedConfig {
        filter_subject: format!("$KV.AX_TASKS.{queue}.>"),
        deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::LastPerSubject,
        ..Default::default()
    };
    let mut consumer = stream.create_consumer(config).await.unwrap();
    let mut left = consumer.info().await.unwrap().num_pending;
    let mut msgs = consumer.messages().await.unwrap();
    let mut out = Vec::new();
    while left > 0 {
        let msg = msgs.next().await.unwrap().unwrap();
        left = msg.info().unwrap().pending;
        if let Ok(r) = serde_json::from_slice::<TaskRecord>(&msg.payload) {
            if let (Some(s), Some(f)) = (r.started_at_ms, r.finished_at_ms) {
                if s >= since {
                    out.push((r.name, s, f));
                }
            }
        }
    }
    out.sort_by_key(|r| r.1);
    out
}

/// One queue's backlogs (`fair`: with fair keys); answers its tasks per second.
async fn backlogs(
    ax: &Client,
    js: &async_nats::jetstream::Context,
    pids: &[(String, u32)],
    n: usize,
    fair: bool,
) -> f64 {
    let queue = if fair { "fair" } else { "unfair" };
    let (big, mid) = (n, n / 10);
    let before: Vec<f64> = pids.iter().map(|(_, p)| usage(*p).0).collect();
    let t0 = now_ms();
    submit_tenant(ax, queue, "a", big, fair).await;
    submit_tenant(ax, queue, "c", mid, fair).await;
    let (b_at, _) = submit_tenant(ax, queue, "b", 10, fair).await;
    let submitted = now_ms();
    let total = big + mid + 10;
    drained(js, queue).await;
    let done = finished(js, queue, t0).await;
    let cpu: Vec<f64> = pids
        .iter()
        .zip(&before)
        .map(|((_, p), b)| usage(*p).0 - b)
        .collect();
    let end = done.iter().map(|r| r.2).max().unwrap_or(t0);
    let secs = (end - t0) as f64 / 1000.0;
    let rate = done.len() as f64 / secs;
    let b_waits: Vec<f64> = done
        .iter()
        .filter(|r| r.0 == "b")
        .map(|r| r.1.saturating_sub(b_at) as f64)
        .collect();
    let (b50, _, bmax) = percentiles(b_waits);
    let first_c = done.iter().position(|r| r.0 == "c").unwrap_or(0);
    let last_c = done.iter().rposition(|r| r.0 == "c").unwrap_or(0);
    let span = &done[first_c..=last_c];
    let count = |t: &str| span.iter().filter(|r| r.0 == t).count();
    let cpu_line = pids
        .iter()
        .zip(&cpu)
        .map(|((name, _), s)| format!("{name} {:.2} s/10k", s * 10_000.0 / total as f64))
        .collect::<Vec<_>>()
        .join(", ");
    println!(
        "fairness {queue}: {} of {total} tasks, {rate:.0}/s first submit to last finished \
         ({secs:.1} s; every submit answered after {:.1} s); b's waits p50 {:.0} ms, max {:.0} ms; \
         c : a starts while c ran {:.3} ({} : {}); CPU {cpu_line}",
        done.len(),
        (submitted - t0) as f64 / 1000.0,
        b50,
        bmax,
        count("c") as f64 / count("a").max(1) as f64,
        count("c"),
        count("a"),
    );
    rate
}

/// `b`'s 10 tasks alone on the idle fair queue, 20 times: its waits, submit to start
/// (each record read until it is finished).
async fn alone(ax: &Client, js: &async_nats::jetstream::Context) {
    let tasks = js.get_key_value("AX_TASKS").await.unwrap();
    let mut waits = Vec::new();
    for _ in 0..20 {
        let (at, ids) = submit_tenant(ax, "fair", "b", 10, true).await;
        for id in ids {
            let t = Instant::now();
            loop {
                let value = tasks.get(&id).await.unwrap();
                let record = value.and_then(|v| serde_json::from_slice::<TaskRecord>(&v).ok());
                if let Some(started) = record.and_then(|r| r.finished_at_ms.and(r.started_at_ms)) {
                    waits.push(started.saturating_sub(at) as f64);
                    break;
                }
                assert!(t.elapsed() < Duration::from_secs(30), "{id} never finished");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let (p50, p99, max) = percentiles(waits);
    println!(
        "fairness alone: b's 10 tasks on the idle fair queue, 20 times: waits p50 {p50:.0} ms, p99 {p99:.0} ms, max {max:.0} ms"
    );
}

fn main() {
    let n = env_or("AX_BENCH_TASKS", 100_000);
    let depth = env_or("AX_BENCH_FAIR_DEPTH", 64);
    let runs = env_or("AX_BENCH_RUNS", 1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let conf = tempfile::NamedTempFile::new().unwrap();
        let (nats, always) = nats_from_env(&conf);
        println!("machine: {}", machine());
        println!(
            "fairness as deployed: producer (this process), `ax server`, `ax worker` (64) and \
             nats-server each a process; depth {depth}; sync {}",
            if always { "always" } else { "default" }
        );
        let url = nats.url();
        let client = connect(&url).await;
        let js = async_nats::jetstream::new(client.clone());
        let capacity = format!("{0},{0},{0}", n * 2);
        let mut procs = vec![(
            "server".to_string(),
            spawn_ax(
                &url,
                &[
                    "server",
                    "--queue",
                    "unfair",
                    "--queue",
                    "fair",
                    "--capacity",
                    &capacity,
                ],
            ),
        )];
        let ax = Client::new(client.clone());
        while ax.submit("unfair", TaskSpec::new("warmup")).await.is_err() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        while ax
            .limits(
                "fair_put",
                &serde_json::json!({"queue": "fair", "weights": {"c": 2}, "depth": depth}),
            )
            .await
            .is_err()
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for queue in ["unfair", "fair"] {
            let args = [
                "worker",
                "--example",
                "--queue",
                queue,
                "--concurrency",
                "64",
                "--sleep",
                "0s",
                "--fail-rate",
                "0",
            ];
            procs.push((format!("worker {queue}"), spawn_ax(&url, &args)));
        }
        drained(&js, "unfair").await;
        drained(&js, "fair").await;
        let pids: Vec<(String, u32)> = [("producer".to_string(), std::process::id())]
            .into_iter()
            .chain(procs.iter().map(|(name, c)| (name.clone(), c.id())))
            .chain([("nats".to_string(), nats.pid().expect("running"))])
            .collect();
        for r in 1..=runs {
            println!("run {r}");
            let plain = backlogs(&ax, &js, &pids, n, false).await;
            let fair = backlogs(&ax, &js, &pids, n, true).await;
            println!("fairness: with fair keys {:.2} × without", fair / plain);
            alone(&ax, &js).await;
        }
        for (_, mut c) in procs {
            let _ = c.kill();
            let _ = c.wait();
        }
    });
}
