//! Flow overhead (issue 9): a linear flow of AX_BENCH_FLOW_STEPS (default 1,000) steps,
//! and a fan-out of AX_BENCH_FANOUT (default 10,000) tasks gathered by one step, against
//! the same tasks submitted without a flow, in the same run.
//!
//! Run: `./dev bench flows`. Edge overhead is read from the task records: a child's
//! `started_at_ms` minus its parent's `finished_at_ms` (ms resolution), i.e. everything
//! between a parent's `succeeded` write and the child's attempt starting on the worker
//! (the feed, the engine's step writes, the submit, the worker's fetch). Printed, not
//! asserted (docs/PERFORMANCE.md; the goal from issue 9 is p99 ≤ 10 ms).

mod common;

use ax::flow::{FlowDef, RunState, StepDef};
use ax::worker::{Task, Worker};
use ax::{Client, Output, Server, TaskSpec};
use common::natsd::LocalNats;
use common::*;
use futures::StreamExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

fn main() {
    let steps = env_or("AX_BENCH_FLOW_STEPS", 1000);
    let fan = env_or("AX_BENCH_FANOUT", 10_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
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

        // 1. A linear flow.
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
            .map(|i| ax::flow::model::step_task_id("flow", &run, &format!("s{i}"), 0, 0))
            .collect();
        let recs: Vec<_> = futures::stream::iter(ids.iter().map(|id| ax.task(id)))
            .buffered(64)
            .collect()
            .await;
        let recs: Vec<_> = recs.into_iter().map(|r| r.unwrap().unwrap().0).collect();
        let edges: Vec<f64> = recs
            .windows(2)
            .map(|w| {
                w[1].started_at_ms.unwrap_or(0) as f64 - w[0].finished_at_ms.unwrap_or(0) as f64
            })
            .collect();
        let (p50, p99, max) = percentiles(edges);
        println!(
            "linear flow: {steps} steps in {:.2} s ({:.2} ms per step); edge overhead (parent finished → child started) p50 {p50:.0} ms, p99 {p99:.0} ms, max {max:.0} ms",
            total.as_secs_f64(),
            total.as_secs_f64() * 1000.0 / steps as f64
        );

        // 2. A fan-out with one gather, then the same tasks without a flow.
        let def = FlowDef::new("fan")
            .step(StepDef::new("list", "flow", TaskSpec::new("range")))
            .step(StepDef::new("each", "flow", TaskSpec::new("item")).needs(["list"]).for_each("list"))
            .step(StepDef::new("gather", "flow", TaskSpec::new("one")).needs(["each"]));
        ax.put_flow(&def).await.unwrap();
        let t = Instant::now();
        let run = ax.run_flow("fan", serde_json::json!({ "n": fan })).await.unwrap();
        let ended = ax.wait_flow(&run).await.unwrap();
        let flow_time = t.elapsed();
        assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);

        let before = ran.load(Ordering::Relaxed);
        let t = Instant::now();
        let mut submits = futures::stream::iter(0..fan)
            .map(|i| {
                let ax = ax.clone();
                async move {
                    ax.submit("flow", TaskSpec::new("item").json(&serde_json::json!({ "item": i })))
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
        let (_, rss) = usage(std::process::id());
        println!("bench process (ax server + worker + client) RSS after: {} MiB", rss / 1024);
        stop.cancel();
        let _ = worker.await;
        server.await.unwrap().unwrap();
    });
}
