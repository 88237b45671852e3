//! Waiting until a KV key holds a final value, without a consumer: what
//! `ax_sdk::Client::wait` and
//! `Client::wait_flow` stand on.
//!
//! A KV watch is an ordered consumer, which the server keeps about 30 s after its reader
//! has gone: a service waiting for one task per request piled up thousands of them and
//! hit the consumer limit (issue 38). A wait here is a core subscription to the key's
//! own subject (`$KV.<bucket>.<key>`) — server state only while it exists, removed by the
//! unsubscribe its drop sends — and reads of the key from the bucket stream's leader:
//!
//! 1. subscribe, and flush, so the server has the interest before the first read: a
//!    write published after that is delivered to the subscription;
//! 2. read; a final value ends the wait. A write the server routed before the
//!    subscription existed but stores after this read reaches neither — the first
//!    messages of an atomic batch (a worker's group commit of task records) are routed as
//!    they arrive and stored when the batch's commit does; a replicated write is stored
//!    once a quorum has it — so the read is repeated 50 ms, 250 ms and 1.25 s later
//!    (also after each new subscription or connection);
//! 3. each message that says it may be final (decided by the caller on the payload) is
//!    *confirmed by a read*, never believed: a core subscriber also sees publishes the
//!    stream refused (a compare-and-set that lost) and sees a write before the stream has
//!    stored it, so the read is repeated 10 ms, 20 ms, … 1.28 s apart until it agrees
//!    (about 2.5 s in all), then the wait goes back to idle;
//! 4. a read every [`IDLE_READ`] anyway, and at once after the connection came back
//!    (core messages published while it was down are lost to the subscription).
//!
//! Many waits of one client share its connection; each costs the server one subscription
//! for as long as it waits, and nothing after.

use std::future::Future;
use std::time::Duration;

use futures::StreamExt;

/// The longest a wait goes without reading the key (missed messages cannot outlast it).
pub const IDLE_READ: Duration = Duration::from_secs(10);
/// How often a wait looks whether its connection was made again.
const RECONNECT_CHECK: Duration = Duration::from_millis(250);

/// The spacing of the reads that follow a read (`None` in a wait: idle, [`IDLE_READ`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rereads {
    next: Duration,
    factor: u32,
    last: Duration,
}

impl Rereads {
    /// After a message that says the value may be final: read at once, then again 10 ms
    /// after, doubling while the read disagrees, up to 1.28 s (then idle).
    const CONFIRM: Rereads = Rereads {
        next: Duration::from_millis(10),
        factor: 2,
        last: Duration::from_millis(1280),
    };
    /// After a (new) subscription's first read: 50 ms, 250 ms and 1.25 s later, for a
    /// write routed before the subscription and stored after the read.
    const SETTLE: Rereads = Rereads {
        next: Duration::from_millis(50),
        factor: 5,
        last: Duration::from_millis(1250),
    };

    /// The spacing after this one, if any.
    fn later(self) -> Option<Rereads> {
        let next = self.next * self.factor;
        (next <= self.last).then_some(Rereads { next, ..self })
    }
}

/// Why a wait could not follow its key.
#[derive(Debug, thiserror::Error)]
#[error("following {subject}: {source}")]
pub struct FollowError {
    /// The key's subject.
    pub subject: String,
    /// The broker's error.
    #[source]
    pub source: async_nats::Error,
}

/// Waits until `read` answers `Some` (the key's final value), reading at the moments the
/// module doc lists. `subject` is the key's subject; `may_be_final` tells, from a
/// message's headers and payload, whether it is worth a read (a delete or an undecodable
/// payload should say yes). `read` errors end the wait.
pub async fn until<T, E, R, Fut>(
    nats: &async_nats::Client,
    subject: String,
    may_be_final: impl Fn(&async_nats::Message) -> bool,
    mut read: R,
) -> Result<T, E>
where
    R: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, E>>,
    E: From<FollowError>,
{
    let failed = |subject: &String, source: async_nats::Error| FollowError {
        subject: subject.clone(),
        source,
    };
    let mut sub = nats
        .subscribe(subject.clone())
        .await
        .map_err(|e| failed(&subject, e.into()))?;
    nats.flush().await.map_err(|e| failed(&subject, e.into()))?;
    let connects = || {
        nats.statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let mut seen_connects = connects();
    // The spacing of the next reads (None: idle).
    let mut rereads = Some(Rereads::SETTLE);
    loop {
        if let Some(done) = read().await? {
            return Ok(done);
        }
        let deadline = tokio::time::Instant::now() + rereads.map_or(IDLE_READ, |r| r.next);
        rereads = rereads.and_then(Rereads::later);
        loop {
            let tick = deadline.min(tokio::time::Instant::now() + RECONNECT_CHECK);
            tokio::select! {
                msg = sub.next() => match msg {
                    Some(msg) if may_be_final(&msg) => {
                        rereads = Some(Rereads::CONFIRM);
                        break;
                    }
                    Some(_) => {}
                    // The subscription ended without the client asking: make it again
                    // (this fails if the client was closed, and the wait ends with it).
                    None => {
                        sub = nats
                            .subscribe(subject.clone())
                            .await
                            .map_err(|e| failed(&subject, e.into()))?;
                        rereads = Some(Rereads::SETTLE);
                        break;
                    }
                },
                _ = tokio::time::sleep_until(tick) => {
                    let now = connects();
                    if now != seen_connects {
                        seen_connects = now;
                        rereads = Some(Rereads::SETTLE);
                        break;
                    }
                    if tokio::time::Instant::now() >= deadline {
                        break;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spacings(first: Rereads) -> Vec<u128> {
        std::iter::successors(Some(first), |r| r.later())
            .map(|r| r.next.as_millis())
            .collect()
    }

    #[test]
    fn reads_follow_their_schedules_then_go_idle() {
        assert_eq!(spacings(Rereads::SETTLE), [50, 250, 1250]);
        assert_eq!(
            spacings(Rereads::CONFIRM),
            [10, 20, 40, 80, 160, 320, 640, 1280]
        );
    }
}
