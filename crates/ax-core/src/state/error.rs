//! Errors of the task store.

/// Errors of the state store.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The revision changed since it was read: another writer won (stale fencing token).
    #[error("task {id}: stale revision {expected} (another writer changed the task)")]
    Stale {
        /// Task id.
        id: String,
        /// The revision the caller held.
        expected: u64,
    },
    /// The record already exists.
    #[error("task {0} already exists")]
    Exists(String),
    /// A stored record is not valid JSON of the record's shape.
    #[error("task {id}: corrupt record: {source}")]
    Corrupt {
        /// Task id.
        id: String,
        /// Decode error.
        source: serde_json::Error,
    },
    /// The broker failed or could not be reached.
    #[error("task {id}: {op} failed: {source}")]
    Broker {
        /// Task id (or `*` for a listing).
        id: String,
        /// Operation.
        op: &'static str,
        /// Underlying error.
        source: async_nats::Error,
    },
}

impl StateError {
    /// What kind of failure this is.
    pub fn kind(&self) -> crate::error::ErrorKind {
        use crate::error::ErrorKind;
        match self {
            StateError::Stale { .. } | StateError::Exists(_) => ErrorKind::Conflict,
            StateError::Corrupt { .. } => ErrorKind::Invalid,
            StateError::Broker { source, .. } => ErrorKind::of(source.as_ref()),
        }
    }
}
