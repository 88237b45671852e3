//! Limits (issue 10): the overhead of a generous limit against none, and the accuracy of a
//! rate limit (achieved / configured) at 10, 100 and 1,000 starts per second.
//!
//! Run: `./dev bench limits`. AX_BENCH_TASKS (default 20,000) tasks per overhead run;
//! AX_BENCH_SECS (default 5) seconds of backlog per accuracy run. Two workers of
//! concurrency 256 in this process. Printed, not asserted (docs/PERFORMANCE.md).

mod common;

use ax::worker::{Task, Worker};
use ax::{Client, Server, TaskSpec};
use common::natsd::LocalNats;
use common::*;
use futures::StreamExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

type Starts = Arc<Mutex<Vec<(String, u64)>>>;

async fn submit_all(ax: &Client, n: usize, name: &str, key: Option<&str>) {
    let mut submits = futures::stream::iter(0..n)
        .map(|_| {
            let mut spec = TaskSpec::new(name.to_string());
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
            .filter(|(t, _)| t == name)
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
                    starts.lock().unwrap().push((task.name.clone(), now_ms()));
                    async { Ok(()) }
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
                .filter(|(t, _)| *t == name)
                .map(|(_, at)| *at)
                .collect();
            times.sort_unstable();
            let first = burst - 1;
            let span = (times[times.len() - 1] - times[first]).max(1) as f64 / 1000.0;
            let achieved = (times.len() - 1 - first) as f64 / span;
            let mut most = 0;
            let mut lo = 0;
            for hi in 0..times.len() {
                while times[hi] - times[lo] >= 1000 {
                    lo += 1;
                }
                most = most.max(hi - lo + 1);
            }
            println!(
                "rate {rate}/s, burst {burst}: {count} starts, after the first burst {achieved:.1}/s (achieved/configured {:.3}); most in any 1 s window {most} (allowed {})",
                achieved / rate as f64,
                rate + burst
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
