//! The default bench (`./dev bench`): ax end to end in the shape it is deployed in, beside
//! raw JetStream on the same nats-server in the same run.
//!
//! - **raw JetStream**: this process publishes N messages of 256 B (≤ 2,048
//!   unacknowledged) to a work-queue stream; a second process (this bench run again with
//!   `AX_BENCH_ROLE=raw-consumer`) pulls them in batches of 500 and acks each. From the
//!   first publish until the consumer process has acked the last.
//! - **ax, by request** and **ax, direct**: an `ax server` process and an `ax worker
//!   --example --sleep 0s` process (concurrency 512, a no-op handler that parses the
//!   payload), this process the producer: N single submits (`Client::submit`, 1,024 in
//!   flight) of a 256 B payload, by request to the server, then published by the producer
//!   itself (`Client::direct_submits`). From the first submit until every task is acked.
//!
//! Each line gives CPU seconds per 10,000 tasks of every process (producer, server,
//! worker, nats-server) from /proc. Nothing is asserted: docs/PERFORMANCE.md.
//!
//! Settings: AX_BENCH_TASKS (default 50,000), AX_BENCH_PAYLOAD (256 bytes), AX_BENCH_BATCH=1
//! (the producer uses `Client::submit_many`, 1,000 tasks a call, as BullMQ's W1 uses
//! `addBulk`), AX_BENCH_RUNS
//! (1: the three phases repeated, alternating), AX_BENCH_SYNC=always (every write fsynced,
//! as deploy/nats-server.conf runs it), AX_BENCH_R3=1 (then the same on a local 3-node
//! cluster with R3 streams, default sync: the figure of what replication costs),
//! AX_BENCH_DIRECT_FIRST=1 (the direct phase before the requested one), AX_BENCH_AX_BIN
//! (the `ax` binary of the server and worker processes: another build's, e.g. an older
//! commit's, to measure what a change costs with the same producer).

mod common;

use async_nats::jetstream::consumer;
use ax_testkit::{LocalCluster, LocalNats};
use common::deployed::{connect, run, Shape};
use common::*;
use futures::stream::StreamExt;
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::Instant;

/// The allocator of the `ax` binary (the producer is ax's client library).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The raw consumer process: acks `AX_BENCH_N` messages of the durable `raw`, then exits.
async fn raw_consumer() {
    let urls = std::env::var("AX_BENCH_URLS").expect("AX_BENCH_URLS");
    let n = env_or("AX_BENCH_N", 0);
    let client = connect(&urls).await;
    let js = async_nats::jetstream::new(client.clone());
    let consumer: consumer::PullConsumer = js
        .get_stream(common::raw::STREAM)
        .await
        .unwrap()
        .get_consumer(common::raw::CONSUMER)
        .await
        .unwrap();
    let mut msgs = consumer
        .stream()
        .max_messages_per_batch(500)
        .messages()
        .await
        .unwrap();
    println!("ready");
    for _ in 0..n {
        let msg = msgs.next().await.unwrap().unwrap();
        msg.ack().await.unwrap();
    }
    client.flush().await.unwrap();
}

/// Raw JetStream through separate producer and consumer processes: messages per second
/// and the CPU line.
async fn raw(
    urls: &str,
    nats_pids: &[u32],
    n: usize,
    payload: usize,
    replicas: usize,
) -> (f64, String) {
    let client = connect(urls).await;
    let js = async_nats::jetstream::new(client.clone());
    common::raw::create(&js, replicas).await;
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("AX_BENCH_ROLE", "raw-consumer")
        .env("AX_BENCH_URLS", urls)
        .env("AX_BENCH_N", n.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the raw consumer process");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready", "the raw consumer did not start");
    let pids: Vec<(String, u32)> = [("producer".to_string(), std::process::id())]
        .into_iter()
        .chain([("consumer".to_string(), child.id())])
        .chain(
            nats_pids
                .iter()
                .enumerate()
                .map(|(i, p)| (format!("nats {i}"), *p)),
        )
        .collect();
    let before: Vec<f64> = pids.iter().map(|(_, p)| usage(*p).0).collect();
    let start = Instant::now();
    common::raw::publish(&js, n, bytes::Bytes::from(vec![b'x'; payload])).await;
    // The consumer's CPU is read before it exits (its /proc entry goes with it).
    let mut consumer_cpu = 0.0;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        consumer_cpu = usage(child.id()).0;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    };
    let secs = start.elapsed().as_secs_f64();
    assert!(status.success(), "the raw consumer failed: {status}");
    let k = 10_000.0 / n as f64;
    let cpu = pids
        .iter()
        .zip(&before)
        .map(|((name, p), b)| {
            let used = match name.as_str() {
                "consumer" => consumer_cpu - b,
                _ => usage(*p).0 - b,
            };
            format!(
                "{name} {:.2} s/10k ({:.0} %)",
                used * k,
                100.0 * used / secs
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let _ = js.delete_stream(common::raw::STREAM).await;
    (n as f64 / secs, cpu)
}

/// The three phases on one nats deployment, `runs` times.
async fn phases(
    label: &str,
    urls: &str,
    pids: &[u32],
    replicas: u8,
    n: usize,
    payload: usize,
    runs: usize,
) {
    for r in 1..=runs {
        let (raw_rate, raw_cpu) = raw(urls, pids, n, payload, replicas.into()).await;
        println!("[{label}, run {r}] raw JetStream: {raw_rate:.0} msg/s; CPU {raw_cpu}");
        // AX_BENCH_DIRECT_FIRST=1: direct before by request (each phase adds to the same
        // store, and under fsync a later phase runs on a larger one).
        let order = match env_or("AX_BENCH_DIRECT_FIRST", 0) {
            1 => [true, false],
            _ => [false, true],
        };
        for direct in order {
            let how = if direct { "direct" } else { "by request" };
            let shape = Shape {
                label,
                urls,
                nats_pids: pids,
                k: 1,
                replicas,
                direct,
                batch: env_or("AX_BENCH_BATCH", 0) == 1,
                concurrency: 512,
            };
            let m = run(&shape, n, payload).await;
            println!(
                "[{label}, run {r}] ax {how}: {:.0} tasks/s = {:.2} x raw (submits alone {:.0}/s, {} refused); CPU {}",
                m.tasks_per_s,
                m.tasks_per_s / raw_rate,
                m.submits_per_s,
                m.refused,
                m.cpu_line(n)
            );
        }
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    if std::env::var("AX_BENCH_ROLE").as_deref() == Ok("raw-consumer") {
        rt.block_on(raw_consumer());
        return;
    }
    let n = env_or("AX_BENCH_TASKS", 50_000);
    let payload = env_or("AX_BENCH_PAYLOAD", 256);
    let runs = env_or("AX_BENCH_RUNS", 1);
    rt.block_on(async {
        let conf = tempfile::NamedTempFile::new().unwrap();
        let (nats, always): (LocalNats, bool) = nats_from_env(&conf);
        println!("machine: {}", machine());
        println!(
            "deployed shape: producer (this process), `ax server`, `ax worker` and nats-server \
             each a process; {n} tasks of {payload} B, {} submits; sync: {}",
            if env_or("AX_BENCH_BATCH", 0) == 1 {
                "batch"
            } else {
                "single"
            },
            if always {
                "always (every write fsynced)"
            } else {
                "default (fsync every 2 min)"
            }
        );
        let pid = nats.pid().expect("running");
        phases("one nats-server", &nats.url(), &[pid], 1, n, payload, runs).await;
        drop(nats);
        if env_or("AX_BENCH_R3", 0) == 1 {
            let cluster = LocalCluster::start(3).expect("3-node cluster");
            let pids: Vec<u32> = cluster.nodes.iter().filter_map(|n| n.pid()).collect();
            let urls = cluster.urls().join(",");
            phases(
                "3-node cluster, R3, default sync",
                &urls,
                &pids,
                3,
                n,
                payload,
                runs,
            )
            .await;
        }
    });
}
