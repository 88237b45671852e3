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
//! callers share one batch, one stored write.

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

/// The headers a message stored by an atomic batch keeps (the server stores them).
const BATCH_HEADERS: [&str; 3] = ["Nats-Batch-Id", "Nats-Batch-Sequence", "Nats-Batch-Commit"];

/// `headers` without the atomic batch headers: a copy of a stored message published with
/// them would be taken for part of a batch (and refused, or abandoned).
pub fn without_batch_headers(headers: HeaderMap) -> HeaderMap {
    if headers.get(BATCH_HEADERS[0]).is_none() {
        return headers;
    }
    let mut out = HeaderMap::new();
    for (name, values) in headers.iter() {
        if BATCH_HEADERS.contains(&name.as_ref()) {
            continue;
        }
        for value in values {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

/// Most messages one group carries (below [`MAX_BATCH`]: a group's latency grows with it).
pub const MAX_GROUP: usize = 256;

/// Group commits in flight at once for one stream.
const LANES: usize = 4;

/// The outcome of one message published through [`Grouped`]: its stream sequence, or the
/// error of the single publish it fell back to.
pub type GroupResult = Result<u64, jetstream::context::PublishError>;

struct Job {
    msg: Outgoing,
    done: tokio::sync::oneshot::Sender<GroupResult>,
}

/// Group commit for one stream: messages published at the same moment by many callers go
/// out as one atomic batch, so one stored write (one fsync under `sync_interval: always`)
/// carries many of them. A caller waits only for its own message: nobody waits for a group
/// to fill; whatever queued while the previous groups were being committed forms the
/// next one (four commits in flight).
///
/// A group the stream refuses as a whole (a full subject, a failed `Nats-Expected-*` check
/// of one message) or whose commit gets no answer falls back to one publish per message,
/// so each caller gets its own message's outcome. Two kinds of messages fit: ones that
/// carry a `Nats-Msg-Id` (the fallback after a commit with no answer may send a stored
/// message again: the id de-duplicates it), and, with [`Grouped::start_distinct`],
/// compare-and-set writes (`Nats-Expected-Last-Subject-Sequence`), of which a group holds at
/// most one per subject, since the stream checks each against the stream as it was before
/// the batch. A write whose batch was stored but not answered fails its fallback's check,
/// as a single write whose answer was lost fails its retry: the caller reads the record to
/// learn which.
#[derive(Debug, Clone)]
pub struct Grouped {
    tx: tokio::sync::mpsc::UnboundedSender<Job>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("subject", &self.msg.subject)
            .finish()
    }
}

impl Grouped {
    /// Starts the lanes of one stream's group commit; they end when every clone of the
    /// handle is dropped.
    pub fn start(js: jetstream::Context) -> Grouped {
        Grouped::lanes(js, false)
    }

    /// Like [`Grouped::start`], with at most one message per subject in a group.
    pub fn start_distinct(js: jetstream::Context) -> Grouped {
        Grouped::lanes(js, true)
    }

    fn lanes(js: jetstream::Context, distinct: bool) -> Grouped {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
        let inbox = std::sync::Arc::new(tokio::sync::Mutex::new(Inbox {
            rx,
            carry: None,
            distinct,
        }));
        for _ in 0..LANES {
            tokio::spawn(lane(js.clone(), inbox.clone()));
        }
        Grouped { tx }
    }

    /// Publishes `msg` in the next group; answers its sequence, or the error of its own
    /// publish.
    pub async fn publish(&self, msg: Outgoing) -> GroupResult {
        let (done, answer) = tokio::sync::oneshot::channel();
        let lost = || {
            jetstream::context::PublishError::new(jetstream::context::PublishErrorKind::BrokenPipe)
        };
        self.tx.send(Job { msg, done }).map_err(|_| lost())?;
        answer.await.map_err(|_| lost())?
    }
}

/// The queue the lanes of one [`Grouped`] take their groups from.
struct Inbox {
    rx: tokio::sync::mpsc::UnboundedReceiver<Job>,
    /// A job that would have repeated a subject of the last group: the next one's first.
    carry: Option<Job>,
    /// At most one message per subject in a group.
    distinct: bool,
}

/// The next group: the first job to come, and every one queued behind it (up to
/// [`MAX_GROUP`]; with `distinct`, up to the first that repeats a subject). `None` once
/// every handle is dropped.
async fn next_group(inbox: &tokio::sync::Mutex<Inbox>) -> Option<Vec<Job>> {
    let mut inbox = inbox.lock().await;
    let first = match inbox.carry.take() {
        Some(job) => job,
        None => inbox.rx.recv().await?,
    };
    let mut subjects = std::collections::HashSet::new();
    if inbox.distinct {
        subjects.insert(first.msg.subject.clone());
    }
    let mut group = vec![first];
    while group.len() < MAX_GROUP {
        match inbox.rx.try_recv() {
            Ok(job) if inbox.distinct && !subjects.insert(job.msg.subject.clone()) => {
                inbox.carry = Some(job);
                break;
            }
            Ok(job) => group.push(job),
            Err(_) => break,
        }
    }
    Some(group)
}

/// One lane: commits groups until every handle is dropped. A commit that panics (a bug)
/// is logged, counted in `ax_service_restarts_total{service="group_commit"}` and the lane
/// goes on with the next group; the callers of the lost group get an error, not silence.
async fn lane(js: jetstream::Context, inbox: std::sync::Arc<tokio::sync::Mutex<Inbox>>) {
    while let Some(group) = next_group(&inbox).await {
        let js = js.clone();
        if let Err(e) = tokio::spawn(async move { commit(&js, group).await }).await {
            tracing::error!(cause = %e, "a group commit ended abnormally; its callers get an error, the lane goes on");
            metrics::counter!(crate::metrics::SERVICE_RESTARTS, "service" => "group_commit", "reason" => "panic")
                .increment(1);
        }
    }
}

async fn commit(js: &jetstream::Context, group: Vec<Job>) {
    #[cfg(feature = "test-hooks")]
    if group
        .iter()
        .any(|j| j.msg.subject == crate::hooks::PANIC_GROUP_SUBJECT)
    {
        panic!("test hook: a group commit made to panic");
    }
    if group.len() > 1 {
        let msgs = group.iter().map(|j| j.msg.clone()).collect();
        if let Ok(ack) = publish(&js.client(), msgs).await {
            let first = (ack.sequence + 1).saturating_sub(group.len() as u64);
            for (i, job) in group.into_iter().enumerate() {
                let _ = job.done.send(Ok(first + i as u64));
            }
            return;
        }
    }
    // One message, or a group refused as a whole: each on its own, concurrently.
    let singles = group.into_iter().map(|job| async move {
        let m = job.msg;
        let publish = jetstream::message::PublishMessage::build()
            .headers(m.headers)
            .payload(m.payload);
        let ack = match js.send_publish(m.subject, publish).await {
            Ok(future) => future.await.map(|a| a.sequence),
            Err(e) => Err(e),
        };
        let _ = job.done.send(ack);
    });
    futures::future::join_all(singles).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inbox(subjects: &[&str], distinct: bool) -> tokio::sync::Mutex<Inbox> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for s in subjects {
            let (done, _) = tokio::sync::oneshot::channel();
            let msg = Outgoing {
                subject: s.to_string(),
                headers: HeaderMap::new(),
                payload: Bytes::new(),
            };
            tx.send(Job { msg, done }).unwrap();
        }
        tokio::sync::Mutex::new(Inbox {
            rx,
            carry: None,
            distinct,
        })
    }

    async fn groups(inbox: &tokio::sync::Mutex<Inbox>, n: usize) -> Vec<Vec<String>> {
        let mut out = Vec::new();
        for _ in 0..n {
            let group = next_group(inbox).await.unwrap();
            out.push(group.into_iter().map(|j| j.msg.subject).collect());
        }
        out
    }

    #[tokio::test]
    async fn a_group_takes_what_is_queued_and_compare_and_sets_one_per_subject() {
        // Submits share their ready subject: one group.
        let same = inbox(&["r", "r", "r"], false);
        assert_eq!(groups(&same, 1).await, [["r", "r", "r"]]);
        // Record writes: a second write of a key waits for the next group, in order.
        let keys = inbox(&["a", "b", "a", "c", "a"], true);
        assert_eq!(
            groups(&keys, 3).await,
            [vec!["a", "b"], vec!["a", "c"], vec!["a"]]
        );
        // At most MAX_GROUP in one.
        let many: Vec<String> = (0..MAX_GROUP + 5).map(|i| i.to_string()).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let lots = inbox(&many, true);
        let sizes: Vec<usize> = groups(&lots, 2).await.iter().map(Vec::len).collect();
        assert_eq!(sizes, [MAX_GROUP, 5]);
    }

    #[test]
    fn a_copy_leaves_the_batch_headers_behind_and_keeps_the_rest() {
        let mut h = HeaderMap::new();
        h.insert("Ax-Id", "q.1");
        h.append("Ax-Tag", "a");
        h.append("Ax-Tag", "b");
        let plain = without_batch_headers(h.clone());
        assert_eq!(plain.len(), 2);
        for name in BATCH_HEADERS {
            h.insert(name, "1");
        }
        let copy = without_batch_headers(h);
        assert!(BATCH_HEADERS.iter().all(|n| copy.get(*n).is_none()));
        assert_eq!(copy.get("Ax-Id").map(|v| v.as_str()), Some("q.1"));
        let tags: Vec<&str> = copy.get_all("Ax-Tag").map(|v| v.as_str()).collect();
        assert_eq!(tags, ["a", "b"]);
    }
}
