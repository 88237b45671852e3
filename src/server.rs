//! `ax server` and the topology flags it shares with `ax streams`.

use crate::conn::Conn;
use anyhow::{bail, Result};
use ax_core::atomic::GroupCommit;
use ax_server::streams::Topology;
use ax_server::Server;
use clap::Args;
use std::time::Duration;

#[derive(Args)]
pub(crate) struct TopologyArgs {
    /// Queues to declare (repeatable).
    #[arg(long = "queue", default_value = "default")]
    pub(crate) queues: Vec<String>,
    /// Capacity of each queue's high / normal / low ready subject.
    #[arg(long, value_delimiter = ',', default_values_t = [1000i64, 5000, 10000])]
    capacity: Vec<i64>,
    /// Redeliver a task held this long without ack or heartbeat.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    ack_wait: Duration,
    /// Stream replicas.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Most delayed tasks held at once, all queues together (a submit beyond it is `busy`).
    #[arg(long, default_value_t = 1_000_000)]
    max_delayed: i64,
    /// Keep every task-state change for 30 days (stream AX_TASK_EVENTS): `ax task events`
    /// then shows a task's whole history, not only its last 16 changes. Costs about a
    /// tenth of end-to-end throughput (the broker copies every record write).
    #[arg(long)]
    task_events: bool,
}

impl TopologyArgs {
    pub(crate) fn topology(&self) -> Result<Topology> {
        let [high, normal, low] = self.capacity[..] else {
            bail!("--capacity takes three numbers: high,normal,low");
        };
        if high < 1 || normal < 1 || low < 1 {
            bail!("--capacity values must be at least 1");
        }
        Ok(Topology {
            capacity: [high, normal, low],
            ack_wait: self.ack_wait,
            replicas: self.replicas,
            max_delayed: self.max_delayed,
            task_events: self.task_events,
            ..Topology::default()
        })
    }
}

/// `--group-commit`: see `ax_core::atomic::GroupCommit`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum GroupCommitArg {
    Auto,
    Always,
    Never,
}

#[derive(Args)]
pub(crate) struct ServerArgs {
    /// Topology settings used when creating what is missing. A server never changes an
    /// existing stream or consumer: use `ax streams apply` for that.
    #[command(flatten)]
    topology: TopologyArgs,
    /// Serve Prometheus metrics here ("off" to disable).
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_addr: String,
    /// Do not create the topology (an admin applied it; the server's NATS user then
    /// needs no stream-management permissions). The server waits until it exists.
    #[arg(long)]
    no_apply: bool,
    /// Answer the trigger API and serve event triggers, but never lead the trigger engine.
    #[arg(long)]
    no_trigger_engine: bool,
    /// Delayed tasks due within this window have their messages read ahead of time.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    dispatch_horizon: Duration,
    /// The trigger engine's leader holds a trigger whole only while it is due within this
    /// window; the others are held as their names and read back half of it before due.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    trigger_hold: Duration,
    /// Most bytes of delayed-task messages held in memory ahead of their due time.
    #[arg(long, default_value = "64MiB", value_parser = parse_bytes)]
    max_held_bytes: usize,
    /// Serve the web console here (e.g. 127.0.0.1:8080); keeps the task index too.
    #[arg(long)]
    console_addr: Option<std::net::SocketAddr>,
    /// The console's admin token (needed off loopback; at least 8 characters, no spaces).
    #[arg(long, env = "AX_CONSOLE_TOKEN", hide_env_values = true)]
    console_token: Option<String>,
    /// A console token that may only read (needs --console-token).
    #[arg(long, env = "AX_CONSOLE_READONLY_TOKEN", hide_env_values = true)]
    console_readonly_token: Option<String>,
    /// Keep the task index (every task's state, searchable) and answer `ax tasks list`,
    /// `ax tasks replay` and `ax queue list`. Costs one more delivery per record write.
    #[arg(long)]
    task_index: bool,
    /// Group the submits of one moment into one atomic batch per ready stream: `auto`
    /// measures and uses the way the broker answers faster (batches when it fsyncs every
    /// write), `always`, or `never` (each submit its own publish).
    #[arg(long, value_enum, default_value_t = GroupCommitArg::Auto)]
    group_commit: GroupCommitArg,
    /// The same as `--group-commit never`.
    #[arg(long, conflicts_with = "group_commit")]
    no_group_commit: bool,
    /// Fold repeats of a terminal failure (same queue, task name and error class) into one
    /// alert per this window.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    alert_window: Duration,
    /// POST every alert as JSON to this URL (http:// or https://).
    #[arg(long, value_parser = check_webhook)]
    alert_webhook: Option<String>,
    /// The console's public base URL (`https://ax.example.com`): the links in alerts; its
    /// host is accepted in requests' Host and Origin (behind a proxy); https marks the
    /// session cookie Secure.
    #[arg(long)]
    console_url: Option<String>,
    /// Most console connections open at once; more are closed at once.
    #[arg(long, default_value_t = 256)]
    console_max_connections: usize,
    /// Time a console client has to send a request's headers, and each part of its body.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    console_request_timeout: Duration,
    /// This server's id (default `<pid>-<nuid>`; unique per process): the holder named in
    /// the leases of the trigger engine, the flow engine and the delayed-task partitions,
    /// and what `ax trigger leader` / `ax flow leader` print.
    #[arg(long)]
    id: Option<String>,
}

fn check_webhook(url: &str) -> Result<String, String> {
    ax_server::ops::alerts::check_webhook(url).map(|()| url.to_string())
}

/// `64MiB`, `512KiB`, `1GiB` or a plain number of bytes.
fn parse_bytes(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let (number, unit) = text
        .find(|c: char| !c.is_ascii_digit())
        .map_or((text, ""), |i| text.split_at(i));
    let n: usize = number
        .parse()
        .map_err(|_| format!("{text:?}: expected e.g. 64MiB"))?;
    let scale = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => return Err(format!("unknown unit {other:?}: use B, KiB, MiB or GiB")),
    };
    n.checked_mul(scale)
        .ok_or_else(|| format!("{text:?} is too large"))
}

pub(crate) async fn run(args: ServerArgs, conn: &Conn) -> Result<()> {
    crate::metrics_at(&args.metrics_addr)?;
    let shutdown = crate::shutdown_on_signal();
    let topology = args.topology.topology()?;
    // Settings that cannot get better by waiting fail before NATS is awaited.
    // The fault tests' AX_TEST_* variables (none in production: see ax_core::faults).
    let mut builder = Server::builder().faults(ax_core::faults::Faults::from_env());
    if let Some(addr) = args.console_addr {
        let mut console = ax_server::console::ConsoleConfig::new(addr)
            .request_timeout(args.console_request_timeout)
            .max_connections(args.console_max_connections);
        console.token = args.console_token.clone();
        console.readonly_token = args.console_readonly_token.clone();
        console.url = args.console_url.clone();
        console.check()?;
        builder = builder.console(console);
    }
    let Some(client) = conn.connect_waiting(&shutdown).await? else {
        return Ok(());
    };
    if let Some(id) = &args.id {
        builder = builder.id(id.clone());
    }
    builder
        .queues(args.topology.queues.clone())
        .topology(topology)
        .apply_streams(!args.no_apply)
        .trigger_engine(!args.no_trigger_engine)
        .max_held_bytes(args.max_held_bytes)
        .dispatch_horizon(args.dispatch_horizon)
        .trigger_hold(args.trigger_hold)
        .task_index(args.task_index || args.console_addr.is_some())
        .group_commit(match (args.no_group_commit, args.group_commit) {
            (true, _) | (_, GroupCommitArg::Never) => GroupCommit::Never,
            (_, GroupCommitArg::Always) => GroupCommit::Always,
            (_, GroupCommitArg::Auto) => GroupCommit::Auto,
        })
        .alerts(ax_server::ops::AlertConfig {
            window: args.alert_window,
            webhook: args.alert_webhook,
            console_url: args.console_url,
        })
        .build()
        .run(client, shutdown)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn byte_sizes() {
        assert_eq!(super::parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(super::parse_bytes("1000"), Ok(1000));
        assert!(super::parse_bytes("64MB").is_err());
        assert!(super::parse_bytes("lots").is_err());
    }
}
