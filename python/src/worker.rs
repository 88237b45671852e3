//! A worker of one queue whose handlers are Python: ax-sdk's [`Worker`] pulls, claims,
//! heartbeats, gates and settles on the core runtime; each attempt is put in an [`Inbox`]
//! as a [`TaskContext`] and waits for Python to call [`TaskContext::ok`] or
//! [`TaskContext::fail`]. The runtime's Python threads take attempts out of the inbox
//! (waiting with the GIL released), so no Rust thread ever waits for the GIL: a task that
//! holds it cannot stall heartbeats, and an attempt costs no thread hand-off to reach
//! Python.

use crate::conn::Connection;
use crate::errors;
use crate::errors::seconds;
use crate::running::Running;
use crate::runtime::wait;
use ax_sdk::settings::TaskSettings;
use ax_sdk::worker::{Task, TaskError, TaskOptions, Worker, WorkerError, WorkerStatus};
use ax_sdk::{ErrorKind, Output};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::{mpsc, Mutex};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

type Outcome = Result<Output, TaskError>;

/// One attempt as Python sees it: the task's fields, its cancellation, and the two calls
/// that end it. An attempt the worker gave up on (hard timeout, cancel, shutdown) refuses
/// its late result: `ok` and `fail` then answer False.
#[pyclass(frozen, module = "ax_scheduler._core")]
pub struct TaskContext {
    task: Task,
    /// Cancelled when the worker stops waiting for this attempt.
    abandoned: CancellationToken,
    done: Mutex<Option<oneshot::Sender<Outcome>>>,
}

impl TaskContext {
    fn finish(&self, outcome: Outcome) -> bool {
        let sender = self.done.lock().expect("not poisoned").take();
        sender.is_some_and(|s| s.send(outcome).is_ok())
    }
}

#[pymethods]
impl TaskContext {
    #[getter]
    fn id(&self) -> &str {
        &self.task.id
    }
    #[getter]
    fn name(&self) -> &str {
        &self.task.name
    }
    #[getter]
    fn queue(&self) -> &str {
        &self.task.queue
    }
    #[getter]
    fn priority(&self) -> &str {
        self.task.priority.as_str()
    }
    #[getter]
    fn attempt(&self) -> u32 {
        self.task.attempt
    }
    #[getter]
    fn max_attempts(&self) -> u32 {
        self.task.max_attempts
    }
    #[getter]
    fn payload<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.task.payload)
    }
    #[getter]
    fn is_json(&self) -> bool {
        self.task.is_json
    }
    #[getter]
    fn idempotency_key(&self) -> Option<&str> {
        self.task.idempotency_key.as_deref()
    }
    #[getter]
    fn created_at_ms(&self) -> u64 {
        self.task.created_at_ms
    }
    #[getter]
    fn run_at_ms(&self) -> Option<u64> {
        self.task.run_at_ms
    }
    #[getter]
    fn traceparent(&self) -> Option<&str> {
        self.task.traceparent.as_deref()
    }
    #[getter]
    fn business_id(&self) -> Option<&str> {
        self.task.business_id.as_deref()
    }

    /// True once an operator cancelled the task or the worker gave up on this attempt
    /// (its hard timeout passed, or the worker shut down past its grace).
    fn cancelled(&self) -> bool {
        self.abandoned.is_cancelled() || self.task.cancellation().is_cancelled()
    }

    /// True once the worker stopped waiting for this attempt (hard timeout, cancel,
    /// shutdown past its grace) before Python ended it: its slot is free and its result
    /// will be refused. A cooperative cancel alone (the task told to stop) does not make
    /// it abandoned, nor does the attempt's own end (the worker stops waiting then too).
    fn abandoned(&self) -> bool {
        self.abandoned.is_cancelled() && self.done.lock().expect("not poisoned").is_some()
    }

    /// Says the task still makes progress (its soft timeout, `heartbeat_timeout`, starts
    /// again); cheap, callable from any thread.
    fn heartbeat(&self) {
        self.task.heartbeat();
    }

    /// The attempt's fencing token (PROTOCOL §3 "Fencing tokens downstream").
    fn fencing_token(&self, py: Python<'_>) -> PyResult<u64> {
        let task = self.task.clone();
        wait(py, async move { task.fencing_token().await })?.map_err(|e| {
            let kind = match e.class.as_str() {
                "overtaken" => ErrorKind::Conflict,
                _ => ErrorKind::Unavailable,
            };
            errors::raise(kind, e.to_string(), Some(&e.class), None)
        })
    }

    /// Ends the attempt with an output: JSON text when `is_json`, else bytes, or None.
    /// False when the worker no longer waits for this attempt.
    #[pyo3(signature = (output = None, is_json = true))]
    fn ok(&self, output: Option<Vec<u8>>, is_json: bool) -> bool {
        let out = match output {
            None => Ok(Output::none()),
            Some(bytes) if is_json => Output::json_text(bytes),
            Some(bytes) => Ok(Output::bytes(bytes)),
        };
        self.finish(out)
    }

    /// Ends the attempt with a failure of `class`; `permanent` is never retried.
    /// False when the worker no longer waits for this attempt.
    #[pyo3(signature = (class_, message, permanent = false, detail = None))]
    fn fail(
        &self,
        class_: String,
        message: String,
        permanent: bool,
        detail: Option<String>,
    ) -> bool {
        let mut err = if permanent {
            TaskError::permanent(class_, message)
        } else {
            TaskError::new(class_, message)
        };
        err.detail = detail;
        self.finish(Err(err))
    }
}

/// A running worker: stop it, or ask whether it is ready.
#[pyclass(frozen, module = "ax_scheduler._core")]
pub struct WorkerHandle {
    running: Running<WorkerError>,
    status: WorkerStatus,
    queue: String,
}

#[pymethods]
impl WorkerHandle {
    /// True once the worker found its queue's consumers and read its limits.
    fn ready(&self) -> bool {
        self.status.ready()
    }
    /// True while the worker sees its queue paused.
    fn paused(&self) -> bool {
        self.status.paused()
    }
    /// True once the worker has ended.
    fn finished(&self) -> bool {
        self.running.finished()
    }
    /// The queue it serves.
    #[getter]
    fn queue(&self) -> &str {
        &self.queue
    }
    /// Stops pulling without waiting: `stop` then waits. A runtime asks every worker first,
    /// so their graces run at once, not one after another.
    fn request_stop(&self) {
        self.running.request_stop();
    }
    /// Stops pulling and waits until running attempts end (the grace given at start, then
    /// they are handed back). Raises the worker's error if it failed.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        self.running.stop(py, "worker", |e| e.kind())
    }
}

/// Attempts waiting for a Python thread: the workers put them in, the runtime's threads
/// take them out with [`Inbox::next`]. Once closed (after the workers stopped), `next`
/// answers None at once.
#[pyclass(frozen, module = "ax_scheduler._core")]
pub struct Inbox {
    tx: Mutex<Option<mpsc::Sender<TaskContext>>>,
    rx: Mutex<mpsc::Receiver<TaskContext>>,
}

#[pymethods]
impl Inbox {
    #[new]
    fn new() -> Inbox {
        let (tx, rx) = mpsc::channel();
        Inbox {
            tx: Mutex::new(Some(tx)),
            rx: Mutex::new(rx),
        }
    }

    /// The next attempt, or None after `timeout` seconds (at once when closed). Waits
    /// with the GIL released; any number of threads may wait at once.
    fn next(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<Py<TaskContext>>> {
        let limit = seconds(timeout, "timeout")?;
        let got = py.detach(|| {
            let rx = self.rx.lock().expect("not poisoned");
            rx.recv_timeout(limit).ok()
        });
        got.map(|ctx| Py::new(py, ctx)).transpose()
    }

    /// Takes no more attempts: workers started later fail theirs (`dispatch`).
    fn close(&self) {
        self.tx.lock().expect("not poisoned").take();
    }
}

impl Inbox {
    fn sender(&self) -> Option<mpsc::Sender<TaskContext>> {
        self.tx.lock().expect("not poisoned").clone()
    }
}

/// Starts a worker of `queue` for `tasks` (`(name, options JSON)`), running at most
/// `concurrency` attempts at once; each attempt goes into `inbox`, and the thread that
/// takes it out ends it through the context.
#[pyfunction]
#[pyo3(signature = (conn, queue, tasks, inbox, concurrency = 16, shutdown_grace = 30.0, id = None, aging = None))]
#[allow(clippy::too_many_arguments)]
pub fn start_worker(
    conn: &Connection,
    queue: String,
    tasks: Vec<(String, Vec<u8>)>,
    inbox: &Inbox,
    concurrency: usize,
    shutdown_grace: f64,
    id: Option<String>,
    aging: Option<f64>,
) -> PyResult<WorkerHandle> {
    let sender = inbox
        .sender()
        .ok_or_else(|| errors::invalid("the inbox is closed"))?;
    let mut builder = Worker::builder(queue.clone())
        .concurrency(concurrency.max(1))
        .shutdown_grace(seconds(shutdown_grace, "shutdown_grace")?);
    if let Some(id) = id {
        builder = builder.id(id);
    }
    if let Some(after) = aging {
        builder = builder.aging(seconds(after, "aging")?);
    }
    for (name, options) in tasks {
        // The decorator's options in their JSON form (ax_sdk::settings), checked there.
        let declared: TaskSettings = serde_json::from_slice(&options)
            .map_err(|e| errors::invalid(format!("task {name:?} options: {e}")))?;
        let declared = TaskOptions::from_settings(declared).map_err(|e| errors::wire(&e))?;
        let sender = sender.clone();
        builder = builder.task_with(name, declared, move |task: Task| run(sender.clone(), task));
    }
    let worker = builder
        .build()
        .map_err(|e| errors::raise(e.kind(), e.to_string(), None, None))?;
    let status = worker.status();
    let nats = conn.nats.clone();
    let running = Running::spawn(|shutdown| worker.run(nats, shutdown));
    Ok(WorkerHandle {
        running,
        status,
        queue,
    })
}

/// One attempt: put it in the inbox and wait for its end. Dropped (timeout, cancel), it
/// marks the context abandoned, so Python skips it if not started, or can stop the work,
/// and a late result is refused.
async fn run(inbox: mpsc::Sender<TaskContext>, task: Task) -> Outcome {
    let abandoned = CancellationToken::new();
    let _mark = abandoned.clone().drop_guard();
    let (tx, rx) = oneshot::channel();
    let ctx = TaskContext {
        task,
        abandoned,
        done: Mutex::new(Some(tx)),
    };
    if inbox.send(ctx).is_err() {
        return Err(TaskError::new(
            "dispatch",
            "the Python runtime has stopped taking tasks",
        ));
    }
    rx.await.unwrap_or_else(|_| {
        Err(TaskError::new(
            "lost",
            "the Python runtime dropped the task without an outcome",
        ))
    })
}
