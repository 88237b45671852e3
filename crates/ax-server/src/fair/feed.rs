//! The fair dispatcher's index feed: an ordered consumer over `AX_FAIR` from its first
//! message, each held task added to its lane. Runs beside the release rounds, so indexing
//! never waits for a release.

use super::error::{err, FairError};
use super::lanes::{Held, Lanes};
use async_nats::jetstream::{consumer, stream};
use ax_core::follow::Reconnects;
use ax_core::names;
use futures::StreamExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
use tracing::{debug, warn};

/// What the feed fills and tells.
pub(crate) struct Feed {
    pub(crate) client: async_nats::Client,
    pub(crate) stream: stream::Stream,
    pub(crate) lanes: Arc<Mutex<Lanes>>,
    /// Set once every message stored when the feed started has been indexed: releases
    /// wait for it, so the first ones are already fair.
    pub(crate) caught_up: Arc<AtomicBool>,
    /// Told of every task indexed.
    pub(crate) added: Arc<Notify>,
}

impl Feed {
    pub(crate) async fn run(self) -> Result<(), FairError> {
        let (mut feed, pending) = follow(&self.stream, 0).await?;
        if pending == 0 {
            self.caught_up.store(true, Ordering::Release);
            self.added.notify_one();
        }
        let mut last_seq = 0u64;
        let mut reconnects = Reconnects::new(&self.client);
        loop {
            tokio::select! {
                _ = reconnects.changed() => {
                    match follow(&self.stream, last_seq + 1).await {
                        Ok((f, _)) => {
                            feed = f;
                            reconnects.mark();
                        }
                        Err(e) => warn!(cause = %e, "cannot follow AX_FAIR yet; retrying"),
                    }
                }
                next = feed.next() => match next {
                    Some(Ok(msg)) => {
                        let Ok(info) = msg.info() else { continue };
                        let seq = info.stream_sequence;
                        let done = info.pending == 0;
                        if seq > last_seq {
                            last_seq = seq;
                            self.index(seq, msg);
                        }
                        if done && !self.caught_up.swap(true, Ordering::AcqRel) {
                            debug!(last_seq, "AX_FAIR indexed");
                        }
                        self.added.notify_one();
                    }
                    Some(Err(e)) => warn!(cause = %e, "AX_FAIR feed error; the ordered consumer resets itself"),
                    None => return Err(err("follow AX_FAIR")("feed ended".into())),
                },
            }
        }
    }

    /// Adds the message's task to its lane, its headers moved out of the message (not
    /// copied) and kept as its release will publish them: each header map held is many
    /// small allocations, for as long as the backlog lasts.
    fn index(&self, seq: u64, msg: async_nats::jetstream::Message) {
        let (msg, _) = msg.split();
        let Some(s) = names::parse_fair_subject(&msg.subject) else {
            warn!(seq, subject = %msg.subject, "AX_FAIR message on a subject that is no fair subject; left in place");
            return;
        };
        let headers = ax_core::atomic::without_publish_headers(msg.headers.unwrap_or_default());
        let held = Held {
            seq,
            body: Some((headers, msg.payload)),
        };
        self.lanes
            .lock()
            .expect("not poisoned")
            .add(s.queue, s.priority, s.key_hex, held);
    }
}

/// An ordered consumer over `AX_FAIR` from `start` (0: the first message), and how many
/// stored messages it has to deliver.
async fn follow(
    stream: &stream::Stream,
    start: u64,
) -> Result<(consumer::pull::Ordered, u64), FairError> {
    ax_core::follow::ordered_from(stream, vec!["ax.fair.>".to_string()], start)
        .await
        .map_err(err("follow AX_FAIR"))
}
