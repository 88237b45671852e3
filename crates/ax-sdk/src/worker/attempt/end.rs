//! How an attempt's handler ended, as one value: what `run` decides the writes from and
//! what the attempt's log line says. Pure.

use crate::output::Output;
use crate::worker::error::TaskError;

/// Why a handler was stopped, or never started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stopped {
    /// An operator cancelled the task (or its flow run) while it was held here.
    Cancelled,
    /// A concurrency slot it held expired (the worker stalled past the ack wait): another
    /// attempt may hold it now.
    SlotLost,
    /// The worker's shutdown grace is over: handed back for another worker.
    Shutdown,
}

/// How an attempt's handler ended.
#[derive(Debug)]
pub(super) enum AttemptEnd {
    /// It returned an output.
    Returned(Output),
    /// It returned an error, or its soft timeout stopped it (class `heartbeat_timeout`).
    Failed(TaskError),
    /// It panicked (the panic's text).
    Panicked(String),
    /// Its hard timeout passed first.
    TimedOut,
    /// It was stopped, or never started.
    Stopped(Stopped),
}

/// What the race of a handler against its hard timeout gives: `None` when it was stopped
/// (or never polled), else the timeout's result over the caught panic over the handler's.
pub(super) type Raced = Option<
    Result<
        Result<Result<Output, TaskError>, Box<dyn std::any::Any + Send>>,
        tokio::time::error::Elapsed,
    >,
>;

impl AttemptEnd {
    /// The end `raced` stands for; `stopped` says why a stopped one was (asked only then).
    pub(super) fn of(raced: Raced, stopped: impl FnOnce() -> Stopped) -> AttemptEnd {
        match raced {
            Some(Ok(Ok(Ok(output)))) => AttemptEnd::Returned(output),
            Some(Ok(Ok(Err(e)))) => AttemptEnd::Failed(e),
            Some(Ok(Err(panic))) => AttemptEnd::Panicked(crate::error::panic_text(panic.as_ref())),
            Some(Err(_elapsed)) => AttemptEnd::TimedOut,
            None => AttemptEnd::Stopped(stopped()),
        }
    }

    /// The attempt's log line fields: outcome, error class, output bytes.
    pub(super) fn log_fields(&self) -> (&'static str, &str, usize) {
        match self {
            AttemptEnd::Returned(Output(out)) => {
                ("succeeded", "", out.as_ref().map_or(0, |o| o.bytes.len()))
            }
            AttemptEnd::Failed(e) => ("failed", e.class.as_str(), 0),
            AttemptEnd::Panicked(_) => ("failed", "panic", 0),
            AttemptEnd::TimedOut => ("failed", "timeout", 0),
            AttemptEnd::Stopped(Stopped::Cancelled) => ("cancelled", "", 0),
            AttemptEnd::Stopped(Stopped::SlotLost) => ("stopped", "slot_lost", 0),
            AttemptEnd::Stopped(Stopped::Shutdown) => ("handed_back", "shutdown", 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn elapsed() -> tokio::time::error::Elapsed {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(std::time::Duration::ZERO, std::future::pending::<()>()).await
        })
        .unwrap_err()
    }

    #[test]
    fn each_way_a_handler_ends_is_one_end_and_one_log_line() {
        let never = || -> Stopped { panic!("asked only for a stopped attempt") };
        let out = AttemptEnd::of(Some(Ok(Ok(Ok(Output::bytes(vec![1, 2, 3]))))), never);
        assert_eq!(out.log_fields(), ("succeeded", "", 3));
        let none = AttemptEnd::of(Some(Ok(Ok(Ok(Output::none())))), never);
        assert_eq!(none.log_fields(), ("succeeded", "", 0));
        let failed = AttemptEnd::of(Some(Ok(Ok(Err(TaskError::new("smtp", "down"))))), never);
        assert_eq!(failed.log_fields(), ("failed", "smtp", 0));
        let panic: Box<dyn std::any::Any + Send> = Box::new("boom");
        let panicked = AttemptEnd::of(Some(Ok(Err(panic))), never);
        assert!(matches!(&panicked, AttemptEnd::Panicked(t) if t == "boom"));
        assert_eq!(panicked.log_fields(), ("failed", "panic", 0));
        let timed_out = AttemptEnd::of(Some(Err(elapsed())), never);
        assert_eq!(timed_out.log_fields(), ("failed", "timeout", 0));
        for (why, line) in [
            (Stopped::Cancelled, ("cancelled", "", 0)),
            (Stopped::SlotLost, ("stopped", "slot_lost", 0)),
            (Stopped::Shutdown, ("handed_back", "shutdown", 0)),
        ] {
            let end = AttemptEnd::of(None, || why);
            assert!(matches!(end, AttemptEnd::Stopped(w) if w == why));
            assert_eq!(end.log_fields(), line);
        }
    }
}
