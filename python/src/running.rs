//! A Rust part running on the core runtime that Python can stop and wait for: a worker or
//! a server.

use crate::errors;
use crate::runtime::wait;
use ax_sdk::ErrorKind;
use pyo3::prelude::*;
use std::future::Future;
use std::sync::Mutex;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub(crate) struct Running<E> {
    shutdown: CancellationToken,
    join: Mutex<Option<JoinHandle<Result<(), E>>>>,
}

impl<E: std::fmt::Display + Send + 'static> Running<E> {
    /// Spawns `run(shutdown)` on the core runtime.
    pub(crate) fn spawn<F>(run: impl FnOnce(CancellationToken) -> F) -> Running<E>
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
    {
        let shutdown = CancellationToken::new();
        let join = crate::runtime::runtime().spawn(run(shutdown.clone()));
        Running {
            shutdown,
            join: Mutex::new(Some(join)),
        }
    }

    /// True once it has ended (stopped, or failed).
    /// Asks it to stop, without waiting (`stop` then waits): many parts asked first end
    /// together.
    pub(crate) fn request_stop(&self) {
        self.shutdown.cancel();
    }

    pub(crate) fn finished(&self) -> bool {
        let join = self.join.lock().expect("not poisoned");
        join.as_ref().is_none_or(|j| j.is_finished())
    }

    /// Cancels it and waits for its end; its error, if it failed, raised by `kind`.
    pub(crate) fn stop(
        &self,
        py: Python<'_>,
        what: &str,
        kind: impl Fn(&E) -> ErrorKind,
    ) -> PyResult<()> {
        self.shutdown.cancel();
        let Some(join) = self.join.lock().expect("not poisoned").take() else {
            return Ok(());
        };
        match wait(py, join)? {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(errors::raise(kind(&e), e.to_string(), None, None)),
            Err(e) => Err(errors::raise(
                ErrorKind::Other,
                format!("{what} ended: {e}"),
                None,
                None,
            )),
        }
    }
}
