//! How one dispatch of a delayed message ended (the dispatcher's answer to its index).

use super::index::Body;

/// How one dispatch ended.
pub(super) enum Outcome {
    /// Published to `subject` (and the delayed message deleted).
    Done { subject: String },
    /// The delayed message is gone: another server moved it, or it was removed by hand.
    Gone,
    /// Not dispatchable (bad headers): left in the stream, dropped from the index.
    Bad,
    /// Publish refused or failed, or the read failed: park under `group`.
    Refused {
        group: String,
        due: u64,
        seq: u64,
        body: Option<Body>,
    },
}
