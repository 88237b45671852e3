//! Delayed-task bursts: many tasks due at one instant beyond the read-ahead horizon
//! ("send at 09:00" to a mailing list), and a second burst submitted while the first is
//! being read ahead.
//!
//! Run: `./dev bench burst`. Settings: AX_BENCH_BURST (default 100000) tasks in the first
//! burst, AX_BENCH_BURST2 (default 20000) in the second, AX_BENCH_HORIZON_SECS (default 5)
//! the server's read-ahead horizon. Prints, for each burst, how long after its due time
//! the last task reached its ready subject (seen by a core subscriber: "available to a
//! worker") and the p50 / p99 of that lag; nothing is asserted.

mod common;

use ax_sdk::{Client, TaskSpec};
use ax_server::Server;
use ax_testkit::LocalNats;
use common::*;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

async fn submit_burst(ax: &Client, n: usize, due_ms: u64, tag: &str) -> f64 {
    let at = ax_core::time::format_rfc3339_ms(due_ms);
    let t = Instant::now();
    let mut submits = futures::stream::iter(0..n)
        .map(|_| {
            let (ax, at) = (ax.clone(), at.clone());
            let name = tag.to_string();
            async move {
                ax.submit("burst", TaskSpec::new(name).run_at(at))
                    .await
                    .unwrap();
            }
        })
        .buffer_unordered(1024);
    while submits.next().await.is_some() {}
    n as f64 / t.elapsed().as_secs_f64()
}

fn report(name: &str, n: usize, due_ms: u64, arrivals: &[u64]) {
    let lags: Vec<f64> = arrivals.iter().map(|a| *a as f64 - due_ms as f64).collect();
    let (p50, p99, max) = percentiles(lags);
    println!(
        "{name}: {} of {n} tasks in ready; the last {max:.0} ms after the due time (p50 {p50:.0} ms, p99 {p99:.0} ms)",
        arrivals.len()
    );
}

fn main() {
    let n = env_or("AX_BENCH_BURST", 100_000);
    let n2 = env_or("AX_BENCH_BURST2", 20_000);
    let horizon = Duration::from_secs(env_or("AX_BENCH_HORIZON_SECS", 5) as u64);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let nats = LocalNats::start().expect("nats-server (run via ./dev bench burst)");
        let client = async_nats::connect(nats.url()).await.unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(
            Server::builder()
                .queues(["burst"])
                .capacity([1000, 500_000, 1000])
                .dispatch_horizon(horizon)
                .build()
                .run(client.clone(), stop.clone()),
        );
        let ax = Client::new(client.clone());
        while ax.submit("burst", TaskSpec::new("warmup")).await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Arrival time of every task at its ready subject, by burst.
        let arrivals: Arc<Mutex<HashMap<String, Vec<u64>>>> = Arc::default();
        let mut sub = client.subscribe("ax.ready.burst.*").await.unwrap();
        let watcher = tokio::spawn({
            let arrivals = arrivals.clone();
            async move {
                while let Some(msg) = sub.next().await {
                    let now = now_ms();
                    if let Some(name) = msg.headers.as_ref().and_then(|h| h.get("Ax-Task-Name")) {
                        arrivals.lock().unwrap().entry(name.to_string()).or_default().push(now);
                    }
                }
            }
        });
        // Due well after submission ends and beyond the horizon when submitted.
        let lead_ms = horizon.as_millis() as u64 + (n as u64 * 1000 / 12_000) + 5000;
        let due_a = now_ms() + lead_ms;
        let rate_a = submit_burst(&ax, n, due_a, "a").await;
        println!(
            "burst a: {n} tasks due at one time, submitted at {rate_a:.0}/s, {} ms before due (horizon {horizon:?})",
            due_a.saturating_sub(now_ms())
        );
        // While burst a is being read ahead (inside the horizon), a second burst.
        let loading = due_a - horizon.as_millis() as u64 + 500;
        tokio::time::sleep(Duration::from_millis(loading.saturating_sub(now_ms()))).await;
        let due_b = due_a + 2000;
        let rate_b = submit_burst(&ax, n2, due_b, "b").await;
        println!("burst b: {n2} tasks submitted during burst a's read-ahead at {rate_b:.0}/s, due 2 s after a");
        let deadline = Instant::now() + Duration::from_secs(120) + Duration::from_millis(due_b.saturating_sub(now_ms()));
        loop {
            let (a, b) = {
                let arr = arrivals.lock().unwrap();
                (arr.get("a").map_or(0, Vec::len), arr.get("b").map_or(0, Vec::len))
            };
            if (a >= n && b >= n2) || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let arr = arrivals.lock().unwrap().clone();
        report("burst a", n, due_a, arr.get("a").map_or(&[][..], |v| v.as_slice()));
        report("burst b", n2, due_b, arr.get("b").map_or(&[][..], |v| v.as_slice()));
        let (_, rss) = usage(std::process::id());
        println!("bench process (ax server + clients) RSS after: {} MiB", rss / 1024);
        watcher.abort();
        stop.cancel();
        server.await.unwrap().unwrap();
    });
}
