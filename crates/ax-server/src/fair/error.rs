//! The error that ends a term of the fair dispatcher.

/// What ends a term of the fair dispatcher with an error (the lease is released and a
/// standby takes over).
#[derive(Debug, thiserror::Error)]
#[error("fair dispatcher: {op}: {source}")]
pub(crate) struct FairError {
    op: &'static str,
    source: async_nats::Error,
}

/// Wraps a broker failure of `op`.
pub(crate) fn err(op: &'static str) -> impl FnOnce(async_nats::Error) -> FairError {
    move |source| FairError { op, source }
}
