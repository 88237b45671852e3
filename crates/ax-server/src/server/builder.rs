//! The server's settings and their builder, with the documented defaults.

use crate::streams::Topology;
use crate::trigger::clock::{Clock, SystemClock};
use ax_core::task::Limits;
use std::sync::Arc;
use std::time::Duration;

/// Server settings. Build with [`Server::builder`].
#[derive(Debug, Clone)]
pub struct Server {
    pub(super) queues: Vec<String>,
    pub(super) topology: Topology,
    pub(super) limits: Limits,
    pub(super) apply_streams: bool,
    pub(super) max_inflight_submits: usize,
    pub(super) dispatch_lookahead: Duration,
    pub(super) dispatch_horizon: Duration,
    pub(super) max_inflight_dispatch: usize,
    pub(super) triggers: bool,
    pub(super) trigger_engine: bool,
    pub(super) flow_engine: bool,
    pub(super) task_index: bool,
    pub(super) console: Option<crate::console::ConsoleConfig>,
    pub(super) alerts: crate::ops::AlertConfig,
    pub(super) max_held_bytes: usize,
    pub(super) lease_ttl: Duration,
    pub(super) trigger_hold: Duration,
    pub(super) partition_ttl: Duration,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) id: String,
    pub(super) group_commit: ax_core::atomic::GroupCommit,
    pub(super) faults: ax_core::faults::Faults,
}

/// Builder for [`Server`].
///
/// ```
/// let server = ax_server::Server::builder()
///     .queues(["emails", "reports"])
///     .capacity([100, 1000, 5000])
///     .build();
/// # let _ = server;
/// ```
#[derive(Debug, Clone)]
pub struct ServerBuilder(Server);

impl Default for ServerBuilder {
    fn default() -> Self {
        ServerBuilder(Server {
            queues: vec!["default".to_string()],
            topology: Topology::default(),
            limits: Limits::default(),
            apply_streams: true,
            max_inflight_submits: 4096,
            dispatch_lookahead: Duration::from_millis(200),
            dispatch_horizon: Duration::from_secs(30),
            max_inflight_dispatch: 20_000,
            triggers: true,
            trigger_engine: true,
            flow_engine: true,
            task_index: false,
            console: None,
            alerts: Default::default(),
            max_held_bytes: 64 << 20,
            lease_ttl: Duration::from_millis(1500),
            trigger_hold: Duration::from_secs(60),
            partition_ttl: Duration::from_millis(1500),
            clock: Arc::new(SystemClock::default()),
            id: format!("{}-{}", std::process::id(), nuid::next()),
            group_commit: ax_core::atomic::GroupCommit::Auto,
            faults: Default::default(),
        })
    }
}

impl ServerBuilder {
    /// Queues to declare at start (default `["default"]`). Queues declared elsewhere (by
    /// `ax streams apply --queue` or another server) are accepted too.
    pub fn queues<I: IntoIterator<Item = S>, S: Into<String>>(mut self, queues: I) -> Self {
        self.0.queues = queues.into_iter().map(Into::into).collect();
        self
    }
    /// Stream topology (capacities, ack wait, replicas); default [`Topology::default`].
    pub fn topology(mut self, topology: Topology) -> Self {
        self.0.topology = topology;
        self
    }
    /// Per-queue capacity of the high, normal and low ready subjects (default
    /// 1000 / 5000 / 10000).
    pub fn capacity(mut self, capacity: [i64; 3]) -> Self {
        self.0.topology.capacity = capacity;
        self
    }
    /// Ack wait / heartbeat timeout of the ready consumers (default 30 s).
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.0.topology.ack_wait = ack_wait;
        self
    }
    /// Submit limits (payload size, delay, attempts, timeout); default [`Limits::default`].
    pub fn limits(mut self, limits: Limits) -> Self {
        self.0.limits = limits;
        self
    }
    /// Apply `streams/` at start (default true).
    pub fn apply_streams(mut self, apply: bool) -> Self {
        self.0.apply_streams = apply;
        self
    }
    /// Most submit requests handled at once (default 4096); more wait in the client buffer.
    pub fn max_inflight_submits(mut self, n: usize) -> Self {
        self.0.max_inflight_submits = n.max(1);
        self
    }
    /// How long before its due time a delayed task is read and armed (default 200 ms).
    pub fn dispatch_lookahead(mut self, d: Duration) -> Self {
        self.0.dispatch_lookahead = d;
        self
    }
    /// Delayed tasks due within this window are held in memory with their message; later
    /// ones only as (due, sequence) and read back as they enter it (default 30 s).
    pub fn dispatch_horizon(mut self, d: Duration) -> Self {
        self.0.dispatch_horizon = d.max(self.0.dispatch_lookahead);
        self
    }
    /// Run the trigger engine and the trigger API (default true).
    pub fn triggers(mut self, on: bool) -> Self {
        self.0.triggers = on;
        self
    }
    /// Take part in the trigger engine's leader election and fire triggers (default true).
    /// Off, the server still answers the trigger API and serves event triggers; another
    /// server fires scheduled triggers.
    pub fn trigger_engine(mut self, on: bool) -> Self {
        self.0.trigger_engine = on;
        self
    }
    /// Take part in the flow engine's leader election and drive flow runs (default true).
    /// Off, the server still answers the flow API; another server drives the runs.
    pub fn flow_engine(mut self, on: bool) -> Self {
        self.0.flow_engine = on;
        self
    }
    /// Serve the web console (default: none). It needs the task index, so it turns that on
    /// too. Refused at start on a non-loopback address without a token.
    pub fn console(mut self, console: crate::console::ConsoleConfig) -> Self {
        self.0.console = Some(console);
        self.0.task_index = true;
        self
    }
    /// Keep every task-state change for 30 days in `AX_TASK_EVENTS` (default false; see
    /// [`Topology::task_events`]). Only creates the stream when it is missing.
    pub fn task_events(mut self, on: bool) -> Self {
        self.0.topology.task_events = on;
        self
    }
    /// Store the unrecorded submits of one moment as one atomic batch per ready stream:
    /// one stored write, one fsync under `sync_interval: always`, carries many tasks.
    /// Default [`GroupCommit::Auto`](ax_core::atomic::GroupCommit): batches while the
    /// broker answers them faster than single publishes (it fsyncs each write), single
    /// publishes while not (and where the streams refuse batches: `persist_mode: async`).
    /// `true` / `false` are `Always` / `Never`. docs/PERFORMANCE.md has all three measured.
    pub fn group_commit(mut self, mode: impl Into<ax_core::atomic::GroupCommit>) -> Self {
        self.0.group_commit = mode.into();
        self
    }
    /// Keep the task index and answer `ax.task.list`, `replay` and `queues` (default
    /// false). The index follows every task-state change (one more delivery per record
    /// write, and about 450 bytes of memory per task: docs/PERFORMANCE.md), so it runs
    /// only where asked for: one or two servers of a cluster, or the console's.
    pub fn task_index(mut self, on: bool) -> Self {
        self.0.task_index = on;
        self
    }
    /// Alerts on terminal failures: dedup window, webhook, console link (default: 10 min
    /// window, no webhook, no link). See [`crate::ops::AlertConfig`].
    pub fn alerts(mut self, alerts: crate::ops::AlertConfig) -> Self {
        self.0.alerts = alerts;
        self
    }
    /// Most payload and header bytes of delayed tasks held in memory ahead of their due
    /// time (default 64 MiB), and, separately, of tasks the fair dispatcher holds for their
    /// tenant's turn. Tasks beyond it are kept as (due, sequence) or their sequence alone
    /// and read back when due or released, so this bounds memory, not how many tasks may
    /// wait.
    pub fn max_held_bytes(mut self, bytes: usize) -> Self {
        self.0.max_held_bytes = bytes;
        self
    }
    /// Lease TTL of the trigger and flow engines' leaders (default 1.5 s; renewed every
    /// third of it): a standby takes over at most this long (plus one poll, a third of it)
    /// after the leader dies. Fires are fenced by the lease revision, so a leader that
    /// loses its lease to a slow renewal cannot fire twice; it only hands over early.
    /// (3 s until 2026-12-02: docs/DECISIONS.md.)
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.0.lease_ttl = ttl.max(Duration::from_millis(300));
        self
    }
    /// How far ahead the trigger engine's leader holds a trigger whole (default 60 s):
    /// one not due within it (and with no task it waits on) is held as its name and next
    /// wake time alone, and read back from the store half of this before it is due. A
    /// shorter time holds less memory and reads more; zero reads each trigger back at
    /// each of its due times.
    pub fn trigger_hold(mut self, ahead: Duration) -> Self {
        self.0.trigger_hold = ahead;
        self
    }
    /// Lease TTL of the delayed-task partitions this server owns (default 1.5 s, renewed
    /// every fifth of it): a killed server's partitions are taken over about this long
    /// after its last renewal.
    pub fn partition_ttl(mut self, ttl: Duration) -> Self {
        self.0.partition_ttl = ttl.max(Duration::from_millis(300));
        self
    }
    /// The clock that decides when triggers are due (default: the system clock).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.0.clock = clock;
        self
    }
    /// This server's id in leases (default `<pid>-<nuid>`).
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.0.id = id.into();
        self
    }
    /// Runs with the faults of `faults` (tests; default: none — see `ax_core::faults`).
    #[doc(hidden)]
    pub fn faults(mut self, faults: ax_core::faults::Faults) -> Self {
        self.0.faults = faults;
        self
    }
    /// Finishes the builder.
    pub fn build(self) -> Server {
        self.0
    }
}
