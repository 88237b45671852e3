//! Reads of a KV key that see every acknowledged write: from the bucket stream's leader.
//!
//! ax's buckets allow direct gets (`allow_direct`), and `kv::Store::entry` uses them: any
//! replica answers, with no read-after-write guarantee (nats-server #6557, #6947). On a
//! replicated bucket a replica may be behind the leader — by the moment a write takes to
//! reach it, or longer while it catches up after a restart — and then answers from its
//! older copy: a key created and acknowledged a moment ago reads as absent. A read followed by a compare-and-set is safe with that (the write is refused
//! and the reader reads again); a read whose answer alone decides something is not. The
//! flow leader loading a run it has just been told of, a trigger leader repairing its
//! fires and a worker polling the pause flag read here instead (`STREAM.MSG.GET`, answered
//! by the stream's leader). `tests/it/kv_read.rs` counts both kinds of reads on a
//! three-node cluster.

use async_nats::jetstream::kv::{self, Entry, Operation};
use async_nats::jetstream::stream::LastRawMessageErrorKind;

/// The latest entry of `key` in `kv` as the stream's leader has it (`None`: never written).
/// A deleted or purged key is answered as an entry with that operation, as
/// `kv::Store::entry` does.
pub async fn latest(kv: &kv::Store, key: &str) -> Result<Option<Entry>, async_nats::Error> {
    let subject = format!("{}{key}", kv.prefix);
    let msg = match kv.stream.get_last_raw_message_by_subject(&subject).await {
        Ok(msg) => msg,
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let header = |name: &str| msg.headers.get(name).map(|v| v.as_str().to_string());
    let operation = match (header("KV-Operation"), header("Nats-Marker-Reason")) {
        (Some(op), _) if op == "DEL" => Operation::Delete,
        (Some(op), _) if op == "PURGE" => Operation::Purge,
        (None, Some(reason)) if reason == "Remove" => Operation::Delete,
        (None, Some(_)) => Operation::Purge,
        _ => Operation::Put,
    };
    Ok(Some(Entry {
        bucket: kv.name.clone(),
        key: key.to_string(),
        value: msg.payload,
        revision: msg.sequence,
        delta: 0,
        created: msg.time,
        operation,
        seen_current: false,
    }))
}
