//! The entry of every single submit request (`ax.submit.<queue>`): decoded and checked,
//! counted against a rate limit that drops its excess, then admitted as a singleton
//! (`singleton`: claiming its key first) or as any other submit (`submit`).

use crate::ops::actions::Ops;
use crate::submit::unrecorded;
use ax_core::debounce::Window;
use ax_core::protocol::{SubmitAccepted, WireError};

/// Handles one submit request for `queue` (any kind: one over a rate limit that drops its
/// excess is refused; one with a singleton key claims it).
pub(crate) async fn submit(
    ops: &Ops,
    queue: &str,
    body: &[u8],
) -> Result<SubmitAccepted, WireError> {
    let (meta, payload, window) = ax_core::debounce::decode_submit(queue, body, &ops.ctx.limits)?;
    // Boxed, as are the rarer paths below: their futures are large, and kept inline they
    // would make every submit's future that large, moved into its box per request
    // (callgrind: thousands of instructions of memcpy a submit; docs/PERFORMANCE.md).
    if ops.ctx.drops.may_apply(&meta) {
        Box::pin(ops.ctx.drops.check(&meta)).await?;
    }
    match window {
        None => ops.ctx.submit_prepared(unrecorded(meta), payload).await,
        Some(Window::Singleton(s)) => {
            Box::pin(crate::singleton::submit_singleton(ops, &s, meta, payload)).await
        }
        Some(window) => Box::pin(ops.ctx.submit_window(meta, payload, window)).await,
    }
}
