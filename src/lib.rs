//! The `ax` command line: a thin shell over the libraries, one file per subcommand.
//! [`main_with`] runs it; the `ax` binary (`src/main.rs`) and the Python package's `ax`
//! console script (`ax_scheduler._core.cli`) both call it.

mod apply_limits;
mod approval;
mod conn;
mod demo;
mod event;
mod exporter;
mod fair;
mod flow;
mod limits;
mod options;
mod out;
mod queue;
mod server;
mod streams;
mod submit;
mod task;
mod trigger;
mod worker;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "ax",
    version,
    about = "A task scheduler native to NATS JetStream"
)]
struct Cli {
    #[command(flatten)]
    conn: conn::Conn,
    /// Output: aligned tables for people, or JSON.
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = out::Output::Table)]
    output: out::Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run an ax server: create missing streams, admit submissions, dispatch delayed
    /// tasks, fire triggers.
    Server(server::ServerArgs),
    /// Run a worker with the example handler.
    Worker(worker::WorkerArgs),
    /// Submit one task, or many from a JSON-lines file (--file), and print the answers.
    Submit(submit::SubmitArgs),
    /// One task: show, cancel, retry, run now.
    Task {
        #[command(subcommand)]
        command: task::TaskCommand,
    },
    /// Find tasks by state, queue, name, error class, trigger, flow run, key and time;
    /// replay dead ones.
    Tasks {
        #[command(subcommand)]
        command: task::TasksCommand,
    },
    /// Queues: list them, pause and resume.
    Queue {
        #[command(subcommand)]
        command: queue::QueueCommand,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell), e.g.
    /// `ax completions bash > /etc/bash_completion.d/ax`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Manage the JetStream topology.
    Streams {
        #[command(subcommand)]
        command: streams::StreamsCommand,
    },
    /// Rate limits and concurrency caps shared by every worker (set, get, list, status,
    /// delete).
    Limits {
        #[command(subcommand)]
        command: limits::LimitsCommand,
    },
    /// Flows: DAGs of tasks (put, run, get, list, cancel, rerun).
    Flow {
        #[command(subcommand)]
        command: flow::FlowCommand,
    },
    /// The flows' approvals (list, approve, reject).
    Approval {
        #[command(subcommand)]
        command: approval::ApprovalCommand,
    },
    /// Events that flows wait for (publish).
    Event {
        #[command(subcommand)]
        command: event::EventCommand,
    },
    /// Manage triggers (cron, interval, once, event).
    Trigger {
        #[command(subcommand)]
        command: trigger::TriggerCommand,
    },
    /// Apply a YAML or JSON file: its `triggers: [...]` become the stored triggers (others
    /// are deleted unless --no-prune), its `tasks: {name: settings}` the stored task
    /// settings of the queues it names (others there deleted unless --no-prune); reports
    /// what changed.
    Apply {
        /// The file.
        #[arg(short = 'f', long)]
        file: PathBuf,
        /// Keep stored triggers and task settings that the file does not name.
        #[arg(long)]
        no_prune: bool,
    },
    /// Run the demo: local nats-server, ax server, example worker and producer.
    Demo(demo::DemoArgs),
}

/// `ax apply -f FILE [--no-prune]`: the file's triggers, its task settings, then its
/// limits and fair shares.
async fn apply(file: &std::path::Path, no_prune: bool, conn: &conn::Conn) -> Result<()> {
    let doc = trigger::read_definitions(file)?;
    let has_triggers = doc.get("triggers").is_some();
    // Checked before anything is applied: a bad task entry or limit changes nothing.
    ax_sdk::settings::file::read_tasks(&doc)?;
    apply_limits::check(&doc)?;
    let client = ax_sdk::Client::new(conn.connect().await?);
    if has_triggers {
        trigger::apply(&doc, no_prune, &client).await?;
    }
    let had_tasks = options::apply(&doc, !no_prune, &client).await?;
    let had_limits = apply_limits::apply(&doc, !no_prune, &client).await?;
    if !has_triggers && !had_tasks && !had_limits {
        anyhow::bail!(
            "{}: nothing to apply (the file has none of `triggers:`, `tasks:`, `limits:`, `fair:`)",
            file.display()
        );
    }
    Ok(())
}

/// Installs the Prometheus exporter unless `addr` is "off".
pub(crate) fn metrics_at(addr: &str) -> Result<()> {
    if addr != "off" {
        let addr: SocketAddr = addr.parse().context("--metrics-addr")?;
        exporter::install_exporter(addr)?;
    }
    Ok(())
}

/// A token cancelled on SIGTERM or ctrl-c.
pub(crate) fn shutdown_on_signal() -> CancellationToken {
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

/// Runs the command line `args` (the first is the program name) to its end on a runtime
/// of its own; the exit code (0 success, 1 failure, 2 a usage error). Errors are printed as one line naming what was refused (no
/// backtrace) and exit 1; a reader that has gone (`ax … | head`) ends the command quietly
/// with success.
pub fn main_with<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    out::quiet_on_broken_pipe();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return 1;
        }
    };
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version print and succeed; a usage error prints and fails.
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => 0,
        Err(e) if out::broken_pipe(&e) => 0,
        Err(e) => {
            eprintln!("error: {}", out::error_text(&e));
            1
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    // A host that set up logging already (the Python package) keeps its own. The demo
    // prints its own story: the parts it runs log warnings only (RUST_LOG overrides).
    let default_filter = match cli.command {
        Command::Demo(_) => "warn",
        _ => "info,async_nats=warn",
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let conn = &cli.conn;
    match cli.command {
        Command::Server(args) => server::run(args, conn).await,
        Command::Worker(args) => worker::run(args, conn).await,
        Command::Submit(args) => submit::run(args, conn).await,
        Command::Task { command } => task::get(command, conn, cli.output).await,
        Command::Tasks { command } => task::list(command, conn, cli.output).await,
        Command::Queue { command } => queue::run(command, conn, cli.output).await,
        Command::Completions { shell } => {
            use clap::CommandFactory;
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "ax", &mut script);
            // A write error (a broken pipe) is an error here, not a panic.
            std::io::Write::write_all(&mut std::io::stdout(), &script)?;
            Ok(())
        }
        Command::Streams { command } => streams::run(command, conn).await,
        Command::Trigger { command } => trigger::run(command, conn).await,
        Command::Flow { command } => flow::run(command, conn, cli.output).await,
        Command::Event { command } => event::run(command, conn).await,
        Command::Approval { command } => approval::run(command, conn, cli.output).await,
        Command::Limits { command } => limits::run(command, conn, cli.output).await,
        Command::Apply { file, no_prune } => apply(&file, no_prune, conn).await,
        Command::Demo(args) => demo::run(args, conn).await,
    }
}
