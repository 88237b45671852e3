//! The payload of a step's task: the run's input, the parents' outputs by step name, the
//! item of a fan-out, and the template's own payload (docs/PROTOCOL.md §6).
//!
//! ```json
//! {"flow": "thumbnails", "run": "…", "step": "report",
//!  "input": {…},                      // the run's input
//!  "parents": {"resize": [o0, o1]},   // outputs of succeeded parents (a fan-out: a list, in item order)
//!  "errors": {"cleanup": {"state": "failed", "class": "…", "message": "…"}},
//!  "item": …, "index": 3,             // a fan-out step: its item and the item's index
//!  "args": …}                         // the step template's `payload`
//! ```
//!
//! A run builds its steps' tasks here: parents' outputs held for it, or read back from
//! the tasks' records (and `AX_RESULTS`); its input held, or read back from the run key.

use super::actor::{Built, Run, CONCURRENCY};
use super::def::MAX_FAN_OUT;
use super::model::StepState;
use super::shared::Shared;
use ax_core::protocol::ErrorCode;
use ax_core::state::ErrorInfo;
use ax_core::task::TaskMeta;
use ax_sdk::output::TaskOutput;
use futures::StreamExt;
use serde_json::{json, Map, Value};

/// A parent's outcome as a step sees it.
#[derive(Debug, Clone)]
pub(crate) enum Parent {
    /// It succeeded with this output (`null` for none).
    Output(Value),
    /// It failed, was skipped or cancelled.
    Ended {
        state: &'static str,
        error: Option<ErrorInfo>,
    },
}

/// A task output as JSON: the value itself, or `{content_type, base64}` for bytes.
pub(crate) fn output_value(out: Option<TaskOutput>) -> Value {
    let Some(out) = out else { return Value::Null };
    if out.is_json {
        if let Ok(v) = serde_json::from_slice(&out.bytes) {
            return v;
        }
    }
    use base64::Engine as _;
    json!({"content_type": "application/octet-stream",
           "base64": base64::engine::general_purpose::STANDARD.encode(&out.bytes)})
}

/// What every task of one step shares.
pub(crate) struct StepInput<'a> {
    pub(crate) flow: &'a str,
    pub(crate) run: &'a str,
    pub(crate) step: &'a str,
    pub(crate) input: &'a Value,
    pub(crate) parents: Vec<(&'a str, Parent)>,
    pub(crate) args: Option<&'a Value>,
}

impl StepInput<'_> {
    /// The payload of one task: `item` is `(index, value)` for a fan-out step.
    pub(crate) fn payload(&self, item: Option<(u32, &Value)>) -> Value {
        let mut body = Map::new();
        body.insert("flow".into(), json!(self.flow));
        body.insert("run".into(), json!(self.run));
        body.insert("step".into(), json!(self.step));
        body.insert("input".into(), self.input.clone());
        let mut outputs = Map::new();
        let mut errors = Map::new();
        for (name, parent) in &self.parents {
            match parent {
                Parent::Output(v) => {
                    outputs.insert(name.to_string(), v.clone());
                }
                Parent::Ended { state, error } => {
                    let mut e = json!({ "state": state });
                    if let Some(error) = error {
                        e["class"] = json!(error.class);
                        e["message"] = json!(error.message);
                    }
                    errors.insert(name.to_string(), e);
                }
            }
        }
        body.insert("parents".into(), Value::Object(outputs));
        if !errors.is_empty() {
            body.insert("errors".into(), Value::Object(errors));
        }
        if let Some((index, value)) = item {
            body.insert("item".into(), value.clone());
            body.insert("index".into(), json!(index));
        }
        if let Some(args) = self.args {
            body.insert("args".into(), args.clone());
        }
        Value::Object(body)
    }
}

/// What a step's tasks are built from, read from a run: its input, its parents' outputs.
impl Run {
    /// The run's input: held, or read back from the run key.
    pub(super) async fn input(&self, sh: &Shared) -> Result<Value, ErrorInfo> {
        if let Some((_, text)) = &self.input {
            return Ok(serde_json::from_slice(text).expect("held as valid JSON"));
        }
        let unavailable = |message: String| ErrorInfo {
            detail: None,
            class: "input_unavailable".into(),
            message,
        };
        match sh.store.run(&self.id).await {
            Ok(Some((run, _))) => Ok(run.input),
            Ok(None) => Err(unavailable("the run is gone".into())),
            Err(e) => Err(unavailable(format!("reading the run's input: {e}"))),
        }
    }

    /// The output of succeeded step `p` as its children see it: the task's output, or for
    /// a fan-out step the list of its tasks' outputs in item order. Outputs not held are
    /// read back from the tasks' records (and `AX_RESULTS`).
    pub(super) async fn output_of(&self, sh: &Shared, p: usize) -> Result<Value, ErrorInfo> {
        let shape = self.shape();
        let name = &shape.def.steps[p].name;
        let unavailable = |message: String| ErrorInfo {
            detail: None,
            class: "input_unavailable".into(),
            message,
        };
        let n = self.steps[p].items.unwrap_or(0) as usize;
        let mut outputs: Vec<Option<Option<TaskOutput>>> = vec![None; n];
        if let Some(held) = self.held.iter().find(|h| h.step == p) {
            for (k, out) in &held.outputs {
                if let Some(slot) = outputs.get_mut(*k as usize) {
                    *slot = Some(out.clone());
                }
            }
        }
        let tasks = &sh.ctx.tasks;
        let reads = (0..n as u32)
            .filter(|&k| outputs[k as usize].is_none())
            .map(|k| (k, self.task_id(p, k)))
            .map(|(k, id)| async move { (k, tasks.get_latest(&id).await) });
        let reads: Vec<_> = futures::stream::iter(reads.collect::<Vec<_>>())
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        for (k, read) in reads {
            let read = read.map_err(|e| unavailable(format!("reading parent {name:?}: {e}")))?;
            let out =
                match read.and_then(|(rec, _)| rec.output) {
                    None => None,
                    Some(stored) => match stored.inline() {
                        Some(out) => Some(out),
                        None => sh.results.read(&stored).await.map_err(|e| {
                            unavailable(format!("reading an output of {name:?}: {e}"))
                        })?,
                    },
                };
            outputs[k as usize] = Some(out);
        }
        let mut values: Vec<Value> = outputs
            .into_iter()
            .map(|out| output_value(out.flatten()))
            .collect();
        Ok(if shape.def.steps[p].for_each.is_some() {
            Value::Array(values)
        } else {
            values.pop().unwrap_or(Value::Null)
        })
    }

    /// The payloads of step `i`'s tasks (one, or one per fan-out item).
    pub(super) async fn payloads(&self, sh: &Shared, i: usize) -> Result<Vec<Value>, ErrorInfo> {
        let shape = self.shape();
        let step = &shape.def.steps[i];
        let mut parents = Vec::new();
        let mut fan_out = None;
        for &p in &shape.plan.parents[i] {
            let name = shape.def.steps[p].name.as_str();
            let parent = match self.steps[p].state {
                StepState::Succeeded => Parent::Output(self.output_of(sh, p).await?),
                other => Parent::Ended {
                    state: other.as_str(),
                    error: self.steps[p].error.as_deref().cloned(),
                },
            };
            if step.for_each.as_deref() == Some(name) {
                fan_out = Some(parent);
            } else {
                parents.push((name, parent));
            }
        }
        let input = self.input(sh).await?;
        let input = StepInput {
            flow: &shape.flow,
            run: &self.id,
            step: &step.name,
            input: &input,
            parents,
            args: step.task.payload.as_ref(),
        };
        let Some(fan_out) = fan_out else {
            return Ok(vec![input.payload(None)]);
        };
        let over = step.for_each.as_deref().unwrap_or_default();
        let list = match fan_out {
            Parent::Output(Value::Array(list)) => list,
            Parent::Output(other) => {
                return Err(ErrorInfo {
                    detail: None,
                    class: "bad_fan_out".into(),
                    message: format!(
                        "for_each {over:?}: its output is not a JSON array but {}",
                        kind(&other)
                    ),
                })
            }
            Parent::Ended { state, .. } => {
                return Err(ErrorInfo {
                    detail: None,
                    class: "bad_fan_out".into(),
                    message: format!("for_each {over:?}: it ended {state}, with no output"),
                })
            }
        };
        if list.len() > MAX_FAN_OUT {
            return Err(ErrorInfo {
                detail: None,
                class: "fan_out_too_large".into(),
                message: format!(
                    "for_each {over:?}: {} items, at most {MAX_FAN_OUT}",
                    list.len()
                ),
            });
        }
        Ok(list
            .iter()
            .enumerate()
            .map(|(k, v)| input.payload(Some((k as u32, v))))
            .collect())
    }

    /// Builds step `i`'s tasks (only items `only`, sorted, if given), each checked as its
    /// submit would be. An error fails the step (never a stuck run).
    pub(super) async fn build(
        &self,
        sh: &Shared,
        i: usize,
        only: Option<&[u32]>,
    ) -> Result<Vec<Built>, ErrorInfo> {
        let step = &self.shape().def.steps[i];
        if let Some(sleep) = &step.sleep {
            return self.sleep_task(sh, i, sleep).map(|t| vec![t]);
        }
        if let Some(wait) = &step.wait_for_event {
            return self.event_task(sh, i, wait).await.map(|t| vec![t]);
        }
        if let Some(approval) = &step.approval {
            return self.approval_task(sh, i, approval).map(|t| vec![t]);
        }
        if let Some(child) = &step.child_flow {
            return self.child_tasks(sh, i, child, only).await;
        }
        let payloads = self.payloads(sh, i).await?;
        let limits = &sh.ctx.limits;
        let template = &self.shape().def.steps[i].task;
        let queue = template.queue.clone().unwrap_or_default();
        let mut built = Vec::with_capacity(only.map_or(payloads.len(), <[u32]>::len));
        for (k, payload) in payloads.into_iter().enumerate() {
            let k = k as u32;
            if only.is_some_and(|only| only.binary_search(&k).is_err()) {
                continue;
            }
            let mut req = template.clone();
            req.payload = Some(payload);
            req.business_id = self.business_id.as_deref().map(str::to_string);
            let (mut meta, body) = TaskMeta::from_request(&queue, req, limits).map_err(|e| {
                let class = match (e.code, e.field.as_deref()) {
                    (ErrorCode::PayloadTooLarge, _) | (_, Some("payload")) => "input_too_large",
                    _ => "invalid_step_task",
                };
                ErrorInfo {
                    detail: None,
                    class: class.into(),
                    message: e.message,
                }
            })?;
            meta.id = self.task_id(i, k);
            built.push((k, meta, body));
        }
        Ok(built)
    }
}

pub(super) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_names_parents_errors_and_items() {
        let input = json!({"order": 7});
        let args = json!({"size": 64});
        let step = StepInput {
            flow: "f",
            run: "R",
            step: "s",
            input: &input,
            parents: vec![
                ("a", Parent::Output(json!([1, 2]))),
                (
                    "b",
                    Parent::Ended {
                        state: "failed",
                        error: Some(ErrorInfo {
                            detail: None,
                            class: "boom".into(),
                            message: "m".into(),
                        }),
                    },
                ),
            ],
            args: Some(&args),
        };
        let p = step.payload(Some((3, &json!("x"))));
        assert_eq!(p["input"]["order"], 7);
        assert_eq!(p["parents"]["a"], json!([1, 2]));
        assert_eq!(p["errors"]["b"]["class"], "boom");
        assert_eq!(
            (p["item"].clone(), p["index"].clone()),
            (json!("x"), json!(3))
        );
        assert_eq!(p["args"]["size"], 64);
        let bytes = output_value(Some(TaskOutput {
            bytes: vec![0u8, 1].into(),
            is_json: false,
        }));
        assert_eq!(bytes["base64"], "AAE=");
        assert_eq!(output_value(None), Value::Null);
    }
}
