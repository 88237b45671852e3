//! The limits API: `ax.limit.<op>` requests served by `ax server` (PROTOCOL.md §7). The
//! limits themselves, and the gate every worker applies, live in `ax_sdk::limits`.

pub(crate) mod api;
pub(crate) mod drops;
mod windows;

pub use ax_sdk::limits::*;
