//! The client calls as futures of plain Rust values (JSON as bytes), shared by the blocking
//! [`Connection`](crate::conn::Connection) and the awaitable
//! [`AsyncConnection`](crate::aio::AsyncConnection): the input is checked before the future
//! exists (a `PyErr` at once); the future's own failure is a [`Failed`], raised as the
//! typed exception by whichever form awaited it.

use crate::errors;
use crate::errors::seconds;
use ax_core::protocol::SubmitRequest;
use ax_sdk::api::{Api, Request};
use ax_sdk::{Client, ClientError, ErrorKind, TaskSpec};
use pyo3::PyErr;
use serde_json::json;
use std::future::Future;
use std::time::Duration;

/// Why a call's future failed.
pub(crate) enum Failed {
    Client(ClientError),
    /// A wait ran past its `timeout` (the message names what was waited for).
    TimedOut(String),
}

impl Failed {
    /// As the typed exception of `ax_scheduler.errors`.
    pub(crate) fn raise(self) -> PyErr {
        match self {
            Failed::Client(e) => errors::client(e),
            Failed::TimedOut(message) => errors::raise(ErrorKind::TimedOut, message, None, None),
        }
    }
}

impl From<ClientError> for Failed {
    fn from(e: ClientError) -> Failed {
        Failed::Client(e)
    }
}

type Json = Vec<u8>;
/// A finished task: `{"record", "revision"}`, its output, whether the output is JSON.
type Finished = (Json, Option<Json>, bool);

fn to_json(value: &impl serde::Serialize) -> Json {
    serde_json::to_vec(value).expect("JSON serializes")
}

/// A submit request decoded by the protocol's own type (unknown fields refused).
fn spec(request: &[u8]) -> Result<TaskSpec, PyErr> {
    let req: SubmitRequest = serde_json::from_slice(request).map_err(errors::invalid)?;
    Ok(TaskSpec::from_request(req))
}

/// Submits one task; the accepted reply.
pub(crate) fn submit(
    client: &Client,
    queue: String,
    request: &[u8],
) -> Result<impl Future<Output = Result<Json, Failed>> + Send + 'static, PyErr> {
    let (client, spec) = (client.clone(), spec(request)?);
    Ok(async move { Ok(to_json(&client.submit(&queue, spec).await?)) })
}

/// Submits many tasks in batches; `(accepted, reply or refusal)` per task, in order.
pub(crate) fn submit_many(
    client: &Client,
    queue: String,
    requests: &[Vec<u8>],
) -> Result<impl Future<Output = Vec<(bool, Json)>> + Send + 'static, PyErr> {
    let specs = requests
        .iter()
        .map(|r| spec(r))
        .collect::<Result<Vec<_>, _>>()?;
    let client = client.clone();
    Ok(async move {
        client
            .submit_many(&queue, specs)
            .await
            .into_iter()
            .map(|a| match a {
                Ok(accepted) => (true, to_json(&accepted)),
                Err(refused) => (false, to_json(&refused)),
            })
            .collect()
    })
}

/// The task's `{"record", "revision"}`, or None.
pub(crate) fn task(
    client: &Client,
    id: String,
) -> impl Future<Output = Result<Option<Json>, Failed>> + Send + 'static {
    let client = client.clone();
    async move {
        let found = client.task(&id).await?;
        Ok(found
            .map(|(record, revision)| to_json(&json!({"record": record, "revision": revision}))))
    }
}

/// Waits until the task is finished: `({"record", "revision"}, output, output is JSON)`.
pub(crate) fn wait(
    client: &Client,
    id: String,
    timeout: Option<f64>,
) -> Result<impl Future<Output = Result<Finished, Failed>> + Send + 'static, PyErr> {
    let client = client.clone();
    let what = format!("task {id}");
    within(timeout, what, async move {
        let finished = client.wait(&id).await?;
        let (output, is_json) = match finished.output {
            Some(out) => (Some(out.bytes.to_vec()), out.is_json),
            None => (None, false),
        };
        let record = to_json(&json!({"record": finished.record, "revision": finished.revision}));
        Ok((record, output, is_json))
    })
}

/// Calls `ax.<api>.<op>`: the body decoded into the operation's typed request here (a bad
/// one refused with the server's own message); the `ok` value.
pub(crate) fn call(
    client: &Client,
    api: &str,
    op: &str,
    body: &[u8],
) -> Result<impl Future<Output = Result<Json, Failed>> + Send + 'static, PyErr> {
    use ax_sdk::{
        flow::FlowRequest, limits::LimitRequest, ops::TaskRequest, trigger::TriggerRequest,
    };
    let api = Api::ALL
        .into_iter()
        .find(|a| a.name() == api)
        .ok_or_else(|| errors::invalid(format!("no API {api:?} (task, flow, limit, trigger)")))?;
    let bad = |e: ax_core::error::WireError| errors::wire(&e);
    enum Typed {
        Task(TaskRequest),
        Flow(FlowRequest),
        Limit(LimitRequest),
        Trigger(TriggerRequest),
    }
    let typed = match api {
        Api::Task => Typed::Task(TaskRequest::decode(op, body).map_err(bad)?),
        Api::Flow => Typed::Flow(FlowRequest::decode(op, body).map_err(bad)?),
        Api::Limit => Typed::Limit(LimitRequest::decode(op, body).map_err(bad)?),
        Api::Trigger => Typed::Trigger(TriggerRequest::decode(op, body).map_err(bad)?),
    };
    let client = client.clone();
    Ok(async move {
        let answer = match &typed {
            Typed::Task(r) => client.call(r).await,
            Typed::Flow(r) => client.call(r).await,
            Typed::Limit(r) => client.call(r).await,
            Typed::Trigger(r) => client.call(r).await,
        };
        Ok(to_json(&answer?))
    })
}

/// Publishes event `name` with a JSON `payload` (`id`: its `Nats-Msg-Id`); its
/// `AX_EVENTS` sequence.
pub(crate) fn publish_event(
    client: &Client,
    name: String,
    payload: &[u8],
    id: Option<String>,
) -> Result<impl Future<Output = Result<u64, Failed>> + Send + 'static, PyErr> {
    let payload: serde_json::Value = serde_json::from_slice(payload)
        .map_err(|e| errors::invalid(format!("the event's payload is not JSON: {e}")))?;
    let client = client.clone();
    Ok(async move { Ok(client.publish_event(&name, &payload, id.as_deref()).await?) })
}

/// Waits until the flow run has ended; the run.
pub(crate) fn wait_flow(
    client: &Client,
    run: String,
    timeout: Option<f64>,
) -> Result<impl Future<Output = Result<Json, Failed>> + Send + 'static, PyErr> {
    let client = client.clone();
    let what = format!("flow run {run}");
    within(timeout, what, async move {
        Ok(to_json(&client.wait_flow(&run).await?))
    })
}

/// `fut` bounded by `timeout` seconds (None: no limit): `TimedOut` naming `what` after.
fn within<T>(
    timeout: Option<f64>,
    what: String,
    fut: impl Future<Output = Result<T, Failed>> + Send + 'static,
) -> Result<impl Future<Output = Result<T, Failed>> + Send + 'static, PyErr> {
    let limit: Option<Duration> = timeout.map(|t| seconds(t, "timeout")).transpose()?;
    Ok(async move {
        match limit {
            None => fut.await,
            Some(limit) => match tokio::time::timeout(limit, fut).await {
                Ok(done) => done,
                Err(_) => Err(Failed::TimedOut(format!(
                    "{what} not finished within {} s",
                    limit.as_secs_f64()
                ))),
            },
        }
    })
}
