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

use ax_testkit::{LocalCluster, LocalNats};
use common::deployed::{run, Shape};
use common::*;

/// One line: `k` servers and `k` workers against `urls`.
async fn report(label: &str, urls: &str, nats_pids: &[u32], k: usize, n: usize, replicas: u8) {
    let shape = Shape {
        label,
        urls,
        nats_pids,
        k,
        replicas,
        direct: std::env::var("AX_BENCH_DIRECT").is_ok_and(|v| v == "1"),
        batch: true,
        concurrency: 256,
    };
    let m = run(&shape, n, 256).await;
    let cpu = m
        .cpu
        .iter()
        .map(|(name, s)| format!("{name} {s:.1} s ({:.0} %)", 100.0 * s / m.secs))
        .collect::<Vec<_>>()
        .join(", ");
    println!(
        "{label}, {k} server(s) + {k} worker(s): {n} tasks in {:.2} s = {:.0} tasks/s ({} refused); CPU: {cpu}",
        m.secs, m.tasks_per_s, m.refused
    );
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
            report("one nats-server", &nats.url(), &[pid], k, n, 1).await;
        }
        if r3 {
            for k in 1..=3 {
                let cluster = LocalCluster::start(3).expect("3-node cluster");
                let pids: Vec<u32> = cluster.nodes.iter().filter_map(|n| n.pid()).collect();
                let urls = cluster.urls().join(",");
                report("3-node cluster, R3", &urls, &pids, k, n, 3).await;
            }
        }
    });
}
