//! Prometheus metrics. Names are constants so docs/METRICS.md (generated from this file's
//! doc comments, and tested against them) and the Grafana dashboard have one place to
//! match; [`describe`] registers their help texts. The process installs the exporter (the
//! `ax` command serves `/metrics`).

/// Gauge, server: tasks admitted or due but not yet in a ready subject (admission pressure).
pub const PENDING_DISPATCH: &str = "ax_pending_dispatch";
/// Gauge, worker `{queue}`: handlers running / concurrency, 0..=1 (executor saturation).
pub const WORKER_BUSY_RATE: &str = "ax_worker_busy_rate";
/// Gauge, worker `{queue}`: attempts ended by timeout (hard timeout or lost heartbeat) /
/// attempts ended, over the last 60 s (live tasks wrongly killed).
pub const TASK_TIMEOUT_RATE: &str = "ax_task_timeout_rate";
/// Counter, server `{queue, priority}`: tasks accepted.
pub const SUBMITTED: &str = "ax_tasks_submitted_total";
/// Counter, server `{queue, code}`: submit requests refused, by error code.
pub const SUBMIT_REJECTED: &str = "ax_submit_rejected_total";
/// Counter, server `{queue}`: submits answered with an existing task (idempotency key).
pub const SUBMIT_DUPLICATES: &str = "ax_submit_duplicates_total";
/// Counter, server `{api}`: requests whose handler panicked (a bug), answered
/// `unavailable`; `api` is `submit`, `task`, `flow`, `limit`, `trigger` or `event`.
pub const REQUEST_PANICS: &str = "ax_request_panics_total";
/// Counter, server `{queue}`: accepted tasks whose record could not be written at
/// admission (the worker writes it when it claims the task).
pub const RECORD_DEFERRED: &str = "ax_record_write_deferred_total";
/// Counter, server: delayed tasks moved to their ready subject.
pub const DELAYED_DISPATCHED: &str = "ax_delayed_dispatched_total";
/// Counter, server `{joined}`: debounced submits accepted, `joined` = `true` if the submit
/// joined an open window (its task runs later, once), `false` if it opened one.
pub const DEBOUNCED: &str = "ax_debounced_submits_total";
/// Counter, server: items of batch keys accepted (each in the list of one batch's task).
pub const BATCHED_ITEMS: &str = "ax_batched_items_total";
/// Gauge, server `{queue}`: tasks with a fair key held in `AX_FAIR` for their turn (set by
/// the fair dispatcher's leader every second).
pub const FAIR_HELD: &str = "ax_fair_held";
/// Counter, server `{queue}`: tasks with a fair key released to their ready subject.
pub const FAIR_RELEASED: &str = "ax_fair_released_total";
/// Gauge, server: delayed-task partitions this server owns (of `names::DELAYED_PARTITIONS`).
pub const DELAYED_PARTITIONS_OWNED: &str = "ax_delayed_partitions_owned";
/// Gauge, server: delayed tasks this server's timer index holds.
pub const DELAYED_TRACKED: &str = "ax_delayed_tracked";
/// Histogram, server: seconds from a delayed task's due time to its publish to ready.
pub const DISPATCH_LAG: &str = "ax_dispatch_lag_seconds";
/// Counter, worker `{queue, task}`: attempts that succeeded.
pub const SUCCEEDED: &str = "ax_tasks_succeeded_total";
/// Counter, worker `{queue, task, class}`: attempts that failed (any reason).
pub const FAILED: &str = "ax_tasks_failed_total";
/// Counter, worker `{queue, task}`: failed attempts scheduled for a retry.
pub const RETRIED: &str = "ax_tasks_retried_total";
/// Counter, worker `{queue, task}`: tasks moved to the dead-letter stream.
pub const DEAD: &str = "ax_tasks_dead_total";
/// Counter, worker `{queue, kind}`: attempts ended by their `hard` timeout, by their
/// `soft` one (no `Task::heartbeat` call within the name's heartbeat timeout), or found
/// ended by a lost `heartbeat` (the worker holding it stopped).
pub const TIMEOUTS: &str = "ax_task_timeouts_total";
/// Counter, worker `{queue}`: results refused because another attempt took over (stale
/// fencing token, e.g. a late ack).
pub const STALE_RESULTS: &str = "ax_stale_results_total";
/// Counter, worker `{queue, task}`: deliveries handed back because this worker serves no
/// handler for the task's name.
pub const UNSERVED: &str = "ax_worker_unserved_total";
/// Histogram, worker `{queue, task}`: handler run time in seconds.
pub const RUN_DURATION: &str = "ax_task_run_duration_seconds";
/// Histogram, worker `{queue}`: seconds from ready (creation or due time) to attempt start.
pub const QUEUE_WAIT: &str = "ax_task_queue_wait_seconds";
/// Counter, server `{flow}`: flow runs started (new runs and re-runs of failed steps).
pub const FLOW_RUNS_STARTED: &str = "ax_flow_runs_started_total";
/// Counter, server (the flow engine's leader) `{flow, state}`: flow runs that ended
/// `succeeded`, `failed` or `cancelled`.
pub const FLOW_RUNS_ENDED: &str = "ax_flow_runs_ended_total";
/// Counter, server `{queue, kind}`: alerts published; `kind` is `task_dead` or
/// `flow_failed`.
pub const ALERTS: &str = "ax_alerts_total";
/// Counter, server `{queue}`: terminal failures folded into an alert window instead of
/// alerting.
pub const ALERTS_SUPPRESSED: &str = "ax_alerts_suppressed_total";
/// Counter, server (with a task index): task records the index could not read (not JSON
/// of a task record's shape); each is logged with its key and left out of the index.
pub const INDEX_UNREADABLE: &str = "ax_index_unreadable_records_total";
/// Gauge, worker `{queue, task}`: failed attempts in a row per task name in one worker
/// process, reset by a success.
pub const CONSECUTIVE_FAILURES: &str = "ax_task_consecutive_failures";
/// Gauge, server (the event matcher's leader): flows' waits for events pending.
pub const EVENT_WAITS_PENDING: &str = "ax_event_waits_pending";
/// Counter, server (the event matcher's leader): waits for events it ended, or found
/// ended, `succeeded` when their event came.
pub const EVENT_WAITS_MET: &str = "ax_event_waits_met_total";
/// Counter, server (the event matcher's leader): events let go before their lookback
/// window ended, for want of memory (64 MiB of events are held).
pub const EVENTS_DROPPED_EARLY: &str = "ax_events_dropped_early_total";
/// Gauge, server (the flow engine's leader): runs it is driving now.
pub const FLOW_RUNS_ACTIVE: &str = "ax_flow_runs_active";
/// Histogram, server (the flow engine's leader) `{flow}`: seconds from the last parent
/// task's finish to the first task of the child step starting on a worker (both times from
/// the task records).
pub const FLOW_STEP_LATENCY: &str = "ax_flow_step_latency_seconds";
/// Counter, worker `{queue, limit, reason}`: deliveries handed back by a limit
/// (`rate_limit`, `concurrency`, `limits_unavailable`); no attempt is counted.
pub const LIMIT_WAITS: &str = "ax_limit_waits_total";
/// Histogram, worker `{queue, limit}`: seconds from a task first seen waiting for a limit
/// to its attempt's start (`limit`: the one it last waited for).
pub const LIMIT_WAIT: &str = "ax_limit_wait_seconds";
/// Gauge, worker `{queue, limit}`: concurrency slots this worker holds.
pub const LIMIT_SLOTS_HELD: &str = "ax_limit_slots_held";
/// Gauge, worker `{queue, limit}`: tokens left in a rate limit's bucket when this worker
/// last took one (limits without `per_key` only).
pub const LIMIT_TOKENS: &str = "ax_limit_tokens";
/// Counter, worker `{queue, limit}`: concurrency slots found lost while their attempt ran
/// (the worker stalled past the ack wait and the slot expired): the attempt was stopped.
pub const LIMIT_SLOTS_LOST: &str = "ax_limit_slots_lost_total";
/// Gauge, worker `{queue, limit}`: the rate in force of an adaptive limit (lowered by
/// pressure, raised while calm), as this worker last computed it (not per key).
pub const LIMIT_RATE: &str = "ax_limit_rate";
/// Counter, worker `{queue, limit}`: reports of pressure (a handler failed with a class
/// the adaptive limit listens to); `lowered="true"` for the ones that lowered the rate.
pub const LIMIT_PRESSURE: &str = "ax_limit_pressure_total";
/// Counter, server `{which}`: console connections closed because the console had its
/// most connections open (`ConsoleConfig::max_connections`): `which="idle"` the one that
/// had waited longest between requests, closed to make room for a new one; `which="new"`
/// the new one, when every open connection was in a request.
pub const CONSOLE_CONNECTIONS_REFUSED: &str = "ax_console_connections_refused_total";
/// Counter, server (the flow engine's leader) `{queue}`: step task submits refused for now
/// (a full ready queue, the broker away) and retried with backoff; one summary line every
/// 10 s at most, not one per task.
pub const FLOW_STEP_SUBMIT_RETRIES: &str = "ax_flow_step_submit_retries_total";
/// Gauge, server and worker `{service}`: 1 while a supervised part of the process runs, 0
/// while it waits to be started again after it stopped.
pub const SERVICE_UP: &str = "ax_service_up";
/// Gauge, worker `{queue}`: the `AX_LIMITS` revision of the latest limit definition of the
/// queue this worker has applied (a change has reached it once this is at its revision).
pub const LIMITS_APPLIED: &str = "ax_limits_applied_revision";
/// Counter, server and worker `{service, reason}`: supervised parts that stopped while the
/// process ran (each is started again); `reason` is `ended`, `error` or `panic`.
/// `service="group_commit"`: a group commit that panicked (its lane goes on).
pub const SERVICE_RESTARTS: &str = "ax_service_restarts_total";
/// Gauge, server and worker `{stream}`: 1 while the writes to the stream go as atomic
/// batches (group commit), 0 while each goes on its own (the broker was measured to
/// answer those faster, or group commit is off).
pub const GROUP_COMMIT_GROUPING: &str = "ax_group_commit_grouping";
/// Gauge, server (the trigger engine's leader) `{how}`: the triggers it follows, `whole`
/// (due within `--trigger-hold`, or waiting on a fire's tasks) or `resting` (held as a
/// name and a wake time, read back from the store when due); 0 on a server not leading.
pub const TRIGGERS_HELD: &str = "ax_triggers_held";
/// Gauge, Python runtime `{queue}`: task threads still running a sync function whose
/// attempt the worker gave up on (hard timeout, cancel): each was replaced by a new
/// thread, so they hold no slot, but they hold memory and CPU until the function returns.
pub const PYTHON_STUCK_THREADS: &str = "ax_python_stuck_threads";
/// Counter, Python runtime `{queue}`: task threads started to replace one stuck in an
/// abandoned attempt.
pub const PYTHON_THREADS_REPLACED: &str = "ax_python_threads_replaced_total";
/// Counter, Python runtime `{executor}`: task threads, the event loop or process-executor
/// children that ended unexpectedly (a runtime bug or a task's `SystemExit` escaping) and
/// were started again.
pub const PYTHON_RESTARTS: &str = "ax_python_restarts_total";

/// Registers help texts for every metric.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!(
        PENDING_DISPATCH,
        "Tasks admitted or due but not yet published to a ready subject"
    );
    describe_gauge!(WORKER_BUSY_RATE, "Busy handler slots / concurrency (0..1)");
    describe_gauge!(
        TASK_TIMEOUT_RATE,
        "Attempts ended by timeout / attempts ended, last 60 s"
    );
    describe_counter!(SUBMITTED, "Tasks accepted");
    describe_counter!(SUBMIT_REJECTED, "Submit requests refused, by code");
    describe_counter!(SUBMIT_DUPLICATES, "Submits answered by an existing task");
    describe_counter!(
        REQUEST_PANICS,
        "Request handlers that panicked (bugs), by API"
    );
    describe_counter!(
        RECORD_DEFERRED,
        "Accepted tasks whose record is left for the worker to write"
    );
    describe_counter!(DELAYED_DISPATCHED, "Delayed tasks moved to ready");
    describe_counter!(
        DEBOUNCED,
        "Debounced submits accepted (joined an open window or not)"
    );
    describe_counter!(
        BATCHED_ITEMS,
        "Items of batch keys accepted (each in one batch's task)"
    );
    describe_gauge!(
        FAIR_HELD,
        "Tasks with a fair key held for their turn (fair dispatcher's leader)"
    );
    describe_counter!(
        FAIR_RELEASED,
        "Tasks with a fair key released to their ready subject"
    );
    describe_gauge!(
        DELAYED_PARTITIONS_OWNED,
        "Delayed-task partitions this server indexes and dispatches"
    );
    describe_gauge!(
        DELAYED_TRACKED,
        "Delayed tasks in this server's timer index"
    );
    describe_histogram!(DISPATCH_LAG, Unit::Seconds, "Due time to ready publish");
    describe_gauge!(
        EVENT_WAITS_PENDING,
        "Flows' waits for events pending (the event matcher's leader)"
    );
    describe_counter!(
        EVENT_WAITS_MET,
        "Waits for events ended by a matching event"
    );
    describe_counter!(
        EVENTS_DROPPED_EARLY,
        "Events let go before their lookback window ended, for want of memory"
    );
    describe_counter!(SUCCEEDED, "Attempts that succeeded");
    describe_counter!(FAILED, "Attempts that failed");
    describe_counter!(RETRIED, "Failed attempts scheduled for retry");
    describe_counter!(DEAD, "Tasks dead-lettered");
    describe_counter!(
        TIMEOUTS,
        "Attempts ended by hard timeout, soft (heartbeat) timeout or lost heartbeat"
    );
    describe_counter!(STALE_RESULTS, "Results refused for a stale fencing token");
    describe_counter!(
        UNSERVED,
        "Deliveries handed back: no handler for the task name in this worker"
    );
    describe_histogram!(RUN_DURATION, Unit::Seconds, "Handler run time");
    describe_histogram!(QUEUE_WAIT, Unit::Seconds, "Ready to attempt start");
    describe_counter!(LIMIT_WAITS, "Deliveries handed back by a limit, by reason");
    describe_gauge!(LIMIT_SLOTS_HELD, "Concurrency slots this worker holds");
    describe_histogram!(
        LIMIT_WAIT,
        Unit::Seconds,
        "First seen waiting for a limit to start"
    );
    describe_gauge!(LIMIT_TOKENS, "Tokens left in a rate limit's bucket");
    describe_counter!(FLOW_RUNS_STARTED, "Flow runs started, by flow");
    describe_counter!(FLOW_RUNS_ENDED, "Flow runs ended, by flow and final state");
    describe_counter!(
        ALERTS,
        "Alerts published on terminal failures, by queue and kind"
    );
    describe_counter!(
        ALERTS_SUPPRESSED,
        "Terminal failures folded into an open alert window"
    );
    describe_counter!(
        INDEX_UNREADABLE,
        "Task records the task index could not read (left out of it)"
    );
    describe_gauge!(
        CONSECUTIVE_FAILURES,
        "Attempts of a task name that failed in a row (reset by a success)"
    );
    describe_counter!(
        LIMIT_SLOTS_LOST,
        "Concurrency slots lost while their attempt ran; the attempt was stopped"
    );
    describe_gauge!(
        LIMIT_RATE,
        "The rate in force of an adaptive limit (starts/s)"
    );
    describe_counter!(
        LIMIT_PRESSURE,
        "Reports of pressure to an adaptive limit (lowered: whether it lowered the rate)"
    );
    describe_counter!(
        CONSOLE_CONNECTIONS_REFUSED,
        "Console connections closed at the bound: the longest idle (idle) or the new one (new)"
    );
    describe_gauge!(FLOW_RUNS_ACTIVE, "Flow runs the engine's leader drives now");
    describe_histogram!(
        FLOW_STEP_LATENCY,
        Unit::Seconds,
        "Last parent task finished to the child step's first task started"
    );
    describe_counter!(
        FLOW_STEP_SUBMIT_RETRIES,
        "Flow step task submits refused for now (queue full, broker away) and retried"
    );
    describe_gauge!(
        LIMITS_APPLIED,
        "The AX_LIMITS revision of the latest limit definition of the queue applied"
    );
    describe_gauge!(
        SERVICE_UP,
        "1 while a supervised part of the process runs, 0 while it waits to start again"
    );
    describe_counter!(
        SERVICE_RESTARTS,
        "Supervised parts that stopped (ended, error, panic) and were started again"
    );
    describe_gauge!(
        GROUP_COMMIT_GROUPING,
        "1 while writes to the stream go as atomic batches, 0 while each goes alone"
    );
    describe_gauge!(
        TRIGGERS_HELD,
        "Triggers the trigger leader follows, held whole or resting (name and wake time)"
    );
    describe_gauge!(
        PYTHON_STUCK_THREADS,
        "Python task threads still running an abandoned attempt (replaced)"
    );
    describe_counter!(
        PYTHON_THREADS_REPLACED,
        "Python task threads started to replace one stuck in an abandoned attempt"
    );
    describe_counter!(
        PYTHON_RESTARTS,
        "Python task threads, event loop or children that ended unexpectedly and restarted"
    );
}

#[cfg(test)]
mod reference {
    /// docs/METRICS.md's table, made from this file: one row per constant, from its doc
    /// comment (`Kind, process {labels}: meaning`).
    fn table() -> String {
        let mut rows = vec![
            "| metric | type | from | labels | meaning |".to_string(),
            "|---|---|---|---|---|".to_string(),
        ];
        let mut doc: Vec<&str> = Vec::new();
        for line in include_str!("metrics.rs").lines() {
            let line = line.trim();
            if let Some(text) = line.strip_prefix("///") {
                doc.push(text.trim());
                continue;
            }
            if let Some(name) = line
                .strip_prefix("pub const ")
                .and_then(|rest| rest.split('"').nth(1))
            {
                let text = doc.join(" ");
                let (head, meaning) = text.split_once(": ").unwrap_or(("", &text));
                let (kind, from) = head.split_once(", ").unwrap_or((head, ""));
                assert!(
                    ["Gauge", "Counter", "Histogram"].contains(&kind) && !from.is_empty(),
                    "{name}: its doc must start `Gauge|Counter|Histogram, <process> {{labels}}: `"
                );
                let (from, labels) = match from.split_once(" `") {
                    Some((from, labels)) => (from, format!("`{labels}")),
                    None => (from, String::new()),
                };
                rows.push(format!(
                    "| `{name}` | {kind} | {from} | {labels} | {meaning} |"
                ));
            }
            doc.clear();
        }
        rows.join("\n")
    }

    /// Each constant's kind as its doc says it, and as `describe` registers it.
    #[test]
    fn each_metric_is_described_as_the_kind_its_doc_says() {
        let text = include_str!("metrics.rs");
        let (consts, rest) = text.split_once("pub fn describe").expect("describe");
        let described = rest.split("#[cfg(test)]").next().unwrap_or_default();
        let mut said = std::collections::BTreeMap::new();
        let mut kind = "";
        for line in consts.lines().map(str::trim) {
            if let Some(doc) = line.strip_prefix("/// ") {
                if let Some(k) = ["Gauge", "Counter", "Histogram"]
                    .into_iter()
                    .find(|k| doc.starts_with(&format!("{k},")))
                {
                    kind = k;
                }
            } else if let Some(rest) = line.strip_prefix("pub const ") {
                let ident = rest.split(':').next().unwrap_or_default().to_string();
                said.insert(ident, kind.to_lowercase());
                kind = "";
            }
        }
        let mut registered = std::collections::BTreeMap::new();
        let words: Vec<&str> = described
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty())
            .collect();
        for pair in words.windows(2) {
            let constant = pair[1].chars().all(|c| c.is_ascii_uppercase() || c == '_');
            if let Some(k) = pair[0].strip_prefix("describe_").filter(|_| constant) {
                registered.insert(pair[1].to_string(), k.to_string());
            }
        }
        assert_eq!(said, registered, "doc kinds vs describe_* calls");
    }

    /// The metrics reference is generated from the constants and their docs, and checked
    /// here: a metric added, renamed or redescribed without the doc fails.
    /// `AX_WRITE_DOCS=1 cargo test -p ax-sdk metrics` writes it again.
    #[test]
    fn docs_metrics_md_lists_every_metric_as_this_file_describes_it() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/METRICS.md");
        let doc = std::fs::read_to_string(path).unwrap_or_default();
        let start = "<!-- generated from crates/ax-core/src/metrics.rs -->";
        let end = "<!-- end of generated table -->";
        let want = format!("{start}\n{}\n{end}", table());
        if std::env::var_os("AX_WRITE_DOCS").is_some() {
            let (head, tail) = match (doc.find(start), doc.find(end)) {
                (Some(a), Some(b)) => (&doc[..a], &doc[b + end.len()..]),
                _ => (doc.as_str(), "\n"),
            };
            std::fs::write(path, format!("{head}{want}{tail}")).expect("write docs/METRICS.md");
            return;
        }
        assert!(
            doc.contains(&want),
            "docs/METRICS.md does not hold the table metrics.rs makes \
             (AX_WRITE_DOCS=1 cargo test -p ax-sdk metrics writes it):\n{want}"
        );
        assert_eq!(super::super::metrics::SERVICE_UP, "ax_service_up");
    }
}
