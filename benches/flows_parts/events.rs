//! Part `events`: `runs` runs of a flow that waits for its own event (`bench.paid`,
//! matched on the run's input `i`) and then runs one task, on an ax server and a worker
//! in this process; once every wait is registered, one event per run is published at
//! `AX_BENCH_EVENT_RATE` (default 1,000) a second. Per event: publish → the wait's end
//! (its wait task's `finished_at_ms`, the matcher's part) and publish → the next step's
//! task starting on the worker (the whole path), split where the engine stored that task
//! (its record's creation). Printed, not asserted.
//!
//! `AX_BENCH_DEPLOYED=1`: as deployed, the server an `ax server` process and the worker a
//! process of its own (this bench run again with `AX_BENCH_ROLE=event-worker`, printing
//! `<i> <ms>` as each next step starts, its warnings on stderr); this process only
//! publishes and reads.
//! `AX_BENCH_SLOWEST=1` also prints the 30 slowest stored → taken, with when each was
//! stored (a stall shows as a run of tasks all taken at one moment). It prints each
//! process's CPU per event over the publishing. `AX_BENCH_NATS_ARGS` adds arguments to
//! nats-server's (`-m 8222` to read its monitoring endpoints while the bench runs; `-V`
//! with `AX_NATSD_LOG=1` to see every message, at a small `AX_BENCH_EVENT_RUNS`).
//! `AX_BENCH_R3=1`: on a local 3-node cluster, every stream and bucket with three replicas
//! (applied before the server starts); nats-server's CPU is the three nodes'.

use crate::common::{env_or, percentiles, usage};
use ax_core::time::now_ms;
use ax_sdk::flow::{FlowDef, StepDef, WaitForEventDef};
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, Output, TaskSpec, TaskState};
use ax_server::Server;
use ax_testkit::{LocalCluster, LocalNats};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Starts of the next step, by the run's input `i`: ms since the epoch.
type Started = Arc<Mutex<HashMap<u64, u64>>>;

/// A worker of queue `ev` that calls `note(i, ms)` as each run's next step starts.
fn recording_worker(note: impl Fn(u64, u64) + Send + Sync + Clone + 'static) -> Worker {
    Worker::builder("ev")
        .concurrency(256)
        .handler(move |task: Task| {
            let at = now_ms();
            let note = note.clone();
            async move {
                let p: serde_json::Value = task.json().unwrap_or_default();
                if let Some(i) = p["input"]["i"].as_u64() {
                    note(i, at);
                }
                Output::json(&1)
            }
        })
        .build()
        .unwrap()
}

/// The worker process of `AX_BENCH_DEPLOYED=1` (`AX_BENCH_ROLE=event-worker`, connected
/// to `AX_BENCH_URL`): prints `<i> <ms>` as each run's next step starts.
pub async fn worker_process() {
    // Its warnings (a claim nak'ed, a fetch that failed) on stderr, which the bench shares.
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(std::io::stderr)
        .init();
    let url = std::env::var("AX_BENCH_URL").expect("AX_BENCH_URL");
    let client = async_nats::connect(url).await.unwrap();
    let worker = recording_worker(|i, at| println!("{i} {at}"));
    worker.run(client, CancellationToken::new()).await.unwrap();
}

/// The worker as a process of its own; its starts are read from its output into
/// `started`.
fn spawn_worker(url: &str, started: Started) -> std::process::Child {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .env("AX_BENCH_ROLE", "event-worker")
        .env("AX_BENCH_URL", url)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the worker process");
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { return };
            let mut parts = line.split(' ').filter_map(|p| p.parse::<u64>().ok());
            if let (Some(i), Some(at)) = (parts.next(), parts.next()) {
                started.lock().unwrap().entry(i).or_insert(at);
            }
        }
    });
    child
}

pub async fn waiting(runs: usize) {
    let rate = env_or("AX_BENCH_EVENT_RATE", 1000) as f64;
    let deployed = env_or("AX_BENCH_DEPLOYED", 0) == 1;
    let nats_args = std::env::var("AX_BENCH_NATS_ARGS").unwrap_or_default();
    let nats_args = nats_args.split_whitespace().map(String::from).collect();
    let r3 = env_or("AX_BENCH_R3", 0) == 1;
    let cluster = r3.then(|| LocalCluster::start(3).expect("a 3-node cluster (./dev bench flows)"));
    let single = (!r3).then(|| {
        LocalNats::start_with_args(nats_args).expect("nats-server (run via ./dev bench flows)")
    });
    let nodes: Vec<&LocalNats> = cluster
        .iter()
        .flat_map(|c| c.nodes.iter())
        .chain(single.iter())
        .collect();
    // Every process connects to the first node (a client learns the others from it).
    let url = nodes[0].url();
    // The server, the worker and the producer each on a connection of its own, as when
    // they run apart: one connection's reader serves its messages one after another.
    let client = async_nats::connect(url.as_str()).await.unwrap();
    let topology = ax_server::streams::Topology {
        replicas: if r3 { 3 } else { 1 },
        ..Default::default()
    };
    if r3 {
        let js = async_nats::jetstream::new(client.clone());
        let t = Instant::now();
        while let Err(e) = ax_server::streams::apply(&js, &topology, &["ev".to_string()]).await {
            assert!(t.elapsed() < Duration::from_secs(60), "R3 streams: {e}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let stop = CancellationToken::new();
    let started: Started = Arc::default();
    let mut procs = Vec::new();
    let mut tasks = Vec::new();
    if deployed {
        procs.push(crate::common::deployed::spawn_ax(
            &url,
            &["server", "--queue", "ev"],
        ));
        procs.push(spawn_worker(&url, started.clone()));
    } else {
        let server_client = async_nats::connect(url.as_str()).await.unwrap();
        let worker_client = async_nats::connect(url.as_str()).await.unwrap();
        let server = Server::builder()
            .queues(["ev"])
            .topology(topology.clone())
            .build();
        tasks.push(tokio::spawn({
            let stop = stop.clone();
            async move { server.run(server_client, stop).await.unwrap() }
        }));
        let worker = recording_worker({
            let started = started.clone();
            move |i, at| {
                started.lock().unwrap().entry(i).or_insert(at);
            }
        });
        tasks.push(tokio::spawn({
            let stop = stop.clone();
            async move { worker.run(worker_client, stop).await.unwrap() }
        }));
    }
    let ax = Client::new(client.clone());
    let wait = WaitForEventDef {
        event: "bench.paid".into(),
        matches: serde_json::json!({"i": "$input.i"})
            .as_object()
            .cloned()
            .unwrap(),
        timeout_ms: Some(3_600_000),
        ..Default::default()
    };
    let def = FlowDef::new("paid")
        .step(StepDef::wait_for_event("w", "ev", wait))
        .step(StepDef::new("b", "ev", TaskSpec::new("ship")).needs(["w"]));
    while ax.put_flow(&def).await.is_err() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "waiting runs: {runs} runs waiting for an event each, then one task; events published at {rate:.0}/s; \
         {}; {}",
        if r3 {
            "a 3-node cluster, R3 streams"
        } else {
            "one nats-server"
        },
        if deployed {
            "ax server, worker and publisher each a process"
        } else {
            "ax server, worker and client in this process, a connection each"
        }
    );
    let t = Instant::now();
    let mut starts = futures::stream::iter(0..runs)
        .map(|i| {
            let ax = ax.clone();
            async move {
                ax.run_flow("paid", serde_json::json!({ "i": i }))
                    .await
                    .unwrap()
            }
        })
        .buffer_unordered(256);
    while starts.next().await.is_some() {}
    let js = async_nats::jetstream::new(client.clone());
    loop {
        let mut waits = js.get_stream("KV_AX_WAITS").await.unwrap();
        if waits.info().await.unwrap().state.messages >= runs as u64 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "the waits did not all register in 600 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "  {runs} runs started and waiting in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    // What an operator's (or the console's) listing of approvals costs beside them.
    let t = Instant::now();
    let listed = ax.approvals().await.unwrap();
    println!(
        "  approvals listed beside {runs} waits for events: {} in {:.0} ms",
        listed.as_array().map_or(0, Vec::len),
        t.elapsed().as_secs_f64() * 1000.0
    );
    // CPU of each process while the events are published and their next steps start.
    let me = match deployed {
        true => "publisher",
        false => "bench process (server, worker, publisher)",
    };
    let mut pids = vec![(me, std::process::id())];
    pids.extend(
        nodes
            .iter()
            .filter_map(|n| n.pid())
            .map(|p| ("nats-server", p)),
    );
    pids.extend(
        ["ax server", "worker"]
            .into_iter()
            .zip(procs.iter().map(|p| p.id())),
    );
    let cpu_before: Vec<f64> = pids.iter().map(|(_, p)| usage(*p).0).collect();
    // One event per run, paced at `rate`; each publish's time noted before it is sent.
    let published: Arc<Mutex<HashMap<u64, u64>>> = Arc::default();
    let t = Instant::now();
    let mut acks = futures::stream::FuturesUnordered::new();
    for i in 0..runs as u64 {
        let due = t + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(due.into()).await;
        published.lock().unwrap().insert(i, now_ms());
        let ax = ax.clone();
        acks.push(async move {
            ax.publish_event("bench.paid", &serde_json::json!({ "i": i }), None)
                .await
                .unwrap()
        });
        while let Some(Some(_)) = futures::FutureExt::now_or_never(acks.next()) {}
    }
    while acks.next().await.is_some() {}
    let sent = t.elapsed();
    let deadline = Instant::now() + Duration::from_secs(300);
    while started.lock().unwrap().len() < runs && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let wall = t.elapsed().as_secs_f64();
    let cpu: Vec<String> = pids
        .iter()
        .zip(&cpu_before)
        .map(|((name, p), b)| {
            let s = usage(*p).0 - b;
            format!(
                "{name} {:.0} µs ({:.0} % of a core)",
                s * 1e6 / runs as f64,
                100.0 * s / wall
            )
        })
        .collect();
    // The waits' ends, from their tasks' records.
    let kv = js.get_key_value("AX_TASKS").await.unwrap();
    let mut feed = kv.watch_with_history("ev.fl.*.w.>").await.unwrap();
    let mut ended = HashMap::new();
    let mut run_of = HashMap::new(); // run id → its input i
    while ended.len() < runs {
        let Ok(Some(Ok(entry))) = tokio::time::timeout(Duration::from_secs(10), feed.next()).await
        else {
            break;
        };
        let Ok(rec) = serde_json::from_slice::<ax_sdk::TaskRecord>(&entry.value) else {
            continue;
        };
        let i = rec
            .output
            .as_ref()
            .and_then(|o| o.json.as_ref())
            .and_then(|v| v["i"].as_u64());
        if let (TaskState::Succeeded, Some(i)) = (rec.state, i) {
            ended.insert(i, rec.finished_at_ms.unwrap_or(0));
            if let Some(t) = ax_sdk::flow::model::parse_step_task(&rec.id) {
                run_of.insert(t.run.to_string(), i);
            }
        }
    }
    // When the engine stored each next step's task (its record's creation), by input: the
    // path splits there into the engine's part and the worker's.
    let mut feed = kv.watch_with_history("ev.fl.*.b.>").await.unwrap();
    let mut stored = HashMap::new();
    // When the worker took each delivery (the record's `started_at_ms`, set as the claim
    // begins, before its record read): the worker's part splits there into dispatch
    // (publish, delivery) and claim.
    let mut delivered = HashMap::new();
    while stored.len() < runs || delivered.len() < runs {
        let Ok(Some(Ok(entry))) = tokio::time::timeout(Duration::from_secs(10), feed.next()).await
        else {
            break;
        };
        let Ok(rec) = serde_json::from_slice::<ax_sdk::TaskRecord>(&entry.value) else {
            continue;
        };
        let run = ax_sdk::flow::model::parse_step_task(&rec.id).map(|t| t.run.to_string());
        if let Some(&i) = run.as_ref().and_then(|r| run_of.get(r)) {
            stored.entry(i).or_insert(rec.created_at_ms);
            if let Some(at) = rec.started_at_ms {
                delivered.entry(i).or_insert(at);
            }
        }
    }
    let published = std::mem::take(&mut *published.lock().unwrap());
    let lag = |at: &HashMap<u64, u64>| -> Vec<f64> {
        at.iter()
            .filter_map(|(i, at)| Some(*at as f64 - *published.get(i)? as f64))
            .collect()
    };
    let started = std::mem::take(&mut *started.lock().unwrap());
    let (m50, m99, mmax) = percentiles(lag(&ended));
    let (s50, s99, smax) = percentiles(lag(&started));
    let between = |from: &HashMap<u64, u64>, to: &HashMap<u64, u64>| -> Vec<f64> {
        to.iter()
            .filter_map(|(i, at)| Some(*at as f64 - *from.get(i)? as f64))
            .collect()
    };
    let (e50, e99, emax) = percentiles(between(&ended, &stored));
    let (w50, w99, wmax) = percentiles(between(&stored, &started));
    let (d50, d99, dmax) = percentiles(between(&stored, &delivered));
    if std::env::var("AX_BENCH_SLOWEST").is_ok() {
        let t0 = published.values().min().copied().unwrap_or(0);
        let mut slow: Vec<(u64, u64, u64)> = delivered
            .iter()
            .filter_map(|(i, at)| Some((at.saturating_sub(*stored.get(i)?), stored[i] - t0, *i)))
            .collect();
        slow.sort();
        for (lag, at, i) in slow.iter().rev().take(30) {
            println!("    slow: run {i} stored at +{at} ms, taken {lag} ms later");
        }
    }
    let (c50, c99, cmax) = percentiles(between(&delivered, &started));
    println!(
        "  {} events published in {:.1} s ({:.0}/s); {} waits ended, {} next steps started",
        runs,
        sent.as_secs_f64(),
        runs as f64 / sent.as_secs_f64(),
        ended.len(),
        started.len()
    );
    println!(
        "  publish → wait ended (matcher): p50 {m50:.0} ms, p99 {m99:.0} ms, max {mmax:.0} ms"
    );
    println!(
        "  publish → next step's task started: p50 {s50:.0} ms, p99 {s99:.0} ms, max {smax:.0} ms"
    );
    println!(
        "    of which wait ended → next task stored (engine): p50 {e50:.0} ms, p99 {e99:.0} ms, \
         max {emax:.0} ms; stored → started (dispatch, worker): p50 {w50:.0} ms, p99 {w99:.0} ms, \
         max {wmax:.0} ms"
    );
    println!(
        "    of which stored → taken by the worker (publish, delivery): p50 {d50:.0} ms, p99 \
         {d99:.0} ms, max {dmax:.0} ms; taken → handler started (claim): p50 {c50:.0} ms, p99 \
         {c99:.0} ms, max {cmax:.0} ms"
    );
    println!(
        "  CPU per event, publish of the first to start of the last next step ({wall:.1} s): {}",
        cpu.join(", ")
    );
    stop.cancel();
    for task in tasks {
        let _ = task.await;
    }
    for mut p in procs {
        let _ = p.kill();
        let _ = p.wait();
    }
}
