//! Atomic batch publish (ADR-50, nats-server ≥ 2.12): up to [`MAX_BATCH`] messages to one
//! stream (which must allow it: `allow_atomic`) stored all together or not at all. Readers
//! never see part of a batch, and each message's `Nats-Expected-*` checks are made against
//! the stream as it was before the batch, at commit.
//!
//! async-nats has no publisher for it, so this sets the headers by hand: every message but
//! the last is a plain publish (one connection keeps them in order; a problem with one
//! abandons the batch), the last carries `Nats-Batch-Commit: 1` and is a request, answered
//! by the pub ack of the whole batch or by the error that abandoned it: one round trip a
//! batch.
//!
//! [`Grouped`] builds group commit on it: messages published at the same moment by many
//! callers share one batch, one stored write, when that is what the broker answers
//! faster ([`GroupCommit`]).

use crate::error::ErrorKind;
use async_nats::header::HeaderMap;
use async_nats::jetstream::{self, publish::PublishAck};
use bytes::Bytes;
use serde::Deserialize;

mod choice;
mod group;

pub use group::{GroupCommit, GroupResult, Grouped, MAX_GROUP};

/// Most messages in one atomic batch (the server's default limit).
pub const MAX_BATCH: usize = 1000;

/// One message of a batch.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// Subject (all of a batch's subjects belong to one stream).
    pub subject: String,
    /// Headers (`Nats-Expected-*` allowed); the batch headers are added.
    pub headers: HeaderMap,
    /// Payload.
    pub payload: Bytes,
}

/// Errors of an atomic publish. Nothing of the batch is stored in any of them, except
/// [`AtomicError::Broker`] on the commit, where the outcome is unknown.
#[derive(Debug, thiserror::Error)]
pub enum AtomicError {
    /// No messages, or more than [`MAX_BATCH`].
    #[error("an atomic batch holds 1..={MAX_BATCH} messages, not {0}")]
    Size(usize),
    /// The stream refused the batch: a failed `Nats-Expected-*` check
    /// ([`ErrorKind::Conflict`]), a stream without `allow_atomic`, a full stream, ….
    #[error("atomic batch refused: {0}")]
    Refused(#[source] jetstream::Error),
    /// The broker did not answer, or answered something that is not a pub ack.
    #[error("atomic batch: {0}")]
    Broker(#[source] async_nats::Error),
}

impl AtomicError {
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            AtomicError::Size(_) => ErrorKind::Invalid,
            AtomicError::Refused(e) => match ErrorKind::of(e) {
                ErrorKind::Other => ErrorKind::Invalid,
                kind => kind,
            },
            AtomicError::Broker(e) => ErrorKind::of(e.as_ref()),
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Reply {
    Refused { error: jetstream::Error },
    Ack(PublishAck),
}

/// Publishes `msgs` as one atomic batch; answers the pub ack of its last message (the
/// ones before it have the sequences just below).
pub async fn publish(
    client: &async_nats::Client,
    msgs: Vec<Outgoing>,
) -> Result<PublishAck, AtomicError> {
    let n = msgs.len();
    if n == 0 || n > MAX_BATCH {
        return Err(AtomicError::Size(n));
    }
    let id = nuid::next().to_string();
    for (i, mut m) in msgs.into_iter().enumerate() {
        let seq = (i + 1).to_string();
        m.headers.insert("Nats-Batch-Id", id.as_str());
        m.headers.insert("Nats-Batch-Sequence", seq.as_str());
        if i + 1 == n {
            m.headers.insert("Nats-Batch-Commit", "1");
            let reply = client
                .request_with_headers(m.subject, m.headers, m.payload)
                .await
                .map_err(|e| AtomicError::Broker(e.into()))?;
            return match serde_json::from_slice::<Reply>(&reply.payload) {
                Ok(Reply::Refused { error }) => Err(AtomicError::Refused(error)),
                Ok(Reply::Ack(ack)) => Ok(ack),
                Err(e) => Err(AtomicError::Broker(e.into())),
            };
        }
        client
            .publish_with_headers(m.subject, m.headers, m.payload)
            .await
            .map_err(|e| AtomicError::Broker(e.into()))?;
    }
    unreachable!("the last message returns")
}

/// Headers a message is stored with that belong to the publish that stored it, not to the
/// message: the atomic batch's, the conditions it was stored under (a delayed task is
/// stored create-if-absent on its own subject: `crate::admit`), and a window write's id.
const PUBLISH_HEADERS: [&str; 5] = [
    "Nats-Batch-Id",
    "Nats-Batch-Sequence",
    "Nats-Batch-Commit",
    "Nats-Expected-Last-Subject-Sequence",
    crate::debounce::WRITE,
];

/// `headers` without the headers of the publish that stored them: a copy of a stored
/// message published with them would be taken for part of a batch (and refused, or
/// abandoned), or checked against the condition its original was stored under (a due
/// delayed task's copy to its ready subject would be refused: that subject is not empty).
pub fn without_publish_headers(headers: HeaderMap) -> HeaderMap {
    if !PUBLISH_HEADERS.iter().any(|n| headers.get(*n).is_some()) {
        return headers;
    }
    let mut out = HeaderMap::new();
    for (name, values) in headers.iter() {
        if PUBLISH_HEADERS.contains(&name.as_ref()) {
            continue;
        }
        for value in values {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_leaves_the_publish_headers_behind_and_keeps_the_rest() {
        let mut h = HeaderMap::new();
        h.insert("Ax-Id", "q.1");
        h.append("Ax-Tag", "a");
        h.append("Ax-Tag", "b");
        let plain = without_publish_headers(h.clone());
        assert_eq!(plain.len(), 2);
        for name in PUBLISH_HEADERS {
            h.insert(name, "1");
        }
        let copy = without_publish_headers(h);
        assert!(PUBLISH_HEADERS.iter().all(|n| copy.get(*n).is_none()));
        assert_eq!(copy.get("Ax-Id").map(|v| v.as_str()), Some("q.1"));
        let tags: Vec<&str> = copy.get_all("Ax-Tag").map(|v| v.as_str()).collect();
        assert_eq!(tags, ["a", "b"]);
    }
}
