//! Prometheus metrics of a Python process: the exporter (the same one the `ax` binary
//! serves, so the Rust worker's `ax_worker_busy_rate`, `ax_task_timeout_rate`, … appear
//! as they do for a Rust worker), and the few metrics the Python runtime itself keeps
//! (`ax_python_*`, named in `ax_core::metrics`).

use crate::errors;
use pyo3::prelude::*;
use std::net::SocketAddr;

/// Serves `http://{addr}/metrics` from this process (once per process: a second call is
/// refused). Returns the address it listens on.
#[pyfunction]
pub fn serve_metrics(addr: &str) -> PyResult<String> {
    let addr: SocketAddr = addr
        .parse()
        .map_err(|e| errors::invalid(format!("metrics address {addr:?}: {e} (give HOST:PORT)")))?;
    let buckets = [
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    let _entered = crate::runtime::runtime().enter();
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets(&buckets)
        .and_then(|b| b.install())
        .map_err(|e| {
            errors::raise(
                ax_sdk::ErrorKind::Unavailable,
                format!("metrics exporter on {addr}: {e}"),
                None,
                None,
            )
        })?;
    ax_core::metrics::describe();
    Ok(addr.to_string())
}

fn labels(pairs: Vec<(String, String)>) -> Vec<metrics::Label> {
    pairs
        .into_iter()
        .map(|(k, v)| metrics::Label::new(k, v))
        .collect()
}

/// The names the Python runtime may set: its own, nothing else.
fn checked(name: &str) -> PyResult<&'static str> {
    use ax_core::metrics::{PYTHON_RESTARTS, PYTHON_STUCK_THREADS, PYTHON_THREADS_REPLACED};
    [
        PYTHON_STUCK_THREADS,
        PYTHON_THREADS_REPLACED,
        PYTHON_RESTARTS,
    ]
    .into_iter()
    .find(|n| *n == name)
    .ok_or_else(|| errors::invalid(format!("no Python runtime metric {name:?}")))
}

/// Sets gauge `name` (an `ax_python_*` metric) to `value`.
#[pyfunction]
#[pyo3(signature = (name, value, labels = Vec::new()))]
pub fn gauge_set(name: &str, value: f64, labels: Vec<(String, String)>) -> PyResult<()> {
    metrics::gauge!(checked(name)?, self::labels(labels)).set(value);
    Ok(())
}

/// Adds `n` to counter `name` (an `ax_python_*` metric).
#[pyfunction]
#[pyo3(signature = (name, n = 1, labels = Vec::new()))]
pub fn counter_add(name: &str, n: u64, labels: Vec<(String, String)>) -> PyResult<()> {
    metrics::counter!(checked(name)?, self::labels(labels)).increment(n);
    Ok(())
}
