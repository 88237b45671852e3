//! Scale-out: 1, 2 and 3 `ax server` processes and as many `ax worker` processes (example
//! handler, no sleep, no failures, concurrency 256) on one nats-server, then on a local
//! 3-node cluster with R3 streams.
//!
//! Run: `./dev bench scaleout` (AX_BENCH_SCALE_TASKS, default 30,000 immediate tasks, sent
//! with batch submits from this process; AX_BENCH_SCALE_R3=0 skips the cluster). Prints
//! tasks/s from the first submit to the last ack and the CPU each process used (seconds,
//! and % of one core over the run), from /proc. Nothing is asserted. AX_BENCH_DIRECT=1: the
//! producer submits directly (`Client::direct_submits`), no server on the immediate path.

mod common;

use ax_sdk::{Client, TaskSpec};
use ax_testkit::{LocalCluster, LocalNats};
use common::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn spawn(urls: &str, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ax"))
        .args(args)
        .args(["--metrics-addr", "off"])
        .env("NATS_URL", urls)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn ax")
}

async fn left(js: &async_nats::jetstream::Context) -> Option<u64> {
    let mut n = 0;
    for p in ax_sdk::Priority::ALL {
        let stream = js.get_stream(p.ready_stream()).await.ok()?;
        let mut consumer: async_nats::jetstream::consumer::PullConsumer = stream
            .get_consumer(&ax_core::names::consumer_name("so", p))
            .await
            .ok()?;
        let info = consumer.info().await.ok()?;
        n += info.num_pending + info.num_ack_pending as u64;
    }
    Some(n)
}

/// One run: `k` servers and `k` workers against `urls`; nats-server pids for CPU.
async fn run(label: &str, urls: &str, nats_pids: &[u32], k: usize, n: usize, replicas: &str) {
    let addrs: Vec<async_nats::ServerAddr> = urls.split(',').map(|u| u.parse().unwrap()).collect();
    let client = async_nats::ConnectOptions::new()
        .request_timeout(Some(Duration::from_secs(10)))
        .connect(addrs.as_slice())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client.clone());
    // A new cluster accepts R3 streams only once its meta leader is elected: apply the
    // topology first, with retries.
    let topology = ax_server::streams::Topology {
        replicas: replicas.parse().unwrap(),
        capacity: [100_000; 3],
        ..Default::default()
    };
    let queues = vec!["so".to_string()];
    let deadline = Instant::now() + Duration::from_secs(60);
    while ax_server::streams::apply(&js, &topology, &queues)
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "{label}: the topology was not applied in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut procs: Vec<(String, Child)> = Vec::new();
    for i in 0..k {
        let id = format!("s{i}");
        let server = spawn(
            urls,
            &[
                "server",
                "--queue",
                "so",
                "--id",
                &id,
                "--replicas",
                replicas,
                "--capacity",
                "100000,100000,100000",
            ],
        );
        procs.push((format!("server {i}"), server));
    }
    let direct = std::env::var("AX_BENCH_DIRECT").is_ok_and(|v| v == "1");
    let ax = Client::new(client.clone()).direct_submits(direct);
    while left(&js).await.is_none() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for i in 0..k {
        let worker = spawn(
            urls,
            &[
                "worker",
                "--example",
                "--queue",
                "so",
                "--concurrency",
                "256",
                "--sleep",
                "0s",
                "--fail-rate",
                "0",
            ],
        );
        procs.push((format!("worker {i}"), worker));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cpu0: Vec<f64> = procs.iter().map(|(_, c)| usage(c.id()).0).collect();
    let ncpu0: Vec<f64> = nats_pids.iter().map(|p| usage(*p).0).collect();
    let start = Instant::now();
    let answers = ax
        .submit_many(
            "so",
            (0..n).map(|i| TaskSpec::new("t").json(&serde_json::json!({"i": i}))),
        )
        .await;
    let refused = answers.iter().filter(|a| a.is_err()).count();
    while left(&js).await != Some(0) && start.elapsed() < Duration::from_secs(300) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = start.elapsed().as_secs_f64();
    let mut report = Vec::new();
    for ((name, c), before) in procs.iter().zip(&cpu0) {
        let used = usage(c.id()).0 - before;
        report.push(format!("{name} {used:.1} s ({:.0} %)", 100.0 * used / secs));
    }
    for (i, (pid, before)) in nats_pids.iter().zip(&ncpu0).enumerate() {
        let used = usage(*pid).0 - before;
        report.push(format!(
            "nats {i} {used:.1} s ({:.0} %)",
            100.0 * used / secs
        ));
    }
    println!(
        "{label}, {k} server(s) + {k} worker(s): {n} tasks in {secs:.2} s = {:.0} tasks/s ({refused} refused); CPU: {}",
        (n - refused) as f64 / secs,
        report.join(", ")
    );
    for (_, mut c) in procs {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn main() {
    let n = env_or("AX_BENCH_SCALE_TASKS", 30_000);
    let r3 = env_or("AX_BENCH_SCALE_R3", 1) != 0;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for k in 1..=3 {
            let nats = LocalNats::start().expect("nats-server (run via ./dev bench scaleout)");
            let pid = nats.pid().expect("running");
            run("one nats-server", &nats.url(), &[pid], k, n, "1").await;
        }
        if r3 {
            for k in 1..=3 {
                let cluster = LocalCluster::start(3).expect("3-node cluster");
                let pids: Vec<u32> = cluster.nodes.iter().filter_map(|n| n.pid()).collect();
                let urls = cluster.urls().join(",");
                run("3-node cluster, R3", &urls, &pids, k, n, "3").await;
            }
        }
    });
}
