//! The core's Tokio runtime, and blocking calls that wait on it with the GIL released.

use pyo3::prelude::*;
use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

/// The runtime every Rust part of the package runs on (two worker threads, named
/// `ax-core`).
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("ax-core")
            .enable_all()
            .build()
            .expect("a Tokio runtime starts")
    })
}

/// Runs `fut` on the core runtime and waits for it with the GIL released, waking every
/// 100 ms to deliver Python's signals: a ctrl-c raises `KeyboardInterrupt` here and drops
/// the future.
pub(crate) fn wait<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let mut handle = runtime().spawn(fut);
    loop {
        let step = py.detach(|| {
            runtime().block_on(async {
                tokio::time::timeout(Duration::from_millis(100), &mut handle).await
            })
        });
        match step {
            Ok(Ok(out)) => return Ok(out),
            Ok(Err(join)) => {
                return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                    "ax core task ended: {join}"
                )))
            }
            Err(_) => {
                if let Err(e) = py.check_signals() {
                    handle.abort();
                    return Err(e);
                }
            }
        }
    }
}
