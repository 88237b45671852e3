//! Direct submits (docs/PROTOCOL.md §2, "Direct submits"): the client validates a task as
//! the server does and publishes its message to JetStream itself — the same message, under
//! the same subject, with the same headers as an ax server would store — so no ax server
//! is on an immediate task's path. The broker is what admits it: the publish returns once
//! the message is stored, `Nats-Msg-Id` (a delayed task: create-if-absent on its subject)
//! de-duplicates a re-publish, a full subject refuses it (`busy`), subject permissions
//! confine a producer to its queues. The messages of one moment go as one atomic batch
//! where the broker answers that faster (group commit, as a server's submits do: under
//! `sync_interval: always`, one fsync for many tasks).
//!
//! A task with an idempotency key still goes by request to a server (its key and its
//! message are written in an order a server owns; docs/PROTOCOL.md §2).

use crate::admit::{self, Queues};
use crate::protocol::{SubmitAccepted, SubmitRequest, WireError};
use crate::state::TaskState;
use crate::task::{Limits, TaskMeta};
use async_nats::jetstream;
use ax_core::atomic::GroupCommit;

/// What a direct-submitting client holds: its JetStream context, the queues it has seen
/// declared, and the bounds it validates with.
#[derive(Debug)]
pub(crate) struct Direct {
    nats: async_nats::Client,
    /// Made at the first submit: a JetStream context spawns a task, so it needs the
    /// runtime a submit runs on (the client may be built outside one, as Python does).
    js: std::sync::OnceLock<jetstream::Context>,
    /// Started at the first submit, for the same reason.
    groups: std::sync::OnceLock<admit::Groups>,
    queues: Queues,
    limits: Limits,
}

impl Direct {
    pub(crate) fn new(nats: async_nats::Client) -> Direct {
        Direct {
            nats,
            js: std::sync::OnceLock::new(),
            groups: std::sync::OnceLock::new(),
            queues: Queues::new(&[]),
            limits: Limits::default(),
        }
    }

    /// True if this task is submitted directly (it has no idempotency key, is not
    /// debounced and joins no batch key: the server keeps those).
    pub(crate) fn takes(req: &SubmitRequest) -> bool {
        req.idempotency_key.is_none() && req.debounce.is_none() && req.batch.is_none()
    }

    /// Validates, checks the queue is declared, publishes; answers when the broker has
    /// stored the message.
    pub(crate) async fn submit(
        &self,
        queue: &str,
        req: SubmitRequest,
    ) -> Result<SubmitAccepted, WireError> {
        let (meta, payload) = TaskMeta::from_request(queue, req, &self.limits)?;
        let meta = admit::unrecorded(meta);
        debug_assert!(meta.unrecorded, "a task without a key is stored unrecorded");
        let js = self.js.get_or_init(|| jetstream::new(self.nats.clone()));
        self.queues.check(js, queue).await?;
        let groups = self.groups.get_or_init(|| {
            admit::Groups::start(js, GroupCommit::Auto, &ax_core::faults::Faults::default())
        });
        groups.store(js, &meta, payload).await?;
        Ok(SubmitAccepted {
            state: if meta.run_at_ms.is_some() {
                TaskState::Scheduled
            } else {
                TaskState::Pending
            },
            id: meta.id,
            duplicate: false,
        })
    }
}
