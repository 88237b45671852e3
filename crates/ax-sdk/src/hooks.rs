//! Fault hooks for tests, compiled only with the `test-hooks` feature (`./dev test` turns
//! it on). Each hook aborts the process, like `kill -9`, at a precise line that a random
//! kill would rarely hit:
//!
//! - `AX_TEST_ABORT_AFTER_PUBLISH=N`: after the N-th accepted task message is stored and
//!   before its record is written (admission).
//! - `AX_TEST_ABORT_AFTER_DISPATCH=N`: after the N-th delayed task is published to its
//!   ready subject and before its delayed message is deleted.
//! - `AX_TEST_ABORT_AFTER_FIRE=N`: after the trigger engine's N-th scheduled fire is
//!   submitted and before the trigger's state records it.
//!
//! And some that widen a window instead: [`set_retry_gap_ms`] delays an operator's retry
//! between its message publish and its record write; `AX_TEST_CLAIM_DELAY_MS=N` makes
//! every claim of a worker process take N ms longer (a slow broker), past the lead its
//! rate tokens are taken with; [`panic_service`] makes a supervised service panic
//! mid-run and [`fail_service_starts`] makes its next starts fail (the supervisor must
//! start it again); [`panic_next_fire`] and [`panic_next_turn`] make a trigger's next fire
//! job or a flow run's next turn panic; `AX_TEST_PANIC_REQUEST=<marker>` makes every management request
//! whose body holds `<marker>` panic in its handler (the request path must answer
//! `unavailable` and count it); a message to [`PANIC_GROUP_SUBJECT`] makes the group
//! commit that carries it panic (its lane must go on); [`set_names_page_bytes`] makes the
//! pages of `ax.trigger.names` small, so that a test's few thousand names span many.

use std::sync::atomic::{AtomicU64, Ordering};

/// A message to this subject makes the group commit that carries it panic
/// ([`crate::atomic::Grouped`]).
pub const PANIC_GROUP_SUBJECT: &str = "ax.test.panic_group";
use std::sync::OnceLock;

fn trip(var: &'static str, cell: &'static OnceLock<u64>, count: &'static AtomicU64) {
    let limit = *cell.get_or_init(|| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    });
    if limit > 0 && count.fetch_add(1, Ordering::SeqCst) + 1 == limit {
        eprintln!("{var}={limit}: aborting here");
        std::process::abort();
    }
}

/// Between a task's message publish and its record write (admission).
pub fn after_publish() {
    static LIMIT: OnceLock<u64> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    trip("AX_TEST_ABORT_AFTER_PUBLISH", &LIMIT, &COUNT);
}

/// Between a delayed task's ready publish and its delete from `AX_DELAYED`.
pub fn after_dispatch() {
    static LIMIT: OnceLock<u64> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    trip("AX_TEST_ABORT_AFTER_DISPATCH", &LIMIT, &COUNT);
}

/// Between a scheduled fire's submit and its trigger-state write.
pub fn after_fire() {
    static LIMIT: OnceLock<u64> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    trip("AX_TEST_ABORT_AFTER_FIRE", &LIMIT, &COUNT);
}

/// After a claim (`AX_TEST_CLAIM_DELAY_MS`).
pub async fn slow_claim() {
    static MS: OnceLock<u64> = OnceLock::new();
    let ms = *MS.get_or_init(|| {
        std::env::var("AX_TEST_CLAIM_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    });
    if ms > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
}

/// Milliseconds an operator's retry waits between its message publish and its record
/// write (0: none); set by tests to widen that window.
static RETRY_GAP_MS: AtomicU64 = AtomicU64::new(0);

/// Sets the retry gap (tests only).
pub fn set_retry_gap_ms(ms: u64) {
    RETRY_GAP_MS.store(ms, Ordering::SeqCst);
}

static NAMES_PAGE_BYTES: AtomicU64 = AtomicU64::new(0);

/// Makes every `ax.trigger.names` page of this process hold at most `bytes` of names (0:
/// the server's own limit).
pub fn set_names_page_bytes(bytes: u64) {
    NAMES_PAGE_BYTES.store(bytes, Ordering::SeqCst);
}

/// The page size [`set_names_page_bytes`] set, if any.
pub fn names_page_bytes() -> Option<usize> {
    match NAMES_PAGE_BYTES.load(Ordering::SeqCst) {
        0 => None,
        n => Some(n as usize),
    }
}

/// Between a retry's message publish and its record write.
pub async fn retry_published() {
    let ms = RETRY_GAP_MS.load(Ordering::SeqCst);
    if ms > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
}

/// How a trigger-state write fails while [`fail_trigger_state_writes`] holds for its
/// trigger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateWriteFault {
    /// Not written; the writer gets a broker error (the broker was unreachable).
    Lost,
    /// Written, but the writer gets a broker error (the acknowledgement was lost).
    AckLost,
}

static STATE_WRITE_FAULTS: std::sync::Mutex<std::collections::BTreeMap<String, StateWriteFault>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Makes every write of trigger `trigger`'s state (`AX_TRIGGER_STATE`) by this process
/// fail with `fault` (`None`: stop failing). Scoped to one trigger name, so tests running
/// side by side in one process do not disturb each other.
pub fn fail_trigger_state_writes(trigger: &str, fault: Option<StateWriteFault>) {
    let mut faults = STATE_WRITE_FAULTS.lock().expect("not poisoned");
    match fault {
        Some(f) => faults.insert(trigger.to_string(), f),
        None => faults.remove(trigger),
    };
}

/// The fault set for writes of `trigger`'s state, if any.
pub fn trigger_state_write_fault(trigger: &str) -> Option<StateWriteFault> {
    STATE_WRITE_FAULTS
        .lock()
        .expect("not poisoned")
        .get(trigger)
        .copied()
}

static SERVICE_PANICS: std::sync::Mutex<std::collections::BTreeSet<(String, String)>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// Makes the running service `name` of the process or server with id `scope` panic once
/// (within 50 ms), as a bug inside it would.
pub fn panic_service(scope: &str, name: &str) {
    SERVICE_PANICS
        .lock()
        .expect("not poisoned")
        .insert((scope.to_string(), name.to_string()));
}

/// Returns when a test asked service `name` of `scope` to panic ([`panic_service`]).
pub async fn service_panic_requested(scope: &str, name: &str) {
    let key = (scope.to_string(), name.to_string());
    loop {
        if SERVICE_PANICS.lock().expect("not poisoned").remove(&key) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Makes the next fire job of trigger `trigger` (any server in this process) panic before
/// it fires.
pub fn panic_next_fire(trigger: &str) {
    SERVICE_PANICS
        .lock()
        .expect("not poisoned")
        .insert(("fire-job".to_string(), trigger.to_string()));
}

/// True (once) if a test asked the next fire job of `trigger` to panic.
pub fn take_fire_panic(trigger: &str) -> bool {
    SERVICE_PANICS
        .lock()
        .expect("not poisoned")
        .remove(&("fire-job".to_string(), trigger.to_string()))
}

/// Makes the next turn of flow run `run` (any server in this process) panic before it
/// reads or decides anything.
pub fn panic_next_turn(run: &str) {
    SERVICE_PANICS
        .lock()
        .expect("not poisoned")
        .insert(("flow-turn".to_string(), run.to_string()));
}

/// True (once) if a test asked the next turn of flow run `run` to panic.
pub fn take_turn_panic(run: &str) -> bool {
    SERVICE_PANICS
        .lock()
        .expect("not poisoned")
        .remove(&("flow-turn".to_string(), run.to_string()))
}

/// Makes the next `n` starts of service `name` of `scope` fail at once (as a bucket that
/// cannot be opened would).
pub fn fail_service_starts(scope: &str, name: &str, n: u32) {
    let mut set = SERVICE_PANICS.lock().expect("not poisoned");
    for k in 0..n {
        set.insert((format!("start-fails:{scope}:{k}"), name.to_string()));
    }
}

/// True (once per failure asked for) if this start of service `name` of `scope` must fail.
pub fn take_start_failure(scope: &str, name: &str) -> bool {
    let mut set = SERVICE_PANICS.lock().expect("not poisoned");
    let prefix = format!("start-fails:{scope}:");
    let found = set
        .iter()
        .find(|(s, n)| s.starts_with(&prefix) && n == name)
        .cloned();
    found.is_some_and(|key| set.remove(&key))
}

/// True if a management request with this body must panic (`AX_TEST_PANIC_REQUEST`).
pub fn request_panics(body: &[u8]) -> bool {
    static MARKER: OnceLock<Option<String>> = OnceLock::new();
    MARKER
        .get_or_init(|| {
            std::env::var("AX_TEST_PANIC_REQUEST")
                .ok()
                .filter(|m| !m.is_empty())
        })
        .as_deref()
        .is_some_and(|m| body.windows(m.len()).any(|w| w == m.as_bytes()))
}
