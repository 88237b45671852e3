//! Trigger precision at scale: N interval triggers each firing every second.
//!
//! Run: `./dev bench triggers` (AX_BENCH_TRIGGERS, default 10,000; AX_BENCH_TRIGGER_SECS,
//! default 60; AX_BENCH_TRIGGER_BURST=1 puts every trigger on the same millisecond instead
//! of spreading them over the second). An `ax server` process runs the engine; a core NATS
//! subscriber on the ready subject measures the lag from each task's scheduled time
//! (`Ax-Scheduled-At-Ms`) to its publish — "available to a worker". No worker runs (the
//! triggers use `overlap: allow`), so the figures are the scheduler's alone. The server's
//! CPU time and RSS are read from /proc.

mod common;

use ax_sdk::Client;
use ax_testkit::LocalNats;
use common::*;
use futures::StreamExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

/// (CPU seconds, RSS MiB) of a process.
fn main() {
    let n = env_or("AX_BENCH_TRIGGERS", 10_000);
    let secs = env_or("AX_BENCH_TRIGGER_SECS", 60) as u64;
    let burst = std::env::var("AX_BENCH_TRIGGER_BURST").is_ok_and(|v| v == "1");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let nats = LocalNats::start().expect("nats-server (run via ./dev bench triggers)");
        let cap = (n as u64 * (secs + 30)).to_string();
        let capacity = format!("{cap},{cap},{cap}");
        let mut server = Command::new(env!("CARGO_BIN_EXE_ax"))
            .args(["server", "--queue", "tb", "--metrics-addr", "off", "--capacity", &capacity])
            .env("NATS_URL", nats.url())
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn ax server");
        let pid = server.id();
        let client = async_nats::connect(nats.url()).await.unwrap();
        let ax = Client::new(client.clone());
        while ax.trigger("list", &serde_json::json!({})).await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // All triggers start together, a few seconds after they are all stored.
        let setup_secs = 5 + n as u64 / 2000;
        let base = now_ms() / 1000 * 1000 + setup_secs * 1000;
        let t0 = std::time::Instant::now();
        futures::stream::iter(0..n)
            .map(|i| {
                let ax = ax.clone();
                let start = base + if burst { 0 } else { (i % 1000) as u64 };
                let at = humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(start)).to_string();
                async move {
                    let def = serde_json::json!({
                        "name": format!("b{i}"), "kind": "interval", "every_ms": 1000,
                        "start_at": at, "overlap": "allow",
                        "tasks": [{"name": "tick", "queue": "tb"}],
                    });
                    ax.trigger("put", &def).await.expect("put trigger");
                }
            })
            .buffer_unordered(256)
            .collect::<Vec<()>>()
            .await;
        eprintln!("  ... {n} triggers stored in {:?}", t0.elapsed());
        let lags: Arc<Mutex<Vec<f64>>> = Arc::default();
        let mut sub = client.subscribe("ax.ready.tb.*").await.unwrap();
        let end = base + secs * 1000;
        let collector = tokio::spawn({
            let lags = lags.clone();
            async move {
                while let Some(msg) = sub.next().await {
                    let now = now_ms();
                    let at = msg
                        .headers
                        .as_ref()
                        .and_then(|h| h.get("Ax-Scheduled-At-Ms"))
                        .and_then(|v| v.as_str().parse::<u64>().ok());
                    if let Some(at) = at {
                        if at >= base && at < end {
                            lags.lock().unwrap().push(now as f64 - at as f64);
                        }
                    }
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(base.saturating_sub(now_ms()))).await;
        let (cpu0, _) = usage(pid);
        let mut peak_rss = 0;
        let wall0 = std::time::Instant::now();
        while now_ms() < end + 5000 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let rss = usage(pid).1 / 1024;
            peak_rss = peak_rss.max(rss);
            let seen = lags.lock().unwrap().len();
            eprintln!("  ... {:>3} s: {seen} fires seen, server RSS {rss} MiB", wall0.elapsed().as_secs());
        }
        let (cpu1, rss) = usage(pid);
        let rss = rss / 1024;
        collector.abort();
        let expected = n as u64 * secs;
        let lags = lags.lock().unwrap().clone();
        let seen = lags.len();
        let (p50, p99, max) = percentiles(lags);
        let wall = wall0.elapsed().as_secs_f64();
        println!("triggers: {n} x every 1 s for {secs} s ({}), expected {expected} fires, seen {seen}", if burst { "all on the same ms" } else { "spread over the second" });
        println!("triggers: lag scheduled -> ready publish  p50 {p50:.1} ms  p99 {p99:.1} ms  max {max:.1} ms");
        println!("triggers: ax server CPU {:.0} % of one core, RSS {rss} MiB (peak {peak_rss} MiB)", 100.0 * (cpu1 - cpu0) / wall);
        let _ = server.kill();
        let _ = server.wait();
    });
}
