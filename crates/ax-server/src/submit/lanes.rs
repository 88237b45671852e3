//! The lanes of batch keys (`batching`): per key, the items waiting for the key's writer
//! and what the writer last stored. Data only: the rounds are in `batching`.

use async_nats::HeaderMap;
use ax_core::batching::Batching;
use ax_core::protocol::{SubmitAccepted, WireError};
use ax_core::task::TaskMeta;
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

/// The lanes of the batch keys this server is writing (by subject).
#[derive(Debug, Default)]
pub(crate) struct Lanes(Mutex<HashMap<String, Arc<Lane>>>);

#[derive(Debug, Default)]
pub(super) struct Lane {
    pub(super) waiting: Mutex<Vec<Waiting>>,
    /// Held by the round writing; what it last stored (the next round's first guess of
    /// the key's last message: a wrong guess fails its expectation and reads).
    pub(super) writer: tokio::sync::Mutex<Option<Last>>,
}

/// A key's last message as this server knows it.
#[derive(Debug)]
pub(super) struct Last {
    pub(super) seq: u64,
    pub(super) headers: HeaderMap,
    pub(super) list: Bytes,
}

#[derive(Debug)]
pub(super) struct Waiting {
    pub(super) meta: TaskMeta,
    pub(super) item: Bytes,
    pub(super) b: Batching,
    pub(super) answer: oneshot::Sender<Result<SubmitAccepted, WireError>>,
}

impl Waiting {
    /// The hex token of the item's idempotency key, if it has one.
    pub(super) fn key_hex(&self) -> Option<String> {
        (self.meta.idempotency_key.as_deref()).map(ax_core::names::hex_token)
    }

    /// Answers the item accepted into batch `id` (`duplicate`: a batch already held its
    /// key), waiting to run.
    pub(super) fn accepted(self, id: &str, duplicate: bool) {
        self.accepted_as(id, duplicate, ax_core::state::TaskState::Scheduled);
    }

    /// [`Waiting::accepted`], the batch's task in `state`.
    pub(super) fn accepted_as(self, id: &str, duplicate: bool, state: ax_core::state::TaskState) {
        let a = SubmitAccepted {
            id: id.to_string(),
            duplicate,
            state,
        };
        match duplicate {
            true => {
                let queue = self.meta.queue.clone();
                metrics::counter!(ax_core::metrics::SUBMIT_DUPLICATES, "queue" => queue)
                    .increment(1);
                let _ = self.answer.send(Ok(a));
            }
            false => self.answer(Ok(a)),
        }
    }

    pub(super) fn answer(self, r: Result<SubmitAccepted, WireError>) {
        if r.is_ok() {
            metrics::counter!(ax_core::metrics::BATCHED_ITEMS).increment(1);
        }
        let _ = self.answer.send(r);
    }
}

impl Lanes {
    pub(super) fn lane(&self, subject: &str) -> Arc<Lane> {
        let mut lanes = self.0.lock().unwrap();
        lanes.entry(subject.to_string()).or_default().clone()
    }

    /// Drops `subject`'s lane when nobody else holds it and nothing waits in it.
    pub(super) fn release(&self, subject: &str, lane: Arc<Lane>) {
        let mut lanes = self.0.lock().unwrap();
        if Arc::strong_count(&lane) == 2 && lane.waiting.lock().unwrap().is_empty() {
            lanes.remove(subject);
        }
    }
}
