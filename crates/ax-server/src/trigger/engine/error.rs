//! Errors that stop the trigger engine.

use crate::trigger::store::TriggerStoreError;

/// Errors that stop the engine.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EngineError {
    /// A bucket could not be opened or followed.
    #[error("trigger engine: {0}")]
    Store(#[from] TriggerStoreError),
    /// The broker failed.
    #[error("trigger engine: {op}: {source}")]
    Broker {
        /// Operation.
        op: &'static str,
        /// Underlying error.
        source: async_nats::Error,
    },
}

pub(super) fn broker(op: &'static str) -> impl FnOnce(async_nats::Error) -> EngineError {
    move |source| EngineError::Broker { op, source }
}
