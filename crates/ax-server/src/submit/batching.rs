//! Items of a batch key (`ax_core::batching`): the open batch of a key is the last message
//! of its delayed subject, its payload the list so far. A round reads it and replaces it
//! with a publish expecting its sequence (the list with the round's items appended); a
//! lost race (another server, or the dispatcher closing the batch) reads again. An item is
//! answered once the list holding it is stored.
//!
//! Items of one key that reach this server together are written together: each key has a
//! lane, and whoever holds the lane's writer takes every item waiting and writes them in
//! one round (one write per batch they fill), so a hot key costs a write per round rather
//! than per item, and this server's items never race each other. A round starts from what
//! the lane stored last instead of a read; if another writer went first, its expectation
//! fails and it reads. Replaced messages are deleted after the round is answered.

use super::debounce::window_headers;
use super::lanes::{Last, Waiting};
use crate::context::Context;
use async_nats::jetstream::stream::DirectGetErrorKind;
use async_nats::HeaderMap;
use ax_core::admit::{delete_delayed, publish_expecting, Expected};
use ax_core::batching::{self, Batching};
use ax_core::debounce;
use ax_core::names::DELAYED_STREAM;
use ax_core::protocol::{ErrorCode, SubmitAccepted, WireError};
use ax_core::task::{header, TaskMeta};
use ax_core::time::now_ms;
use bytes::Bytes;
use std::collections::VecDeque;
use tokio::sync::oneshot;
use tracing::debug;

/// Reads and conditional publishes one round tries before its items are answered
/// `unavailable` (each lost race means another writer of the key made progress).
const MAX_TRIES: usize = 64;

/// The batch a round is filling: the key's open batch, or one it opened.
struct Filling {
    headers: HeaderMap,
    list: Bytes,
    id: String,
    count: usize,
    /// The stored message this one replaces (deleted once it is stored).
    replaces: Option<u64>,
    /// Items in `list` not stored yet.
    items: Vec<Waiting>,
    /// Items whose idempotency key an item of `items` has (retries of one submit that
    /// met in one round): answered as duplicates once `list` is stored.
    dups: Vec<Waiting>,
    /// Full (or its list at the largest payload): stored closed, after the keys of its
    /// items are written if it has any (`close_keyed`).
    closed: bool,
}

impl Context {
    /// Admits one item of batch key `b`: appended to the key's open batch (closed at once
    /// if it fills it) or the first of a new batch. Answers the batch's task id.
    pub(crate) async fn submit_batched(
        &self,
        meta: TaskMeta,
        item: Bytes,
        b: Batching,
    ) -> Result<SubmitAccepted, WireError> {
        self.queues.check(&self.js, &meta.queue).await?;
        let subject = b.subject(&meta.queue);
        let (answer, answered) = oneshot::channel();
        let lane = self.lanes.lane(&subject);
        lane.waiting.lock().unwrap().push(Waiting {
            meta,
            item,
            b,
            answer,
        });
        let replaced = {
            let mut writing = lane.writer.lock().await;
            let items = std::mem::take(&mut *lane.waiting.lock().unwrap());
            match items.is_empty() {
                true => Vec::new(),
                false => self.write_round(&subject, items.into(), &mut writing).await,
            }
        };
        self.lanes.release(&subject, lane);
        // After the round (its items are answered): a message left behind is dropped by
        // the dispatcher when due (its close expects its sequence, no longer the last).
        futures::future::join_all(replaced.into_iter().map(|seq| async move {
            if let Err(e) = delete_delayed(&self.js, seq).await {
                debug!(seq, cause = %e, "replaced batch message not deleted; dropped when due");
            }
        }))
        .await;
        answered
            .await
            .unwrap_or_else(|_| Err(WireError::unavailable("the batch round ended unanswered")))
    }

    /// Writes `items` (in order) to the key's subject, answering each; `known` is what
    /// the lane last stored. Returns the sequences of the messages it replaced.
    async fn write_round(
        &self,
        subject: &str,
        mut items: VecDeque<Waiting>,
        known: &mut Option<Last>,
    ) -> Vec<u64> {
        let mut replaced = Vec::new();
        let stream = match self.js.get_stream_no_info(DELAYED_STREAM).await {
            Ok(s) => s,
            Err(e) => {
                answer_all(items, &WireError::unavailable(e));
                return replaced;
            }
        };
        for tries in 0..MAX_TRIES {
            if items.is_empty() {
                return replaced;
            }
            if tries >= 4 {
                tokio::time::sleep(std::time::Duration::from_millis(5 * tries as u64)).await;
            }
            let last = match known.take() {
                Some(last) => Some(last),
                None => match stream.direct_get_last_for_subject(subject).await {
                    Ok(msg) => Some(Last {
                        seq: msg.sequence,
                        headers: msg.headers,
                        list: msg.payload,
                    }),
                    Err(e) if e.kind() == DirectGetErrorKind::NotFound => None,
                    Err(e) => {
                        let e = WireError::unavailable(format!("{subject}: {e}"));
                        answer_all(items, &e);
                        return replaced;
                    }
                },
            };
            let mut expect = last.as_ref().map_or(0, |m| m.seq);
            let mut filling = match last.filter(|m| debounce::is_open(&m.headers)) {
                Some(open) => match Filling::of_open(open) {
                    Some(f) => Some(f),
                    None => {
                        let e = WireError::unavailable(format!(
                            "{subject}: the open batch's message has no task id, count or list"
                        ));
                        answer_all(items, &e);
                        return replaced;
                    }
                },
                None => None,
            };
            if items.iter().any(|w| w.meta.idempotency_key.is_some()) {
                let open = filling.as_ref().map(|f| (f.id.as_str(), &f.headers));
                items = self.answer_duplicates(items, open).await;
            }
            // Fill and store batches until the items run out or a write loses a race.
            loop {
                let Some(f) = filling.as_mut() else {
                    let Some(w) = items.pop_front() else { break };
                    filling = Some(Filling::open(w));
                    continue;
                };
                let full = f.closed;
                if !full {
                    if let Some(w) = items.pop_front() {
                        if let Some(w) = f.take(w, self.limits.max_payload_bytes) {
                            items.push_front(w); // the batch closed full: for the next
                        }
                        continue;
                    }
                }
                // Closed, or no item left: store it.
                let f = filling.take().expect("filling");
                let unchanged = f.items.is_empty() && f.dups.is_empty() && f.replaces.is_some();
                if unchanged && !f.closed {
                    break; // the open batch as it was: nothing to write
                }
                // A batch with item keys closes in two writes, its keys written between
                // them: first its items (open), so that no key names a batch that does
                // not hold its item.
                let keyed = f.headers.get(batching::KEYS).is_some();
                let mut headers = f.headers.clone();
                if f.closed && !keyed {
                    close(&mut headers);
                }
                let stored = match unchanged {
                    true => Ok(Expected::Stored(expect)), // stored as it is: close it
                    false => {
                        let (subject, list) = (subject.to_string(), f.list.clone());
                        publish_expecting(&self.js, subject, headers.clone(), expect, list).await
                    }
                };
                match stored {
                    Ok(Expected::Stored(seq)) => {
                        if !unchanged {
                            replaced.extend(f.replaces);
                        }
                        let stored = Last {
                            seq,
                            headers,
                            list: f.list,
                        };
                        f.items.into_iter().for_each(|w| w.accepted(&f.id, false));
                        f.dups.into_iter().for_each(|w| w.accepted(&f.id, true));
                        if keyed {
                            // Items left whose key this batch holds: not for the next.
                            let held = stored.headers.get(batching::KEYS).map(|v| v.to_string());
                            let holds = |w: &Waiting| {
                                (w.key_hex())
                                    .is_some_and(|h| batching::holds_key(held.as_deref(), &h))
                            };
                            let (dups, rest): (VecDeque<Waiting>, VecDeque<Waiting>) =
                                std::mem::take(&mut items).into_iter().partition(holds);
                            items = rest;
                            dups.into_iter().for_each(|w| w.accepted(&f.id, true));
                        }
                        expect = seq;
                        if !(f.closed && keyed) {
                            *known = Some(stored);
                            continue;
                        }
                        match self.close_keyed(subject, &f.id, stored).await {
                            Ok(Some(closed)) => {
                                replaced.push(seq);
                                expect = closed.seq;
                                *known = Some(closed);
                            }
                            // Written after it by another writer (who closes it, or the
                            // dispatcher does at its timeout): the rest from a fresh read.
                            Ok(None) => {
                                *known = None;
                                break;
                            }
                            Err(e) => {
                                *known = None;
                                answer_all(items, &e);
                                return replaced;
                            }
                        }
                    }
                    Ok(Expected::MovedOn | Expected::InFlight) => {
                        // Another writer went first (or its write is in flight): its items
                        // again, from a fresh read.
                        *known = None;
                        for w in f.items.into_iter().chain(f.dups).rev() {
                            items.push_front(w);
                        }
                        break;
                    }
                    Err(e) => {
                        *known = None;
                        answer_all(f.items.into(), &e);
                        answer_all(f.dups.into(), &e);
                        answer_all(items, &e);
                        return replaced;
                    }
                }
            }
        }
        let e = WireError::new(
            ErrorCode::Unavailable,
            "batch key too contended to take the item; retry",
        );
        answer_all(items, &e);
        replaced
    }
}

impl Filling {
    /// The key's open batch as stored (`None` if its message lacks a part).
    fn of_open(open: Last) -> Option<Filling> {
        let h = &open.headers;
        let id = h.get(header::ID)?.to_string();
        let count = h.get(batching::COUNT)?.as_str().parse::<usize>().ok()?;
        batching::append(&open.list, b"0")?; // a list this module can append to
        Some(Filling {
            headers: open.headers.clone(),
            list: open.list,
            id,
            count,
            replaces: Some(open.seq),
            items: Vec::new(),
            dups: Vec::new(),
            closed: false,
        })
    }

    /// A new batch holding item `w`.
    fn open(w: Waiting) -> Filling {
        let id = w.b.batch_id(&w.meta.queue);
        let until = w.b.until(now_ms());
        // The batch's task has no idempotency key of its own: its items' are listed.
        let meta = TaskMeta {
            idempotency_key: None,
            ..w.meta.clone()
        };
        let mut headers = window_headers(&meta, &id, until, until, &w.b.key);
        headers.insert(batching::COUNT, "1");
        if let Some(hex) = w.key_hex() {
            headers.insert(batching::KEYS, hex.as_str());
        }
        Filling {
            headers,
            list: batching::first(&w.item),
            id,
            count: 1,
            replaces: None,
            closed: w.b.size == 1,
            items: vec![w],
            dups: Vec::new(),
        }
    }

    /// Appends `w`, closing the batch when it reaches `w`'s size, or answers its refusal.
    /// Gives `w` back when the list would outgrow `max_bytes`: then this batch is closed
    /// as it is, and `w` goes to the next.
    fn take(&mut self, w: Waiting, max_bytes: usize) -> Option<Waiting> {
        if let Some(name) = self.headers.get(header::NAME) {
            if name.as_str() != w.meta.name {
                let e = WireError::field(
                    "batch.key",
                    format!(
                        "this key's open batch is of task {name}: one key batches one task name"
                    ),
                );
                w.answer(Err(e));
                return None;
            }
        }
        if self.count >= w.b.size {
            // Stored full and still open (its keys' write failed): closed as it is.
            self.closed = true;
            return Some(w);
        }
        let held = self.headers.get(batching::KEYS).map(|v| v.to_string());
        let hex = w.key_hex();
        if let Some(hex) = &hex {
            if batching::holds_key(held.as_deref(), hex) {
                self.dups.push(w); // an item of this round has its key
                return None;
            }
        }
        let list = batching::append(&self.list, &w.item).expect("checked when opened");
        let keys = hex.map(|hex| batching::with_key(held.as_deref(), &hex));
        if list.len() + keys.as_ref().map_or(0, String::len) > max_bytes {
            self.closed = true;
            return Some(w);
        }
        self.list = list;
        self.count += 1;
        self.headers
            .insert(batching::COUNT, self.count.to_string().as_str());
        if let Some(keys) = keys {
            self.headers.insert(batching::KEYS, keys.as_str());
        }
        if self.count >= w.b.size {
            self.closed = true;
        }
        self.items.push(w);
        None
    }
}

fn answer_all(items: VecDeque<Waiting>, e: &WireError) {
    for w in items {
        w.answer(Err(e.clone()));
    }
}

/// Marks a batch's headers closed: due now, dispatched as any due task.
pub(super) fn close(headers: &mut HeaderMap) {
    headers.insert(debounce::FIRED, "1");
    headers.insert(header::RUN_AT_MS, now_ms().to_string().as_str());
}
