use super::choice::{Chooser, Way};
use super::{publish, Outgoing};
use crate::faults::Faults;
use async_nats::jetstream;
use std::time::Instant;

/// Most messages one group carries (below [`MAX_BATCH`](super::MAX_BATCH): a group's latency grows with it).
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

/// When messages go as atomic batches ([`Grouped`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GroupCommit {
    /// Measure both ways while running and use the one the broker answers faster
    /// (docs/PERFORMANCE.md, "Group commit"): batches where each stored write is
    /// fsynced (`sync_interval: always`), single publishes where it is not.
    #[default]
    Auto,
    /// Always in batches.
    Always,
    /// Never: each message its own publish.
    Never,
}

impl From<bool> for GroupCommit {
    /// `true` is [`GroupCommit::Always`], `false` [`GroupCommit::Never`].
    fn from(on: bool) -> GroupCommit {
        match on {
            true => GroupCommit::Always,
            false => GroupCommit::Never,
        }
    }
}

/// Group commit for one stream: messages published at the same moment by many callers go
/// out as one atomic batch, so one stored write (one fsync under `sync_interval: always`)
/// carries many of them. A caller waits only for its own message: nobody waits for a group
/// to fill; whatever queued while the previous groups were being committed forms the
/// next one (four commits in flight). With [`GroupCommit::Auto`] it measures whether the
/// broker answers batches or single publishes faster and sends the faster way (the
/// gauge `ax_group_commit_grouping{stream}` says which).
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
    js: jetstream::Context,
    mode: GroupCommit,
    chooser: std::sync::Arc<Chooser>,
    stream: std::sync::Arc<str>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("subject", &self.msg.subject)
            .finish()
    }
}

impl Grouped {
    /// Starts the lanes of the group commit of `stream` (its name labels the gauge); they
    /// end when every clone of the handle is dropped.
    pub fn start(js: jetstream::Context, mode: GroupCommit, stream: &str) -> Grouped {
        Grouped::lanes(js, mode, stream, false, Faults::default())
    }

    /// Like [`Grouped::start`] (or [`Grouped::start_distinct`] if `distinct`), with the
    /// faults a test armed (a group commit that panics).
    #[doc(hidden)]
    pub fn start_with_faults(
        js: jetstream::Context,
        mode: GroupCommit,
        stream: &str,
        distinct: bool,
        faults: Faults,
    ) -> Grouped {
        Grouped::lanes(js, mode, stream, distinct, faults)
    }

    /// Like [`Grouped::start`], with at most one message per subject in a group.
    pub fn start_distinct(js: jetstream::Context, mode: GroupCommit, stream: &str) -> Grouped {
        Grouped::lanes(js, mode, stream, true, Faults::default())
    }

    fn lanes(
        js: jetstream::Context,
        mode: GroupCommit,
        stream: &str,
        distinct: bool,
        faults: Faults,
    ) -> Grouped {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
        let inbox = std::sync::Arc::new(tokio::sync::Mutex::new(Inbox {
            rx,
            carry: None,
            distinct,
        }));
        for _ in 0..LANES {
            tokio::spawn(lane(js.clone(), inbox.clone(), faults.clone()));
        }
        metrics::gauge!(crate::metrics::GROUP_COMMIT_GROUPING, "stream" => stream.to_string())
            .set(f64::from(u8::from(mode != GroupCommit::Never)));
        Grouped {
            tx,
            js,
            mode,
            chooser: std::sync::Arc::new(Chooser::new(Instant::now())),
            stream: stream.into(),
        }
    }

    /// Whether the next message goes in a group (false while single publishes are being
    /// measured or were found faster).
    pub fn grouping(&self) -> bool {
        self.way() == Way::Grouped
    }

    fn way(&self) -> Way {
        match self.mode {
            GroupCommit::Auto => self.chooser.way(),
            GroupCommit::Always => Way::Grouped,
            GroupCommit::Never => Way::Single,
        }
    }

    /// Publishes `msg` in the next group, or on its own; answers its sequence, or the
    /// error of its own publish.
    pub async fn publish(&self, msg: Outgoing) -> GroupResult {
        let way = self.way();
        let started = Instant::now();
        let out = match way {
            Way::Grouped => self.in_group(msg).await,
            Way::Single => single(&self.js, msg).await,
        };
        if self.mode == GroupCommit::Auto {
            let now = Instant::now();
            if let Some((best, last)) = self.chooser.record(way, now - started, now) {
                let grouping = best == Way::Grouped;
                let [g, s] = last.map(|m| m.map(|m| (m.mean.as_micros() as u64, m.rate as u64)));
                tracing::debug!(
                    stream = %self.stream,
                    grouping,
                    grouped_mean_us = g.map(|m| m.0),
                    grouped_per_s = g.map(|m| m.1),
                    single_mean_us = s.map(|m| m.0),
                    single_per_s = s.map(|m| m.1),
                    "group commit: the broker answers the other way faster now"
                );
                metrics::gauge!(crate::metrics::GROUP_COMMIT_GROUPING, "stream" => self.stream.to_string())
                    .set(f64::from(u8::from(grouping)));
            }
        }
        out
    }

    async fn in_group(&self, msg: Outgoing) -> GroupResult {
        let (done, answer) = tokio::sync::oneshot::channel();
        let lost = || {
            jetstream::context::PublishError::new(jetstream::context::PublishErrorKind::BrokenPipe)
        };
        self.tx.send(Job { msg, done }).map_err(|_| lost())?;
        answer.await.map_err(|_| lost())?
    }
}

/// `m` published on its own.
async fn single(js: &jetstream::Context, m: Outgoing) -> GroupResult {
    let publish = jetstream::message::PublishMessage::build()
        .headers(m.headers)
        .payload(m.payload);
    match js.send_publish(m.subject, publish).await {
        Ok(future) => future.await.map(|a| a.sequence),
        Err(e) => Err(e),
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
async fn lane(
    js: jetstream::Context,
    inbox: std::sync::Arc<tokio::sync::Mutex<Inbox>>,
    faults: Faults,
) {
    while let Some(group) = next_group(&inbox).await {
        let (js, faults) = (js.clone(), faults.clone());
        if let Err(e) = tokio::spawn(async move { commit(&js, group, &faults).await }).await {
            tracing::error!(cause = %e, "a group commit ended abnormally; its callers get an error, the lane goes on");
            metrics::counter!(crate::metrics::SERVICE_RESTARTS, "service" => "group_commit", "reason" => "panic")
                .increment(1);
        }
    }
}

async fn commit(js: &jetstream::Context, group: Vec<Job>, faults: &Faults) {
    if group.iter().any(|j| faults.group_panics(&j.msg.subject)) {
        panic!("injected fault: a group commit made to panic");
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
        let _ = job.done.send(single(js, job.msg).await);
    });
    futures::future::join_all(singles).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::header::HeaderMap;
    use bytes::Bytes;

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
}
