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
//!    write after that read is delivered to the subscription;
//! 2. read; a final value ends the wait;
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
/// After a message that says the value may be final: read at once, then again this long
/// after, doubling while the read disagrees, up to [`LAST_REREAD`] (then idle).
const FIRST_REREAD: Duration = Duration::from_millis(10);
const LAST_REREAD: Duration = Duration::from_millis(1280);
/// How often a wait looks whether its connection was made again.
const RECONNECT_CHECK: Duration = Duration::from_millis(250);

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
    // The spacing of the re-reads after a message that may be final (None: idle).
    let mut fast: Option<Duration> = None;
    loop {
        if let Some(done) = read().await? {
            return Ok(done);
        }
        let deadline = tokio::time::Instant::now() + fast.unwrap_or(IDLE_READ);
        fast = fast.map(|p| p * 2).filter(|p| *p <= LAST_REREAD);
        loop {
            let tick = deadline.min(tokio::time::Instant::now() + RECONNECT_CHECK);
            tokio::select! {
                msg = sub.next() => match msg {
                    Some(msg) if may_be_final(&msg) => {
                        fast = Some(FIRST_REREAD);
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
                        break;
                    }
                },
                _ = tokio::time::sleep_until(tick) => {
                    let now = connects();
                    if now != seen_connects {
                        seen_connects = now;
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
