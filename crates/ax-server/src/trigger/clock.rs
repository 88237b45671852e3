//! The one time authority for "is it due", injectable for tests.

use std::sync::atomic::{AtomicI64, Ordering};

/// Wall-clock time in ms since the Unix epoch.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Now.
    fn now_ms(&self) -> u64;
}

/// The system clock, shifted by an adjustable offset (0 in production). Tests step it to
/// simulate NTP corrections.
#[derive(Debug, Default)]
pub struct SystemClock {
    offset_ms: AtomicI64,
}

impl SystemClock {
    /// Shifts the clock by `ms` (negative: back).
    pub fn step(&self, ms: i64) {
        self.offset_ms.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        let now = ax_core::time::now_ms() as i64 + self.offset_ms.load(Ordering::SeqCst);
        now.max(0) as u64
    }
}
