//! The awaitable form of [`Connection`]'s calls, for `asyncio` code (a FastAPI handler):
//! each returns an awaitable at once, and the call runs on the core's own runtime, not on
//! a thread of the caller's. Cancelling the awaitable cancels the call.
//!
//! The futures run on a runtime of their own (`ax-async`, one thread): handing a result
//! to the event loop takes the GIL, and no thread of the runtime that carries workers'
//! heartbeats ever waits for the GIL.

use crate::conn::Connection;
use crate::ops::{self, Failed};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::OnceLock;

/// The runtime the awaitables' futures run on (`pyo3_async_runtimes` drives them).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ax-async")
            .enable_all()
            .build()
            .expect("a Tokio runtime starts")
    })
}

/// Hands `runtime()` to `pyo3_async_runtimes` (once).
fn init() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let _ = pyo3_async_runtimes::tokio::init_with_runtime(runtime());
    });
}

fn bytes(json: Vec<u8>) -> Py<PyBytes> {
    Python::attach(|py| PyBytes::new(py, &json).unbind())
}

/// The awaitable calls over a [`Connection`]'s client.
#[pyclass(frozen, module = "ax_scheduler._core")]
pub struct AsyncConnection {
    client: ax_sdk::Client,
}

#[pymethods]
impl AsyncConnection {
    #[new]
    fn new(conn: &Connection) -> AsyncConnection {
        init();
        AsyncConnection {
            client: conn.client.clone(),
        }
    }

    /// Awaitable: the accepted reply of one submit, as JSON.
    fn submit<'py>(
        &self,
        py: Python<'py>,
        queue: String,
        request: &[u8],
    ) -> PyResult<Bound<'py, PyAny>> {
        let fut = ops::submit(&self.client, queue, request)?;
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            fut.await.map(bytes).map_err(Failed::raise)
        })
    }

    /// Awaitable: `(accepted, reply JSON)` per task, in order.
    fn submit_many<'py>(
        &self,
        py: Python<'py>,
        queue: String,
        requests: Vec<Vec<u8>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let fut = ops::submit_many(&self.client, queue, &requests)?;
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let answers = fut.await;
            Ok(answers
                .into_iter()
                .map(|(ok, json)| (ok, bytes(json)))
                .collect::<Vec<_>>())
        })
    }

    /// Awaitable: the task's `{"record", "revision"}` JSON, or None.
    fn task<'py>(&self, py: Python<'py>, id: String) -> PyResult<Bound<'py, PyAny>> {
        let fut = ops::task(&self.client, id);
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            fut.await
                .map(|found| found.map(bytes))
                .map_err(Failed::raise)
        })
    }

    /// Awaitable: `(record JSON, output or None, output is JSON)` once the task finished.
    #[pyo3(signature = (id, timeout = None))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        id: String,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let fut = ops::wait(&self.client, id, timeout)?;
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let (record, output, is_json) = fut.await.map_err(Failed::raise)?;
            Ok((bytes(record), output.map(bytes), is_json))
        })
    }

    /// Awaitable: the `ok` value of `ax.<api>.<op>` as JSON.
    fn call<'py>(
        &self,
        py: Python<'py>,
        api: &str,
        op: &str,
        body: &[u8],
    ) -> PyResult<Bound<'py, PyAny>> {
        let fut = ops::call(&self.client, api, op, body)?;
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            fut.await.map(bytes).map_err(Failed::raise)
        })
    }

    /// Awaitable: the `AX_EVENTS` sequence of event `name` published with a JSON `payload`.
    #[pyo3(signature = (name, payload, id = None))]
    fn publish_event<'py>(
        &self,
        py: Python<'py>,
        name: String,
        payload: &[u8],
        id: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let fut = ops::publish_event(&self.client, name, payload, id)?;
        pyo3_async_runtimes::tokio::future_into_py(
            py,
            async move { fut.await.map_err(Failed::raise) },
        )
    }

    /// Awaitable: the run's JSON once it has ended.
    #[pyo3(signature = (run, timeout = None))]
    fn wait_flow<'py>(
        &self,
        py: Python<'py>,
        run: String,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let fut = ops::wait_flow(&self.client, run, timeout)?;
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            fut.await.map(bytes).map_err(Failed::raise)
        })
    }
}
