//! A connection to NATS and the ax APIs over it: submit (one or many), read a task, wait
//! for it, call a request API, follow a subject. JSON crosses the boundary as bytes; the
//! Python side decodes it.

use crate::errors;
use crate::wait;
use ax_sdk::api::{Api, Request};
use ax_sdk::protocol::SubmitRequest;
use ax_sdk::{Client, ErrorKind, TaskSpec};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde_json::json;
use std::future::Future;
use std::time::Duration;

/// A connection to NATS, with the ax producer client over it. Cheap to share between
/// threads.
#[pyclass(frozen, module = "ax_scheduler._core")]
pub struct Connection {
    pub(crate) nats: async_nats::Client,
    pub(crate) client: Client,
}

fn json_bytes<'py>(py: Python<'py>, value: &impl serde::Serialize) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &serde_json::to_vec(value).expect("JSON serializes"))
}

#[pymethods]
impl Connection {
    /// Connects to `url` (one or more comma-separated `nats://` URLs), failing after
    /// `timeout` seconds with `Unavailable`. `creds` is a NATS credentials file, `token` a
    /// token; `wait_for_server` is how long requests wait for an ax server to answer.
    #[staticmethod]
    #[pyo3(signature = (url, name = None, timeout = 5.0, creds = None, token = None, wait_for_server = 30.0))]
    fn connect(
        py: Python<'_>,
        url: String,
        name: Option<String>,
        timeout: f64,
        creds: Option<String>,
        token: Option<String>,
        wait_for_server: f64,
    ) -> PyResult<Connection> {
        let timeout = seconds(timeout, "timeout")?;
        let wait_for_server = seconds(wait_for_server, "wait_for_server")?;
        let nats = wait(py, async move {
            let mut opts = async_nats::ConnectOptions::new()
                .name(name.unwrap_or_else(|| "ax-python".into()))
                .connection_timeout(timeout);
            if let Some(path) = creds {
                opts = opts
                    .credentials_file(path)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            if let Some(token) = token {
                opts = opts.token(token);
            }
            opts.connect(url.as_str())
                .await
                .map_err(|e| format!("connect to {url}: {e}"))
        })?
        .map_err(|e| errors::raise(ErrorKind::Unavailable, e, None, None))?;
        let client = Client::new(nats.clone()).wait_for_server(wait_for_server);
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
        let spec = spec(request)?;
        let client = self.client.clone();
        let accepted =
            wait(py, async move { client.submit(&queue, spec).await })?.map_err(errors::client)?;
        Ok(json_bytes(py, &accepted))
    }

    /// Submits many tasks to `queue` in batches; one `(accepted, reply JSON)` per task, in
    /// order (a refusal's JSON is the wire error).
    fn submit_many<'py>(
        &self,
        py: Python<'py>,
        queue: String,
        requests: Vec<Vec<u8>>,
    ) -> PyResult<Vec<(bool, Bound<'py, PyBytes>)>> {
        let specs = requests
            .iter()
            .map(|r| spec(r))
            .collect::<PyResult<Vec<_>>>()?;
        let client = self.client.clone();
        let answers = wait(py, async move { client.submit_many(&queue, specs).await })?;
        Ok(answers
            .into_iter()
            .map(|a| match a {
                Ok(accepted) => (true, json_bytes(py, &accepted)),
                Err(refused) => (false, json_bytes(py, &refused)),
            })
            .collect())
    }

    /// The task's record and revision as JSON `{"record", "revision"}`, or None.
    fn task<'py>(&self, py: Python<'py>, id: String) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let client = self.client.clone();
        let found = wait(py, async move { client.task(&id).await })?.map_err(errors::client)?;
        Ok(found.map(|(record, revision)| {
            json_bytes(py, &json!({"record": record, "revision": revision}))
        }))
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
        let client = self.client.clone();
        let what = format!("task {id}");
        let finished = within(py, timeout, what, async move { client.wait(&id).await })?;
        let (output, is_json) = match finished.output {
            Some(out) => (Some(PyBytes::new(py, &out.bytes)), out.is_json),
            None => (None, false),
        };
        Ok((
            json_bytes(
                py,
                &json!({"record": finished.record, "revision": finished.revision}),
            ),
            output,
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
        use ax_sdk::{
            flow::FlowRequest, limits::LimitRequest, ops::TaskRequest, trigger::TriggerRequest,
        };
        let client = self.client.clone();
        let api = Api::ALL
            .into_iter()
            .find(|a| a.name() == api)
            .ok_or_else(|| {
                errors::invalid(format!("no API {api:?} (task, flow, limit, trigger)"))
            })?;
        let bad = |e: ax_sdk::error::WireError| errors::wire(&e);
        let answer = match api {
            Api::Task => {
                let req = TaskRequest::decode(op, body).map_err(bad)?;
                wait(py, async move { client.call(&req).await })?
            }
            Api::Flow => {
                let req = FlowRequest::decode(op, body).map_err(bad)?;
                wait(py, async move { client.call(&req).await })?
            }
            Api::Limit => {
                let req = LimitRequest::decode(op, body).map_err(bad)?;
                wait(py, async move { client.call(&req).await })?
            }
            Api::Trigger => {
                let req = TriggerRequest::decode(op, body).map_err(bad)?;
                wait(py, async move { client.call(&req).await })?
            }
        };
        Ok(json_bytes(py, &answer.map_err(errors::client)?))
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
        let client = self.client.clone();
        let what = format!("flow run {run}");
        let ended = within(
            py,
            timeout,
            what,
            async move { client.wait_flow(&run).await },
        )?;
        Ok(json_bytes(py, &ended))
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

/// Waits for `fut` at most `timeout` seconds (None: no limit): `TimedOut` naming `what`
/// when the time runs out, a client error raised by its kind.
fn within<T: Send + 'static>(
    py: Python<'_>,
    timeout: Option<f64>,
    what: String,
    fut: impl Future<Output = Result<T, ax_sdk::ClientError>> + Send + 'static,
) -> PyResult<T> {
    let limit = timeout.map(|t| seconds(t, "timeout")).transpose()?;
    let done = wait(py, async move {
        match limit {
            Some(limit) => tokio::time::timeout(limit, fut).await.ok(),
            None => Some(fut.await),
        }
    })?;
    let late = || {
        let message = format!(
            "{what} not finished within {} s",
            timeout.unwrap_or_default()
        );
        errors::raise(ErrorKind::TimedOut, message, None, None)
    };
    done.ok_or_else(late)?.map_err(errors::client)
}

/// A submit request decoded by the protocol's own type (unknown fields refused).
fn spec(request: &[u8]) -> PyResult<TaskSpec> {
    let req: SubmitRequest = serde_json::from_slice(request).map_err(errors::invalid)?;
    Ok(TaskSpec::from_request(req))
}

/// Seconds from Python: finite and not negative.
pub(crate) fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        errors::invalid(format!(
            "{what} must be a finite number of seconds ≥ 0, not {value}"
        ))
    })
}
