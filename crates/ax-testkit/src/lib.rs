//! A local `nats-server` process with JetStream, for tests, benchmarks and `ax demo`.
//!
//! Not part of the product's API: the tests, the benches and the command line's demo
//! depend on this crate; libraries never do.
//!
//! [`LocalNats::start`] spawns the binary on a random loopback port (`-p -1`) with its own
//! temporary store directory, reads the client URL from the server's log, and kills the
//! process (and removes the store) on drop. [`LocalNats::restart`] restarts it on the same
//! port and store, for durability tests.
//!
//! [`LocalCluster`] starts three (or more) such servers routed into one JetStream cluster.
//!
//! With the feature `env` (tests only): `env::Env`, a nats-server with an ax server in
//! the test's process and helpers to wait on what the system exposes, and `net`'s helpers
//! for tests that run `ax` processes.
//!
//! The binary is found in this order: `$AX_NATS_SERVER`, `.tools/nats/bin/nats-server` under
//! the workspace root (where `./dev` installs the pinned version), then `nats-server` on `PATH`.

#[cfg(feature = "env")]
pub mod env;
#[cfg(feature = "env")]
pub mod net;
#[cfg(feature = "env")]
pub mod proxy;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Errors starting a local nats-server.
#[derive(Debug, thiserror::Error)]
pub enum NatsdError {
    /// No nats-server binary was found.
    #[error("no nats-server binary found: set AX_NATS_SERVER or run ./dev to install one")]
    NotFound,
    /// The process could not be spawned or its store created.
    #[error("could not start nats-server {binary}: {source}")]
    Spawn {
        /// The binary that was tried.
        binary: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// The server exited or did not report its listening port in time.
    #[error("nats-server did not come up: {0}")]
    NotReady(String),
}

/// A running local nats-server; killed on drop.
#[derive(Debug)]
pub struct LocalNats {
    child: Option<Child>,
    binary: PathBuf,
    store: tempfile::TempDir,
    port: u16,
    extra_args: Vec<String>,
    jetstream: bool,
}

/// nats-server's soft memory limit (Go's `GOMEMLIMIT`) unless the environment sets one:
/// the value `deploy/docker-compose.yml` ships. It makes the Go runtime return the
/// file store's idle block caches instead of keeping them: with 1,000,000 delayed tasks
/// nats-server held 718 MiB without it, 495 MiB with it (docs/PERFORMANCE.md, W4). A soft
/// limit: a broker that needs more keeps growing, its garbage collector just works harder.
pub const NATS_GOMEMLIMIT: &str = "512MiB";

/// Locates the nats-server binary (see the module docs for the search order).
pub fn find_binary() -> Result<PathBuf, NatsdError> {
    if let Some(path) = std::env::var_os("AX_NATS_SERVER") {
        return Ok(PathBuf::from(path));
    }
    let local = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.tools/nats/bin/nats-server");
    if local.exists() {
        return Ok(local);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("nats-server"))
        .find(|candidate| candidate.exists())
        .ok_or(NatsdError::NotFound)
}

impl LocalNats {
    /// Starts a JetStream-enabled server on a random loopback port with a fresh store.
    pub fn start() -> Result<Self, NatsdError> {
        Self::start_with_args(Vec::new())
    }

    /// Like [`LocalNats::start`], on a given port (for processes started before it).
    pub fn start_on(port: u16) -> Result<Self, NatsdError> {
        Self::start_inner(Vec::new(), Some(port))
    }

    /// Like [`LocalNats::start`], with extra command-line arguments (e.g. `--config`).
    pub fn start_with_args(extra_args: Vec<String>) -> Result<Self, NatsdError> {
        Self::start_inner(extra_args, None)
    }

    fn start_inner(extra_args: Vec<String>, port: Option<u16>) -> Result<Self, NatsdError> {
        let binary = find_binary()?;
        let store = tempfile::Builder::new()
            .prefix("ax-nats-")
            .tempdir()
            .map_err(|source| NatsdError::Spawn {
                binary: binary.clone(),
                source,
            })?;
        let mut server = LocalNats {
            child: None,
            binary,
            store,
            port: 0,
            extra_args,
            jetstream: true,
        };
        server.spawn(port)?;
        Ok(server)
    }

    /// The nats-server process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Freezes the server (SIGSTOP): connections stay open and what clients send waits in
    /// them unanswered. A request sent now and the server then killed ([`LocalNats::restart`])
    /// is one the broker had when it died: never answered.
    pub fn freeze(&self) -> std::io::Result<()> {
        let Some(pid) = self.pid() else {
            return Ok(());
        };
        let status = std::process::Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()?;
        if status.success() {
            Ok(())
        } else {
            Err(std::io::Error::other(format!("kill -STOP {pid}: {status}")))
        }
    }

    /// The client URL, e.g. `nats://127.0.0.1:40123`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The store directory (JetStream data lives below it).
    pub fn store_dir(&self) -> &Path {
        self.store.path()
    }

    /// Kills the server with SIGKILL, keeping its store.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills and starts the server again on the same port with the same store.
    pub fn restart(&mut self) -> Result<(), NatsdError> {
        self.kill();
        self.jetstream = true;
        let port = self.port;
        self.spawn(Some(port))
    }

    /// Kills and starts the server again on the same port with JetStream off: clients
    /// connect, but every JetStream request fails at once (until [`LocalNats::restart`]).
    pub fn restart_without_jetstream(&mut self) -> Result<(), NatsdError> {
        self.kill();
        self.jetstream = false;
        let port = self.port;
        self.spawn(Some(port))
    }

    fn spawn(&mut self, port: Option<u16>) -> Result<(), NatsdError> {
        let port_arg = port.map_or("-1".to_string(), |p| p.to_string());
        let mut command = Command::new(&self.binary);
        if self.jetstream {
            command.arg("-js");
        }
        // The memory target ax ships (deploy/docker-compose.yml); a set GOMEMLIMIT wins.
        if std::env::var_os("GOMEMLIMIT").is_none() {
            command.env("GOMEMLIMIT", NATS_GOMEMLIMIT);
        }
        let mut child = command
            .args(["-a", "127.0.0.1", "-p", &port_arg, "-sd"])
            .arg(self.store.path())
            .args(&self.extra_args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| NatsdError::Spawn {
                binary: self.binary.clone(),
                source,
            })?;
        let stderr = child.stderr.take().expect("stderr is piped");
        let (tx, rx) = std::sync::mpsc::channel();
        // The log reader lives as long as the process: it drains stderr so the server never
        // blocks on a full pipe, and it ends when the process closes the pipe.
        // AX_NATSD_LOG=1 echoes the server's log (for debugging a test).
        let echo = std::env::var_os("AX_NATSD_LOG").is_some();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if echo {
                    eprintln!("nats-server: {line}");
                }
                if !sent {
                    if let Some(rest) = line.split("Listening for client connections on ").nth(1) {
                        let port = rest.trim().rsplit(':').next().and_then(|p| p.parse().ok());
                        let _ = tx.send(port);
                        sent = true;
                    }
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        let reported = rx.recv_timeout(deadline.saturating_duration_since(Instant::now()));
        self.child = Some(child);
        match reported {
            Ok(Some(port)) => {
                self.port = port;
                wait_for_port(port, deadline)
            }
            _ => {
                self.kill();
                Err(NatsdError::NotReady(format!(
                    "{} did not report a client port",
                    self.binary.display()
                )))
            }
        }
    }
}

fn wait_for_port(port: u16, deadline: Instant) -> Result<(), NatsdError> {
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(NatsdError::NotReady(format!("port {port} not accepting")))
}

impl Drop for LocalNats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free loopback TCP port (bound and released; a small race is possible).
fn free_port() -> Result<u16, NatsdError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|source| NatsdError::Spawn {
            binary: PathBuf::from("bind 127.0.0.1:0"),
            source,
        })
}

/// Local nats-servers routed into one JetStream cluster named `ax`.
#[derive(Debug)]
pub struct LocalCluster {
    /// The nodes; kill or restart them one by one.
    pub nodes: Vec<LocalNats>,
}

impl LocalCluster {
    /// Starts `n` nodes (`n0`, `n1`, ...) on random loopback ports.
    pub fn start(n: usize) -> Result<Self, NatsdError> {
        let cluster_ports = (0..n).map(|_| free_port()).collect::<Result<Vec<_>, _>>()?;
        let routes = cluster_ports
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let nodes = cluster_ports
            .iter()
            .enumerate()
            .map(|(i, port)| {
                LocalNats::start_with_args(vec![
                    "--cluster_name".into(),
                    "ax".into(),
                    "--server_name".into(),
                    format!("n{i}"),
                    "--cluster".into(),
                    format!("nats://127.0.0.1:{port}"),
                    "--routes".into(),
                    routes.clone(),
                ])
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(LocalCluster { nodes })
    }

    /// Every node's client URL.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(LocalNats::url).collect()
    }
}
