//! The integration tests' environment (feature `env`): a real nats-server, an ax server in
//! the test's process, helpers to run workers and to wait for what the system exposes.

use crate::LocalNats;
use ax_core::state::TaskStore;
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, TaskRecord, TaskState};
use ax_server::ServerBuilder;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub struct Env {
    pub nats: LocalNats,
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub ax: Client,
    pub shutdown: CancellationToken,
    server: Option<JoinHandle<Result<(), ax_server::ServerError>>>,
}

/// RUST_LOG=ax=debug shows the library's logs for a failing test.
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Runs a whole test body, panicking with `what` after `limit`: a test that hangs fails
/// with its name instead of stalling the suite until CI gives up on it.
pub async fn within<T>(limit: Duration, what: &str, body: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, body).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: did not finish within {limit:?}"),
    }
}

/// Polls `f` every 20 ms until it returns `Some`, panicking with `what` after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        // A probe that hangs (a request into a cluster mid-election) must not outlive the
        // deadline: the test fails with `what` instead of hanging the suite.
        let left = deadline.saturating_duration_since(Instant::now());
        if let Ok(Some(v)) = tokio::time::timeout(left.max(Duration::from_millis(100)), f()).await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Env {
    /// nats-server + an ax server with queue `q` (plus the builder's queues) and a short
    /// ack wait, ready to answer.
    pub async fn start(server: ServerBuilder) -> Env {
        let mut env = Env::nats_only().await;
        env.start_server(server).await;
        env
    }

    /// A nats-server and a client, no ax server yet.
    pub async fn nats_only() -> Env {
        init_logs();
        let nats = LocalNats::start().expect("nats-server starts (run ./dev test)");
        let client = async_nats::connect(nats.url()).await.expect("connect");
        let js = async_nats::jetstream::new(client.clone());
        Env {
            nats,
            ax: Client::new(client.clone()),
            client,
            js,
            shutdown: CancellationToken::new(),
            server: None,
        }
    }

    /// The builder most tests use: queue `q`, ack wait 1 s, triggers read back at each due
    /// time (`trigger_hold` zero).
    pub fn server() -> ServerBuilder {
        ax_server::Server::builder()
            .queues(["q"])
            .ack_wait(Duration::from_secs(1))
            // Every trigger read back from the store at each of its due times: the tests
            // take the path a trigger due later than the default hold time takes.
            .trigger_hold(Duration::ZERO)
    }

    pub async fn start_server(&mut self, server: ServerBuilder) {
        self.shutdown = CancellationToken::new();
        let handle = tokio::spawn(
            server
                .build()
                .run(self.client.clone(), self.shutdown.clone()),
        );
        self.server = Some(handle);
        // Ready when it answers a request (an unknown queue is answered too).
        let client = self.client.clone();
        eventually(Duration::from_secs(15), "ax server to answer", || {
            let client = client.clone();
            async move {
                client
                    .request("ax.submit.__probe", "{\"name\":\"x\"}".into())
                    .await
                    .ok()
            }
        })
        .await;
    }

    /// Stops the ax server gracefully and waits for it.
    pub async fn stop_server(&mut self) {
        self.shutdown.cancel();
        if let Some(handle) = self.server.take() {
            handle
                .await
                .expect("server task")
                .expect("server ran cleanly");
        }
    }

    pub async fn store(&self) -> TaskStore {
        TaskStore::open(&self.js).await.expect("task bucket")
    }

    /// Runs `worker` until the returned token is cancelled.
    pub fn spawn_worker(&self, worker: Worker) -> (CancellationToken, JoinHandle<()>) {
        let token = CancellationToken::new();
        let handle = tokio::spawn({
            let client = self.client.clone();
            let token = token.clone();
            async move { worker.run(client, token).await.expect("worker ran cleanly") }
        });
        (token, handle)
    }

    pub async fn record(&self, id: &str) -> TaskRecord {
        self.ax
            .task(id)
            .await
            .expect("read task")
            .unwrap_or_else(|| panic!("no record for {id}"))
            .0
    }

    /// Waits until task `id` is in `state`.
    pub async fn wait_state(&self, id: &str, state: TaskState, timeout: Duration) -> TaskRecord {
        let ax = self.ax.clone();
        let what = format!("task {id} to be {state}");
        eventually(timeout, &what, || {
            let ax = ax.clone();
            async move {
                // The record alone: polling must not walk the ready messages each time.
                match ax.record(id).await {
                    Ok(Some((rec, _))) if rec.state == state => Some(rec),
                    _ => None,
                }
            }
        })
        .await
    }

    /// Messages currently stored in a stream.
    pub async fn stream_len(&self, name: &str) -> u64 {
        stream_len(&self.js, name).await
    }
}

/// Messages currently stored in stream `name` (for tests that run no [`Env`]).
pub async fn stream_len(js: &async_nats::jetstream::Context, name: &str) -> u64 {
    let mut stream = js.get_stream(name).await.expect("stream");
    stream.info().await.expect("info").state.messages
}

impl Drop for Env {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Runs per task id, filled by [`counting_worker`].
pub type Runs = Arc<Mutex<HashMap<String, u32>>>;

/// A worker for queue `q` with a no-op handler that counts runs per task id.
pub fn counting_worker(concurrency: usize) -> (Worker, Runs) {
    let runs: Runs = Arc::default();
    let worker = Worker::builder("q")
        .concurrency(concurrency)
        .handler({
            let runs = runs.clone();
            move |task: Task| {
                let runs = runs.clone();
                async move {
                    *runs.lock().unwrap().entry(task.id).or_default() += 1;
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    (worker, runs)
}
