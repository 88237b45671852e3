//! The group commits a submitter stores unrecorded tasks through: an ax server's submit
//! path and a client that submits directly share them, so the messages of both are stored
//! the same way (docs/ARCHITECTURE.md, "Group commit").

use super::{first_headers, is_stored_already, refusal, stored_delayed_seq};
use crate::atomic::{GroupCommit, Grouped, Outgoing};
use crate::faults::Faults;
use crate::names::{Priority, DELAYED_STREAM, FAIR_STREAM};
use crate::protocol::WireError;
use crate::task::TaskMeta;
use async_nats::jetstream;
use bytes::Bytes;

/// One [`Grouped`] per ready stream (by priority index), one for `AX_DELAYED` and one for
/// `AX_FAIR` (an atomic batch is stored by one stream). The delayed one holds at most one message per
/// subject in a group: a delayed task is stored create-if-absent on its own subject.
#[derive(Debug, Clone)]
pub struct Groups {
    ready: [Grouped; 3],
    delayed: Grouped,
    fair: Grouped,
}

impl Groups {
    /// Starts the lanes (on the current tokio runtime); they end when every clone is
    /// dropped.
    pub fn start(js: &jetstream::Context, mode: GroupCommit, faults: &Faults) -> Groups {
        let start = |stream: &str, distinct: bool| {
            Grouped::start_with_faults(js.clone(), mode, stream, distinct, faults.clone())
        };
        Groups {
            ready: Priority::ALL.map(|p| start(&p.ready_stream(), false)),
            delayed: start(DELAYED_STREAM, true),
            fair: start(FAIR_STREAM, false),
        }
    }

    /// Stores a task's first message (headers: [`first_headers`]) with the other
    /// messages of the moment; answers its stream sequence. A full subject is `busy`; a
    /// delayed task found stored already (its group was stored but not answered, and the
    /// fallback's create-if-absent found it) answers the sequence it is stored under.
    pub async fn store(
        &self,
        js: &jetstream::Context,
        meta: &TaskMeta,
        payload: Bytes,
    ) -> Result<u64, WireError> {
        let msg = Outgoing {
            subject: super::subject(meta),
            headers: first_headers(meta),
            payload,
        };
        let subject = msg.subject.clone();
        let group = match (meta.run_at_ms, &meta.fair_key) {
            (Some(_), _) => &self.delayed,
            (None, Some(_)) => &self.fair,
            (None, None) => &self.ready[meta.priority.index()],
        };
        match group.publish(msg).await {
            Ok(seq) => Ok(seq),
            Err(e) if meta.run_at_ms.is_some() && is_stored_already(&e) => {
                // Boxed: rare, and inline it would double every submit's future.
                Box::pin(stored_delayed_seq(js, &subject)).await
            }
            Err(e) => Err(refusal(&subject, &e)),
        }
    }

    /// Publishes a stored task message as it is to its ready subject of `priority` (the
    /// fair dispatcher releasing a held task) with the other messages of the moment,
    /// `Nats-Msg-Id` = `id`; answers its ready sequence. A full subject is `busy`.
    pub async fn release(
        &self,
        priority: Priority,
        subject: String,
        headers: async_nats::HeaderMap,
        id: &str,
        payload: Bytes,
    ) -> Result<u64, WireError> {
        let mut headers = crate::atomic::without_publish_headers(headers);
        headers.insert("Nats-Msg-Id", id);
        let msg = Outgoing {
            subject: subject.clone(),
            headers,
            payload,
        };
        self.ready[priority.index()]
            .publish(msg)
            .await
            .map_err(|e| refusal(&subject, &e))
    }
}
