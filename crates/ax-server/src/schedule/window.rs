//! Debounce windows and batches in `AX_DELAYED` (`ax_core::debounce`, `ax_core::batching`):
//! closing a due window, and retiring a closed window's fired copy once it is dispatched.

use super::outcome::Outcome;
use async_nats::jetstream::{self, stream};
use ax_core::admit::{delete_delayed, publish_expecting, Expected};
use ax_core::faults::Faults;
use ax_core::protocol::WireError;
use ax_core::task::header;
use ax_core::time::now_ms;
use ax_core::{batching, debounce};
use tracing::{debug, warn};

/// Deletes a dispatched fired copy (`seq`) and every *open* message below it on its
/// window's subject: such a message was replaced (a later submit's, or the close's copy)
/// and only its delete was lost; left there it would become the subject's last once the
/// copy is gone, and a submit would join a window that already ran. Older *fired* copies
/// are left alone: they are earlier windows of the key still to be dispatched (a ready
/// subject refused them for now), and removing them lost their tasks (an R3 campaign
/// seed: two windows of one key parked during a node restart, the newer dispatched
/// first). The walk reads the subject's messages from its first (`next_by_subject`): one
/// read when the copy is the subject's only message, as it nearly always is.
pub(super) async fn retire(
    js: &jetstream::Context,
    stream: &stream::Stream,
    window: &str,
    seq: u64,
) -> Result<(), String> {
    let mut from = 1;
    while from < seq {
        let msg = match stream.direct_get_next_for_subject(window, Some(from)).await {
            Ok(msg) => msg,
            Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => break,
            Err(e) => return Err(e.to_string()),
        };
        if msg.sequence >= seq {
            break;
        }
        if debounce::is_open(&msg.headers) {
            delete_delayed(js, msg.sequence).await?;
        }
        from = msg.sequence + 1;
    }
    delete_delayed(js, seq).await
}

/// True if `subject`'s last message in `AX_DELAYED` is known to be a later one than `seq`
/// (false when it cannot be read: the caller then does what a last message needs).
async fn replaced_version(js: &jetstream::Context, subject: &str, seq: u64) -> bool {
    let Ok(stream) = js.get_stream_no_info(ax_core::names::DELAYED_STREAM).await else {
        return false;
    };
    match stream.direct_get_last_for_subject(subject).await {
        Ok(last) => last.sequence > seq,
        Err(_) => false,
    }
}

/// Closes a debounce window that is due (`ax_core::debounce`): stores its copy marked
/// fired and due now, only if the window is still its subject's last message, then
/// deletes the window's message. The copy is dispatched as any due task when the index
/// reads it; a window a later submit replaced is only deleted (that submit's message is
/// the window now). Killed between the two writes, the window's message is re-indexed
/// and its close, expecting a sequence that is no longer the last, deletes it. A batch
/// whose items had idempotency keys (`Ax-Batch-Keys`) has them written to
/// `idempotency` first, each naming the batch; if that fails, the close is retried.
pub(super) async fn close(
    js: &jetstream::Context,
    idempotency: &jetstream::kv::Store,
    seq: u64,
    due: u64,
    mut headers: async_nats::HeaderMap,
    payload: bytes::Bytes,
    faults: &Faults,
) -> Outcome {
    let subject = headers
        .get(header::ID)
        .and_then(|id| debounce::window_subject_of(id.as_str()));
    let Some(subject) = subject else {
        warn!(
            seq,
            "debounce window without a debounced task id; left in place"
        );
        return Outcome::Bad;
    };
    let keys = headers.get(batching::KEYS).map(|v| v.to_string());
    let id = headers
        .get(header::ID)
        .map(|v| v.to_string())
        .unwrap_or_default();
    let queue = ax_core::names::queue_of_task_id(&id).unwrap_or_default();
    // A version of the batch a later item replaced (its delete still to come) is dropped
    // by the close below, which expects its sequence: its keys are the later one's to write.
    let replaced = match keys {
        Some(_) => replaced_version(js, &subject, seq).await,
        None => false,
    };
    if let Some(keys) = keys.as_deref().filter(|_| !replaced) {
        let hex = batching::keys_of(Some(keys)).map(String::from).collect();
        if let Err(e) = ax_core::idempotency::write_item_keys(idempotency, queue, &id, hex).await {
            debug!(seq, cause = %e, "a batch's item keys not written; its close retried");
            return Outcome::Refused {
                group: "(debounce)".into(),
                due,
                seq,
                body: None,
            };
        }
    }
    headers.insert(debounce::FIRED, "1");
    headers.insert(header::RUN_AT_MS, now_ms().to_string().as_str());
    let closed = match publish_expecting(js, subject, headers, seq, payload).await {
        // Another write to the window in flight (a submit joining it, on a replicated
        // stream): it may yet fail, and the window must not be dropped for it. Retried.
        Ok(Expected::InFlight) => Err(WireError::unavailable("a write to the window in flight")),
        closed => closed,
    };
    match closed {
        Ok(closed) => {
            match closed {
                Expected::Stored(_) => faults.pass(ax_core::faults::Abort::AfterClose),
                Expected::MovedOn | Expected::InFlight => {
                    debug!(seq, "debounce window replaced by a later submit; dropped")
                }
            }
            let deleted = if faults.window_delete_lost() {
                Err("lost (injected fault)".to_string())
            } else {
                delete_delayed(js, seq).await
            };
            if let Err(e) = deleted {
                debug!(seq, cause = %e, "closed debounce window not deleted; dropped when re-indexed");
            }
            Outcome::Gone
        }
        Err(e) => {
            debug!(seq, cause = %e.message, "debounce window not closed; retried");
            Outcome::Refused {
                group: "(debounce)".into(),
                due,
                seq,
                body: None,
            }
        }
    }
}
