//! Atomic batch publish (ADR-50, nats-server ≥ 2.12): up to [`MAX_BATCH`] messages to one
//! stream (which must allow it: `allow_atomic`) stored all together or not at all. Readers
//! never see part of a batch, and each message's `Nats-Expected-*` checks are made against
//! the stream as it was before the batch, at commit.
//!
//! async-nats has no publisher for it, so this sets the headers by hand: the first message
//! is a request (the server answers empty once it opened the batch), the middle ones are
//! plain publishes, the last carries `Nats-Batch-Commit: 1` and is answered by the pub ack
//! of the whole batch, or by the error that abandoned it.

use crate::error::ErrorKind;
use async_nats::header::HeaderMap;
use async_nats::jetstream::{self, publish::PublishAck};
use bytes::Bytes;
use serde::Deserialize;

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
        let last = i + 1 == n;
        if last {
            m.headers.insert("Nats-Batch-Commit", "1");
        }
        if i == 0 || last {
            let reply = client
                .request_with_headers(m.subject, m.headers, m.payload)
                .await
                .map_err(|e| AtomicError::Broker(e.into()))?;
            if !last && reply.payload.is_empty() {
                continue;
            }
            return match serde_json::from_slice::<Reply>(&reply.payload) {
                Ok(Reply::Refused { error }) => Err(AtomicError::Refused(error)),
                Ok(Reply::Ack(ack)) if last => Ok(ack),
                Ok(Reply::Ack(_)) => Err(AtomicError::Broker(
                    "the server acknowledged a batch's first message as a whole batch: \
                     does the stream allow atomic publish?"
                        .into(),
                )),
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
