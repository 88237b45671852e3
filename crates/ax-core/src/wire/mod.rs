//! The wire layer: what the protocol carries (docs/PROTOCOL.md) — names of subjects,
//! streams and buckets, times, error codes, the submit request and reply, a task's
//! message and headers, its record and output, backoff. Serde and pure functions only:
//! no awaits, no I/O, and nothing here names a module above it (`.ci/layers`).

pub mod backoff;
pub mod batching;
pub mod debounce;
pub mod error;
pub mod event;
pub mod fair;
pub mod names;
pub mod output;
pub mod protocol;
pub mod record;
pub mod singleton;
pub mod task;
pub mod time;
