//! Idempotency keys of batch items (docs/PROTOCOL.md §2, "Batching", "Item keys"): an
//! item whose key a batch holds is answered as that batch's duplicate and stores nothing.
//! A batch's item keys are listed in its open message (`Ax-Batch-Keys`) and created in
//! `AX_IDEMPOTENCY`, each naming the batch, before it is closed: by the item that fills it
//! (`close_keyed`, between the batch stored open and stored closed) or by the dispatcher
//! at its timeout (`schedule::window::close`). So a key names only a batch that holds its
//! item, and a batch closed before an item's round read its key is found there.

use super::lanes::{Last, Waiting};
use crate::context::Context;
use async_nats::jetstream::kv;
use async_nats::HeaderMap;
use ax_core::admit::{publish_expecting, Expected};
use ax_core::batching;
use ax_core::idempotency::KeyValue;
use ax_core::protocol::WireError;
use ax_core::state::TaskState;
use std::collections::VecDeque;

impl Context {
    /// Answers the items whose idempotency key a batch already holds as duplicates of it,
    /// and gives back the others: the key is in `open` (the key's open batch, as just
    /// read or last stored), or `AX_IDEMPOTENCY` names a task for it, read from the
    /// stream's leader after the open batch was (a batch's keys are written there before
    /// it is closed, so one closed before this read is found). An item whose key cannot
    /// be read is answered `unavailable`.
    pub(super) async fn answer_duplicates(
        &self,
        items: VecDeque<Waiting>,
        open: Option<(&str, &HeaderMap)>,
    ) -> VecDeque<Waiting> {
        let held = open.and_then(|(_, h)| h.get(batching::KEYS).map(|v| v.to_string()));
        let checks = items.into_iter().map(|w| {
            let held = held.as_deref();
            async move {
                let Some(hex) = w.key_hex() else {
                    return Some(w);
                };
                if let (Some((id, _)), true) = (open, batching::holds_key(held, &hex)) {
                    w.accepted(id, true);
                    return None;
                }
                let kv_key = format!("{}.{hex}", w.meta.queue);
                match ax_core::kv_read::latest(&self.idempotency, &kv_key).await {
                    Ok(Some(entry)) if entry.operation == kv::Operation::Put => {
                        // A closed batch: recorded once a worker claimed it.
                        let named = KeyValue::parse(&entry.value).id;
                        let state = match self.tasks.get(&named).await {
                            Ok(Some((rec, _))) => rec.state,
                            _ => TaskState::Scheduled,
                        };
                        w.accepted_as(&named, true, state);
                        None
                    }
                    Ok(_) => Some(w),
                    Err(e) => {
                        let e = WireError::unavailable(format!("idempotency key {kv_key}: {e}"));
                        w.answer(Err(e));
                        None
                    }
                }
            }
        });
        let kept = futures::future::join_all(checks).await;
        kept.into_iter().flatten().collect()
    }

    /// Closes a batch just stored open (`stored`) whose items have keys: writes the keys,
    /// each naming the batch, then stores it closed expecting `stored`'s sequence.
    /// `Ok(None)`: another write came after it (its writer, or the dispatcher at the
    /// batch's timeout, closes it). An error leaves it open, full: the next item closes
    /// it (`Filling::take`), or the dispatcher at its timeout.
    pub(super) async fn close_keyed(
        &self,
        subject: &str,
        id: &str,
        stored: Last,
    ) -> Result<Option<Last>, WireError> {
        self.faults.pass(ax_core::faults::Abort::BeforeBatchKeys);
        let keys = stored.headers.get(batching::KEYS).map(|v| v.to_string());
        let queue = ax_core::names::queue_of_task_id(id).unwrap_or_default();
        let hex = batching::keys_of(keys.as_deref())
            .map(String::from)
            .collect();
        ax_core::idempotency::write_item_keys(&self.idempotency, queue, id, hex)
            .await
            .map_err(|e| WireError::unavailable(format!("a batch's item keys: {e}")))?;
        let mut headers = stored.headers;
        super::batching::close(&mut headers);
        let (subject, list) = (subject.to_string(), stored.list.clone());
        match publish_expecting(&self.js, subject, headers.clone(), stored.seq, list).await? {
            Expected::Stored(seq) => Ok(Some(Last {
                seq,
                headers,
                list: stored.list,
            })),
            Expected::MovedOn | Expected::InFlight => Ok(None),
        }
    }
}
