//! Memory under a flood of submissions: ax answers `busy` instead of buffering.
//!
//! Run: `./dev bench flood` (AX_FLOOD_TASKS, default 1,000,000; AX_FLOOD_INFLIGHT, default
//! 4096 requests in flight). Starts a nats-server, an `ax server` process with the default
//! capacities (1000 / 5000 / 10000 per queue) and a no-op worker draining the queue, then
//! floods submits and samples the server's resident memory (VmRSS) every 100 ms.

mod common;

use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, ClientError, Priority, TaskSpec};
use ax_testkit::LocalNats;
use common::*;
use futures::StreamExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

fn main() {
    let n = env_or("AX_FLOOD_TASKS", 1_000_000);
    let inflight = env_or("AX_FLOOD_INFLIGHT", 4096);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let nats = LocalNats::start().expect("nats-server (run via ./dev bench flood)");
        let mut server = Command::new(env!("CARGO_BIN_EXE_ax"))
            .args(["server", "--queue", "flood", "--metrics-addr", "off"])
            .env("NATS_URL", nats.url())
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn ax server");
        let pid = server.id();
        let client = async_nats::ConnectOptions::new()
            .request_timeout(Some(Duration::from_secs(5)))
            .connect(nats.url())
            .await
            .unwrap();
        let ax = Client::new(client.clone());
        while ax.submit("flood", TaskSpec::new("warmup")).await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let stop = CancellationToken::new();
        let worker = Worker::builder("flood")
            .concurrency(256)
            .handler(|_t: Task| async { Ok(()) })
            .build()
            .unwrap();
        let worker = tokio::spawn(worker.run(client.clone(), stop.clone()));
        let before = usage(pid).1;
        let peak = Arc::new(AtomicU64::new(before));
        let done = Arc::new(AtomicBool::new(false));
        let sampler = tokio::spawn({
            let (peak, done) = (peak.clone(), done.clone());
            async move {
                while !done.load(Ordering::Relaxed) {
                    peak.fetch_max(usage(pid).1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        });
        let (accepted, busy, failed) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        let start = Instant::now();
        let mut flood = futures::stream::iter(0..n)
            .map(|i| {
                let (ax, accepted, busy, failed) =
                    (ax.clone(), accepted.clone(), busy.clone(), failed.clone());
                async move {
                    let spec = TaskSpec::new("t").priority(Priority::ALL[i % 3]);
                    match ax.submit("flood", spec).await {
                        Ok(_) => accepted.fetch_add(1, Ordering::Relaxed),
                        Err(ClientError::Refused(e)) if e.code.is_retryable() => {
                            busy.fetch_add(1, Ordering::Relaxed)
                        }
                        Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
            .buffer_unordered(inflight);
        let mut sent = 0;
        while flood.next().await.is_some() {
            sent += 1;
            if sent % 100_000 == 0 {
                eprintln!(
                    "  ... {sent} submits, server RSS {} MiB",
                    usage(pid).1 / 1024
                );
            }
        }
        let elapsed = start.elapsed();
        done.store(true, Ordering::Relaxed);
        sampler.await.unwrap();
        let after = usage(pid).1;
        println!(
            "flood: {n} submits, {inflight} in flight, in {elapsed:.1?} ({:.0}/s)",
            n as f64 / elapsed.as_secs_f64()
        );
        println!(
            "flood: accepted {}, busy {}, unanswered or failed {}",
            accepted.load(Ordering::Relaxed),
            busy.load(Ordering::Relaxed),
            failed.load(Ordering::Relaxed)
        );
        println!(
            "flood: ax server RSS before {} MiB, peak {} MiB, after {} MiB",
            before / 1024,
            peak.load(Ordering::Relaxed) / 1024,
            after / 1024
        );
        stop.cancel();
        worker.await.unwrap().unwrap();
        let _ = server.kill();
        let _ = server.wait();
    });
}
