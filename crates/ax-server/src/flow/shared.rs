//! What every run's turn shares: the stores, the shapes (definitions checked once), the
//! byte budget for held outputs and inputs, and the log of refused step submits.

use super::def::{FlowDef, Plan};
use super::store::FlowStore;
use crate::context::Context;
use ax_core::metrics as m;
use ax_core::protocol::WireError;
use ax_core::results::ResultStore;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tracing::warn;

/// At most one summary line of step tasks not accepted yet this often.
pub(super) const RETRY_LINE_EVERY: Duration = Duration::from_secs(10);

/// What every run's turn uses.
pub(crate) struct Shared {
    pub(crate) ctx: Arc<Context>,
    pub(crate) store: FlowStore,
    pub(crate) results: ResultStore,
    pub(crate) alerts: Option<crate::ops::alerts::Alerts>,
    pub(crate) shapes: Shapes,
    pub(crate) held: Budget,
    pub(crate) retries: SubmitRetries,
}

/// A run's definition checked once, shared by every run that follows the same one (each
/// run key holds its own copy of the definition; 20,000 runs of one flow need one shape).
#[derive(Debug)]
pub(crate) struct Shape {
    /// The flow's name.
    pub(crate) flow: String,
    /// The definition.
    pub(crate) def: FlowDef,
    /// Parents by index and a parents-first order.
    pub(crate) plan: Plan,
    /// Step index by name.
    pub(crate) index: HashMap<String, usize>,
    /// `children[i]`: the steps that need step `i`.
    pub(crate) children: Vec<Vec<usize>>,
}

/// The shapes of the definitions of the runs being driven, by flow name; a shape lives as
/// long as a run holds it.
#[derive(Default)]
pub(crate) struct Shapes(pub(super) Mutex<HashMap<String, Vec<Weak<Shape>>>>);

impl Shapes {
    /// The shape of `def` (flow `flow`): one already held by another run, or a new one,
    /// checked against `limits`.
    pub(crate) fn get(
        &self,
        flow: &str,
        def: FlowDef,
        limits: &ax_core::task::Limits,
    ) -> Result<Arc<Shape>, WireError> {
        let find = |map: &mut HashMap<String, Vec<Weak<Shape>>>, def: &FlowDef| {
            let list = map.get_mut(flow)?;
            list.retain(|w| w.strong_count() > 0);
            list.iter()
                .filter_map(Weak::upgrade)
                .find(|s| s.def == *def)
        };
        if let Some(shape) = find(&mut self.0.lock().expect("shapes"), &def) {
            return Ok(shape);
        }
        let plan = def.validate(limits)?;
        let mut children = vec![Vec::new(); def.steps.len()];
        for (i, parents) in plan.parents.iter().enumerate() {
            for &p in parents {
                children[p].push(i);
            }
        }
        let index = def
            .steps
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), i))
            .collect();
        let shape = Arc::new(Shape {
            flow: flow.to_string(),
            def,
            plan,
            index,
            children,
        });
        let mut map = self.0.lock().expect("shapes");
        if let Some(found) = find(&mut map, &shape.def) {
            return Ok(found); // made meanwhile by another turn
        }
        map.entry(flow.to_string())
            .or_default()
            .push(Arc::downgrade(&shape));
        Ok(shape)
    }
}

/// Bytes held across runs (outputs for steps not started yet, run inputs), within a limit.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    used: Arc<AtomicUsize>,
    limit: usize,
}

impl Budget {
    pub(crate) fn new(limit: usize) -> Budget {
        Budget {
            used: Arc::default(),
            limit,
        }
    }

    /// A reservation of `bytes`, or `None` if the budget has not that much left.
    pub(crate) fn take(&self, bytes: usize) -> Option<Reserved> {
        let mut reserved = Reserved {
            used: self.used.clone(),
            bytes: 0,
        };
        reserved.grow(self, bytes).then_some(reserved)
    }

    /// Bytes reserved now.
    #[cfg(test)]
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

/// Bytes reserved on a [`Budget`], given back when dropped.
#[derive(Debug)]
pub(crate) struct Reserved {
    used: Arc<AtomicUsize>,
    bytes: usize,
}

impl Reserved {
    /// Reserves `bytes` more; false (and nothing reserved) if over the budget.
    pub(crate) fn grow(&mut self, budget: &Budget, bytes: usize) -> bool {
        let before = budget.used.fetch_add(bytes, Ordering::Relaxed);
        if before + bytes > budget.limit {
            budget.used.fetch_sub(bytes, Ordering::Relaxed);
            return false;
        }
        self.bytes += bytes;
        true
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.used.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Step tasks not accepted yet (a full ready queue, the broker away): counted in
/// `ax_flow_step_submit_retries_total{queue}` and summed up in one line at most every
/// [`RETRY_LINE_EVERY`], instead of a line per task.
#[derive(Default)]
pub(crate) struct SubmitRetries(Mutex<RetryLog>);

impl SubmitRetries {
    /// One step task of `queue` refused for now with `cause`.
    pub(crate) fn record(&self, queue: &str, cause: &str) {
        metrics::counter!(m::FLOW_STEP_SUBMIT_RETRIES, "queue" => queue.to_string()).increment(1);
        let line = self
            .0
            .lock()
            .expect("retry log")
            .add(queue, cause, std::time::Instant::now());
        if let Some(line) = line {
            line.log();
        }
    }

    /// Logs the retries since the last line, if there are some and the last line is old
    /// enough (called every few seconds).
    pub(crate) fn flush(&self) {
        let line = self
            .0
            .lock()
            .expect("retry log")
            .due(std::time::Instant::now());
        if let Some(line) = line {
            line.log();
        }
    }
}

/// Retries since the last summary line (a pure structure, unit-tested).
#[derive(Debug, Default)]
struct RetryLog {
    since: Vec<(String, u64)>,
    cause: String,
    last_line: Option<std::time::Instant>,
}

/// One summary line.
#[derive(Debug, PartialEq, Eq)]
struct RetryLine {
    retried: u64,
    queues: String,
    cause: String,
}

impl RetryLine {
    fn log(&self) {
        warn!(retried = self.retried, queues = %self.queues, last_cause = %self.cause,
            "flow step tasks not accepted yet (ready queue full or broker away); each is retried with backoff");
    }
}

impl RetryLog {
    fn add(&mut self, queue: &str, cause: &str, now: std::time::Instant) -> Option<RetryLine> {
        match self.since.iter_mut().find(|(q, _)| q == queue) {
            Some((_, n)) => *n += 1,
            None => self.since.push((queue.to_string(), 1)),
        }
        if self.cause != cause {
            self.cause = cause.to_string();
        }
        self.due(now)
    }

    fn due(&mut self, now: std::time::Instant) -> Option<RetryLine> {
        if self.since.is_empty()
            || self
                .last_line
                .is_some_and(|t| now.duration_since(t) < RETRY_LINE_EVERY)
        {
            return None;
        }
        self.last_line = Some(now);
        let since = std::mem::take(&mut self.since);
        let queues = since
            .iter()
            .map(|(q, n)| format!("{q}: {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        Some(RetryLine {
            retried: since.iter().map(|(_, n)| n).sum(),
            queues,
            cause: self.cause.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_make_one_line_per_ten_seconds_with_counts_per_queue() {
        let mut log = RetryLog::default();
        let t0 = std::time::Instant::now();
        let first = log
            .add("emails", "busy", t0)
            .expect("the first retry is told at once");
        assert_eq!((first.retried, first.queues.as_str()), (1, "emails: 1"));
        let mut lines = 0;
        for k in 1..5_000u64 {
            let at = t0 + Duration::from_millis(k);
            let queue = if k % 2 == 0 { "emails" } else { "reports" };
            lines += usize::from(log.add(queue, "busy", at).is_some());
        }
        assert_eq!(lines, 0, "nothing more within 10 s");
        assert_eq!(log.due(t0 + Duration::from_secs(9)), None);
        let line = log
            .due(t0 + Duration::from_secs(10))
            .expect("a line after 10 s");
        assert_eq!(line.retried, 4_999);
        assert_eq!(line.queues, "reports: 2500, emails: 2499");
        assert_eq!(log.due(t0 + Duration::from_secs(30)), None, "nothing since");
    }
}
