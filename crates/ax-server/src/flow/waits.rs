//! A wait step's wait task (docs/PROTOCOL.md §6, "Waits"): a task no worker runs, due
//! when the wait ends by time, marked `Ax-Wait` so the dispatcher ends it itself.
//!
//! - A sleep's task is due when the sleep ends; its dispatch records it `succeeded`.
//! - A wait for an event's task is due at its timeout; its payload names the event, the
//!   values the event must have (resolved here, from the step's input document) and the
//!   window of events that count. The submit stores that in `AX_WAITS` before the task
//!   is accepted (`submit`); the matcher (`crate::event_wait`) ends it `succeeded` with the
//!   first matching event; a timeout ends it by its policy (`schedule::wake`).
//!
//! - An approval's task is due at its timeout; its payload names the step and its
//!   message. The submit draws the token's secret and stores it in `AX_WAITS` (never in
//!   the message), and announces the token once the task is stored (`crate::approval`);
//!   a completion that presents it ends the wait; a timeout ends it by its policy.
//!
//! All are counted from the step's recorded start, so a task submitted again is the
//! same task.

use super::actor::{Built, Run};
use super::def::{ApprovalDef, SleepDef, WaitForEventDef};
use super::shared::Shared;
use ax_core::event::{ApprovalWait, WaitRegistration};
use ax_core::state::ErrorInfo;
use ax_core::task::{TaskMeta, Wait};
use ax_core::time::now_ms;
use serde_json::{json, Map, Value};
use std::time::Duration;

/// When a sleep that started at `started_ms` ends, ms since the epoch (`until`, or
/// `for_ms` after the start).
pub(crate) fn wake_at_ms(sleep: &SleepDef, started_ms: u64) -> u64 {
    match (&sleep.until, sleep.for_ms) {
        (Some(until), _) => ax_core::time::parse_rfc3339_ms(until).unwrap_or(started_ms),
        (None, Some(ms)) => started_ms.saturating_add(ms),
        (None, None) => started_ms,
    }
}

/// When a wait that started at `started_ms` times out (its `timeout_ms`, or the
/// server's max delay).
pub(crate) fn timeout_at_ms(timeout_ms: Option<u64>, started_ms: u64, max_delay: Duration) -> u64 {
    let timeout = timeout_ms.unwrap_or(max_delay.as_millis().min(u128::from(u64::MAX)) as u64);
    started_ms.saturating_add(timeout)
}

/// A `match` resolved against the step's input document: `"$input.a"` and
/// `"$parents.p.b"` are read from it, `"$$x"` is `"$x"`, other values are themselves.
pub(crate) fn resolve(
    matches: &Map<String, Value>,
    doc: &Value,
) -> Result<Map<String, Value>, ErrorInfo> {
    let mut out = Map::new();
    for (path, want) in matches {
        let value = match want.as_str() {
            Some(text) if text.starts_with("$$") => Value::String(text[1..].to_string()),
            Some(text) if text.starts_with('$') => ax_core::event::field(doc, &text[1..])
                .cloned()
                .ok_or_else(|| ErrorInfo {
                    detail: None,
                    class: "bad_match".into(),
                    message: format!(
                        "match {path:?}: {text:?} names nothing in the step's input (it has input, parents and args)"
                    ),
                })?,
            _ => want.clone(),
        };
        out.insert(path.clone(), value);
    }
    Ok(out)
}

fn invalid(message: String) -> ErrorInfo {
    ErrorInfo {
        detail: None,
        class: "invalid_step_task".into(),
        message,
    }
}

impl Run {
    /// A sleep step's wait task: due when the sleep ends, `Ax-Wait: sleep`.
    pub(super) fn sleep_task(
        &self,
        sh: &Shared,
        i: usize,
        sleep: &SleepDef,
    ) -> Result<Built, ErrorInfo> {
        let started = self.steps[i].record().started_at_ms.unwrap_or_else(now_ms);
        let wake = wake_at_ms(sleep, started);
        let body = json!({"wake_at_ms": wake});
        self.wait_task(sh, i, 0, body, wake, Wait::Sleep)
    }

    /// A wait for an event's wait task: due at its timeout, `Ax-Wait: event` (or
    /// `event-or-null`), its payload the [`WaitRegistration`] the submit stores.
    pub(super) async fn event_task(
        &self,
        sh: &Shared,
        i: usize,
        wait: &WaitForEventDef,
    ) -> Result<Built, ErrorInfo> {
        let started = self.steps[i].record().started_at_ms.unwrap_or_else(now_ms);
        let until = timeout_at_ms(wait.timeout_ms, started, sh.ctx.limits.max_delay);
        let doc = self
            .payloads(sh, i)
            .await?
            .pop()
            .ok_or_else(|| invalid("a wait for an event has no input document".into()))?;
        let matches = resolve(&wait.matches, &doc)?;
        let reg = WaitRegistration {
            task: self.task_id(i, 0),
            event: wait.event.clone(),
            matches: matches.into_iter().collect(),
            since_ms: started.saturating_sub(wait.lookback()),
            until_ms: until,
            approval: None,
            on_timeout: Some(wait.on_timeout),
        };
        let body = serde_json::to_value(&reg).expect("a registration serializes");
        self.wait_task(sh, i, 0, body, until, Wait::Event(wait.on_timeout))
    }

    /// An approval's wait task: due at its timeout, `Ax-Wait: approval` (or
    /// `approval-or-null`), its payload the [`WaitRegistration`] (no event, no secret
    /// yet: the submit draws it).
    pub(super) fn approval_task(
        &self,
        sh: &Shared,
        i: usize,
        approval: &ApprovalDef,
    ) -> Result<Built, ErrorInfo> {
        let started = self.steps[i].record().started_at_ms.unwrap_or_else(now_ms);
        let until = timeout_at_ms(approval.timeout_ms, started, sh.ctx.limits.max_delay);
        let shape = self.shape();
        let reg = WaitRegistration {
            task: self.task_id(i, 0),
            event: String::new(),
            matches: Default::default(),
            since_ms: started,
            until_ms: until,
            on_timeout: None,
            approval: Some(ApprovalWait {
                flow: shape.flow.to_string(),
                run: self.id.to_string(),
                step: shape.def.steps[i].name.clone(),
                message: approval.message.clone(),
                secret: None,
            }),
        };
        let body = serde_json::to_value(&reg).expect("a registration serializes");
        self.wait_task(sh, i, 0, body, until, Wait::Approval(approval.on_timeout))
    }

    /// Item `k` of step `i`'s wait tasks: `fields` beside the flow, run and step in its
    /// payload.
    pub(super) fn wait_task(
        &self,
        sh: &Shared,
        i: usize,
        k: u32,
        fields: Value,
        due_ms: u64,
        wait: Wait,
    ) -> Result<Built, ErrorInfo> {
        let shape = self.shape();
        let step = &shape.def.steps[i];
        let mut payload = json!({"flow": shape.flow, "run": self.id.as_ref(), "step": step.name});
        if let (Some(to), Value::Object(from)) = (payload.as_object_mut(), fields) {
            to.extend(from);
        }
        let mut req = step.task.clone();
        req.payload = Some(payload);
        req.business_id = self.business_id.as_deref().map(str::to_string);
        let queue = req.queue.clone().unwrap_or_default();
        let (mut meta, body) =
            TaskMeta::from_request(&queue, req, &sh.ctx.limits).map_err(|e| invalid(e.message))?;
        meta.run_at_ms = Some(due_ms);
        meta.wait = Some(wait);
        meta.id = self.task_id(i, k);
        Ok((k, meta, body))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sleep_wakes_by_its_start_or_its_time() {
        let for_ms = SleepDef {
            for_ms: Some(500),
            ..SleepDef::default()
        };
        assert_eq!(wake_at_ms(&for_ms, 1_000), 1_500);
        let until = SleepDef {
            until: Some("2030-01-01T00:00:00Z".into()),
            ..SleepDef::default()
        };
        assert_eq!(wake_at_ms(&until, 1_000), 1_893_456_000_000);
    }

    #[test]
    fn a_match_reads_references_from_the_step_input_and_keeps_literals() {
        let doc = json!({"input": {"order_id": 7}, "parents": {"bill": {"invoice": "I-1"}}});
        let want = json!({"order_id": "$input.order_id", "invoice": "$parents.bill.invoice",
                          "kind": "paid", "tag": "$$input", "n": 3});
        let got = resolve(want.as_object().unwrap(), &doc).unwrap();
        assert_eq!(
            Value::Object(got),
            json!({"order_id": 7, "invoice": "I-1", "kind": "paid", "tag": "$input", "n": 3})
        );
        let missing = json!({"order_id": "$input.nope"});
        let e = resolve(missing.as_object().unwrap(), &doc).unwrap_err();
        assert_eq!(e.class, "bad_match");
    }

    #[test]
    fn a_wait_times_out_after_its_timeout_or_the_max_delay() {
        let wait = WaitForEventDef {
            timeout_ms: Some(500),
            ..WaitForEventDef::default()
        };
        let day = Duration::from_secs(86_400);
        assert_eq!(timeout_at_ms(wait.timeout_ms, 1_000, day), 1_500);
        let open = WaitForEventDef::default();
        assert_eq!(timeout_at_ms(open.timeout_ms, 1_000, day), 86_401_000);
    }
}
