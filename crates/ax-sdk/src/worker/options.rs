//! Task names a worker serves, each with its own handler and options.
//!
//! Options declared in code apply where the submit left the option unset (the message's
//! `Ax-Defaulted` header lists those): a producer's explicit `max_attempts` wins over the
//! worker's, the worker's wins over the server default. A task name the worker does not
//! serve (and no catch-all handler) is handed back, not failed: nak with a delay, counted in
//! `ax_worker_unserved_total`.

use super::Handler;
use crate::backoff::Backoff;
use crate::task::TaskMeta;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Options of one task name, declared by the worker that serves it. Unset options keep what
/// the task message says.
#[derive(Debug, Clone, Default)]
pub struct TaskOptions {
    max_attempts: Option<u32>,
    timeout: Option<Duration>,
    backoff: Option<Backoff>,
    retry_on: Option<Vec<String>>,
    no_retry_on: Option<Vec<String>>,
    concurrency: Option<usize>,
}

impl TaskOptions {
    /// No options: the task message decides everything.
    pub fn new() -> TaskOptions {
        TaskOptions::default()
    }
    /// Attempts in all, unless the submit set `max_attempts`.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n.max(1));
        self
    }
    /// Hard timeout of one attempt, unless the submit set `timeout_ms`.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = Some(d.max(Duration::from_millis(1)));
        self
    }
    /// Retry backoff (exponential from `base` to `max`, randomly shortened by up to
    /// `jitter`), unless the submit set `backoff`.
    pub fn backoff(mut self, base: Duration, max: Duration, jitter: f64) -> Self {
        self.backoff = Some(Backoff {
            base,
            max: max.max(base),
            jitter: jitter.clamp(0.0, 1.0),
        });
        self
    }
    /// Error classes to retry (others are not), unless the submit set `retry_on`.
    pub fn retry_on<I: IntoIterator<Item = S>, S: Into<String>>(mut self, classes: I) -> Self {
        self.retry_on = Some(classes.into_iter().map(Into::into).collect());
        self
    }
    /// Error classes never retried, unless the submit set `no_retry_on`.
    pub fn no_retry_on<I: IntoIterator<Item = S>, S: Into<String>>(mut self, classes: I) -> Self {
        self.no_retry_on = Some(classes.into_iter().map(Into::into).collect());
        self
    }
    /// Most attempts of this name running at once in this worker (within the worker's
    /// own concurrency). A task waiting for one of these keeps its worker slot, so give
    /// a name with a tight limit its own queue if other names must not wait behind it.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = Some(n.max(1));
        self
    }

    /// Replaces the options `meta` took from the server defaults with these.
    pub(crate) fn apply(&self, meta: &mut TaskMeta) {
        let d = meta.defaulted;
        if let (true, Some(n)) = (d.max_attempts, self.max_attempts) {
            meta.max_attempts = n;
        }
        if let (true, Some(t)) = (d.timeout, self.timeout) {
            meta.timeout = t;
        }
        if let (true, Some(b)) = (d.backoff, &self.backoff) {
            meta.backoff = *b;
        }
        if let (true, Some(l)) = (d.retry_on, &self.retry_on) {
            meta.retry_on = l.clone();
        }
        if let (true, Some(l)) = (d.no_retry_on, &self.no_retry_on) {
            meta.no_retry_on = l.clone();
        }
    }
}

/// One served name.
pub(crate) struct Served {
    pub(crate) handler: Handler,
    pub(crate) options: TaskOptions,
    /// The name's own concurrency limit, if it has one.
    pub(crate) slots: Option<Arc<Semaphore>>,
}

/// What serves one task name: its handler, options (none for the catch-all) and slots.
pub(crate) struct Found<'a> {
    pub(crate) handler: &'a Handler,
    pub(crate) options: Option<&'a TaskOptions>,
    pub(crate) slots: Option<&'a Arc<Semaphore>>,
}

/// Every name a worker serves, and its catch-all handler.
#[derive(Default)]
pub(crate) struct Routes {
    pub(crate) named: HashMap<String, Served>,
    pub(crate) fallback: Option<Handler>,
}

impl Routes {
    pub(crate) fn add(&mut self, name: String, options: TaskOptions, handler: Handler) {
        let slots = options.concurrency.map(|n| Arc::new(Semaphore::new(n)));
        self.named.insert(
            name,
            Served {
                handler,
                options,
                slots,
            },
        );
    }

    /// The handler for `name`, its options and its slots; `None` if it is not served.
    pub(crate) fn route(&self, name: &str) -> Option<Found<'_>> {
        match self.named.get(name) {
            Some(s) => Some(Found {
                handler: &s.handler,
                options: Some(&s.options),
                slots: s.slots.as_ref(),
            }),
            None => self.fallback.as_ref().map(|handler| Found {
                handler,
                options: None,
                slots: None,
            }),
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
        options.apply(&mut unset);
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
        options.apply(&mut set);
        assert_eq!(set.max_attempts, 2, "the producer's value wins");
        assert_eq!(set.timeout, Duration::from_millis(700));
        assert!(
            set.retry_on.is_empty(),
            "an explicit empty list is a value too"
        );
        assert_eq!(set.no_retry_on, vec!["bad".to_string()]);
    }
}
