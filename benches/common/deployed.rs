//! ax as it is deployed: `ax server` and `ax worker --example` processes on a nats-server
//! (or a cluster), this bench process the producer. Shared by `deployed` and `scaleout`.

use super::usage;
use ax_sdk::{Client, TaskSpec};
use futures::stream::StreamExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The queue the deployed runs use.
pub const QUEUE: &str = "bench";

/// An `ax` process (the release binary of this build, or `AX_BENCH_AX_BIN`: another
/// build's, to compare two versions of the server and worker with one producer) connected
/// to `urls`.
pub fn spawn_ax(urls: &str, args: &[&str]) -> Child {
    let bin = std::env::var("AX_BENCH_AX_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_ax").into());
    Command::new(bin)
        .args(args)
        .args(["--metrics-addr", "off"])
        .env("NATS_URL", urls)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn ax")
}

/// Tasks of [`QUEUE`] not yet acked (pending or delivered), or `None` before its
/// consumers exist.
pub async fn left(js: &async_nats::jetstream::Context) -> Option<u64> {
    let mut n = 0;
    for p in ax_sdk::Priority::ALL {
        let stream = js.get_stream(p.ready_stream()).await.ok()?;
        let mut consumer: async_nats::jetstream::consumer::PullConsumer = stream
            .get_consumer(&ax_core::names::consumer_name(QUEUE, p))
            .await
            .ok()?;
        let info = consumer.info().await.ok()?;
        n += info.num_pending + info.num_ack_pending as u64;
    }
    Some(n)
}

/// A client of `urls` (comma-separated) with a patient request timeout.
pub async fn connect(urls: &str) -> async_nats::Client {
    let addrs: Vec<async_nats::ServerAddr> = urls.split(',').map(|u| u.parse().unwrap()).collect();
    async_nats::ConnectOptions::new()
        .request_timeout(Some(Duration::from_secs(10)))
        .connect(addrs.as_slice())
        .await
        .unwrap()
}

/// One deployed run's shape.
pub struct Shape<'a> {
    /// Printed first on the result line.
    pub label: &'a str,
    /// The nats-server URLs, comma-separated.
    pub urls: &'a str,
    /// nats-server processes, for their CPU.
    pub nats_pids: &'a [u32],
    /// `ax server` and `ax worker` processes (as many of each).
    pub k: usize,
    /// Stream replicas (1, or 3 on a cluster).
    pub replicas: u8,
    /// The producer publishes its tasks itself (`Client::direct_submits`).
    pub direct: bool,
    /// `submit_many` (1,000 a call) instead of single submits (1,024 in flight).
    pub batch: bool,
    /// Each worker's concurrency.
    pub concurrency: usize,
}

/// What one run measured.
pub struct Measured {
    /// Tasks from the first submit to the last ack, per second.
    pub tasks_per_s: f64,
    /// Submits per second, until the last was accepted.
    pub submits_per_s: f64,
    /// Submits refused for good (none expected).
    pub refused: usize,
    /// CPU seconds of each process over the run: the producer (this process), the ax
    /// processes, the nats-servers.
    pub cpu: Vec<(String, f64)>,
    /// Wall seconds of the run.
    pub secs: f64,
}

impl Measured {
    /// The CPU line: seconds per 10,000 tasks and % of one core, per process.
    pub fn cpu_line(&self, n: usize) -> String {
        let k = 10_000.0 / n as f64;
        self.cpu
            .iter()
            .map(|(name, s)| format!("{name} {:.2} s/10k ({:.0} %)", s * k, 100.0 * s / self.secs))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Applies the topology of [`QUEUE`] (retried: a new cluster accepts R3 streams only once
/// its meta leader is elected).
async fn apply_topology(js: &async_nats::jetstream::Context, replicas: u8, label: &str) {
    let topology = ax_server::streams::Topology {
        replicas: replicas.into(),
        capacity: [100_000; 3],
        ..Default::default()
    };
    let queues = vec![QUEUE.to_string()];
    let deadline = Instant::now() + Duration::from_secs(60);
    while ax_server::streams::apply(js, &topology, &queues)
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "{label}: the topology was not applied in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Runs `n` tasks of `payload_len` bytes through `shape`: starts its servers and
/// workers, submits, waits until every task is acked, stops the processes.
pub async fn run(shape: &Shape<'_>, n: usize, payload_len: usize) -> Measured {
    let client = connect(shape.urls).await;
    let js = async_nats::jetstream::new(client.clone());
    apply_topology(&js, shape.replicas, shape.label).await;
    let replicas = shape.replicas.to_string();
    let mut procs: Vec<(String, Child)> = Vec::new();
    for i in 0..shape.k {
        let id = format!("s{i}");
        let args = [
            "server",
            "--queue",
            QUEUE,
            "--id",
            &id,
            "--replicas",
            &replicas,
            "--capacity",
            "100000,100000,100000",
        ];
        procs.push((format!("server {i}"), spawn_ax(shape.urls, &args)));
    }
    let ax = Client::new(client.clone()).direct_submits(shape.direct);
    while left(&js).await.is_none() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let concurrency = shape.concurrency.to_string();
    for i in 0..shape.k {
        let args = [
            "worker",
            "--example",
            "--queue",
            QUEUE,
            "--concurrency",
            &concurrency,
            "--sleep",
            "0s",
            "--fail-rate",
            "0",
        ];
        procs.push((format!("worker {i}"), spawn_ax(shape.urls, &args)));
    }
    // The server answers and the workers are pulling.
    while !shape.direct && ax.submit(QUEUE, TaskSpec::new("warmup")).await.is_err() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    while left(&js).await != Some(0) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let me = std::process::id();
    let pids: Vec<(String, u32)> = std::iter::once(("producer".to_string(), me))
        .chain(procs.iter().map(|(name, c)| (name.clone(), c.id())))
        .chain(
            shape
                .nats_pids
                .iter()
                .enumerate()
                .map(|(i, p)| (format!("nats {i}"), *p)),
        )
        .collect();
    let before: Vec<f64> = pids.iter().map(|(_, p)| usage(*p).0).collect();
    let value = serde_json::Value::String("x".repeat(payload_len.saturating_sub(2)));
    let start = Instant::now();
    let refused = submit(&ax, n, &value, shape.batch).await;
    let submits_per_s = n as f64 / start.elapsed().as_secs_f64();
    while left(&js).await != Some(0) && start.elapsed() < Duration::from_secs(600) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = pids
        .iter()
        .zip(&before)
        .map(|((name, p), b)| (name.clone(), usage(*p).0 - b))
        .collect();
    for (_, mut c) in procs {
        let _ = c.kill();
        let _ = c.wait();
    }
    Measured {
        tasks_per_s: (n - refused) as f64 / secs,
        submits_per_s,
        refused,
        cpu,
        secs,
    }
}

/// Submits `n` tasks; a `busy` one is sent again. Answers how many were refused for good.
async fn submit(ax: &Client, n: usize, value: &serde_json::Value, batch: bool) -> usize {
    let spec = || TaskSpec::new("noop").json(value);
    if batch {
        let answers = ax.submit_many(QUEUE, (0..n).map(|_| spec())).await;
        return answers.iter().filter(|a| a.is_err()).count();
    }
    let refused = futures::stream::iter(0..n)
        .map(|_| async {
            loop {
                match ax.submit(QUEUE, spec()).await {
                    Ok(_) => return 0,
                    Err(ax_sdk::ClientError::Refused(e)) if e.code.is_retryable() => {
                        tokio::time::sleep(Duration::from_millis(5)).await
                    }
                    Err(e) => {
                        eprintln!("submit refused: {e}");
                        return 1;
                    }
                }
            }
        })
        .buffer_unordered(1024)
        .fold(0, |sum, r| async move { sum + r })
        .await;
    refused
}
