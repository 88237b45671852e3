//! A connection to NATS and the ax APIs over it: submit (one or many), read a task, wait
//! for it, call a request API, follow a subject. JSON crosses the boundary as bytes; the
//! Python side decodes it.

use crate::errors::{self, seconds};
use crate::ops::{self, Failed};
use crate::runtime::wait;
use ax_sdk::{Client, ErrorKind};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A connection to NATS, with the ax producer client over it. Cheap to share between
/// threads.
#[pyclass(frozen, module = "ax_scheduler._core")]
pub struct Connection {
    pub(crate) nats: async_nats::Client,
    pub(crate) client: Client,
}

#[pymethods]
impl Connection {
    /// Connects to `url` (one or more comma-separated `nats://` URLs), failing after
    /// `timeout` seconds with `Unavailable`. `creds` is a NATS credentials file, `token` a
    /// token; `wait_for_server` is how long requests wait for an ax server to answer;
    /// `direct_submits` publishes tasks without an idempotency key straight to JetStream
    /// (`Client::direct_submits`).
    #[staticmethod]
    #[pyo3(signature = (url, name = None, timeout = 5.0, creds = None, token = None, wait_for_server = 30.0, direct_submits = false))]
    #[allow(clippy::too_many_arguments)] // the keyword arguments of `ax.Client(...)`
    fn connect(
        py: Python<'_>,
        url: String,
        name: Option<String>,
        timeout: f64,
        creds: Option<String>,
        token: Option<String>,
        wait_for_server: f64,
        direct_submits: bool,
    ) -> PyResult<Connection> {
        let timeout = seconds(timeout, "timeout")?;
        let wait_for_server = seconds(wait_for_server, "wait_for_server")?;
        let nats = wait(py, async move {
            let mut opts = async_nats::ConnectOptions::new()
                .name(name.unwrap_or_else(|| "ax-python".into()))
                .connection_timeout(timeout);
            if let Some(path) = creds {
                // A credentials file that cannot be read or parsed is the caller's error.
                opts = opts
                    .credentials_file(&path)
                    .await
                    .map_err(|e| (ErrorKind::Invalid, format!("creds {path}: {e}")))?;
            }
            if let Some(token) = token {
                opts = opts.token(token);
            }
            // Classified by type: a refused login is `Permission`, a timeout `TimedOut`.
            opts.connect(url.as_str())
                .await
                .map_err(|e| (ErrorKind::of(&e), format!("connect to {url}: {e}")))
        })?
        .map_err(|(kind, e)| errors::raise(kind, e, None, None))?;
        let client = Client::new(nats.clone())
            .wait_for_server(wait_for_server)
            .direct_submits(direct_submits);
        Ok(Connection { nats, client })
    }

    /// Submits one task (a submit request of PROTOCOL §2 as JSON) to `queue`; returns the
    /// accepted reply as JSON.
    fn submit<'py>(
        &self,
        py: Python<'py>,
        queue: String,
        request: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let fut = ops::submit(&self.client, queue, request)?;
        Ok(PyBytes::new(py, &wait(py, fut)?.map_err(Failed::raise)?))
    }

    /// Sends one submit and returns at once, without its answer: [`PendingSubmit::result`]
    /// gives it (the accepted reply as JSON, or the refusal raised). Many may be in flight
    /// from one thread (a producer that pipelines its submits).
    fn submit_nowait(&self, queue: String, request: &[u8]) -> PyResult<PendingSubmit> {
        let fut = ops::submit(&self.client, queue, request)?;
        Ok(PendingSubmit(std::sync::Mutex::new(Some(
            crate::runtime::runtime().spawn(fut),
        ))))
    }

    /// Submits many tasks to `queue` in batches; one `(accepted, reply JSON)` per task, in
    /// order (a refusal's JSON is the wire error).
    fn submit_many<'py>(
        &self,
        py: Python<'py>,
        queue: String,
        requests: Vec<Vec<u8>>,
    ) -> PyResult<Vec<(bool, Bound<'py, PyBytes>)>> {
        let fut = ops::submit_many(&self.client, queue, &requests)?;
        Ok(wait(py, fut)?
            .into_iter()
            .map(|(ok, json)| (ok, PyBytes::new(py, &json)))
            .collect())
    }

    /// The task's record and revision as JSON `{"record", "revision"}`, or None.
    fn task<'py>(&self, py: Python<'py>, id: String) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let found = wait(py, ops::task(&self.client, id))?.map_err(Failed::raise)?;
        Ok(found.map(|json| PyBytes::new(py, &json)))
    }

    /// Waits until the task is finished, at most `timeout` seconds (None: no limit);
    /// returns `(record JSON, output bytes or None, output is JSON)`; `TimedOut` when the
    /// time runs out.
    #[pyo3(signature = (id, timeout = None))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        id: String,
        timeout: Option<f64>,
    ) -> PyResult<(Bound<'py, PyBytes>, Option<Bound<'py, PyBytes>>, bool)> {
        let fut = ops::wait(&self.client, id, timeout)?;
        let (record, output, is_json) = wait(py, fut)?.map_err(Failed::raise)?;
        Ok((
            PyBytes::new(py, &record),
            output.map(|out| PyBytes::new(py, &out)),
            is_json,
        ))
    }

    /// Calls `ax.<api>.<op>` with a JSON `body`; returns the `ok` value as JSON. The body
    /// is decoded into the operation's typed request first, so a bad one is refused here
    /// with the server's own message.
    fn call<'py>(
        &self,
        py: Python<'py>,
        api: &str,
        op: &str,
        body: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let fut = ops::call(&self.client, api, op, body)?;
        Ok(PyBytes::new(py, &wait(py, fut)?.map_err(Failed::raise)?))
    }

    /// Publishes event `name` (`ax.events.<name>`) with a JSON `payload`; returns its
    /// `AX_EVENTS` sequence. `id`: a publish retried with it is one event.
    #[pyo3(signature = (name, payload, id = None))]
    fn publish_event(
        &self,
        py: Python<'_>,
        name: String,
        payload: &[u8],
        id: Option<String>,
    ) -> PyResult<u64> {
        let fut = ops::publish_event(&self.client, name, payload, id)?;
        wait(py, fut)?.map_err(Failed::raise)
    }

    /// Waits until flow run `run` has ended, at most `timeout` seconds; returns the run as
    /// JSON.
    #[pyo3(signature = (run, timeout = None))]
    fn wait_flow<'py>(
        &self,
        py: Python<'py>,
        run: String,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let fut = ops::wait_flow(&self.client, run, timeout)?;
        Ok(PyBytes::new(py, &wait(py, fut)?.map_err(Failed::raise)?))
    }

    /// Follows a core NATS subject (wildcards allowed), e.g. `ax.events.alert.>`. With a
    /// `queue` group, each message goes to one member of the group (one replica of a
    /// service), not to every subscriber.
    #[pyo3(signature = (subject, queue = None))]
    fn subscribe(
        &self,
        py: Python<'_>,
        subject: String,
        queue: Option<String>,
    ) -> PyResult<Subscription> {
        let nats = self.nats.clone();
        let sub = wait(py, async move {
            match queue {
                Some(group) => nats.queue_subscribe(subject, group).await,
                None => nats.subscribe(subject).await,
            }
        })?
        .map_err(|e| errors::raise(ErrorKind::Unavailable, e.to_string(), None, None))?;
        Ok(Subscription(tokio::sync::Mutex::new(sub).into()))
    }

    /// Flushes what was published and closes the connection.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let nats = self.nats.clone();
        let _ = wait(py, async move { nats.drain().await })?;
        Ok(())
    }

    /// The URL of the server this connection is on.
    fn server(&self) -> String {
        let info = self.nats.server_info();
        format!("nats://{}:{}", info.host, info.port)
    }
}

/// The answer to a submit on its way: the accepted reply's JSON, or why not.
type Answer = tokio::task::JoinHandle<Result<Vec<u8>, Failed>>;

/// A submit sent and not yet answered (or answered and not yet taken).
#[pyclass(frozen, module = "ax_scheduler._core")]
pub struct PendingSubmit(std::sync::Mutex<Option<Answer>>);

#[pymethods]
impl PendingSubmit {
    /// The accepted reply as JSON, waiting for it at most `timeout` seconds (None: until
    /// it comes; `TimedOut` then, and it may still come); a refusal or no answer raised
    /// as its typed exception. Once taken, a second call raises `InvalidInput`.
    #[pyo3(signature = (timeout = None))]
    fn result<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyBytes>> {
        let limit = timeout.map(|t| seconds(t, "timeout")).transpose()?;
        let Some(mut join) = self.0.lock().expect("not poisoned").take() else {
            return Err(errors::invalid("this submit's answer was taken already"));
        };
        let waited = wait(py, async move {
            let done = match limit {
                None => Some((&mut join).await),
                Some(limit) => tokio::time::timeout(limit, &mut join).await.ok(),
            };
            (done, join)
        });
        let (done, join) = waited?;
        match done {
            Some(Ok(answer)) => Ok(PyBytes::new(py, &answer.map_err(Failed::raise)?)),
            Some(Err(e)) => Err(errors::raise(
                ErrorKind::Unavailable,
                format!("the submit ended: {e}"),
                None,
                None,
            )),
            None => {
                *self.0.lock().expect("not poisoned") = Some(join);
                Err(errors::raise(
                    ErrorKind::TimedOut,
                    format!(
                        "no answer to the submit within {} s",
                        timeout.unwrap_or_default()
                    ),
                    None,
                    None,
                ))
            }
        }
    }

    /// True once the answer has come.
    fn done(&self) -> bool {
        self.0
            .lock()
            .expect("not poisoned")
            .as_ref()
            .is_none_or(tokio::task::JoinHandle::is_finished)
    }
}

/// A subscription; [`Subscription::next`] gives the next message.
#[pyclass(frozen, module = "ax_scheduler._core")]
pub struct Subscription(std::sync::Arc<tokio::sync::Mutex<async_nats::Subscriber>>);

#[pymethods]
impl Subscription {
    /// The next message as `(subject, payload)`, or None when `timeout` seconds passed
    /// or the subscription ended.
    fn next<'py>(
        &self,
        py: Python<'py>,
        timeout: f64,
    ) -> PyResult<Option<(String, Bound<'py, PyBytes>)>> {
        use futures::StreamExt;
        let limit = seconds(timeout, "timeout")?;
        let sub = self.0.clone();
        let msg = wait(py, async move {
            let mut sub = sub.lock().await;
            tokio::time::timeout(limit, sub.next()).await.ok().flatten()
        })?;
        Ok(msg.map(|m| (m.subject.to_string(), PyBytes::new(py, &m.payload))))
    }
}
