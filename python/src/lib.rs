//! `ax_scheduler._core`: the native core of the Python package `ax-scheduler`.
//!
//! The protocol lives here once, in Rust: the producer client, the worker (pull, claim,
//! fencing, heartbeats, limits gate, outputs, retries) and the server are ax-sdk's and
//! ax-server's own code, run on one Tokio runtime whose threads never take the GIL. Python
//! threads take attempts out of an inbox and report each end through
//! `worker::TaskContext`; every other call is a blocking call that releases the GIL and
//! wakes every 100 ms to let Python deliver a signal (ctrl-c).
//!
//! | module | concept |
//! |---|---|
//! | `conn` | a connection: submit, read and wait for tasks, the request APIs, subscriptions |
//! | `aio` | the same calls as awaitables, for `asyncio` code |
//! | `ops` | those calls as futures, shared by both forms |
//! | `worker` | a worker of one queue whose handlers are Python |
//! | `embed` | an ax server inside the Python process |
//! | `errors` | Rust errors raised as the typed exceptions of `ax_scheduler.errors` |
//! | `metrics` | the Prometheus exporter and the Python runtime's own metrics |
//! | `logs` | the core's log lines, relayed to Python's `logging` |
//! | `runtime` | the Tokio runtime of the core, and waiting on it with the GIL released |

mod aio;
mod conn;
mod embed;
mod errors;
mod logs;
mod metrics;
mod ops;
mod running;
mod runtime;
mod settings;
mod worker;

use pyo3::prelude::*;

/// Runs the `ax` command line with `argv` (the first is the program name) and returns its
/// exit code. The GIL is released meanwhile: the command owns the process until it ends
/// (`ax server` until SIGTERM or ctrl-c, as the binary does).
#[pyfunction]
fn cli(py: Python<'_>, argv: Vec<String>) -> u8 {
    py.detach(|| ax_cli::main_with(argv))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(logs::init_logging, m)?)?;
    m.add_class::<logs::LogRelay>()?;
    m.add_function(wrap_pyfunction!(cli, m)?)?;
    m.add_class::<conn::Connection>()?;
    m.add_class::<conn::Subscription>()?;
    m.add_class::<conn::PendingSubmit>()?;
    m.add_class::<aio::AsyncConnection>()?;
    m.add_class::<worker::WorkerHandle>()?;
    m.add_class::<worker::TaskContext>()?;
    m.add_class::<worker::Inbox>()?;
    m.add_class::<embed::ServerHandle>()?;
    m.add_function(wrap_pyfunction!(worker::start_worker, m)?)?;
    m.add_function(wrap_pyfunction!(embed::serve, m)?)?;
    m.add_function(wrap_pyfunction!(settings::read_settings_file, m)?)?;
    m.add_function(wrap_pyfunction!(settings::settings_of, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::serve_metrics, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::gauge_set, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::counter_add, m)?)?;
    Ok(())
}
