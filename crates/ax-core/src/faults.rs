//! Faults injected by tests, as a value: a [`Faults`] handle is held by the server's context,
//! a worker and the supervisors they start, set by a hidden builder method
//! (`ServerBuilder::faults`, `WorkerBuilder::faults`, [`Supervisor::faults`]). The default
//! handle injects nothing (each check is one branch on `None`), so the build that ships is
//! the build the tests run; a test holds a clone of the handle it passed and arms faults
//! on it, scoped to that server or worker alone.
//!
//! Two kinds:
//! - **Aborts** ([`Abort`]): the process aborts, like `kill -9`, at a precise line that a
//!   random kill would rarely hit, the N-th time it gets there. The `ax` binary arms them
//!   from `AX_TEST_ABORT_AFTER_PUBLISH`, `_AFTER_DISPATCH`, `_AFTER_FIRE` and the like
//!   ([`Faults::from_env`]), as the fault tests run it.
//! - **Widened windows and injected failures**: a slower claim (`AX_TEST_CLAIM_DELAY_MS`),
//!   a late record read after a delivery, a late end of a worker's long poll, a late
//!   cancel-signal subscription, a pause between an operator's retry publish and its record write, a service that
//!   panics or fails to start, a trigger's fire job or a flow run's turn that panics, a
//!   management request that panics (`AX_TEST_PANIC_REQUEST=<marker>`), a group commit
//!   that panics, trigger-state writes that fail, small pages of `ax.trigger.names`, lost
//!   deletes of closed debounce windows.
//!
//! [`Supervisor::faults`]: crate::supervisor::Supervisor::faults

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A message to this subject makes the group commit that carries it panic, when the
/// group's faults were armed with [`Faults::panic_group_commits`].
pub const PANIC_GROUP_SUBJECT: &str = "ax.test.panic_group";

/// A line where an armed fault aborts the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Abort {
    /// Between a task's message publish and its record write (admission).
    AfterPublish,
    /// Between a delayed task's ready publish and its delete from `AX_DELAYED`.
    AfterDispatch,
    /// Between a scheduled fire's submit and its trigger-state write.
    AfterFire,
    /// Between a due debounce window's fired copy and the delete of its message.
    AfterClose,
    /// Between fair-share tasks' release to their ready subject and the purge of their
    /// held messages.
    AfterRelease,
    /// Between a singleton key's claim and the store of its task.
    AfterClaim,
    /// Between a child flow step's stored wait tasks and the start of their child runs.
    AfterChildSubmit,
    /// Between a full batch's items stored (open) and the write of their idempotency keys.
    BeforeBatchKeys,
}

impl Abort {
    /// The environment variable [`Faults::from_env`] reads for this line.
    pub fn env_var(self) -> &'static str {
        match self {
            Abort::AfterPublish => "AX_TEST_ABORT_AFTER_PUBLISH",
            Abort::AfterDispatch => "AX_TEST_ABORT_AFTER_DISPATCH",
            Abort::AfterFire => "AX_TEST_ABORT_AFTER_FIRE",
            Abort::AfterClose => "AX_TEST_ABORT_AFTER_CLOSE",
            Abort::AfterRelease => "AX_TEST_ABORT_AFTER_RELEASE",
            Abort::AfterClaim => "AX_TEST_ABORT_AFTER_CLAIM",
            Abort::AfterChildSubmit => "AX_TEST_ABORT_AFTER_CHILD_SUBMIT",
            Abort::BeforeBatchKeys => "AX_TEST_ABORT_BEFORE_BATCH_KEYS",
        }
    }

    const ALL: [Abort; 8] = [
        Abort::AfterPublish,
        Abort::AfterDispatch,
        Abort::AfterFire,
        Abort::AfterClose,
        Abort::AfterRelease,
        Abort::AfterClaim,
        Abort::AfterChildSubmit,
        Abort::BeforeBatchKeys,
    ];
}

/// How a trigger-state write fails while [`Faults::fail_trigger_state_writes`] holds for
/// its trigger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateWriteFault {
    /// Not written; the writer gets a broker error (the broker was unreachable).
    Lost,
    /// Written, but the writer gets a broker error (the acknowledgement was lost).
    AckLost,
    /// Not written, and neither are the records of the trigger's fires meanwhile (their
    /// messages are): the broker unreachable for the KV buckets only.
    LostWithRecords,
}

/// A fault that fires once (or `n` times), keyed by what it names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Once {
    ServicePanic(String),
    StartFailure(String, u32),
    FirePanic(String),
    TurnPanic(String),
}

#[derive(Debug, Default)]
struct Armed {
    /// Abort at the N-th pass (N, passes so far).
    aborts: Mutex<BTreeMap<Abort, (u64, u64)>>,
    claim_delay_ms: AtomicU64,
    read_delay_ms: AtomicU64,
    cancel_write_delay_ms: AtomicU64,
    cancel_signal_delay_ms: AtomicU64,
    cancel_subscribe_delay_ms: AtomicU64,
    poll_end_delay_ms: AtomicU64,
    fetch_round_delay_ms: AtomicU64,
    retry_gap_ms: AtomicU64,
    names_page_bytes: AtomicU64,
    panic_request: Mutex<Option<String>>,
    panic_group: std::sync::atomic::AtomicBool,
    lose_window_deletes: std::sync::atomic::AtomicBool,
    state_writes: Mutex<BTreeMap<String, StateWriteFault>>,
    once: Mutex<BTreeSet<Once>>,
}

/// The faults of one server or worker (see the module's documentation); cheap to clone,
/// and every clone arms the same faults. `Faults::default()` injects none.
#[derive(Debug, Clone, Default)]
pub struct Faults(Option<Arc<Armed>>);

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Faults {
    /// A handle that injects nothing yet; its faults are armed by the methods below.
    pub fn armed() -> Faults {
        Faults(Some(Arc::default()))
    }

    /// The faults the `AX_TEST_*` environment variables ask for (see the module's
    /// documentation); none, when none is set, as in production.
    pub fn from_env() -> Faults {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let num = |name: &str| var(name).and_then(|v| v.parse::<u64>().ok());
        let f = Faults::armed();
        let mut any = false;
        for point in Abort::ALL {
            if let Some(n) = num(point.env_var()) {
                f.abort_after(point, n);
                any = true;
            }
        }
        if let Some(n) = num("AX_TEST_CLAIM_DELAY_MS") {
            f.claim_delay(Duration::from_millis(n));
            any = true;
        }
        if let Some(marker) = var("AX_TEST_PANIC_REQUEST") {
            f.panic_requests_with(&marker);
            any = true;
        }
        if any {
            tracing::warn!(
                "test faults armed from AX_TEST_* variables: this process will fail on purpose"
            );
            f
        } else {
            Faults::default()
        }
    }

    fn on(&self) -> Option<&Armed> {
        self.0.as_deref()
    }

    // --- Arming (tests) ---

    /// Aborts the process the `n`-th time it passes `point` (0: never).
    pub fn abort_after(&self, point: Abort, n: u64) {
        if let Some(a) = self.on() {
            a.aborts.lock().expect("not poisoned").insert(point, (n, 0));
        }
    }

    /// Makes every claim take `d` longer (a slow broker), past the lead rate tokens are
    /// taken with.
    pub fn claim_delay(&self, d: Duration) {
        if let Some(a) = self.on() {
            a.claim_delay_ms.store(ms(d), Ordering::SeqCst);
        }
    }

    /// Makes a worker wait `d` between taking a delivery and reading its task's record
    /// (a window in which a test stops the broker).
    pub fn record_read_delay(&self, d: Duration) {
        if let Some(a) = self.on() {
            a.read_delay_ms.store(ms(d), Ordering::SeqCst);
        }
    }

    /// Makes an operator's cancel of an unstarted task wait `d` between its look for a
    /// worker holding the message and its `cancelled` write (a slow broker).
    pub fn cancel_write_delay(&self, d: Duration) {
        if let Some(a) = self.on() {
            a.cancel_write_delay_ms.store(ms(d), Ordering::SeqCst);
        }
    }

    /// Makes an operator's cancel of a running task wait `d` between its read of the record
    /// and its signal to the worker holding the attempt (a slow broker, or a busy server).
    pub fn cancel_signal_delay(&self, d: Duration) {
        if let Some(a) = self.on() {
            a.cancel_signal_delay_ms.store(ms(d), Ordering::SeqCst);
        }
    }

    /// Makes a worker's long poll wait `d` after it woke the worker and before it ends (its
    /// thread descheduled between the two on a busy machine).
    pub fn poll_end_delay(&self, d: Duration) {
        if let Some(a) = self.on() {
            a.poll_end_delay_ms.store(ms(d), Ordering::SeqCst);
        }
    }

    /// Makes each of a worker's fetch rounds wait `d` before its first request (a busy
    /// broker answering its no-wait pulls late).
    pub fn fetch_round_delay(&self, d: Duration) {
        if let Some(a) = self.on() {
            a.fetch_round_delay_ms.store(ms(d), Ordering::SeqCst);
        }
    }

    /// Makes a worker's cancel-signal subscription wait `d` before it subscribes (a slow
    /// connection, or a SUB queued behind other writes).
    pub fn cancel_subscribe_delay(&self, d: Duration) {
        if let Some(a) = self.on() {
            a.cancel_subscribe_delay_ms.store(ms(d), Ordering::SeqCst);
        }
    }

    /// Makes an operator's retry wait `d` between its message publish and its record write.
    pub fn retry_gap(&self, d: Duration) {
        if let Some(a) = self.on() {
            a.retry_gap_ms.store(ms(d), Ordering::SeqCst);
        }
    }

    /// Makes the delete of every closed debounce window's message fail, as a lost delete
    /// does (the message stays in `AX_DELAYED` under its window's subject, older than the
    /// window's fired copy).
    pub fn lose_window_deletes(&self) {
        if let Some(a) = self.on() {
            a.lose_window_deletes.store(true, Ordering::SeqCst);
        }
    }

    /// Makes every `ax.trigger.names` page hold at most `bytes` of names (0: the server's
    /// own limit).
    pub fn names_page_bytes(&self, bytes: u64) {
        if let Some(a) = self.on() {
            a.names_page_bytes.store(bytes, Ordering::SeqCst);
        }
    }

    /// Makes every management request whose body holds `marker` panic in its handler.
    pub fn panic_requests_with(&self, marker: &str) {
        if let Some(a) = self.on() {
            *a.panic_request.lock().expect("not poisoned") =
                Some(marker.to_string()).filter(|m| !m.is_empty());
        }
    }

    /// Makes a group commit that carries a message to [`PANIC_GROUP_SUBJECT`] panic.
    pub fn panic_group_commits(&self) {
        if let Some(a) = self.on() {
            a.panic_group.store(true, Ordering::SeqCst);
        }
    }

    /// Makes every write of trigger `trigger`'s state fail with `fault` (`None`: stop).
    pub fn fail_trigger_state_writes(&self, trigger: &str, fault: Option<StateWriteFault>) {
        if let Some(a) = self.on() {
            let mut faults = a.state_writes.lock().expect("not poisoned");
            match fault {
                Some(f) => faults.insert(trigger.to_string(), f),
                None => faults.remove(trigger),
            };
        }
    }

    /// Makes the running service `name` panic once (within 50 ms), as a bug inside it would.
    pub fn panic_service(&self, name: &str) {
        self.arm(Once::ServicePanic(name.to_string()));
    }

    /// Makes the next `n` starts of service `name` fail at once (as a bucket that cannot be
    /// opened would).
    pub fn fail_service_starts(&self, name: &str, n: u32) {
        for k in 0..n {
            self.arm(Once::StartFailure(name.to_string(), k));
        }
    }

    /// Makes the next fire job of trigger `trigger` panic before it fires.
    pub fn panic_next_fire(&self, trigger: &str) {
        self.arm(Once::FirePanic(trigger.to_string()));
    }

    /// Makes the next turn of flow run `run` panic before it reads or decides anything.
    pub fn panic_next_turn(&self, run: &str) {
        self.arm(Once::TurnPanic(run.to_string()));
    }

    fn arm(&self, once: Once) {
        if let Some(a) = self.on() {
            a.once.lock().expect("not poisoned").insert(once);
        }
    }

    fn take(&self, once: &Once) -> bool {
        self.on()
            .is_some_and(|a| a.once.lock().expect("not poisoned").remove(once))
    }

    // --- Checks (the code under test) ---

    /// Whether a closed debounce window's delete is to be lost
    /// ([`Faults::lose_window_deletes`]).
    pub fn window_delete_lost(&self) -> bool {
        self.on()
            .is_some_and(|a| a.lose_window_deletes.load(Ordering::SeqCst))
    }

    /// Aborts the process here if this is the pass at `point` a test asked for.
    pub fn pass(&self, point: Abort) {
        let Some(a) = self.on() else { return };
        let mut aborts = a.aborts.lock().expect("not poisoned");
        if let Some((limit, count)) = aborts.get_mut(&point) {
            *count += 1;
            if *limit > 0 && *count == *limit {
                eprintln!("{}={limit}: aborting here", point.env_var());
                std::process::abort();
            }
        }
    }

    /// Waits the delay `which` names, if one is armed.
    async fn delay(&self, which: impl Fn(&Armed) -> &AtomicU64) {
        let ms = self.on().map_or(0, |a| which(a).load(Ordering::SeqCst));
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }

    /// After a claim: waits the claim delay, if any.
    pub async fn claimed(&self) {
        self.delay(|a| &a.claim_delay_ms).await;
    }

    /// Before a worker reads a delivered task's record: waits the read delay, if any.
    pub async fn reading_record(&self) {
        self.delay(|a| &a.read_delay_ms).await;
    }

    /// Between a cancel's look for a holder and its `cancelled` write: waits its delay.
    pub async fn cancel_writing(&self) {
        self.delay(|a| &a.cancel_write_delay_ms).await;
    }

    /// Between a cancel's read of a running task and its signal: waits its delay.
    pub async fn cancel_signalling(&self) {
        self.delay(|a| &a.cancel_signal_delay_ms).await;
    }

    /// Before a worker's cancel-signal subscription: waits its delay, if any.
    pub async fn cancel_subscribing(&self) {
        self.delay(|a| &a.cancel_subscribe_delay_ms).await;
    }

    /// At the end of a worker's long poll, after it woke the worker: waits its delay, if any.
    pub async fn poll_ending(&self) {
        self.delay(|a| &a.poll_end_delay_ms).await;
    }

    /// Before a worker's fetch round: waits the fetch-round delay, if any.
    pub async fn fetch_round_starting(&self) {
        self.delay(|a| &a.fetch_round_delay_ms).await;
    }

    /// Between a retry's message publish and its record write: waits the retry gap, if any.
    pub async fn retry_published(&self) {
        self.delay(|a| &a.retry_gap_ms).await;
    }

    /// The `ax.trigger.names` page size a test set, if any.
    pub fn page_bytes(&self) -> Option<usize> {
        match self.on()?.names_page_bytes.load(Ordering::SeqCst) {
            0 => None,
            n => usize::try_from(n).ok(),
        }
    }

    /// True if a management request with this body must panic.
    pub fn request_panics(&self, body: &[u8]) -> bool {
        let Some(a) = self.on() else { return false };
        let marker = a.panic_request.lock().expect("not poisoned");
        marker
            .as_deref()
            .is_some_and(|m| body.windows(m.len()).any(|w| w == m.as_bytes()))
    }

    /// True if a group commit carrying a message to `subject` must panic.
    pub fn group_panics(&self, subject: &str) -> bool {
        self.on()
            .is_some_and(|a| a.panic_group.load(Ordering::SeqCst))
            && subject == PANIC_GROUP_SUBJECT
    }

    /// The fault set for writes of `trigger`'s state, if any.
    pub fn trigger_state_write(&self, trigger: &str) -> Option<StateWriteFault> {
        let a = self.on()?;
        a.state_writes
            .lock()
            .expect("not poisoned")
            .get(trigger)
            .copied()
    }

    /// True (once per failure asked for) if this start of service `name` must fail.
    pub fn start_fails(&self, name: &str) -> bool {
        let Some(a) = self.on() else { return false };
        let mut once = a.once.lock().expect("not poisoned");
        let found = once
            .iter()
            .find(|o| matches!(o, Once::StartFailure(n, _) if n == name))
            .cloned();
        found.is_some_and(|key| once.remove(&key))
    }

    /// Returns when a test asked service `name` to panic; never, with no faults armed.
    pub async fn service_panic(&self, name: &str) {
        if self.on().is_none() {
            return std::future::pending().await;
        }
        let key = Once::ServicePanic(name.to_string());
        while !self.take(&key) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// True (once) if a test asked the next fire job of `trigger` to panic.
    pub fn fire_panics(&self, trigger: &str) -> bool {
        self.take(&Once::FirePanic(trigger.to_string()))
    }

    /// True (once) if a test asked the next turn of flow run `run` to panic.
    pub fn turn_panics(&self, run: &str) -> bool {
        self.take(&Once::TurnPanic(run.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_handle_injects_nothing_even_when_asked() {
        let f = Faults::default();
        f.panic_next_fire("t");
        f.fail_service_starts("s", 2);
        f.panic_requests_with("boom");
        f.abort_after(Abort::AfterPublish, 1);
        f.pass(Abort::AfterPublish);
        assert!(!f.fire_panics("t"));
        assert!(!f.start_fails("s"));
        assert!(!f.request_panics(b"xx boom xx"));
        assert_eq!(f.page_bytes(), None);
    }

    #[test]
    fn armed_faults_fire_as_often_as_asked_and_clones_share_them() {
        let f = Faults::armed();
        let g = f.clone();
        g.panic_next_fire("t");
        g.fail_service_starts("s", 2);
        assert!(f.fire_panics("t"));
        assert!(!f.fire_panics("t"), "once");
        assert!(f.start_fails("s") && f.start_fails("s"));
        assert!(!f.start_fails("s"), "twice");
        assert!(!f.start_fails("other"));
        g.panic_requests_with("boom");
        assert!(f.request_panics(b"xx boom xx"));
        assert!(!f.request_panics(b"quiet"));
        g.fail_trigger_state_writes("t", Some(StateWriteFault::AckLost));
        assert_eq!(f.trigger_state_write("t"), Some(StateWriteFault::AckLost));
        g.fail_trigger_state_writes("t", None);
        assert_eq!(f.trigger_state_write("t"), None);
        assert!(!f.group_panics(PANIC_GROUP_SUBJECT));
        g.panic_group_commits();
        assert!(f.group_panics(PANIC_GROUP_SUBJECT) && !f.group_panics("g.x"));
        // Passes before the N-th do not abort (the N-th would end this test process).
        f.abort_after(Abort::AfterDispatch, 3);
        f.pass(Abort::AfterDispatch);
        f.pass(Abort::AfterDispatch);
        f.pass(Abort::AfterPublish);
    }
}
