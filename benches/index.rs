//! The task index at scale: N task records (default 1,000,000) in `AX_TASKS`,
//! then a server with `task_index(true)` loads them and answers searches.
//!
//! Run: `./dev bench index` (AX_BENCH_RECORDS to change N).
//!
//! `./dev bench index flows`: the index's memory under flow-run churn instead. N step
//! tasks (default 1,000,000) of N/10 distinct flow runs are loaded; then, AX_BENCH_ROUNDS
//! times (default 1), every one of them is superseded: its record purged and a step task
//! of a new run written (so each round's runs are new strings and the last round's are
//! no longer used). Printed: the process's resident memory (VmRSS) before the server,
//! with the index loaded, and after each round, per record.
//!
//! Printed (not asserted; docs/PERFORMANCE.md "Finding tasks"):
//! - raw baseline: reading every record once with an ordered consumer, no index;
//! - the server's index load time (ratio to the baseline) and the process's resident
//!   memory before and after (per record);
//! - search round trips (request → reply through NATS) for: the 12 dead tasks of one
//!   error class among N; a page of 50 of the ~N succeeded ones; one idempotency key;
//!   one id; an error text (12 match among the ~30,000 with an error); one task name in
//!   a time window.

mod common;

use ax_sdk::ops::{ListRequest, TaskQuery};
use ax_sdk::Client;
use ax_server::Server;
use ax_testkit::LocalNats;
use common::*;
use futures::StreamExt;
use std::future::IntoFuture;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

fn rss_kib() -> u64 {
    usage(std::process::id()).1
}

fn record(i: usize, base_ms: u64) -> (String, String) {
    let id = format!("q.t{i:08}");
    let (state, error) = match i {
        // 12 dead of a rare class among a million.
        _ if i % 83_333 == 7 => (
            "dead",
            r#","last_error":{"class":"card_declined","message":"declined"}"#,
        ),
        _ if i % 100 == 1 => (
            "dead",
            r#","last_error":{"class":"timeout","message":"slow"}"#,
        ),
        _ if i % 50 == 2 => (
            "retrying",
            r#","last_error":{"class":"io","message":"reset"}"#,
        ),
        _ => ("succeeded", ""),
    };
    let name = ["send_email", "charge", "resize", "report"][i % 4];
    let updated = base_ms + i as u64;
    let body = format!(
        r#"{{"id":"{id}","queue":"q","name":"{name}","priority":"normal","state":"{state}","attempt":1,"max_attempts":5,"created_at_ms":{updated},"updated_at_ms":{updated},"idempotency_key":"order-{i}","worker":"w-1"{error}}}"#
    );
    (id, body)
}

/// A step task record of flow run `run` of generation `round` (`<queue>.fl.<run>.<step>.<epoch>.<item>`).
fn step_record(round: usize, i: usize, base_ms: u64) -> (String, String) {
    let (run, step) = (i / 10, i % 10);
    let id = format!("q.fl.g{round}r{run:06}.step{step}.0.0");
    let (state, error) = match i % 100 {
        1 => (
            "dead",
            r#","last_error":{"class":"timeout","message":"slow"}"#,
        ),
        _ => ("succeeded", ""),
    };
    let updated = base_ms + i as u64;
    let body = format!(
        r#"{{"id":"{id}","queue":"q","name":"step{step}","priority":"normal","state":"{state}","attempt":1,"max_attempts":5,"created_at_ms":{updated},"updated_at_ms":{updated},"started_at_ms":{updated},"finished_at_ms":{updated},"worker":"w-1"{error}}}"#
    );
    (id, body)
}

/// Publishes `n` messages (`message(i)`: subject, headers, body), 4,096 in flight.
async fn publish_all(
    js: &async_nats::jetstream::Context,
    n: usize,
    what: &str,
    message: impl Fn(usize) -> (String, async_nats::HeaderMap, String),
) {
    let started = Instant::now();
    let mut acks = futures::stream::FuturesUnordered::new();
    for i in 0..n {
        let (subject, headers, body) = message(i);
        acks.push(
            js.publish_with_headers(subject, headers, body.into())
                .await
                .unwrap()
                .into_future(),
        );
        if acks.len() >= 4096 {
            acks.next().await.unwrap().unwrap();
        }
    }
    while let Some(a) = acks.next().await {
        a.unwrap();
    }
    eprintln!("  {n} {what} in {:.1?}", started.elapsed());
}

/// Flow-run churn: the index's memory as runs come and go (see the module doc).
/// Starts a server keeping the task index and waits until it has read every record.
async fn index_server(
    client: &async_nats::Client,
) -> (
    tokio::task::JoinHandle<Result<(), ax_server::ServerError>>,
    CancellationToken,
    Client,
) {
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(
        Server::builder()
            .queues(["q"])
            .task_index(true)
            .trigger_engine(false)
            .flow_engine(false)
            .build()
            .run(client.clone(), shutdown.clone()),
    );
    let ax = Client::new(client.clone());
    let probe = ListRequest {
        limit: Some(1),
        ..Default::default()
    };
    loop {
        if let Ok(r) = ax.find_tasks(&probe).await {
            if r.complete {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (server, shutdown, ax)
}

async fn flows(n: usize) {
    let rounds = env_or("AX_BENCH_ROUNDS", 1);
    let nats = LocalNats::start().expect("nats-server (set AX_NATS_SERVER or run ./dev bench)");
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    ax_server::streams::apply(&js, &Default::default(), &["q".to_string()])
        .await
        .unwrap();
    println!("step tasks: {n} of {} flow runs per round", n / 10);
    let base_ms = now_ms() - n as u64 - 1000;
    publish_all(&js, n, "step records written", |i| {
        let (id, body) = step_record(0, i, base_ms);
        (format!("$KV.AX_TASKS.{id}"), Default::default(), body)
    })
    .await;
    let rss_before = rss_kib();
    let started = Instant::now();
    let (server, shutdown, ax) = index_server(&client).await;
    let loaded = rss_kib();
    let per_record = |rss: u64| (rss.saturating_sub(rss_before) * 1024) as f64 / n as f64;
    println!(
        "index load: {:.2} s; resident memory {} MiB before the server, {} MiB loaded: {:.0} bytes per record",
        started.elapsed().as_secs_f64(),
        rss_before / 1024,
        loaded / 1024,
        per_record(loaded)
    );
    for round in 1..=rounds {
        // Each old step task purged and a new run's written in its place, in turn.
        publish_all(&js, 2 * n, "purges and step records written", |j| {
            let i = j / 2;
            if j % 2 == 0 {
                let (old, _) = step_record(round - 1, i, base_ms);
                let mut h = async_nats::HeaderMap::new();
                h.insert("KV-Operation", "PURGE");
                h.insert("Nats-Rollup", "sub");
                (format!("$KV.AX_TASKS.{old}"), h, String::new())
            } else {
                let (id, body) = step_record(round, i, base_ms);
                (format!("$KV.AX_TASKS.{id}"), Default::default(), body)
            }
        })
        .await;
        // The feed is ordered: once the last new record is indexed, all are.
        let (last, _) = step_record(round, n - 1, base_ms);
        let run = last.split('.').nth(2).unwrap().to_string();
        let probe = ListRequest {
            query: TaskQuery {
                flow_run: Some(run),
                ..Default::default()
            },
            ..Default::default()
        };
        loop {
            if let Ok(r) = ax.find_tasks(&probe).await {
                if r.tasks.iter().any(|t| t.id == last) {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let total = ax.queues().await.unwrap()["queues"][0]["tasks"].clone();
        let rss = rss_kib();
        println!(
            "after round {round} (every task superseded by a new run's): {} MiB: {:.0} bytes per record; tasks {total}",
            rss / 1024,
            per_record(rss)
        );
    }
    shutdown.cancel();
    let _ = server.await;
}

#[tokio::main]
async fn main() {
    let n = env_or("AX_BENCH_RECORDS", 1_000_000);
    if std::env::args().any(|a| a == "flows") {
        return flows(n).await;
    }
    let nats = LocalNats::start().expect("nats-server (set AX_NATS_SERVER or run ./dev bench)");
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    ax_server::streams::apply(&js, &Default::default(), &["q".to_string()])
        .await
        .unwrap();
    println!("records: {n}");

    // Write the records (pipelined publishes; not timed as part of any figure).
    let base_ms = now_ms() - n as u64 - 1000;
    let started = Instant::now();
    let mut acks = futures::stream::FuturesUnordered::new();
    for i in 0..n {
        let (id, body) = record(i, base_ms);
        acks.push(
            js.publish(format!("$KV.AX_TASKS.{id}"), body.into())
                .await
                .unwrap()
                .into_future(),
        );
        if acks.len() >= 4096 {
            acks.next().await.unwrap().unwrap();
        }
        if i > 0 && i % 200_000 == 0 {
            eprintln!("  ... {i} written");
        }
    }
    while let Some(a) = acks.next().await {
        a.unwrap();
    }
    eprintln!("  written in {:.1?}", started.elapsed());

    // Baseline: read every record once with an ordered consumer.
    let stream = js.get_stream("KV_AX_TASKS").await.unwrap();
    let started = Instant::now();
    let mut msgs = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::LastPerSubject,
            filter_subject: "$KV.AX_TASKS.>".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .messages()
        .await
        .unwrap();
    let mut read = 0;
    while read < n {
        msgs.next().await.unwrap().unwrap();
        read += 1;
    }
    let raw = started.elapsed();
    drop(msgs);
    println!(
        "raw read of every record (ordered consumer): {:.2} s",
        raw.as_secs_f64()
    );

    // The index: load time and memory.
    let rss_before = rss_kib();
    let started = Instant::now();
    let (server, shutdown, ax) = index_server(&client).await;
    let load = started.elapsed();
    let rss_after = rss_kib();
    println!(
        "index load: {:.2} s (ratio to the raw read {:.2})",
        load.as_secs_f64(),
        load.as_secs_f64() / raw.as_secs_f64()
    );
    println!(
        "process resident memory: {} MiB before the server, {} MiB with the index loaded: {:.0} bytes per record",
        rss_before / 1024,
        rss_after / 1024,
        (rss_after.saturating_sub(rss_before) * 1024) as f64 / n as f64
    );

    let queries = [
        (
            "12 dead of one error class",
            TaskQuery {
                state: Some(ax_sdk::TaskState::Dead),
                error_class: Some("card_declined".into()),
                ..Default::default()
            },
        ),
        (
            "a page of 50 succeeded",
            TaskQuery {
                state: Some(ax_sdk::TaskState::Succeeded),
                ..Default::default()
            },
        ),
        (
            "one idempotency key",
            TaskQuery {
                idempotency_key: Some(format!("order-{}", n / 2)),
                ..Default::default()
            },
        ),
        (
            "one id",
            TaskQuery {
                id: Some(format!("q.t{:08}", n / 3)),
                ..Default::default()
            },
        ),
        (
            "error text \"DECLINED\" (class or message, any case)",
            TaskQuery {
                error_text: Some("DECLINED".into()),
                ..Default::default()
            },
        ),
        (
            "one name in a 10 s window",
            TaskQuery {
                name: Some("charge".into()),
                from_ms: Some(base_ms + n as u64 / 2),
                to_ms: Some(base_ms + n as u64 / 2 + 10_000),
                ..Default::default()
            },
        ),
    ];
    for (what, query) in queries {
        let req = ListRequest {
            query,
            limit: Some(50),
            ..Default::default()
        };
        let mut samples = Vec::new();
        let mut found = None;
        for _ in 0..200 {
            let t = Instant::now();
            let r = ax.find_tasks(&req).await.unwrap();
            samples.push(t.elapsed().as_secs_f64() * 1000.0);
            found = Some((r.tasks.len(), r.total));
        }
        let (p50, p99, max) = percentiles(samples);
        let (rows, total) = found.unwrap();
        let total = total.map_or("over 100000".to_string(), |t| t.to_string());
        println!(
            "search {what}: {rows} rows of {total}: p50 {p50:.2} ms  p99 {p99:.2} ms  max {max:.2} ms"
        );
    }
    shutdown.cancel();
    let _ = server.await;
}
