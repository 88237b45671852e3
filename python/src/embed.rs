//! An ax server inside the Python process: ax-server's own [`Server`] on the core runtime,
//! for the embedded local runtime (`ax.Runtime()` with nothing listening) and
//! `python -m ax_scheduler server`.

use crate::conn::Connection;
use crate::errors;
use crate::running::Running;
use ax_server::Server;
use pyo3::prelude::*;

/// A running ax server.
#[pyclass(frozen, module = "ax_scheduler._core")]
pub struct ServerHandle(Running<ax_server::ServerError>);

#[pymethods]
impl ServerHandle {
    /// True once the server has ended (stopped, or failed).
    fn finished(&self) -> bool {
        self.0.finished()
    }

    /// Stops taking requests, finishes the ones in flight and returns; raises the server's
    /// error if it failed.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        self.0.stop(py, "server", |e| e.kind())
    }
}

/// Starts an ax server on `conn` declaring `queues` (the defaults of `ax server`
/// otherwise), with the console on `console` (`host:port`) if given, guarded by
/// `console_token` for its writes; `ack_wait` (seconds) is the ready consumers' ack wait when
/// this server creates them (default 30 s), `capacity` the high / normal / low capacity
/// of each queue it creates (default 1,000 / 5,000 / 10,000; `ax streams apply
/// --capacity` changes existing ones). `task_index` (default on, unlike `ax server`)
/// keeps the index that lists and finds tasks (`list`, `queues`, `series`; PROTOCOL §8).
#[pyfunction]
#[pyo3(signature = (conn, queues, console = None, console_token = None, ack_wait = None, task_index = true, capacity = None))]
#[allow(clippy::too_many_arguments)]
pub fn serve(
    conn: &Connection,
    queues: Vec<String>,
    console: Option<String>,
    console_token: Option<String>,
    ack_wait: Option<f64>,
    task_index: bool,
    capacity: Option<(i64, i64, i64)>,
) -> PyResult<ServerHandle> {
    let mut builder = Server::builder().queues(queues).task_index(task_index);
    if let Some(secs) = ack_wait {
        builder = builder.ack_wait(crate::errors::seconds(secs, "ack_wait")?);
    }
    if let Some((high, normal, low)) = capacity {
        if high < 1 || normal < 1 || low < 1 {
            return Err(errors::invalid(format!(
                "capacity must be three numbers of at least 1 (high, normal, low), not ({high}, {normal}, {low})"
            )));
        }
        builder = builder.capacity([high, normal, low]);
    }
    if let Some(addr) = console {
        let addr = addr
            .parse()
            .map_err(|e| errors::invalid(format!("console address {addr:?}: {e}")))?;
        let mut config = ax_server::console::ConsoleConfig::new(addr);
        config.token = console_token;
        config.check().map_err(|e| errors::invalid(e.to_string()))?;
        builder = builder.console(config).task_index(true);
    }
    let server = builder.build();
    let nats = conn.nats.clone();
    Ok(ServerHandle(Running::spawn(|shutdown| {
        server.run(nats, shutdown)
    })))
}
