//! Part `sleep`: `runs` runs of a one-step flow that sleeps `AX_BENCH_SLEEP_MS` (default
//! 60,000 ms) on an ax server in this process: the memory each sleeping run costs (live
//! heap and RSS, measured once every run sleeps), and the wake-up lag of every sleep from
//! its wait task's record (`finished_at_ms` − `run_at_ms`, ms). Printed, not asserted.
//! With `AX_BENCH_SLEEP_KIND=event` the step is a wait for an event that never comes
//! (each run's its own match, `on_timeout: continue`), timing out after the same time:
//! the same figures for waits for events, whose timeouts wait for the event matcher.

use super::{live_heap, MIB};
use crate::common::{env_or, percentiles, usage};
use ax_sdk::flow::{FlowDef, OnTimeout, StepDef, WaitForEventDef};
use ax_sdk::{Client, TaskState};
use ax_server::Server;
use ax_testkit::LocalNats;
use futures::StreamExt;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

pub async fn sleeping(runs: usize) {
    let sleep_ms = env_or("AX_BENCH_SLEEP_MS", 60_000) as u64;
    let pid = std::process::id();
    let nats = LocalNats::start().expect("nats-server (run via ./dev bench flows)");
    let client = async_nats::connect(nats.url()).await.unwrap();
    let stop = CancellationToken::new();
    let server = tokio::spawn(
        Server::builder()
            .queues(["nap"])
            .build()
            .run(client.clone(), stop.clone()),
    );
    let ax = Client::new(client.clone());
    let kind = std::env::var("AX_BENCH_SLEEP_KIND").unwrap_or_default();
    let waits_for_event = kind == "event";
    let step = match waits_for_event {
        true => {
            let matches = serde_json::json!({"i": "$input.i"});
            StepDef::wait_for_event(
                "z",
                "nap",
                WaitForEventDef {
                    event: "bench.never".into(),
                    matches: matches.as_object().cloned().expect("an object"),
                    timeout_ms: Some(sleep_ms),
                    on_timeout: OnTimeout::Continue,
                    lookback_ms: None,
                    queue: None,
                },
            )
        }
        false => StepDef::sleep_for("z", "nap", Duration::from_millis(sleep_ms)),
    };
    let what = match waits_for_event {
        true => "wait for an event that never comes, timing out after",
        false => "sleep",
    };
    let def = FlowDef::new("nap").step(step);
    while ax.put_flow(&def).await.is_err() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (_, rss0) = usage(pid);
    let heap0 = live_heap();
    println!(
        "sleeping runs: {runs} runs of one step, a {what} {sleep_ms} ms; one nats-server; ax server and client \
         in this process"
    );
    let t = Instant::now();
    let mut starts = futures::stream::iter(0..runs)
        .map(|i| {
            let ax = ax.clone();
            async move {
                ax.run_flow("nap", serde_json::json!({ "i": i }))
                    .await
                    .unwrap()
            }
        })
        .buffer_unordered(256);
    while starts.next().await.is_some() {}
    let started = t.elapsed();
    let js = async_nats::jetstream::new(client.clone());
    // Every sleep's wait task is in AX_DELAYED once its run's step started.
    loop {
        let mut delayed = js.get_stream("AX_DELAYED").await.unwrap();
        if delayed.info().await.unwrap().state.messages >= runs as u64 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_millis(sleep_ms),
            "not every run slept before the first woke: raise AX_BENCH_SLEEP_MS"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let slept = t.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, rss1) = usage(pid);
    let heap1 = live_heap();
    println!(
        "  {runs} runs started in {:.1} s ({:.0} runs/s), every one sleeping by {:.1} s",
        started.as_secs_f64(),
        runs as f64 / started.as_secs_f64(),
        slept.as_secs_f64()
    );
    println!(
        "  per sleeping run: live heap {:.1} → {:.1} MiB = {:.0} bytes, RSS {:.0} → {:.0} MiB = {:.0} bytes \
         (the flow leader's runs and the delayed index's entries, plus what the API and the client kept of \
         the `run` requests)",
        heap0 as f64 / MIB,
        heap1 as f64 / MIB,
        heap1.saturating_sub(heap0) as f64 / runs as f64,
        rss0 as f64 / 1024.0,
        rss1 as f64 / 1024.0,
        (rss1.saturating_sub(rss0) * 1024) as f64 / runs as f64,
    );
    // Every sleep's end, from its wait task's record, read once the last is due.
    let last_due = t + started + Duration::from_millis(sleep_ms);
    tokio::time::sleep_until((last_due + Duration::from_secs(5)).into()).await;
    let kv = js.get_key_value("AX_TASKS").await.unwrap();
    let mut feed = kv.watch_with_history("nap.fl.>").await.unwrap();
    let mut lags = std::collections::HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(600);
    while lags.len() < runs && Instant::now() < deadline {
        let Ok(Some(Ok(entry))) = tokio::time::timeout(Duration::from_secs(30), feed.next()).await
        else {
            break;
        };
        let Ok(rec) = serde_json::from_slice::<ax_sdk::TaskRecord>(&entry.value) else {
            continue;
        };
        if rec.state == TaskState::Succeeded {
            let lag = rec.finished_at_ms.unwrap_or(0) as f64 - rec.run_at_ms.unwrap_or(0) as f64;
            lags.insert(rec.id, lag);
        }
    }
    let woke = lags.len();
    let (p50, p99, max) = percentiles(lags.into_values().collect());
    println!(
        "  {woke} of {runs} steps ended; wake-up lag after the due time: p50 {p50:.0} ms, p99 {p99:.0} ms, max \
         {max:.0} ms (the due times spread over {:.1} s, as the runs started)",
        started.as_secs_f64()
    );
    stop.cancel();
    server.await.unwrap().unwrap();
}
