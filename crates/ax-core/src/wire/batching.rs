//! Batching (docs/PROTOCOL.md §2, "Batching"): the submits (*items*) of one batch key in
//! one queue become one task whose payload is the JSON list of their payloads, in the order
//! they were stored, due once `size` items arrived or `timeout` after the batch's first.
//!
//! A batch is held as a debounce window is (the `debounce` module): the last message of the
//! delayed subject of its base id `<queue>.=b.<key in hex>` is a delayed task
//! `<base id>.<nuid>` whose payload is the list so far, with `Ax-Debounce-Until-Ms` (its due
//! time: the first item's time plus `timeout`), `Ax-Debounce-Key` and `Ax-Batch-Count`. An
//! item replaces it with a publish that expects its sequence, so items serialize on the
//! broker and none is held twice or lost; the item that fills the batch (or would make its
//! list longer than the largest payload) stores it closed (`Ax-Debounce-Fired`, due now).
//! The dispatcher closes a batch that times out as it closes a debounce window. The
//! batch's task has the name and options of its first item.

use crate::error::WireError;
use crate::names::{self, Priority};
use crate::protocol::BatchRequest;
use bytes::{BufMut, Bytes, BytesMut};
use std::time::Duration;

/// Header of a batch's message: how many items its list holds.
pub const COUNT: &str = "Ax-Batch-Count";
/// Header of a batch's message: the idempotency keys of its items that had one, each as
/// its bytes in lowercase hex, separated by commas (absent while no item had a key).
pub const KEYS: &str = "Ax-Batch-Keys";
/// The id token after the queue that marks a batch's task id.
pub(crate) const MARK: &str = "=b";
/// Most items in one batch.
pub const MAX_SIZE: i64 = 10_000;
/// Longest batch key (its hex form is part of task ids of at most 255 bytes), as a
/// debounce key's.
pub const MAX_KEY: usize = 64;
/// Longest timeout: 7 days, as a debounce period's.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);

/// A validated batch key, size and timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batching {
    /// The key (1..=64 of `A-Z a-z 0-9 _ - . : @`).
    pub key: String,
    /// Items per task at most (1..=10,000): the batch is due once this many arrived.
    pub size: usize,
    /// Longest time from a batch's first item to its run.
    pub timeout: Duration,
}

impl Batching {
    /// Checks a request's `batch` object.
    pub fn from_request(req: &BatchRequest) -> Result<Batching, WireError> {
        if req.key.len() > MAX_KEY || !crate::task::valid_limit_key(&req.key) {
            return Err(WireError::field(
                "batch.key",
                "must be 1..=64 of A-Z a-z 0-9 _ - . : @",
            ));
        }
        if !(1..=MAX_SIZE).contains(&req.size) {
            return Err(WireError::field("batch.size", "must be 1 to 10000"));
        }
        let most = MAX_TIMEOUT.as_millis();
        if req.timeout_ms < 1 || req.timeout_ms as u128 > most {
            return Err(WireError::field(
                "batch.timeout_ms",
                "must be 1 ms to 7 days (604800000 ms)",
            ));
        }
        Ok(Batching {
            key: req.key.clone(),
            size: req.size as usize,
            timeout: Duration::from_millis(req.timeout_ms as u64),
        })
    }

    /// The base id of this key's batches in `queue`: `<queue>.=b.<key's bytes in hex>`.
    pub fn base_id(&self, queue: &str) -> String {
        window_base_id(queue, MARK, &self.key)
    }

    /// The subject of this key's open batch in `queue`.
    pub fn subject(&self, queue: &str) -> String {
        window_subject(queue, &self.base_id(queue))
    }

    /// A new batch's task id.
    pub fn batch_id(&self, queue: &str) -> String {
        format!("{}.{}", self.base_id(queue), nuid::next())
    }

    /// The due time of a batch whose first item came at `now_ms`.
    pub fn until(&self, now_ms: u64) -> u64 {
        now_ms.saturating_add(self.timeout.as_millis() as u64)
    }
}

/// The base id of a window (a batch's, or a debounce window's) of `key` in `queue`:
/// `<queue>.<mark>.<key's bytes in lowercase hex>`.
pub(crate) fn window_base_id(queue: &str, mark: &str, key: &str) -> String {
    format!("{queue}.{mark}.{}", names::hex_token(key))
}

/// The subject of the window of base id `base` in `queue`: its delayed subject, under the
/// priority token `normal` whatever the task's priority.
pub(crate) fn window_subject(queue: &str, base: &str) -> String {
    names::delayed_subject(queue, Priority::Normal, base)
}

/// The list of a new batch: `[item]`.
pub fn first(item: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(item.len() + 2);
    out.put_u8(b'[');
    out.put_slice(item);
    out.put_u8(b']');
    out.freeze()
}

/// `list` (a JSON array this module wrote, never empty) with `item` (one JSON value)
/// appended, or `None` if `list` is not such an array.
pub fn append(list: &[u8], item: &[u8]) -> Option<Bytes> {
    let body = list.strip_prefix(b"[")?.strip_suffix(b"]")?;
    let mut out = BytesMut::with_capacity(list.len() + item.len() + 1);
    out.put_u8(b'[');
    out.put_slice(body);
    out.put_u8(b',');
    out.put_slice(item);
    out.put_u8(b']');
    Some(out.freeze())
}

/// The item keys a batch's `Ax-Batch-Keys` value lists (hex tokens; empty if none).
pub fn keys_of(value: Option<&str>) -> impl Iterator<Item = &str> {
    value.unwrap_or("").split(',').filter(|k| !k.is_empty())
}

/// True if the `Ax-Batch-Keys` value lists the item key whose hex token is `hex`.
pub fn holds_key(value: Option<&str>, hex: &str) -> bool {
    keys_of(value).any(|k| k == hex)
}

/// The `Ax-Batch-Keys` value with `hex` (an item key's hex token) added.
pub fn with_key(value: Option<&str>, hex: &str) -> String {
    match value.filter(|v| !v.is_empty()) {
        Some(v) => format!("{v},{hex}"),
        None => hex.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn item_keys_are_listed_in_hex_and_found_again() {
        let a = names::hex_token("order 1, eu");
        let b = names::hex_token("o-2");
        let v = with_key(None, &a);
        let v = with_key(Some(&v), &b);
        assert_eq!(
            keys_of(Some(&v)).collect::<Vec<_>>(),
            vec![a.as_str(), b.as_str()]
        );
        assert!(holds_key(Some(&v), &a) && holds_key(Some(&v), &b));
        assert!(!holds_key(Some(&v), &names::hex_token("o-")));
        assert!(!holds_key(None, &a));
        assert_eq!(keys_of(Some("")).count(), 0);
    }

    fn req(key: &str, size: i64, timeout_ms: i64) -> BatchRequest {
        BatchRequest {
            key: key.into(),
            size,
            timeout_ms,
        }
    }

    #[test]
    fn a_batch_is_checked() {
        let b = Batching::from_request(&req("invoices", 500, 2000)).unwrap();
        assert_eq!((b.size, b.timeout), (500, Duration::from_secs(2)));
        for bad in [
            req("", 1, 1),
            req("a b", 1, 1),
            req("k", 0, 1),
            req("k", MAX_SIZE + 1, 1),
            req("k", 1, 0),
            req("k", 1, i64::MAX),
            req("k", -1, 1),
        ] {
            assert!(Batching::from_request(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_batch_id_names_its_subject_and_lists_grow_in_order() {
        let b = Batching::from_request(&req("a:b", 2, 10)).unwrap();
        let id = b.batch_id("q");
        assert!(id.starts_with("q.=b.613a62."), "{id}");
        assert_eq!(names::queue_of_task_id(&id), Some("q"));
        let list = first(b"{\"n\":1}");
        let list = append(&list, b"null").unwrap();
        let list = append(&list, b"[2]").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&list).unwrap();
        assert_eq!(v, serde_json::json!([{"n": 1}, null, [2]]));
        assert_eq!(append(b"{}", b"1"), None);
    }
}
