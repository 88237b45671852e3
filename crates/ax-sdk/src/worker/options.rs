//! Task names a worker serves, each with its own handler and options.
//!
//! Options declared in code apply where the submit left the option unset (the message's
//! `Ax-Defaulted` header lists those): a producer's explicit `max_attempts` wins over the
//! worker's, the worker's wins over the server default. A task name the worker does not
//! serve (and no catch-all handler) is handed back, not failed: nak with a delay, counted in
//! `ax_worker_unserved_total`.

use super::handler::Handler;
use super::slots::Slots;
use crate::backoff::Backoff;
use crate::protocol::BackoffRequest;
use crate::settings::{self, TaskSettings};
use crate::task::TaskMeta;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tracing::info;

/// Options of one task name, declared by the worker that serves it. Unset options keep what
/// the stored settings or the task message say.
#[derive(Debug, Clone, Default)]
pub struct TaskOptions {
    settings: TaskSettings,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl TaskOptions {
    /// No options: the task message decides everything.
    pub fn new() -> TaskOptions {
        TaskOptions::default()
    }
    /// Options from their JSON form, checked ([`TaskSettings::validate`]): how the
    /// Python decorator's options reach the Rust worker.
    pub fn from_settings(settings: TaskSettings) -> Result<TaskOptions, crate::error::WireError> {
        settings.validate()?;
        Ok(TaskOptions { settings })
    }
    /// These options in their JSON form.
    pub fn settings(&self) -> &TaskSettings {
        &self.settings
    }
    /// Attempts in all (1..=1000), unless the submit set `max_attempts`.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.settings.max_attempts = Some(n.clamp(1, settings::MAX_ATTEMPTS));
        self
    }
    /// Hard timeout of one attempt (at most 24 h), unless the submit set `timeout_ms`.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.settings.timeout_ms = Some(ms(d).clamp(1, settings::MAX_TIMEOUT_MS));
        self
    }
    /// Soft timeout (at most 24 h): an attempt whose handler has not called
    /// [`Task::heartbeat`](super::Task::heartbeat) for this long (since it started or
    /// since its last call) is stopped and failed with class `heartbeat_timeout`, retried
    /// like any failure. For work of unknown length that can report progress; the hard
    /// [`timeout`](Self::timeout) still applies.
    pub fn heartbeat_timeout(mut self, d: Duration) -> Self {
        self.settings.heartbeat_timeout_ms = Some(ms(d).clamp(1, settings::MAX_TIMEOUT_MS));
        self
    }
    /// Retry backoff (exponential from `base` to `max`, randomly shortened by up to
    /// `jitter`), unless the submit set `backoff`.
    pub fn backoff(mut self, base: Duration, max: Duration, jitter: f64) -> Self {
        let top = crate::backoff::MAX_BACKOFF_MS as u64;
        let base_ms = ms(base).clamp(1, top);
        let jitter = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        self.settings.backoff = Some(BackoffRequest {
            base_ms: Some(base_ms as i64),
            max_ms: Some(ms(max).clamp(base_ms, top) as i64),
            jitter: Some(jitter),
        });
        self
    }
    /// Error classes to retry (others are not), unless the submit set `retry_on`.
    pub fn retry_on<I: IntoIterator<Item = S>, S: Into<String>>(mut self, classes: I) -> Self {
        self.settings.retry_on = Some(classes.into_iter().map(Into::into).collect());
        self
    }
    /// Error classes never retried, unless the submit set `no_retry_on`.
    pub fn no_retry_on<I: IntoIterator<Item = S>, S: Into<String>>(mut self, classes: I) -> Self {
        self.settings.no_retry_on = Some(classes.into_iter().map(Into::into).collect());
        self
    }
    /// Most attempts of this name running at once in this worker (within the worker's
    /// own concurrency). A task waiting for one of these keeps its worker slot, so give
    /// a name with a tight limit its own queue if other names must not wait behind it.
    pub fn concurrency(mut self, n: usize) -> Self {
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        self.settings.concurrency = Some(n.clamp(1, settings::MAX_CONCURRENCY));
        self
    }
}

/// Replaces the options `meta` took from the server defaults with the settings'.
pub(crate) fn apply(s: &TaskSettings, meta: &mut TaskMeta) {
    let d = meta.defaulted;
    if let (true, Some(n)) = (d.max_attempts, s.max_attempts) {
        meta.max_attempts = n;
    }
    if let (true, Some(t)) = (d.timeout, s.timeout()) {
        meta.timeout = t;
    }
    if let (true, Some(b)) = (d.backoff, &s.backoff) {
        if let Ok(b) = Backoff::from_request(b.clone()) {
            meta.backoff = b;
        }
    }
    if let (true, Some(l)) = (d.retry_on, &s.retry_on) {
        meta.retry_on = l.clone();
    }
    if let (true, Some(l)) = (d.no_retry_on, &s.no_retry_on) {
        meta.no_retry_on = l.clone();
    }
}

/// The stored settings of the worker's queue, by task name, kept current by the limits
/// gate's watch of the queue's keys (`<queue>.=task.<name>` in `AX_LIMITS`).
#[derive(Debug, Default)]
pub(crate) struct Live {
    stored: RwLock<HashMap<String, TaskSettings>>,
}

impl Live {
    /// Stores (`Some`) or removes (`None`) the settings of `name`.
    pub(crate) fn set(&self, queue: &str, name: &str, settings: Option<TaskSettings>) {
        let mut stored = self.stored.write().expect("not poisoned");
        match settings {
            Some(s) => {
                info!(queue, task = name, settings = %serde_json::to_string(&s).unwrap_or_default(),
                    "task settings in force from the next attempt");
                stored.insert(name.to_string(), s);
            }
            None => {
                if stored.remove(name).is_some() {
                    info!(queue, task = name, "stored task settings removed");
                }
            }
        }
    }

    fn get(&self, name: &str) -> Option<TaskSettings> {
        self.stored.read().expect("not poisoned").get(name).cloned()
    }
}

/// One served name.
pub(crate) struct Served {
    pub(crate) handler: Handler,
    pub(crate) declared: TaskSettings,
}

/// What serves one task name: its handler, the settings in force, and the name's own
/// slots if it has a concurrency limit.
pub(crate) struct Found<'a> {
    pub(crate) handler: &'a Handler,
    pub(crate) settings: TaskSettings,
    pub(crate) slots: Option<Arc<Slots>>,
}

/// Every name a worker serves, its catch-all handler, and the stored settings.
#[derive(Default)]
pub(crate) struct Routes {
    pub(crate) named: HashMap<String, Served>,
    pub(crate) fallback: Option<Handler>,
    pub(crate) live: Arc<Live>,
    slots: Mutex<HashMap<String, Arc<Slots>>>,
}

impl Routes {
    pub(crate) fn add(&mut self, name: String, options: TaskOptions, handler: Handler) {
        let declared = options.settings;
        self.named.insert(name, Served { handler, declared });
    }

    /// The handler for `name`, its settings in force (stored over declared) and its
    /// slots; `None` if it is not served.
    pub(crate) fn route(&self, name: &str) -> Option<Found<'_>> {
        let (handler, declared) = match self.named.get(name) {
            Some(s) => (&s.handler, Some(&s.declared)),
            None => (self.fallback.as_ref()?, None),
        };
        let settings = match (self.live.get(name), declared) {
            (Some(stored), Some(declared)) => stored.over(declared),
            (Some(stored), None) => stored,
            (None, Some(declared)) => declared.clone(),
            (None, None) => TaskSettings::default(),
        };
        let slots = self.slots_of(name, settings.concurrency);
        Some(Found {
            handler,
            settings,
            slots,
        })
    }

    /// The slots of `name` sized `size`, resized if the setting changed; `None` without a
    /// limit (an earlier limit's slots are opened wide, so its waiters go on).
    fn slots_of(&self, name: &str, size: Option<u32>) -> Option<Arc<Slots>> {
        let mut all = self.slots.lock().expect("not poisoned");
        match size {
            Some(n) => {
                let slots = all
                    .entry(name.to_string())
                    .or_insert_with(|| Slots::new(n as usize));
                if slots.size() != n as usize {
                    slots.resize(n as usize);
                }
                Some(slots.clone())
            }
            None => {
                if let Some(old) = all.get(name) {
                    old.resize(usize::MAX);
                }
                None
            }
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.named.is_empty() && self.fallback.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::SubmitRequest;
    use crate::task::Limits;

    fn meta(req: SubmitRequest) -> TaskMeta {
        TaskMeta::from_request("q", req, &Limits::default())
            .unwrap()
            .0
    }

    #[test]
    fn worker_options_fill_only_what_the_submit_left_unset() {
        let options = TaskOptions::new()
            .max_attempts(9)
            .timeout(Duration::from_secs(2))
            .retry_on(["io"])
            .no_retry_on(["bad"])
            .backoff(Duration::from_millis(5), Duration::from_millis(50), 0.0);
        let mut unset = meta(SubmitRequest {
            name: "t".into(),
            ..Default::default()
        });
        // Through the headers, as a worker sees it.
        unset = TaskMeta::from_headers(&unset.to_headers()).unwrap();
        apply(options.settings(), &mut unset);
        assert_eq!(unset.max_attempts, 9);
        assert_eq!(unset.timeout, Duration::from_secs(2));
        assert_eq!(
            (unset.retry_on.clone(), unset.no_retry_on.clone()),
            (vec!["io".to_string()], vec!["bad".to_string()])
        );
        assert_eq!(unset.backoff.base, Duration::from_millis(5));

        let mut set = meta(SubmitRequest {
            name: "t".into(),
            max_attempts: Some(2),
            timeout_ms: Some(700),
            retry_on: Some(vec![]),
            ..Default::default()
        });
        set = TaskMeta::from_headers(&set.to_headers()).unwrap();
        apply(options.settings(), &mut set);
        assert_eq!(set.max_attempts, 2, "the producer's value wins");
        assert_eq!(set.timeout, Duration::from_millis(700));
        assert!(
            set.retry_on.is_empty(),
            "an explicit empty list is a value too"
        );
        assert_eq!(set.no_retry_on, vec!["bad".to_string()]);
    }
}
