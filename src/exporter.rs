//! The Prometheus exporter that `ax server` and `ax worker` serve `/metrics` from.

use anyhow::{Context, Result};
use std::net::SocketAddr;

/// Installs the global recorder and serves `http://{addr}/metrics`. Call once per process,
/// inside a tokio runtime.
pub(crate) fn install_exporter(addr: SocketAddr) -> Result<()> {
    let buckets = [
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets(&buckets)
        .and_then(|b| b.install())
        .with_context(|| format!("metrics exporter on {addr}"))?;
    ax_core::metrics::describe();
    Ok(())
}
