//! The peer workloads of `shared/peers/bullmq` that `e2e` does not cover, run against ax.
//!
//! Run: `./dev bench workloads [w3|w4|w5 ...]` (default all three).
//! - **W3 retries**: AX_BENCH_W3 (default 5,000) tasks with 3 attempts and a fixed 100 ms
//!   backoff; the handler fails attempts 1 and 2. Time from the first submit to the last
//!   success; handler calls (expected 3 × N); every record read back (attempt must be 3).
//!   In-process server and worker (concurrency 64, like the peer's), batch submits.
//! - **W4 pending memory**: AX_BENCH_W4 (default 1,000,000) tasks delayed by one hour,
//!   single submits (1,024 in flight; AX_BENCH_W4_BATCH=1 uses batches), no worker. An `ax
//!   server` process; RSS of it and of nats-server from /proc before, at the peak and after,
//!   5 s, every minute, and AX_BENCH_W4_SETTLE (default 60) s after the last submit, and
//!   the stored bytes of the streams behind it. AX_BENCH_NATS_PROFILE=<port> also reads
//!   nats-server's heap after a forced GC (AX_BENCH_NATS_HEAP=<file> keeps the profile).
//! - **W5 cron triggers**: AX_BENCH_W5 (default 100,000) daily cron triggers, one per user,
//!   put through the trigger API (256 in flight). Put rate; the `ax server` process's RSS;
//!   then a restart: how long until the new leader holds them all (`ax_triggers_held`),
//!   its RSS and its peak RSS.

mod common;

use ax_sdk::worker::{Task, TaskError, Worker};
use ax_sdk::{Client, TaskSpec};
use ax_server::Server;
use ax_testkit::LocalNats;
use common::*;
use futures::StreamExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Submits W4 sent again after a refusal or no answer.
static RETRIES: AtomicU64 = AtomicU64::new(0);

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

async fn w3(client: &async_nats::Client, n: usize) {
    let stop = CancellationToken::new();
    let server = tokio::spawn(
        Server::builder()
            .queues(["w3"])
            .build()
            .run(client.clone(), stop.clone()),
    );
    let ax = Client::new(client.clone());
    let calls = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let worker = Worker::builder("w3")
        .concurrency(64)
        .handler({
            let (calls, done) = (calls.clone(), done.clone());
            move |task: Task| {
                calls.fetch_add(1, Ordering::Relaxed);
                let done = done.clone();
                async move {
                    if task.attempt < 3 {
                        return Err(TaskError::new("flaky", "fails attempts 1 and 2"));
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    let worker = tokio::spawn(worker.run(client.clone(), stop.clone()));
    while ax
        .submit("w3", TaskSpec::new("warmup").max_attempts(1))
        .await
        .is_err()
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let base = calls.load(Ordering::Relaxed);
    let start = Instant::now();
    let specs = (0..n).map(|i| {
        TaskSpec::new("flaky")
            .json(&serde_json::json!({ "i": i }))
            .max_attempts(3)
            .backoff(Duration::from_millis(100), Duration::from_millis(100), 0.0)
    });
    let answers = ax.submit_many("w3", specs).await;
    let ids: Vec<String> = answers
        .into_iter()
        .map(|a| a.expect("accepted").id)
        .collect();
    let enqueued = start.elapsed();
    while done.load(Ordering::Relaxed) < n && start.elapsed() < Duration::from_secs(180) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let total = start.elapsed();
    let calls = calls.load(Ordering::Relaxed) - base;
    let mut mismatched = 0;
    for id in &ids {
        match ax.task(id).await.unwrap() {
            Some((rec, _)) if rec.attempt == 3 && rec.state == ax_sdk::TaskState::Succeeded => {}
            _ => mismatched += 1,
        }
    }
    println!(
        "W3 retries: {n} tasks x 3 attempts, fixed 100 ms backoff, concurrency 64: total {:.3} s (enqueue {:.3} s); succeeded {}; handler calls {calls} (expected {}); records with attempt != 3: {mismatched} of {n}",
        total.as_secs_f64(),
        enqueued.as_secs_f64(),
        done.load(Ordering::Relaxed),
        3 * n
    );
    stop.cancel();
    worker.await.unwrap().unwrap();
    server.await.unwrap().unwrap();
}

fn spawn_server(nats: &LocalNats, queue: &str) -> Child {
    spawn_server_with(nats, queue, "off")
}

/// [`spawn_server`] with its metrics at `metrics` (`host:port`, or `off`).
fn spawn_server_with(nats: &LocalNats, queue: &str, metrics: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ax"))
        .args([
            "server",
            "--queue",
            queue,
            "--metrics-addr",
            metrics,
            "--max-delayed",
            "5000000",
        ])
        .env("NATS_URL", nats.url())
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn ax server")
}

async fn stream_bytes(js: &async_nats::jetstream::Context, name: &str) -> (u64, u64) {
    match js.get_stream(name).await {
        Ok(mut s) => {
            let info = s.info().await.unwrap();
            (info.state.messages, info.state.bytes)
        }
        Err(_) => (0, 0),
    }
}

async fn w4(nats: &LocalNats, m: usize, batch: bool) {
    let mut server = spawn_server(nats, "w4");
    let (ax_pid, nats_pid) = (server.id(), nats.pid().expect("nats runs"));
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let ax = Client::new(client.clone());
    while ax.task("w4.none").await.is_err() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    while ax
        .submit(
            "w4",
            TaskSpec::new("warmup").delay(Duration::from_secs(3600)),
        )
        .await
        .is_err()
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (nats0, ax0) = (usage(nats_pid).1, usage(ax_pid).1);
    let peak = Arc::new(AtomicU64::new(0));
    let sampling = CancellationToken::new();
    let sampler = tokio::spawn({
        let (peak, sampling) = (peak.clone(), sampling.clone());
        async move {
            while !sampling.is_cancelled() {
                peak.fetch_max(usage(nats_pid).1 + usage(ax_pid).1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    });
    let start = Instant::now();
    let spec = || {
        TaskSpec::new("later")
            .json(&serde_json::json!({"i": 1}))
            .delay(Duration::from_secs(3600))
    };
    if batch {
        let mut left = m;
        while left > 0 {
            let chunk = left.min(100_000);
            let answers = ax.submit_many("w4", (0..chunk).map(|_| spec())).await;
            left -= answers.iter().filter(|a| a.is_ok()).count();
            eprintln!("  ... {} submitted", m - left);
        }
    } else {
        let mut submits = futures::stream::iter(0..m)
            .map(|_| {
                let ax = ax.clone();
                async move {
                    loop {
                        match ax.submit("w4", spec()).await {
                            Ok(_) => return,
                            Err(e) => {
                                RETRIES.fetch_add(1, Ordering::Relaxed);
                                if RETRIES.load(Ordering::Relaxed) < 5 {
                                    eprintln!("  retry: {e}");
                                }
                                tokio::time::sleep(Duration::from_millis(20)).await
                            }
                        }
                    }
                }
            })
            .buffer_unordered(1024);
        let mut k = 0;
        while submits.next().await.is_some() {
            k += 1;
            if k % 100_000 == 0 {
                eprintln!(
                    "  ... {k} submitted ({:.0}/s)",
                    k as f64 / start.elapsed().as_secs_f64()
                );
            }
        }
    }
    let rate = m as f64 / start.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (nats5, ax5) = (usage(nats_pid).1, usage(ax_pid).1);
    let settle = env_or("AX_BENCH_W4_SETTLE", 60) as u64;
    // Every minute of the settle, the figures so far: the broker's duplicate-window map
    // (2 min) and the file store's block caches go, and Go returns freed memory slowly.
    let mut waited = 5;
    while waited < settle {
        let step = (settle - waited).min(60);
        tokio::time::sleep(Duration::from_secs(step)).await;
        waited += step;
        if waited < settle {
            eprintln!(
                "  ... {waited} s after: nats-server {:.1} MiB + ax server {:.1} MiB",
                mib(usage(nats_pid).1),
                mib(usage(ax_pid).1)
            );
        }
    }
    sampling.cancel();
    sampler.await.unwrap();
    let (nats1, ax1) = (usage(nats_pid).1, usage(ax_pid).1);
    let per_task = ((nats1 + ax1) as f64 - (nats0 + ax0) as f64) * 1024.0 / m as f64;
    println!(
        "W4 pending: {m} tasks delayed 1 h, {} submits: enqueue {rate:.0}/s ({} retried)",
        if batch { "batch" } else { "single" },
        RETRIES.load(Ordering::Relaxed)
    );
    println!(
        "W4 RSS before: nats-server {:.1} MiB, ax server {:.1} MiB",
        mib(nats0),
        mib(ax0)
    );
    println!(
        "W4 RSS 5 s after: nats-server {:.1} MiB + ax server {:.1} MiB = {:.1} MiB",
        mib(nats5),
        mib(ax5),
        mib(nats5 + ax5)
    );
    println!(
        "W4 RSS {settle} s after: nats-server {:.1} MiB + ax server {:.1} MiB = {:.1} MiB; peak sum {:.1} MiB; {per_task:.0} B per pending task",
        mib(nats1),
        mib(ax1),
        mib(nats1 + ax1),
        mib(peak.load(Ordering::Relaxed))
    );
    if let Ok(port) = std::env::var("AX_BENCH_NATS_PROFILE") {
        // Force a GC in nats-server and read its heap figures: what is live, and what is
        // only not yet collected or returned to the OS.
        let text = http_get(
            &format!("127.0.0.1:{port}"),
            "/debug/pprof/heap?debug=1&gc=1",
        );
        // AX_BENCH_NATS_HEAP=<file> keeps the whole profile (stacks with their live bytes).
        if let Ok(file) = std::env::var("AX_BENCH_NATS_HEAP") {
            std::fs::write(&file, &text).expect("write the heap profile");
        }
        let stat = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("# {name} = ")))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map_or(f64::NAN, |b| b as f64 / (1 << 20) as f64)
        };
        tokio::time::sleep(Duration::from_secs(10)).await;
        println!(
            "W4 nats-server after a forced GC: HeapAlloc {:.1} MiB, HeapInuse {:.1} MiB, HeapIdle {:.1} MiB, HeapReleased {:.1} MiB; RSS 10 s later {:.1} MiB",
            stat("HeapAlloc"),
            stat("HeapInuse"),
            stat("HeapIdle"),
            stat("HeapReleased"),
            mib(usage(nats_pid).1)
        );
    }
    for name in ["AX_DELAYED", "KV_AX_TASKS", "KV_AX_IDEMPOTENCY"] {
        let (msgs, bytes) = stream_bytes(&js, name).await;
        println!(
            "W4 stream {name}: {msgs} messages, {:.1} MiB stored ({:.0} B each)",
            bytes as f64 / (1 << 20) as f64,
            bytes as f64 / msgs.max(1) as f64
        );
    }
    let _ = server.kill();
    let _ = server.wait();
}

/// A plain HTTP/1.0 GET; the body (empty on any failure).
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut conn) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    let _ = write!(conn, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut text = String::new();
    let _ = conn.read_to_string(&mut text);
    text
}

async fn w5(nats: &LocalNats, n: usize) {
    let mut server = spawn_server(nats, "w5");
    let pid = server.id();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let ax = Client::new(client.clone());
    while ax.trigger("list", &serde_json::json!({})).await.is_err() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = usage(pid).1;
    let start = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let ax = ax.clone();
            async move {
                // One trigger per user, each at its own minute of the day.
                let def = serde_json::json!({
                    "name": format!("user-{i}"), "kind": "cron",
                    "expr": format!("0 {} {} * * *", i % 60, (i / 60) % 24),
                    "tasks": [{"name": "digest", "queue": "w5", "payload": {"user": i}}],
                });
                ax.trigger("put", &def).await.expect("put");
            }
        })
        .buffer_unordered(256)
        .collect::<Vec<()>>()
        .await;
    let rate = n as f64 / start.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = usage(pid).1;
    println!(
        "W5 cron triggers: {n} daily triggers put at {rate:.0}/s; ax server RSS {:.1} MiB before, {:.1} MiB after ({:.0} B per trigger)",
        mib(before),
        mib(after),
        (after as f64 - before as f64) * 1024.0 / n as f64
    );
    let _ = server.kill();
    let _ = server.wait();
    // A restart: the new leader reads every definition back from the store.
    let addr = format!(
        "127.0.0.1:{}",
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_or(0, |a| a.port())
    );
    let mut server = spawn_server_with(nats, "w5", &addr);
    let start = Instant::now();
    let held = || -> f64 {
        http_get(&addr, "/metrics")
            .lines()
            .filter(|l| l.starts_with("ax_triggers_held{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    while held() < n as f64 && start.elapsed() < Duration::from_secs(300) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let loaded = start.elapsed();
    tokio::time::sleep(Duration::from_secs(5)).await;
    println!(
        "W5 after a restart: {:.0} of {n} triggers held {:.1} s after the start; ax server RSS {:.1} MiB, its peak {:.1} MiB",
        held(),
        loaded.as_secs_f64(),
        mib(usage(server.id()).1),
        mib(peak_rss(server.id()))
    );
    let _ = server.kill();
    let _ = server.wait();
}

/// The peak resident set of process `pid` (`VmHWM`), KiB.
fn peak_rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let all = args.is_empty();
    let want = |w: &str| all || args.iter().any(|a| a == w);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        if want("w3") {
            let nats = LocalNats::start().expect("nats-server (run via ./dev bench workloads)");
            let client = async_nats::connect(nats.url()).await.unwrap();
            w3(&client, env_or("AX_BENCH_W3", 5000)).await;
        }
        if want("w4") {
            // AX_BENCH_NATS_PROFILE=<port> serves nats-server's pprof endpoints there
            // (e.g. /debug/pprof/heap?debug=1 while the tasks are held).
            let nats = match std::env::var("AX_BENCH_NATS_PROFILE") {
                Ok(port) => LocalNats::start_with_args(vec!["--profile".into(), port]),
                Err(_) => LocalNats::start(),
            }
            .expect("nats-server");
            let batch = std::env::var("AX_BENCH_W4_BATCH").is_ok_and(|v| v == "1");
            w4(&nats, env_or("AX_BENCH_W4", 1_000_000), batch).await;
        }
        if want("w5") {
            let nats = LocalNats::start().expect("nats-server");
            w5(&nats, env_or("AX_BENCH_W5", 100_000)).await;
        }
    });
}
