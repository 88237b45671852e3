//! A handler's failure (its class, message and detail become the record's `last_error`)
//! and the errors that stop a worker.

/// A handler's failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{class}: {message}")]
pub struct TaskError {
    /// Error class, matched against the task's `retry_on` / `no_retry_on`.
    pub class: String,
    /// Message, stored as the task's last error.
    pub message: String,
    /// Never retry, whatever the task's lists say.
    pub permanent: bool,
    /// More than the message (a stack trace, a response body), kept in the record's
    /// `last_error.detail` up to 8 KiB and shown on the console's task page.
    pub detail: Option<String>,
}

impl TaskError {
    /// A failure that is retried unless the task's lists refuse its class.
    pub fn new(class: impl Into<String>, message: impl Into<String>) -> Self {
        TaskError {
            class: class.into(),
            message: message.into(),
            permanent: false,
            detail: None,
        }
    }

    /// Adds a detail (a stack trace, a response body) to the error.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// The downstream pushes back (an HTTP 429, a slow database): a retried failure of
    /// class `pressure`, which lowers the rate of an adaptive limit that applies to the
    /// task (docs/PROTOCOL.md §7, "Adaptive rates").
    pub fn pressure(message: impl Into<String>) -> Self {
        TaskError::new(crate::limits::model::PRESSURE_CLASS, message)
    }

    /// A failure that is never retried.
    pub fn permanent(class: impl Into<String>, message: impl Into<String>) -> Self {
        TaskError {
            permanent: true,
            ..TaskError::new(class, message)
        }
    }
}

/// Errors that stop a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// No handler was set.
    #[error("worker for queue {0}: no handler set")]
    NoHandler(String),
    /// The queue name is invalid.
    #[error("invalid queue name {0:?}")]
    InvalidQueue(String),
    /// The queue's consumers do not exist.
    #[error("queue {queue} is not declared (run `ax streams apply --queue {queue}`): {source}")]
    QueueNotDeclared {
        /// Queue.
        queue: String,
        /// Lookup error.
        source: async_nats::Error,
    },
    /// Opening the task bucket failed.
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    /// The broker failed.
    #[error("worker {op}: {source}")]
    Broker {
        /// Operation.
        op: &'static str,
        /// Underlying error.
        source: async_nats::Error,
    },
}

impl WorkerError {
    /// What kind of failure this is.
    pub fn kind(&self) -> crate::error::ErrorKind {
        use crate::error::ErrorKind;
        match self {
            WorkerError::NoHandler(_) | WorkerError::InvalidQueue(_) => ErrorKind::Invalid,
            WorkerError::QueueNotDeclared { .. } => ErrorKind::NotFound,
            WorkerError::State(e) => e.kind(),
            WorkerError::Broker { source, .. } => ErrorKind::of(source.as_ref()),
        }
    }
}
