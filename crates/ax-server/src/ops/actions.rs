//! Operations on tasks and queues (docs/PROTOCOL.md §8). Each one changes the task's record
//! by compare-and-set, so it cannot overwrite a worker's concurrent write; messages it
//! publishes are written before the record that names them, so a crash in between leaves
//! a message the claim discards (the record still says what it said), never a record
//! naming a message that does not exist.

use super::feed::TaskIndex;
use async_nats::jetstream::{self, kv};
use ax_core::names::{self, Priority};
use ax_core::protocol::{ErrorCode, WireError};
use ax_core::state::{OpNote, StateError, TaskRecord, TaskState, TaskStore};
use ax_core::task::TaskMeta;
use ax_core::time::now_ms;
use bytes::Bytes;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tracing::info;

/// How long `cancel` waits for a worker to answer the signal, and then for the record.
const SIGNAL_WAIT: Duration = Duration::from_secs(2);
const RECORD_WAIT: Duration = Duration::from_secs(5);
/// How many times a cancel follows a task that moved on while it was being cancelled
/// (delivered again, or handed back by its attempt).
const MOVED_RETRIES: u32 = 3;

/// How signalling a running attempt to stop came out.
enum Cancelling {
    /// The answer to give.
    Answer(Value),
    /// The task moved on meanwhile: another attempt runs now (the one signalled was
    /// stale), or the attempt ended and handed the task back (`retrying`, `pending`: it
    /// failed, or its worker let it go) instead of ending it `cancelled`. Cancel it as it
    /// is now; this answer if that keeps happening.
    Moved(Value),
}

/// True for a record no attempt runs under: a task waiting to be delivered (again).
fn unstarted(state: TaskState) -> bool {
    matches!(
        state,
        TaskState::Scheduled | TaskState::Pending | TaskState::Retrying
    )
}

#[derive(Clone)]
pub(crate) struct Ops {
    pub(crate) js: jetstream::Context,
    pub(crate) tasks: TaskStore,
    /// `AX_LIMITS`: a queue's pause is a key there (`limits::pause_key`).
    pub(crate) limits: kv::Store,
    /// The task index, on a server that keeps one (`ServerBuilder::task_index`).
    pub(crate) index: Option<Arc<TaskIndex>>,
    /// The declared queues, to refuse settings of an unknown one.
    pub(crate) ctx: Arc<crate::context::Context>,
}

fn conflict(msg: impl Into<String>) -> WireError {
    WireError::new(ErrorCode::Conflict, msg)
}

fn state_err(e: StateError) -> WireError {
    WireError::unavailable(e)
}

fn note(op: &str, by: &str) -> Option<OpNote> {
    Some(OpNote {
        op: op.to_string(),
        by: by.to_string(),
        at_ms: now_ms(),
    })
}

/// The events one stored change stands for: the change itself, preceded, when it is the
/// first record of a task whose submit stored none (the claim created it: docs/PROTOCOL.md
/// §3, "Unrecorded tasks"), by the `submitted` event and, when it ends an attempt that
/// never wrote `running` (one that ended within its first second), by that attempt's
/// `started` event, from the times the record keeps.
fn events_of(before: Option<&TaskRecord>, rec: &TaskRecord) -> Vec<Value> {
    let mut out = Vec::new();
    let mut before = before.cloned();
    if before.is_none() && !matches!(rec.state, TaskState::Scheduled | TaskState::Pending) {
        let mut submitted = rec.clone();
        submitted.state = TaskState::Pending;
        submitted.op = None;
        submitted.attempt = 0;
        submitted.updated_at_ms = rec.created_at_ms;
        out.push(event(None, &submitted));
        before = Some(submitted);
    }
    let ends_attempt = matches!(
        rec.state,
        TaskState::Succeeded | TaskState::Retrying | TaskState::Dead | TaskState::Cancelled
    );
    let unwritten_start = before.as_ref().is_some_and(|b| b.attempt != rec.attempt);
    if let (Some(at), true) = (rec.started_at_ms, ends_attempt && unwritten_start) {
        let mut started = rec.clone();
        started.state = TaskState::Running;
        started.op = None;
        started.updated_at_ms = at;
        out.push(event(before.as_ref(), &started));
        before = Some(started);
    }
    out.push(event(before.as_ref(), rec));
    out
}

/// One change of a task as an event: what happened, when, who did it, why.
fn event(before: Option<&TaskRecord>, rec: &TaskRecord) -> Value {
    let by_op = rec
        .op
        .as_ref()
        .filter(|o| before.is_none_or(|b| b.op.as_ref() != Some(*o)));
    let name = match (rec.state, by_op) {
        (TaskState::Pending, Some(o)) if o.op == "retry" => "retried",
        (TaskState::Pending, Some(o)) if o.op == "run_now" => "run_now",
        (TaskState::Cancelled, _) => "cancelled",
        (TaskState::Running, Some(o)) if o.op == "cancel" => "cancel_requested",
        (TaskState::Scheduled, _) => "scheduled",
        (TaskState::Pending, _) if before.is_none() => "submitted",
        (TaskState::Pending, _) => "pending",
        (TaskState::Running, _) => "started",
        (TaskState::Retrying, _) => "failed_will_retry",
        (TaskState::Succeeded, _) => "succeeded",
        (TaskState::Dead, _) => "dead",
    };
    let actor = match (by_op, rec.state) {
        (Some(o), _) => format!("operator {}", o.by),
        (None, TaskState::Scheduled | TaskState::Pending) => match &rec.trigger {
            Some(t) => format!("trigger {t}"),
            None => "producer".to_string(),
        },
        (None, _) => rec
            .worker
            .as_ref()
            .map_or("ax".to_string(), |w| format!("worker {w}")),
    };
    let reason = match rec.state {
        TaskState::Retrying | TaskState::Dead | TaskState::Cancelled => rec
            .last_error
            .as_ref()
            .map(|e| format!("{}: {}", e.class, e.message)),
        _ => None,
    };
    json!({
        "event": name,
        "at_ms": rec.updated_at_ms,
        "state": rec.state,
        "attempt": rec.attempt,
        "actor": actor,
        "reason": reason,
        "next_retry_at_ms": rec.next_retry_at_ms,
    })
}

impl Ops {
    async fn read(&self, id: &str) -> Result<(TaskRecord, u64), WireError> {
        if names::queue_of_task_id(id).is_none() {
            return Err(WireError::field("id", "not a task id"));
        }
        self.tasks
            .find(id)
            .await
            .map_err(state_err)?
            .ok_or_else(|| WireError::new(ErrorCode::NotFound, format!("no task {id}")))
    }

    /// Cancels a task: one not started never runs; a running attempt is signalled to stop
    /// and ends `cancelled`. Answers the task's state after the operation.
    pub(crate) async fn cancel(&self, id: &str, by: &str) -> Result<Value, WireError> {
        let mut attempts_moved = 0;
        // A worker that held the task's message and stopped at this cancel's signal.
        let mut signalled: Option<String> = None;
        loop {
            let (rec, rev) = self.read(id).await?;
            match rec.state {
                // The signalled worker wrote `cancelled` itself, before this cancel did.
                TaskState::Cancelled if signalled.is_some() => {
                    return Ok(json!({"id": id, "state": "cancelled", "worker": signalled}))
                }
                s if s.is_terminal() => {
                    return Err(conflict(format!("task {id} is {s}: nothing to cancel")))
                }
                TaskState::Running => match self.cancel_running(rec, rev, by).await? {
                    Cancelling::Answer(answer) => return Ok(answer),
                    // Another attempt took over meanwhile: cancel that one (a few times).
                    Cancelling::Moved(answer) => {
                        attempts_moved += 1;
                        if attempts_moved > MOVED_RETRIES {
                            return Ok(answer);
                        }
                    }
                },
                _ => {
                    let delayed = rec
                        .delayed_seq
                        .filter(|_| rec.state == TaskState::Scheduled);
                    // No record yet (revision 0): a task whose submit stored none, found by
                    // its ready message. The message goes as the record is made, so no
                    // worker fetches it only to ack it unrun.
                    let unclaimed = rec.ready_seq.filter(|_| rev == 0);
                    // A worker may be starting it without a `running` write: stopped first,
                    // so the record counts the attempt it had started (ops::holder).
                    let holder = self.holders().stop_holder(&rec).await;
                    self.ctx.faults.cancel_writing().await;
                    let mut done = rec.transition(TaskState::Cancelled);
                    done.op = note("cancel", by);
                    done.attempt = done.attempt.max(holder.started());
                    match self.tasks.cas(&done, rev).await {
                        Ok(revision) => {
                            if let Some(seq) = delayed {
                                // Tidy: the dispatch would only be acked unrun.
                                self.delete(names::DELAYED_STREAM, seq).await;
                            }
                            if let Some(seq) = unclaimed {
                                self.delete(&done.priority.ready_stream(), seq).await;
                            }
                            let late = self
                                .holders()
                                .stop_late_holder(&holder, &done, revision)
                                .await;
                            let worker = holder.worker().or(late);
                            info!(task_id = %id, by, ?worker, "task cancelled before it started");
                            return Ok(match worker {
                                Some(w) => json!({"id": id, "state": "cancelled", "worker": w}),
                                None => json!({"id": id, "state": "cancelled"}),
                            });
                        }
                        Err(StateError::Stale { .. }) => {
                            signalled = holder.worker().or(signalled);
                            continue;
                        }
                        Err(e) => return Err(state_err(e)),
                    }
                }
            }
        }
    }

    async fn cancel_running(
        &self,
        rec: TaskRecord,
        rev: u64,
        by: &str,
    ) -> Result<Cancelling, WireError> {
        let id = rec.id.clone();
        let client = self.js.client();
        self.ctx.faults.cancel_signalling().await;
        let signal = tokio::time::timeout(
            SIGNAL_WAIT,
            client.request(names::cancel_subject(&rec.queue), Bytes::from(id.clone())),
        )
        .await;
        if let Ok(Ok(reply)) = signal {
            let worker = serde_json::from_slice::<Value>(&reply.payload)
                .ok()
                .and_then(|v| v["worker"].as_str().map(str::to_string));
            info!(task_id = %id, by, ?worker, "cancel signalled to the running attempt");
            let now = self.wait_change(&id, rev).await;
            let state = now
                .as_ref()
                .map_or("running".into(), |r| r.state.to_string());
            let answer = json!({"id": id, "state": state, "worker": worker});
            // The worker that answered held an older attempt (it stalled, and the task was
            // delivered again meanwhile): the attempt running now was not signalled.
            return Ok(match now {
                Some(now) if now.state == TaskState::Running && now.attempt != rec.attempt => {
                    Cancelling::Moved(answer)
                }
                // The answering worker's attempt had ended, or ended otherwise, and handed
                // the task back: it would be delivered and run again.
                Some(now) if unstarted(now.state) => Cancelling::Moved(answer),
                _ => Cancelling::Answer(answer),
            });
        }
        // No worker holds it (it died, or is cut off): fence it out and leave the word in
        // the record; the next delivery ends the task `cancelled` without running it.
        let mut asked = rec;
        asked.cancel_requested_at_ms = Some(now_ms());
        asked.op = note("cancel", by);
        match self.tasks.cas(&asked, rev).await {
            Ok(_) => {
                info!(task_id = %id, by, "cancel recorded; no worker answered the signal");
                Ok(Cancelling::Answer(
                    json!({"id": id, "state": "running", "cancel_requested": true}),
                ))
            }
            Err(StateError::Stale { .. }) => {
                let (now, _) = self.read(&id).await?;
                if now.state == TaskState::Cancelled {
                    return Ok(Cancelling::Answer(json!({"id": id, "state": "cancelled"})));
                }
                let changed = conflict(format!(
                    "task {id} ended {} while it was being cancelled: nothing to cancel",
                    now.state
                ));
                match now.state {
                    // Delivered again meanwhile: cancel the attempt running now. Or its
                    // attempt ended and handed it back (a failure to retry): cancel it as
                    // a task not started, or it runs again (a `cancel_in_progress`
                    // trigger's fire took this for "ended" and let the old run go on).
                    s if s == TaskState::Running || unstarted(s) => {
                        Ok(Cancelling::Moved(json!({"id": id, "state": s.to_string()})))
                    }
                    _ => Err(changed),
                }
            }
            Err(e) => Err(state_err(e)),
        }
    }

    /// The task's record once it moves past revision `rev` (or as it is after a while;
    /// `None` if it could not be read).
    async fn wait_change(&self, id: &str, rev: u64) -> Option<TaskRecord> {
        let deadline = tokio::time::Instant::now() + RECORD_WAIT;
        loop {
            if let Ok(Some((rec, now))) = self.tasks.get_latest(id).await {
                if now != rev || tokio::time::Instant::now() >= deadline {
                    return Some(rec);
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Runs a dead task again: one more attempt, or (`reset`) its attempts from zero.
    pub(crate) async fn retry(&self, id: &str, reset: bool, by: &str) -> Result<Value, WireError> {
        let (rec, rev) = self.read(id).await?;
        if rec.state != TaskState::Dead {
            return Err(conflict(format!(
                "task {id} is {}: only dead tasks are retried",
                rec.state
            )));
        }
        let letter = self.dead_letter(id).await?;
        let mut meta = TaskMeta::from_headers(&letter.0)
            .map_err(|e| conflict(format!("dead letter of {id} unreadable: {e}")))?;
        let attempt = if reset { 0 } else { rec.attempt };
        if !reset {
            // One more attempt; the number is explicit, so no worker option replaces it.
            meta.max_attempts = rec.attempt + 1;
            meta.defaulted.max_attempts = false;
        }
        meta.retry_of = Some(rev);
        let subject = names::ready_subject(&meta.queue, meta.priority);
        let msg_id = format!("{id}.retry.{rev}");
        let ack = self
            .publish(subject, meta.to_headers(), &msg_id, letter.1)
            .await?;
        self.ctx.faults.retry_published().await;
        let mut again = rec.transition(TaskState::Pending);
        again.attempt = attempt;
        again.max_attempts = meta.max_attempts;
        again.finished_at_ms = None;
        again.ready_seq = Some(ack);
        again.superseded_seq = None;
        again.cancel_requested_at_ms = None;
        again.op = note("retry", by);
        match self.tasks.cas(&again, rev).await {
            Ok(_) => {
                info!(task_id = %id, by, reset, "dead task retried");
                Ok(json!({"id": id, "state": "pending", "attempt": attempt,
                    "max_attempts": meta.max_attempts}))
            }
            Err(StateError::Stale { .. }) => Err(conflict(format!(
                "task {id} changed while it was being retried; look again"
            ))),
            Err(e) => Err(state_err(e)),
        }
    }

    /// Starts a scheduled or retrying task now instead of at its due time.
    pub(crate) async fn run_now(&self, id: &str, by: &str) -> Result<Value, WireError> {
        let (rec, rev) = self.read(id).await?;
        let (stream, old_seq, msg_id) = match rec.state {
            TaskState::Scheduled => {
                let seq = rec.delayed_seq.ok_or_else(|| {
                    conflict(format!(
                        "task {id} names no delayed message (submitted before this version)"
                    ))
                })?;
                // The scheduler's own dispatch uses the task id: whichever is second is a
                // duplicate within the window.
                (names::DELAYED_STREAM.to_string(), seq, id.to_string())
            }
            TaskState::Retrying => {
                let seq = rec
                    .ready_seq
                    .ok_or_else(|| conflict(format!("task {id} names no ready message")))?;
                (rec.priority.ready_stream(), seq, format!("{id}.now.{rev}"))
            }
            s => {
                return Err(conflict(format!(
                    "task {id} is {s}: only scheduled and retrying tasks are run now"
                )))
            }
        };
        let (headers, payload) = match self.message(&stream, old_seq).await {
            Ok(found) => found,
            Err(e) if e.code == ErrorCode::NotFound => {
                return Err(conflict(format!(
                    "task {id} is on its way to a worker already"
                )))
            }
            Err(e) => return Err(e),
        };
        if let Some(wait) = headers.get(ax_core::task::header::WAIT) {
            // A flow's wait: run now ends it now as its time would (a sleep wakes; a wait
            // for an event or an approval times out by its policy); no worker runs it.
            let kind = ax_core::task::Wait::parse(wait.as_str()).ok_or_else(|| {
                conflict(format!(
                    "task {id} is a wait of a kind this server does not know ({})",
                    wait.as_str()
                ))
            })?;
            let state = crate::schedule::wake::end(&self.tasks, id, kind)
                .await
                .map_err(state_err)?;
            self.delete(&stream, old_seq).await;
            return Ok(json!({"id": id, "state": state}));
        }
        let subject = names::ready_subject(&rec.queue, rec.priority);
        let ack = self.publish(subject, headers, &msg_id, payload).await?;
        let scheduled = rec.state == TaskState::Scheduled;
        let mut now = rec.transition(TaskState::Pending);
        now.ready_seq = Some(ack);
        now.superseded_seq = (!scheduled).then_some(old_seq);
        now.op = note("run_now", by);
        match self.tasks.cas(&now, rev).await {
            Ok(_) => {}
            // A worker took it meanwhile (the scheduler dispatched it): it runs anyway.
            Err(StateError::Stale { .. }) => {
                let (cur, _) = self.read(id).await?;
                return Ok(json!({"id": id, "state": cur.state}));
            }
            Err(e) => return Err(state_err(e)),
        }
        self.delete(&stream, old_seq).await;
        info!(task_id = %id, by, "task run now");
        Ok(json!({"id": id, "state": "pending"}))
    }

    /// Pauses (`paused` true) or resumes a queue.
    pub(crate) async fn pause(
        &self,
        queue: &str,
        paused: bool,
        reason: Option<&str>,
        by: &str,
    ) -> Result<Value, WireError> {
        if !names::valid_queue(queue) {
            return Err(WireError::field("queue", "not a queue name"));
        }
        let key = crate::limits::pause_key(queue);
        if paused {
            let value = json!({"paused_at_ms": now_ms(), "by": by, "reason": reason});
            self.limits
                .put(&key, value.to_string().into())
                .await
                .map_err(WireError::unavailable)?;
        } else {
            self.limits
                .delete(&key)
                .await
                .map_err(WireError::unavailable)?;
        }
        info!(
            queue,
            by,
            paused,
            "queue {}",
            if paused { "paused" } else { "resumed" }
        );
        Ok(json!({"queue": queue, "paused": paused}))
    }

    /// The paused queues, with when and why.
    pub(crate) async fn paused(&self) -> Result<Vec<(String, Value)>, WireError> {
        use futures::StreamExt;
        let mut out = Vec::new();
        let info = self
            .limits
            .stream
            .get_info()
            .await
            .map_err(WireError::unavailable)?;
        if info.state.messages == 0 {
            return Ok(out);
        }
        let mut keys = self.limits.keys().await.map_err(WireError::unavailable)?;
        while let Some(key) = keys.next().await {
            let key = key.map_err(WireError::unavailable)?;
            if let Some(queue) = key.strip_suffix(".=paused") {
                if let Some(v) = self
                    .limits
                    .get(&key)
                    .await
                    .map_err(WireError::unavailable)?
                {
                    out.push((
                        queue.to_string(),
                        serde_json::from_slice(&v).unwrap_or(Value::Null),
                    ));
                }
            }
        }
        Ok(out)
    }

    /// Ready tasks per priority of `queue` (messages on its ready subjects).
    pub(crate) async fn depth(&self, queue: &str) -> [u64; 3] {
        use futures::StreamExt;
        let mut out = [0; 3];
        for p in Priority::ALL {
            let Ok(stream) = self.js.get_stream(p.ready_stream()).await else {
                continue;
            };
            let subject = names::ready_subject(queue, p);
            if let Ok(mut subjects) = stream.info_with_subjects(subject.clone()).await {
                while let Some(Ok((s, n))) = subjects.next().await {
                    if s == subject {
                        out[p.index()] = n as u64;
                    }
                }
            }
        }
        out
    }

    /// Every stored change of task `id`, oldest first, from `AX_TASK_EVENTS` (kept 30
    /// days, however many revisions the record has had): one event per change, named
    /// for what happened, with who did it.
    ///
    /// Without that stream (it is optional: `Topology::task_events`), the record's own
    /// history (its last 16 revisions); `complete` says which.
    pub(crate) async fn events(&self, id: &str) -> Result<(Vec<Value>, bool), WireError> {
        use futures::StreamExt;
        if names::queue_of_task_id(id).is_none() {
            return Err(WireError::field("id", "not a task id"));
        }
        let stream = match self.js.get_stream(names::EVENTS_STREAM).await {
            Ok(stream) => stream,
            Err(e) if crate::streams::is_not_found(&e) => {
                let history = self.tasks.history(id).await.map_err(state_err)?;
                let mut before: Option<TaskRecord> = None;
                let mut out = Vec::new();
                for (rec, _) in history {
                    out.extend(events_of(before.as_ref(), &rec));
                    before = Some(rec);
                }
                return Ok((out, false));
            }
            Err(e) => return Err(WireError::unavailable(e)),
        };
        let subject = format!("$KV.{}.{id}", names::TASKS_BUCKET);
        let mut info = stream
            .info_with_subjects(subject.clone())
            .await
            .map_err(WireError::unavailable)?;
        let mut stored = 0u64;
        while let Some(Ok((_, n))) = info.next().await {
            stored += n as u64;
        }
        let mut out = Vec::new();
        if stored == 0 {
            return Ok((out, true));
        }
        let mut messages = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subject: subject,
                deliver_policy: jetstream::consumer::DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .map_err(WireError::unavailable)?
            .messages()
            .await
            .map_err(WireError::unavailable)?;
        let mut before: Option<TaskRecord> = None;
        for _ in 0..stored {
            let msg = tokio::time::timeout(Duration::from_secs(5), messages.next())
                .await
                .map_err(|_| WireError::unavailable("the event history did not arrive in time"))?;
            let Some(Ok(msg)) = msg else { break };
            let Ok(rec) = serde_json::from_slice::<TaskRecord>(&msg.payload) else {
                out.push(json!({"event": "removed"}));
                continue;
            };
            out.extend(events_of(before.as_ref(), &rec));
            before = Some(rec);
        }
        Ok((out, true))
    }

    /// A task's latest dead letter (`ax.dead.<task id>`, a direct get by subject).
    pub(super) async fn dead_letter(
        &self,
        id: &str,
    ) -> Result<(async_nats::HeaderMap, Bytes), WireError> {
        let stream = self
            .js
            .get_stream(names::DEAD_STREAM)
            .await
            .map_err(WireError::unavailable)?;
        match stream
            .get_last_raw_message_by_subject(&names::task_dead_subject(id))
            .await
        {
            Ok(msg) => Ok((msg.headers, msg.payload)),
            Err(e) if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound => {
                Err(conflict(format!(
                    "no dead letter of task {id} (kept 30 days; before version 0.2 dead letters \
                     were stored per queue): its payload is gone"
                )))
            }
            Err(e) => Err(WireError::unavailable(e)),
        }
    }

    pub(super) async fn message(
        &self,
        stream: &str,
        seq: u64,
    ) -> Result<(async_nats::HeaderMap, Bytes), WireError> {
        let stream = self
            .js
            .get_stream(stream)
            .await
            .map_err(WireError::unavailable)?;
        match stream.get_raw_message(seq).await {
            Ok(msg) => Ok((msg.headers, msg.payload)),
            Err(e) if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound => {
                Err(WireError::new(
                    ErrorCode::NotFound,
                    format!("message {seq} is gone"),
                ))
            }
            Err(e) => Err(WireError::unavailable(e)),
        }
    }

    /// Publishes a task message and returns its stream sequence.
    async fn publish(
        &self,
        subject: String,
        headers: async_nats::HeaderMap,
        msg_id: &str,
        payload: Bytes,
    ) -> Result<u64, WireError> {
        // A copy of a task's message (a retry, a run now) is never an unrecorded task's
        // first delivery: its record exists (docs/PROTOCOL.md §3 step 1).
        let mut headers = headers;
        headers.insert(ax_core::task::header::UNRECORDED, "0");
        let ack =
            crate::submit::publish_headers(&self.js, subject, headers, msg_id, payload).await?;
        Ok(ack.sequence)
    }

    async fn delete(&self, stream: &str, seq: u64) {
        // Best effort: a message left behind is acked unrun by the claim that meets it.
        let _ = ax_core::admit::delete_message(&self.js, stream, seq).await;
    }
}
