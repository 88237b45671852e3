//! The entry of every single submit request (`ax.submit.<queue>`): decoded and checked,
//! counted against a rate limit that drops its excess, then admitted as a singleton
//! (`singleton`: claiming its key first) or as any other submit (`submit`).

use crate::ops::actions::Ops;
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
    ops.ctx.drops.check(&meta).await?;
    match window {
        // Boxed: the rarer paths' futures are large, and kept inline they would make every
        // submit's future that large, moved into its box per request (callgrind: ~10,000
        // instructions of memcpy a submit; docs/PERFORMANCE.md).
        Some(Window::Singleton(s)) => {
            Box::pin(crate::singleton::submit_singleton(ops, &s, meta, payload)).await
        }
        window => ops.ctx.submit_decoded(meta, payload, window).await,
    }
}
