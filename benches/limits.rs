//! Limits: the overhead of a generous limit against none; the accuracy of
//! a rate limit (achieved / configured) and the most *handler starts* in any 1 s window at
//! 10, 100 and 1,000 starts per second; and the utilisation of a saturated concurrency cap
//! (busy slot-time / capacity) whose tasks finish at 10, 100 and 1,000 per second.
//!
//! Run: `./dev bench limits`. AX_BENCH_TASKS (default 20,000) tasks per overhead run;
//! AX_BENCH_SECS (default 5) seconds of backlog per accuracy and cap run. Two workers of
//! concurrency 256 in this process. Printed, not asserted (docs/PERFORMANCE.md; the
//! integration tests `limits_pace` assert looser bounds beside the whole suite).

mod common;

use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, TaskSpec};
use ax_server::Server;
use ax_testkit::LocalNats;
use common::*;
use futures::StreamExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Per handler run: task name, start and end (µs since the epoch).
type Starts = Arc<Mutex<Vec<(String, u64, u64)>>>;

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

async fn submit_all(ax: &Client, n: usize, name: &str, key: Option<&str>) {
    submit_sleeping(ax, n, name, key, 0).await
}

async fn submit_sleeping(ax: &Client, n: usize, name: &str, key: Option<&str>, sleep_us: u64) {
    let mut submits = futures::stream::iter(0..n)
        .map(|_| {
            let mut spec =
                TaskSpec::new(name.to_string()).json(&serde_json::json!({ "sleep_us": sleep_us }));
            if let Some(k) = key {
                spec = spec.limit_key(k);
            }
            let ax = ax.clone();
            async move {
                ax.submit("lim", spec).await.unwrap();
            }
        })
        .buffer_unordered(512);
    while submits.next().await.is_some() {}
}

async fn wait_for(starts: &Starts, name: &str, n: usize) {
    loop {
        let done = starts
            .lock()
            .unwrap()
            .iter()
            .filter(|(t, _, _)| t == name)
            .count();
        if done >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn main() {
    let n = env_or("AX_BENCH_TASKS", 20_000);
    let secs = env_or("AX_BENCH_SECS", 5);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let nats = LocalNats::start().expect("nats-server (run via ./dev bench limits)");
        let client = async_nats::connect(nats.url()).await.unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(
            Server::builder()
                .queues(["lim"])
                .capacity([1000, 200_000, 1000])
                .build()
                .run(client.clone(), stop.clone()),
        );
        let ax = Client::new(client.clone());
        while ax.submit("lim", TaskSpec::new("warmup")).await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let starts: Starts = Arc::default();
        let mut workers = Vec::new();
        for _ in 0..2 {
            let starts = starts.clone();
            let worker = Worker::builder("lim")
                .concurrency(256)
                .handler(move |task: Task| {
                    let starts = starts.clone();
                    async move {
                        let start = now_us();
                        let p: serde_json::Value = task.json().unwrap_or_default();
                        let sleep = p["sleep_us"].as_u64().unwrap_or(0);
                        if sleep > 0 {
                            tokio::time::sleep(Duration::from_micros(sleep)).await;
                        }
                        starts.lock().unwrap().push((task.name.clone(), start, now_us()));
                        Ok(())
                    }
                })
                .build()
                .unwrap();
            let c = async_nats::connect(nats.url()).await.unwrap();
            workers.push(tokio::spawn(worker.run(c, stop.clone())));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;

        // Overhead: the same tasks without a limit, then under a generous one.
        let t = Instant::now();
        submit_all(&ax, n, "free", None).await;
        wait_for(&starts, "free", n).await;
        let free = t.elapsed();
        ax.limits("put", &serde_json::json!({"name": "generous", "queue": "lim", "task": "limited",
            "rate": 100000.0, "burst": 100000, "concurrency": 1000}))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let t = Instant::now();
        submit_all(&ax, n, "limited", None).await;
        wait_for(&starts, "limited", n).await;
        let limited = t.elapsed();
        println!(
            "overhead: {n} tasks without a limit {:.0}/s, under a generous rate + concurrency limit {:.0}/s (ratio limited/free {:.2})",
            n as f64 / free.as_secs_f64(),
            n as f64 / limited.as_secs_f64(),
            (n as f64 / limited.as_secs_f64()) / (n as f64 / free.as_secs_f64())
        );

        // Accuracy: a backlog of `secs` seconds at each rate, with burst 1 (strict) and
        // with the default burst (the rate: a second's worth may be banked). The starts
        // within the first burst are left out of the achieved rate.
        for (rate, strict) in [(10usize, true), (100, true), (1000, true), (10, false), (100, false), (1000, false)] {
            let name = format!("r{rate}{}", if strict { "s" } else { "d" });
            let burst = if strict { 1 } else { rate };
            ax.limits("put", &serde_json::json!({"name": name, "queue": "lim", "task": name,
                "rate": rate as f64, "burst": burst}))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(500)).await;
            let count = rate * secs;
            submit_all(&ax, count, &name, None).await;
            wait_for(&starts, &name, count).await;
            let mut times: Vec<u64> = starts
                .lock()
                .unwrap()
                .iter()
                .filter(|(t, _, _)| *t == name)
                .map(|(_, at, _)| *at)
                .collect();
            times.sort_unstable();
            let first = burst - 1;
            let span = (times[times.len() - 1] - times[first]).max(1) as f64 / 1e6;
            let achieved = (times.len() - 1 - first) as f64 / span;
            let most = most_in_window(&times, 1_000_000);
            println!(
                "rate {rate}/s, burst {burst}: {count} starts, after the first burst {achieved:.1}/s (achieved/configured {:.3}); most handler starts in any 1 s window {most} (allowed burst + rate = {})",
                achieved / rate as f64,
                rate + burst
            );
        }

        // Caps: a backlog of `secs` seconds of work for a cap of 5, with tasks that take
        // 500, 50 and 5 ms (the cap passes 10, 100 and 1,000 tasks a second when full).
        for (per_s, cap) in [(10usize, 5usize), (100, 5), (1000, 5)] {
            let name = format!("c{per_s}");
            ax.limits("put", &serde_json::json!({"name": name, "queue": "lim", "task": name,
                "concurrency": cap}))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(500)).await;
            let count = per_s * secs;
            let sleep_us = 1_000_000 * cap as u64 / per_s as u64;
            submit_sleeping(&ax, count, &name, None, sleep_us).await;
            wait_for(&starts, &name, count).await;
            let runs: Vec<(u64, u64)> = starts
                .lock()
                .unwrap()
                .iter()
                .filter(|(t, _, _)| *t == name)
                .map(|(_, s, e)| (*s, *e))
                .collect();
            let busy: u64 = runs.iter().map(|(s, e)| e - s).sum();
            let first = runs.iter().map(|r| r.0).min().unwrap();
            let last = runs.iter().map(|r| r.1).max().unwrap();
            let used = busy as f64 / (cap as f64 * (last - first).max(1) as f64);
            println!(
                "cap {cap}, tasks of {} ms ({per_s}/s when full): {count} tasks, utilisation {used:.3} (busy slot-time / cap × span), most running at once {}",
                sleep_us as f64 / 1000.0,
                most_open(&runs)
            );
        }
        let (_, rss) = usage(std::process::id());
        println!("bench process RSS after: {} MiB", rss / 1024);
        stop.cancel();
        for w in workers {
            let _ = w.await;
        }
        server.await.unwrap().unwrap();
    });
}

/// Most of the sorted `times` in any window of `window` (µs, half-open).
fn most_in_window(times: &[u64], window: u64) -> usize {
    let (mut most, mut lo) = (0, 0);
    for hi in 0..times.len() {
        while times[hi] - times[lo] >= window {
            lo += 1;
        }
        most = most.max(hi - lo + 1);
    }
    most
}

/// Most runs open at once.
fn most_open(runs: &[(u64, u64)]) -> usize {
    let mut edges: Vec<(u64, i32)> = runs.iter().flat_map(|(s, e)| [(*s, 1), (*e, -1)]).collect();
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in edges {
        now += d;
        most = most.max(now);
    }
    most as usize
}
