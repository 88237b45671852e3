//! Flow overhead and many runs at once: a linear flow of
//! AX_BENCH_FLOW_STEPS (default 1,000) steps, a fan-out of AX_BENCH_FANOUT (default
//! 10,000) tasks gathered by one step against the same tasks submitted without a flow,
//! and AX_BENCH_FLOW_RUNS (default 20,000) concurrent runs of a 4-step diamond; part
//! `sleep`: AX_BENCH_SLEEP_RUNS (default 20,000) runs sleeping AX_BENCH_SLEEP_MS (60,000);
//! part `events`: AX_BENCH_EVENT_RUNS (default 10,000) runs waiting for an event each,
//! the events published at AX_BENCH_EVENT_RATE (1,000/s).
//!
//! Run: `./dev bench flows` (all three), or name the parts: `./dev bench flows many`,
//! `./dev bench flows linear fan` (or `AX_BENCH_FLOW_PARTS=many`). Edge overhead is read
//! from the task records: a child's `started_at_ms` minus its parent's `finished_at_ms`
//! (ms resolution), i.e. everything between a parent's `succeeded` write and the child's
//! attempt starting on the worker (the feed, the engine's step writes, the submit, the
//! worker's fetch). Printed, not asserted (docs/PERFORMANCE.md;  the goals are
//! p99 ≤ 10 ms and ≤ 2 KiB of the leader's memory per waiting run).

mod common;
#[path = "flows_parts/events.rs"]
mod events;
#[path = "flows_parts/sleep.rs"]
mod sleep;

use ax_sdk::flow::{FlowDef, RunState, StepDef};
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, Output, TaskSpec};
use ax_server::Server;
use ax_testkit::LocalNats;
use common::*;
use futures::StreamExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

fn main() {
    let steps = env_or("AX_BENCH_FLOW_STEPS", 1000);
    let fan = env_or("AX_BENCH_FANOUT", 10_000);
    let runs = env_or("AX_BENCH_FLOW_RUNS", 20_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    if std::env::var("AX_BENCH_ROLE").as_deref() == Ok("event-worker") {
        rt.block_on(events::worker_process());
        return;
    }
    let parts = parts();
    let warns = count_warnings();
    rt.block_on(async {
        // First, so that the process's peak RSS (VmHWM) is this part's.
        if parts.iter().any(|p| p == "many") {
            many(runs, &warns).await;
        }
        if parts.iter().any(|p| p == "sleep") {
            sleep::sleeping(env_or("AX_BENCH_SLEEP_RUNS", 20_000)).await;
        }
        if parts.iter().any(|p| p == "events") {
            events::waiting(env_or("AX_BENCH_EVENT_RUNS", 10_000)).await;
        }
        if !parts.iter().any(|p| p == "linear" || p == "fan") {
            return;
        }
        let nats = LocalNats::start().expect("nats-server (run via ./dev bench flows)");
        let client = async_nats::connect(nats.url()).await.unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(
            Server::builder()
                .queues(["flow"])
                .capacity([1000, 100_000, 1000])
                .build()
                .run(client.clone(), stop.clone()),
        );
        let ran = Arc::new(AtomicUsize::new(0));
        let worker = Worker::builder("flow")
            .concurrency(256)
            .handler({
                let ran = ran.clone();
                move |task: Task| {
                    ran.fetch_add(1, Ordering::Relaxed);
                    async move {
                        let p: serde_json::Value = task.json().unwrap_or_default();
                        match task.name.as_str() {
                            "range" => {
                                let n = p["input"]["n"].as_u64().unwrap_or(0);
                                Output::json(&(0..n).collect::<Vec<u64>>())
                            }
                            "item" => Output::json(&p["item"]),
                            _ => Output::json(&1),
                        }
                    }
                }
            })
            .build()
            .unwrap();
        let worker = tokio::spawn(worker.run(client.clone(), stop.clone()));
        let ax = Client::new(client.clone());
        while ax.submit("flow", TaskSpec::new("warmup")).await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        if parts.iter().any(|p| p == "linear") {
            linear(&ax, steps).await;
        }
        if parts.iter().any(|p| p == "fan") {
            fan_out(&ax, &ran, fan).await;
        }
        let (_, rss) = usage(std::process::id());
        println!(
            "bench process (ax server + worker + client) RSS after: {} MiB",
            rss / 1024
        );
        stop.cancel();
        let _ = worker.await;
        server.await.unwrap().unwrap();
    });
}

/// Part 1: a linear flow of `steps` steps; the edge overhead from the task records.
async fn linear(ax: &Client, steps: usize) {
    let mut def = FlowDef::new("linear").step(StepDef::new("s0", "flow", TaskSpec::new("one")));
    for i in 1..steps {
        def = def.step(
            StepDef::new(format!("s{i}"), "flow", TaskSpec::new("one"))
                .needs([format!("s{}", i - 1)]),
        );
    }
    ax.put_flow(&def).await.unwrap();
    let t = Instant::now();
    let run = ax.run_flow("linear", serde_json::json!({})).await.unwrap();
    let ended = ax.wait_flow(&run).await.unwrap();
    let total = t.elapsed();
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    let ids: Vec<String> = (0..steps)
        .map(|i| ax_sdk::flow::model::step_task_id("flow", &run, &format!("s{i}"), 0, 0))
        .collect();
    let recs: Vec<_> = futures::stream::iter(ids.iter().map(|id| ax.task(id)))
        .buffered(64)
        .collect()
        .await;
    let recs: Vec<_> = recs.into_iter().map(|r| r.unwrap().unwrap().0).collect();
    let edges: Vec<f64> = recs
        .windows(2)
        .map(|w| w[1].started_at_ms.unwrap_or(0) as f64 - w[0].finished_at_ms.unwrap_or(0) as f64)
        .collect();
    let (p50, p99, max) = percentiles(edges);
    println!(
        "linear flow: {steps} steps in {:.2} s ({:.2} ms per step); edge overhead (parent finished → child started) p50 {p50:.0} ms, p99 {p99:.0} ms, max {max:.0} ms",
        total.as_secs_f64(),
        total.as_secs_f64() * 1000.0 / steps as f64
    );
}

/// Part 2: a fan-out of `fan` tasks and a gather, then the same tasks without a flow.
async fn fan_out(ax: &Client, ran: &AtomicUsize, fan: usize) {
    let def = FlowDef::new("fan")
        .step(StepDef::new("list", "flow", TaskSpec::new("range")))
        .step(
            StepDef::new("each", "flow", TaskSpec::new("item"))
                .needs(["list"])
                .for_each("list"),
        )
        .step(StepDef::new("gather", "flow", TaskSpec::new("one")).needs(["each"]));
    ax.put_flow(&def).await.unwrap();
    let t = Instant::now();
    let run = ax
        .run_flow("fan", serde_json::json!({ "n": fan }))
        .await
        .unwrap();
    let ended = ax.wait_flow(&run).await.unwrap();
    let flow_time = t.elapsed();
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);

    let before = ran.load(Ordering::Relaxed);
    let t = Instant::now();
    let mut submits = futures::stream::iter(0..fan)
        .map(|i| {
            let ax = ax.clone();
            async move {
                ax.submit(
                    "flow",
                    TaskSpec::new("item").json(&serde_json::json!({ "item": i })),
                )
                .await
                .unwrap();
            }
        })
        .buffer_unordered(1024);
    while submits.next().await.is_some() {}
    while ran.load(Ordering::Relaxed) < before + fan {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let plain = t.elapsed();
    println!(
        "fan-out: {fan} tasks + 1 gather as a flow in {:.2} s; the same {fan} tasks submitted and run without a flow in {:.2} s (ratio flow/plain {:.2})",
        flow_time.as_secs_f64(),
        plain.as_secs_f64(),
        flow_time.as_secs_f64() / plain.as_secs_f64()
    );
}

/// The parts to run: the bench's arguments (cargo's own `--bench` left out), else
/// `AX_BENCH_FLOW_PARTS` (comma-separated), else all of `many`, `linear`, `fan`, `sleep`,
/// `events`.
fn parts() -> Vec<String> {
    let known = ["many", "linear", "fan", "sleep", "events"];
    let mut parts: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if parts.is_empty() {
        if let Ok(list) = std::env::var("AX_BENCH_FLOW_PARTS") {
            parts = list.split(',').map(|p| p.trim().to_string()).collect();
        }
    }
    parts.retain(|p| !p.is_empty());
    for p in &parts {
        assert!(
            known.contains(&p.as_str()),
            "unknown part {p:?}: give some of {known:?}"
        );
    }
    if parts.is_empty() {
        parts = known.iter().map(|p| p.to_string()).collect();
    }
    parts
}

/// WARN events by message, counted by a tracing layer (nothing is printed as they happen).
#[derive(Clone, Default)]
struct Warnings(Arc<std::sync::Mutex<std::collections::BTreeMap<String, u64>>>);

impl Warnings {
    fn snapshot(&self) -> std::collections::BTreeMap<String, u64> {
        self.0.lock().unwrap().clone()
    }
}

struct WarnLayer(Warnings);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for WarnLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        *self.0 .0.lock().unwrap().entry(message.0).or_default() += 1;
    }
}

/// Installs the WARN counter as the process's tracing subscriber.
fn count_warnings() -> Warnings {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let warnings = Warnings::default();
    tracing_subscriber::registry()
        .with(
            WarnLayer(warnings.clone()).with_filter(tracing_subscriber::filter::LevelFilter::WARN),
        )
        .init();
    warnings
}

/// Peak resident memory of this process (VmHWM), KiB.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The value of counter `name` summed over its labels, from the Prometheus text.
fn counter(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series[name.len()..].to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Bytes the allocator has handed out and not been given back (glibc's `mallinfo2`:
/// `uordblks + hblkhd`, every arena): the live heap, where RSS also keeps what was freed.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn live_heap() -> u64 {
    #[repr(C)]
    struct MallInfo2 {
        arena: usize,
        ordblks: usize,
        smblks: usize,
        hblks: usize,
        hblkhd: usize,
        usmblks: usize,
        fsmblks: usize,
        uordblks: usize,
        fordblks: usize,
        keepcost: usize,
    }
    extern "C" {
        fn mallinfo2() -> MallInfo2;
    }
    // SAFETY: glibc's mallinfo2 (2.33+) takes no arguments and returns a plain struct.
    let info = unsafe { mallinfo2() };
    (info.uordblks + info.hblkhd) as u64
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn live_heap() -> u64 {
    0
}

const MIB: f64 = 1024.0 * 1024.0;

/// Part 3: `runs` concurrent runs of a diamond (a → b, a → c, {b, c} → d) on a server with the
/// default capacity (5,000 normal tasks per queue): first with no worker
/// (every run waits: the leader's memory per waiting run), then with a worker of 256 slots
/// whose handler sleeps 50–300 ms like `ax worker --example` (runs/s, CPU, RSS at peak).
async fn many(runs: usize, warns: &Warnings) {
    let pid = std::process::id();
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .ok();
    let nats = LocalNats::start().expect("nats-server (run via ./dev bench flows)");
    let nats_pid = nats.pid().unwrap_or(0);
    let client = async_nats::connect(nats.url()).await.unwrap();
    let stop = CancellationToken::new();
    let server = tokio::spawn(
        Server::builder()
            .queues(["diamond"])
            .build()
            .run(client.clone(), stop.clone()),
    );
    let ax = Client::new(client.clone());
    let def = FlowDef::new("diamond")
        .step(StepDef::new("a", "diamond", TaskSpec::new("step")))
        .step(StepDef::new("b", "diamond", TaskSpec::new("step")).needs(["a"]))
        .step(StepDef::new("c", "diamond", TaskSpec::new("step")).needs(["a"]))
        .step(StepDef::new("d", "diamond", TaskSpec::new("step")).needs(["b", "c"]));
    while ax.put_flow(&def).await.is_err() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _ = std::fs::write("/proc/self/clear_refs", "5"); // resets VmHWM
    let warned_before: u64 = warns.snapshot().values().sum();
    let (cpu0, rss0) = usage(pid);
    let (nats_cpu0, _) = usage(nats_pid);
    let heap0 = live_heap();
    println!(
        "many runs: {runs} concurrent runs of a 4-step diamond; one nats-server; ax server (default capacity: \
         5,000 normal tasks per queue), worker and client in this process"
    );

    // a. No worker: every run waits for its first step.
    let t = Instant::now();
    let mut starts = futures::stream::iter(0..runs)
        .map(|i| {
            let ax = ax.clone();
            async move {
                ax.run_flow("diamond", serde_json::json!({ "i": i }))
                    .await
                    .unwrap()
            }
        })
        .buffer_unordered(256);
    while starts.next().await.is_some() {}
    let submitted = t.elapsed();
    let js = async_nats::jetstream::new(client.clone());
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let mut stream = js.get_stream("KV_AX_FLOW_RUNS").await.unwrap();
        if stream.info().await.unwrap().state.subjects_count >= 2 * runs as u64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the leader did not start every run's first step in 300 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let loaded = t.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (cpu1, rss1) = usage(pid);
    let (nats_cpu1, _) = usage(nats_pid);
    let heap1 = live_heap();
    let mut ready = js.get_stream("AX_READY_NORMAL").await.unwrap();
    let ready = ready.info().await.unwrap().state.messages;
    println!(
        "  a. no worker: {runs} runs started in {:.2} s ({:.0} runs/s), every first step written by {:.2} s; \
         {ready} tasks ready, the rest refused `busy` and retried",
        submitted.as_secs_f64(),
        runs as f64 / submitted.as_secs_f64(),
        loaded.as_secs_f64(),
    );
    println!(
        "     per waiting run: RSS {:.0} → {:.0} MiB = {:.0} bytes; live heap {:.1} → {:.1} MiB = {:.0} bytes \
         (the flow leader's runs, plus what the ax server's API and the client kept of the {runs} `run` requests; \
         RSS also keeps what was freed); CPU: this process {:.1} s, nats-server {:.1} s",
        rss0 as f64 / 1024.0,
        rss1 as f64 / 1024.0,
        (rss1.saturating_sub(rss0) * 1024) as f64 / runs as f64,
        heap0 as f64 / MIB,
        heap1 as f64 / MIB,
        heap1.saturating_sub(heap0) as f64 / runs as f64,
        cpu1 - cpu0,
        nats_cpu1 - nats_cpu0,
    );

    // b. A worker of 256 slots runs them all.
    let kv = js.get_key_value("AX_FLOW_RUNS").await.unwrap();
    let mut feed = kv.watch("*").await.unwrap();
    let ended = Arc::new(AtomicUsize::new(0));
    let succeeded = Arc::new(AtomicUsize::new(0));
    let follow = tokio::spawn({
        let (ended, succeeded) = (ended.clone(), succeeded.clone());
        async move {
            #[derive(serde::Deserialize)]
            struct Brief {
                id: String,
                state: RunState,
            }
            let mut seen = std::collections::HashSet::new();
            while let Some(Ok(entry)) = feed.next().await {
                let Ok(run) = serde_json::from_slice::<Brief>(&entry.value) else {
                    continue;
                };
                if run.state != RunState::Running && seen.insert(run.id) {
                    if run.state == RunState::Succeeded {
                        succeeded.fetch_add(1, Ordering::Relaxed);
                    }
                    ended.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    });
    // Every 100 ms: the highest RSS while every run is in flight (peak concurrency: until
    // the first run ends), and the highest live heap with the runs in flight then.
    let sampler = tokio::spawn({
        let ended = ended.clone();
        async move {
            let (mut rss_all, mut heap_peak) = (0u64, (0u64, 0usize));
            loop {
                let (_, rss) = usage(pid);
                let heap = live_heap();
                let in_flight = runs - ended.load(Ordering::Relaxed).min(runs);
                if in_flight == runs {
                    rss_all = rss_all.max(rss);
                }
                if heap > heap_peak.0 {
                    heap_peak = (heap, in_flight);
                }
                if in_flight == 0 {
                    return (rss_all, heap_peak);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    let t = Instant::now();
    let worker = Worker::builder("diamond")
        .concurrency(256)
        .handler(|task: Task| async move {
            let ms = rand::Rng::random_range(&mut rand::rng(), 50..300);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            let p: serde_json::Value = task.json().unwrap_or_default();
            Output::json(&p["step"])
        })
        .build()
        .unwrap();
    let worker = tokio::spawn(worker.run(client.clone(), stop.clone()));
    let (rss_all, heap_peak) = tokio::time::timeout(Duration::from_secs(900), sampler)
        .await
        .expect("every run ended within 900 s")
        .unwrap();
    let took = t.elapsed();
    let (cpu2, rss2) = usage(pid);
    let (nats_cpu2, _) = usage(nats_pid);
    follow.abort();
    println!(
        "  b. a worker of 256 slots (handler 50–300 ms): {} of {runs} succeeded in {:.1} s ({:.0} runs/s, {:.0} tasks/s); \
         CPU: this process {:.1} s ({:.0} % of one core), nats-server {:.1} s",
        succeeded.load(Ordering::Relaxed),
        took.as_secs_f64(),
        runs as f64 / took.as_secs_f64(),
        4.0 * runs as f64 / took.as_secs_f64(),
        cpu2 - cpu1,
        100.0 * (cpu2 - cpu1) / took.as_secs_f64(),
        nats_cpu2 - nats_cpu1,
    );
    println!(
        "     RSS with all {runs} runs in flight {:.0} MiB = {:.0} bytes per run over the {:.0} MiB before; \
         peak (VmHWM) {:.0} MiB, {:.0} MiB after (RSS keeps freed memory); live heap: highest {:.1} MiB with {} runs \
         in flight = {:.0} bytes per run over the {:.1} MiB before (ax server + worker + client)",
        rss_all as f64 / 1024.0,
        (rss_all.saturating_sub(rss0) * 1024) as f64 / runs as f64,
        rss0 as f64 / 1024.0,
        peak_rss_kib() as f64 / 1024.0,
        rss2 as f64 / 1024.0,
        heap_peak.0 as f64 / MIB,
        heap_peak.1,
        heap_peak.0.saturating_sub(heap0) as f64 / heap_peak.1.max(1) as f64,
        heap0 as f64 / MIB,
    );
    let warned = warns.snapshot();
    let total: u64 = warned.values().sum::<u64>() - warned_before;
    println!("     WARN lines logged: {total}");
    let mut by_count: Vec<_> = warned.into_iter().collect();
    by_count.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    for (message, n) in by_count.iter().take(5) {
        println!("       {n} × {message}");
    }
    if let Some(handle) = &prometheus {
        let retries = counter(&handle.render(), "ax_flow_step_submit_retries_total");
        println!("     ax_flow_step_submit_retries_total: {retries:?}");
    }
    stop.cancel();
    let _ = worker.await;
    server.await.unwrap().unwrap();
}
