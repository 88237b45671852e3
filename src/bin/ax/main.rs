//! The `ax` command: a thin shell over the library.

mod demo;

use anyhow::{bail, Context, Result};
use ax::state::{ListFilter, TaskState};
use ax::streams::Topology;
use ax::{Client, Priority, Server, TaskSpec};
use clap::{Args, Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "ax",
    version,
    about = "A task scheduler native to NATS JetStream"
)]
struct Cli {
    #[command(flatten)]
    conn: Conn,
    #[command(subcommand)]
    command: Command,
}

/// How to reach NATS. Secrets are read from flags or the environment and never logged.
#[derive(Args)]
struct Conn {
    /// NATS server URL(s), comma-separated.
    #[arg(
        long,
        global = true,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    url: String,
    /// Credentials file (JWT + nkey seed).
    #[arg(long, global = true, env = "NATS_CREDS")]
    creds: Option<PathBuf>,
    /// User name (with --password).
    #[arg(long, global = true, env = "NATS_USER")]
    user: Option<String>,
    /// Password (with --user).
    #[arg(long, global = true, env = "NATS_PASSWORD", hide_env_values = true)]
    password: Option<String>,
    /// Token.
    #[arg(long, global = true, env = "NATS_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Nkey seed.
    #[arg(long, global = true, env = "NATS_NKEY", hide_env_values = true)]
    nkey: Option<String>,
    /// CA certificate (PEM) to verify the server's TLS certificate.
    #[arg(long, global = true, env = "NATS_CA")]
    tls_ca: Option<PathBuf>,
    /// Inbox prefix for replies, e.g. `_INBOX.worker-emails` under a least-privilege
    /// config where each user may only subscribe to its own prefix.
    #[arg(long, global = true, env = "NATS_INBOX_PREFIX")]
    inbox_prefix: Option<String>,
}

impl Conn {
    async fn connect(&self) -> Result<async_nats::Client> {
        let mut opts = async_nats::ConnectOptions::new().name("ax");
        if let Some(creds) = &self.creds {
            opts = opts
                .credentials_file(creds)
                .await
                .context("reading creds file")?;
        }
        match (&self.user, &self.password) {
            (Some(u), Some(p)) => opts = opts.user_and_password(u.clone(), p.clone()),
            (None, None) => {}
            _ => bail!("--user and --password go together"),
        }
        if let Some(token) = &self.token {
            opts = opts.token(token.clone());
        }
        if let Some(seed) = &self.nkey {
            opts = opts.nkey(seed.clone());
        }
        if let Some(ca) = &self.tls_ca {
            opts = opts.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some(prefix) = &self.inbox_prefix {
            opts = opts.custom_inbox_prefix(prefix);
        }
        opts.connect(self.url.as_str())
            .await
            .with_context(|| format!("connecting to NATS at {}", self.url))
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run an ax server: apply streams, admit submissions, dispatch delayed tasks.
    Server(ServerArgs),
    /// Run a worker with the example handler (sleeps, fails now and then).
    Worker(WorkerArgs),
    /// Submit one task and print the answer.
    Submit(SubmitArgs),
    /// Show one task.
    Task {
        #[command(subcommand)]
        command: TaskCommand,
    },
    /// List tasks.
    Tasks {
        #[command(subcommand)]
        command: TasksCommand,
    },
    /// Manage the JetStream topology.
    Streams {
        #[command(subcommand)]
        command: StreamsCommand,
    },
    /// Manage triggers (cron, interval, once).
    Trigger {
        #[command(subcommand)]
        command: TriggerCommand,
    },
    /// Make the stored triggers match a YAML or JSON file (`triggers: [...]`), reporting
    /// what changed; triggers not in the file are deleted unless --no-prune.
    Apply {
        /// The file.
        #[arg(short = 'f', long)]
        file: PathBuf,
        /// Keep stored triggers that the file does not name.
        #[arg(long)]
        no_prune: bool,
    },
    /// Run the demo: local nats-server, ax server, example worker and producer.
    Demo(demo::DemoArgs),
}

#[derive(Subcommand)]
enum TriggerCommand {
    /// Create or update one trigger from a YAML or JSON file.
    Put {
        /// The file.
        #[arg(short = 'f', long)]
        file: PathBuf,
    },
    /// Definition, state, next 5 fire times, running tasks.
    Get {
        /// Trigger name.
        name: String,
    },
    /// All triggers with their next fire time.
    List,
    /// Stop firing (state is kept).
    Pause {
        /// Trigger name.
        name: String,
    },
    /// Fire again.
    Resume {
        /// Trigger name.
        name: String,
    },
    /// Delete the definition and state (tasks already created are not touched).
    Delete {
        /// Trigger name.
        name: String,
    },
    /// Run now (trigger_source=manual); refused while a run is in progress unless --force.
    Run {
        /// Trigger name.
        name: String,
        /// Run even if the previous run is still running.
        #[arg(long)]
        force: bool,
    },
}

/// Reads a YAML or JSON file into JSON.
fn read_definitions(path: &std::path::Path) -> Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_yaml::from_str(&text)
        .with_context(|| format!("{} is not valid YAML or JSON", path.display()))
}

#[derive(Args)]
struct TopologyArgs {
    /// Queues to declare (repeatable).
    #[arg(long = "queue", default_value = "default")]
    queues: Vec<String>,
    /// Capacity of each queue's high / normal / low ready subject.
    #[arg(long, value_delimiter = ',', default_values_t = [1000i64, 5000, 10000])]
    capacity: Vec<i64>,
    /// Redeliver a task held this long without ack or heartbeat.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    ack_wait: Duration,
    /// Stream replicas.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
}

impl TopologyArgs {
    fn topology(&self) -> Result<Topology> {
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
            ..Topology::default()
        })
    }
}

#[derive(Args)]
struct ServerArgs {
    #[command(flatten)]
    topology: TopologyArgs,
    /// Serve Prometheus metrics here ("off" to disable).
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_addr: String,
    /// Do not apply the topology at start (it was applied by an admin; the server's
    /// NATS user then needs no stream-management permissions).
    #[arg(long)]
    no_apply: bool,
    /// This server's id in the trigger engine's lease (default `<pid>-<nuid>`).
    #[arg(long)]
    id: Option<String>,
}

#[derive(Args)]
struct WorkerArgs {
    /// Queue to work on.
    #[arg(long, default_value = "default")]
    queue: String,
    /// Use the example handler (the only one this binary has).
    #[arg(long)]
    example: bool,
    /// Tasks run at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Share of attempts the example handler fails (retryably).
    #[arg(long, default_value_t = 0.2)]
    fail_rate: f64,
    /// Example handler run time (default: random 50-300 ms).
    #[arg(long, value_parser = humantime::parse_duration)]
    sleep: Option<Duration>,
    /// Worker id stored in task records.
    #[arg(long)]
    id: Option<String>,
    /// Serve Prometheus metrics here ("off" to disable).
    #[arg(long, default_value = "127.0.0.1:9465")]
    metrics_addr: String,
}

#[derive(Args)]
struct SubmitArgs {
    /// Queue.
    #[arg(long, default_value = "default")]
    queue: String,
    /// Task name.
    #[arg(long)]
    name: String,
    /// JSON payload.
    #[arg(long)]
    json: Option<String>,
    /// high, normal or low.
    #[arg(long)]
    priority: Option<Priority>,
    /// Run after this long, e.g. 90s, 5m.
    #[arg(long, value_parser = humantime::parse_duration)]
    delay: Option<Duration>,
    /// Run at this RFC 3339 time.
    #[arg(long)]
    run_at: Option<String>,
    /// Idempotency key.
    #[arg(long)]
    key: Option<String>,
    /// Attempts in all.
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Hard timeout of one attempt.
    #[arg(long, value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
}

#[derive(Subcommand)]
enum TaskCommand {
    /// Print a task's record as JSON.
    Get {
        /// Task id.
        id: String,
        /// Print every stored transition, oldest first.
        #[arg(long)]
        history: bool,
    },
}

#[derive(Subcommand)]
enum TasksCommand {
    /// List task records (reads the whole bucket: an operator command).
    List {
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Only this state.
        #[arg(long)]
        state: Option<TaskState>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
}

#[derive(Subcommand)]
enum StreamsCommand {
    /// Create or update every stream, bucket and queue consumer; refuse incompatible changes.
    Apply(TopologyArgs),
    /// Print the stream definitions as applied (JSON, one per line).
    Print(TopologyArgs),
}

fn metrics_at(addr: &str) -> Result<()> {
    if addr != "off" {
        let addr: SocketAddr = addr.parse().context("--metrics-addr")?;
        ax::metrics::install_exporter(addr)?;
    }
    Ok(())
}

/// A token cancelled on SIGTERM or ctrl-c.
fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutdown requested");
        t.cancel();
    });
    token
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,async_nats=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Demo(args) => demo::run(args, &cli.conn).await,
        Command::Trigger { command } => {
            let client = Client::new(cli.conn.connect().await?);
            let (op, body) = match command {
                TriggerCommand::Put { file } => ("put", read_definitions(&file)?),
                TriggerCommand::Get { name } => ("get", serde_json::json!({ "name": name })),
                TriggerCommand::List => ("list", serde_json::json!({})),
                TriggerCommand::Pause { name } => ("pause", serde_json::json!({ "name": name })),
                TriggerCommand::Resume { name } => ("resume", serde_json::json!({ "name": name })),
                TriggerCommand::Delete { name } => ("delete", serde_json::json!({ "name": name })),
                TriggerCommand::Run { name, force } => {
                    ("run", serde_json::json!({ "name": name, "force": force }))
                }
            };
            let answer = client.trigger(op, &body).await?;
            println!("{}", serde_json::to_string_pretty(&answer)?);
            Ok(())
        }
        Command::Apply { file, no_prune } => {
            let client = Client::new(cli.conn.connect().await?);
            let mut body = read_definitions(&file)?;
            body["prune"] = (!no_prune).into();
            let report = client.trigger("apply", &body).await?;
            for line in report.as_array().into_iter().flatten() {
                println!(
                    "{:<10} {}",
                    line["outcome"].as_str().unwrap_or("?"),
                    line["name"].as_str().unwrap_or("?")
                );
            }
            Ok(())
        }
        Command::Server(args) => {
            metrics_at(&args.metrics_addr)?;
            let client = cli.conn.connect().await?;
            let mut builder = Server::builder();
            if let Some(id) = &args.id {
                builder = builder.id(id.clone());
            }
            builder
                .queues(args.topology.queues.clone())
                .topology(args.topology.topology()?)
                .apply_streams(!args.no_apply)
                .build()
                .run(client, shutdown_on_signal())
                .await?;
            Ok(())
        }
        Command::Worker(args) => {
            if !args.example {
                bail!("this binary only has the example handler: pass --example, or build a worker with the ax library");
            }
            metrics_at(&args.metrics_addr)?;
            let client = cli.conn.connect().await?;
            demo::example_worker(
                &args.queue,
                args.concurrency,
                args.fail_rate,
                args.sleep,
                args.id,
            )?
            .run(client, shutdown_on_signal())
            .await?;
            Ok(())
        }
        Command::Submit(args) => {
            let client = Client::new(cli.conn.connect().await?);
            let mut spec = TaskSpec::new(args.name);
            if let Some(json) = args.json {
                let value: serde_json::Value =
                    serde_json::from_str(&json).context("--json is not valid JSON")?;
                spec = spec.json(&value);
            }
            if let Some(p) = args.priority {
                spec = spec.priority(p);
            }
            if let Some(d) = args.delay {
                spec = spec.delay(d);
            }
            if let Some(at) = args.run_at {
                spec = spec.run_at(at);
            }
            if let Some(k) = args.key {
                spec = spec.idempotency_key(k);
            }
            if let Some(n) = args.max_attempts {
                spec = spec.max_attempts(n);
            }
            if let Some(t) = args.timeout {
                spec = spec.timeout(t);
            }
            let accepted = client.submit(&args.queue, spec).await?;
            println!("{}", serde_json::to_string(&accepted)?);
            Ok(())
        }
        Command::Task {
            command: TaskCommand::Get { id, history },
        } => {
            let client = Client::new(cli.conn.connect().await?);
            if history {
                let entries = client.history(&id).await?;
                if entries.is_empty() {
                    bail!("no task {id}");
                }
                for (rec, rev) in entries {
                    println!("{}", record_json(&rec, rev));
                }
            } else {
                let (rec, rev) = client
                    .task(&id)
                    .await?
                    .with_context(|| format!("no task {id}"))?;
                println!("{}", record_json(&rec, rev));
            }
            Ok(())
        }
        Command::Tasks {
            command:
                TasksCommand::List {
                    queue,
                    state,
                    limit,
                },
        } => {
            let client = Client::new(cli.conn.connect().await?);
            let records = client
                .list(&ListFilter {
                    queue,
                    state,
                    limit,
                })
                .await?;
            for rec in &records {
                println!("{}", serde_json::to_string(rec)?);
            }
            eprintln!("{} task(s)", records.len());
            Ok(())
        }
        Command::Streams { command } => match command {
            StreamsCommand::Apply(args) => {
                let client = cli.conn.connect().await?;
                let js = async_nats::jetstream::new(client);
                for applied in ax::streams::apply(&js, &args.topology()?, &args.queues).await? {
                    println!(
                        "{:<10} {}",
                        format!("{:?}", applied.outcome).to_lowercase(),
                        applied.object
                    );
                }
                Ok(())
            }
            StreamsCommand::Print(args) => {
                for config in ax::streams::stream_configs(&args.topology()?)? {
                    println!("{}", serde_json::to_string(&config)?);
                }
                Ok(())
            }
        },
    }
}

fn record_json(rec: &ax::TaskRecord, revision: u64) -> String {
    let mut value = serde_json::to_value(rec).expect("record serializes");
    value["revision"] = revision.into();
    value.to_string()
}
