//! Child flow steps (docs/PROTOCOL.md §6, "Child flows"): a step whose wait task
//! (`Ax-Wait: flow`, due at the step's timeout) stands for a run of another flow.
//!
//! - The engine submits the wait task, then starts the child run with an id drawn from
//!   the task's id ([`child_run_id`]) and `parent` naming the task: a start made again
//!   (a retry, a new leader, a load that finds the task stored and not ended) is a
//!   no-op. A fan-out step has one wait task, and one child run, per item.
//! - The child's end ends the wait task by compare-and-set *before* the child's final
//!   state is written (`end_parent`): a leader killed in between finds the child still
//!   running, decides its end again, and the task is ended already. Succeeded: the
//!   task's output is `{<leaf step>: <its output>}`; failed or cancelled: the task fails
//!   (`child_failed`, `child_cancelled`) and the step's `on_failure` applies.
//! - A wait task ended otherwise — its timeout (`schedule::wake`), a run-now, the parent's
//!   cancel or fail-fast — leaves its child without a parent: the engine cancels the
//!   child run before it writes the step's end (`Run::cancel_orphans`).

use super::actor::{Built, Done, Fault, Run, CONCURRENCY};
use super::child::ChildFlowDef;
use super::model::{child_run_id, ParentRef, RunState};
use super::shared::Shared;
use super::start::{start_run, Start};
use super::waits::timeout_at_ms;
use ax_core::protocol::ErrorCode;
use ax_core::state::{ErrorInfo, TaskState};
use ax_core::task::Wait;
use ax_core::time::now_ms;
use ax_core::wire::output::{StoredOutput, TaskOutput};
use futures::StreamExt;
use serde_json::{json, Map, Value};
use tracing::{debug, warn};

/// Most child runs one step starts (a longer fan-out fails the step, class
/// `fan_out_too_large`): each is a run of its own, with its own records.
pub(crate) const MAX_CHILD_RUNS: usize = 1_000;

/// How deep child flows nest: a run started by a step of a run started by a step … at
/// most this many levels below a run started otherwise (a deeper start fails its step,
/// class `too_deep`): a flow that starts itself ends there.
pub(crate) const MAX_FLOW_DEPTH: u32 = 8;

/// The error class of a step whose child run failed.
pub(crate) const CHILD_FAILED: &str = "child_failed";
/// The error class of a step whose child run was cancelled.
pub(crate) const CHILD_CANCELLED: &str = "child_cancelled";

/// A child's input template in force: its own, else `"$item"` in a fan-out step and
/// `"$input"` (the parent run's input) otherwise.
fn input_template(child: &ChildFlowDef, fan_out: bool) -> Value {
    match (&child.input, fan_out) {
        (Some(t), _) => t.clone(),
        (None, true) => "$item".into(),
        (None, false) => "$input".into(),
    }
}

/// `template` with each `"$…"` string read from the step's input document `doc` (`"$$…"`
/// is the literal `"$…"`), in objects and lists too.
pub(crate) fn resolve_input(template: &Value, doc: &Value) -> Result<Value, ErrorInfo> {
    Ok(match template {
        Value::String(text) if text.starts_with("$$") => Value::String(text[1..].to_string()),
        Value::String(text) if text.starts_with('$') => ax_core::event::field(doc, &text[1..])
            .cloned()
            .ok_or_else(|| ErrorInfo {
                detail: None,
                class: "bad_input".into(),
                message: format!(
                    "child_flow.input: {text:?} names nothing in the step's input (it has input, parents, item, index and args)"
                ),
            })?,
        Value::Array(list) => Value::Array(
            list.iter()
                .map(|v| resolve_input(v, doc))
                .collect::<Result<_, _>>()?,
        ),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| Ok((k.clone(), resolve_input(v, doc)?)))
                .collect::<Result<Map<_, _>, ErrorInfo>>()?,
        ),
        other => other.clone(),
    })
}

/// True if a child flow step's item that ended so was not ended by its child (a
/// timeout, a run-now, a cancel): its child run is to be cancelled.
fn orphaned(done: &Done, output: Option<&StoredOutput>) -> bool {
    match done.state {
        TaskState::Cancelled => true,
        // A child's end always gives an output (an object); a timeout's `continue` none.
        TaskState::Succeeded => output.is_none(),
        _ => done
            .error
            .as_ref()
            .is_some_and(|e| e.class == crate::schedule::wake::CHILD_TIMED_OUT),
    }
}

/// How one child run's start went.
enum Started {
    Yes,
    /// Refused for good: its wait task fails with this.
    Refused(ErrorInfo),
    /// The broker was out of reach: started again later.
    Later(String),
}

/// What a child wait task's payload says of its child.
#[derive(serde::Deserialize)]
struct Body {
    child: ChildRef,
    #[serde(default)]
    input: Value,
}

#[derive(serde::Deserialize)]
struct ChildRef {
    run: String,
}

impl Run {
    /// Notes item `item` of step `i`, just ended so, if it is a child flow step's whose
    /// child did not end it: its child run is cancelled before the next step write.
    pub(super) fn note_orphan(
        &mut self,
        i: usize,
        item: u32,
        done: &Done,
        output: Option<&StoredOutput>,
    ) {
        if self.shape().def.steps[i].child_flow.is_some() && orphaned(done, output) {
            let child = child_run_id(&self.task_id(i, item));
            self.orphans.push(child.into_boxed_str());
        }
    }

    /// Step `i`'s wait tasks, one per item (only items `only`, if given): payload
    /// `{flow, run, step, child: {flow, run}, input, until_ms}`, due at the timeout.
    pub(super) async fn child_tasks(
        &self,
        sh: &Shared,
        i: usize,
        child: &ChildFlowDef,
        only: Option<&[u32]>,
    ) -> Result<Vec<Built>, ErrorInfo> {
        let step = &self.shape().def.steps[i];
        let docs = self.payloads(sh, i).await?;
        if docs.len() > MAX_CHILD_RUNS {
            return Err(ErrorInfo {
                detail: None,
                class: "fan_out_too_large".into(),
                message: format!(
                    "{} child runs, at most {MAX_CHILD_RUNS} per step",
                    docs.len()
                ),
            });
        }
        let started = self.steps[i].record().started_at_ms.unwrap_or_else(now_ms);
        let until = timeout_at_ms(child.timeout_ms, started, sh.ctx.limits.max_delay);
        let template = input_template(child, step.for_each.is_some());
        let mut built = Vec::with_capacity(only.map_or(docs.len(), <[u32]>::len));
        for (k, doc) in docs.iter().enumerate() {
            let k = k as u32;
            if only.is_some_and(|only| only.binary_search(&k).is_err()) {
                continue;
            }
            let input = resolve_input(&template, doc)?;
            let run = child_run_id(&self.task_id(i, k));
            let body = json!({"child": {"flow": child.flow, "run": run}, "input": input,
                              "until_ms": until});
            built.push(self.wait_task(sh, i, k, body, until, Wait::Flow(child.on_timeout))?);
        }
        Ok(built)
    }

    /// Starts the child runs of step `i`'s stored wait tasks `tasks`, each once (a fixed
    /// id). One that cannot start (its flow unknown or invalid, too deep) fails its task.
    pub(super) async fn start_children(
        &mut self,
        sh: &Shared,
        i: usize,
        tasks: &[&Built],
    ) -> Result<(), Fault> {
        let Some(child) = self.shape().def.steps[i].child_flow.clone() else {
            return Ok(());
        };
        if tasks.is_empty() {
            return Ok(());
        }
        let depth = self.depth + 1;
        let def = match depth > MAX_FLOW_DEPTH {
            true => None,
            false => sh.store.def(&child.flow).await?,
        };
        let step = self.shape().def.steps[i].name.clone();
        let (id, business_id) = (self.id.to_string(), self.business_id.clone());
        let starts = tasks.iter().map(|(k, meta, body)| {
            let (def, step, id) = (def.clone(), step.clone(), id.clone());
            let business_id = business_id.as_deref().map(str::to_string);
            let flow = child.flow.clone();
            async move {
                let task = meta.id.clone();
                let refusal = |class: &str, message: String| {
                    Started::Refused(ErrorInfo {
                        detail: None,
                        class: class.into(),
                        message,
                    })
                };
                let answer = if depth > MAX_FLOW_DEPTH {
                    refusal(
                        "too_deep",
                        format!("child flows nest at most {MAX_FLOW_DEPTH} levels deep"),
                    )
                } else if let Some(def) = def {
                    let body: Body = serde_json::from_slice(body).expect("built here");
                    let start = Start {
                        id: Some(body.child.run),
                        business_id,
                        parent: Some(ParentRef {
                            run: id,
                            step,
                            task: task.clone(),
                            depth,
                        }),
                        ..Start::default()
                    };
                    match start_run(&sh.store, &sh.ctx.limits, def, body.input, start).await {
                        Ok(_) => Started::Yes,
                        Err(e) if e.code == ErrorCode::Unavailable => Started::Later(e.message),
                        Err(e) => refusal("invalid_child", e.message),
                    }
                } else {
                    refusal("unknown_flow", format!("no flow {flow:?} is defined"))
                };
                (*k, task, answer)
            }
        });
        let answers: Vec<_> = futures::stream::iter(starts.collect::<Vec<_>>())
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        let mut later = None;
        for (k, task, answer) in answers {
            let error = match answer {
                Started::Yes => continue,
                Started::Later(cause) => {
                    later = Some(cause);
                    continue;
                }
                Started::Refused(error) => error,
            };
            warn!(run = %self.id, task_id = %task, class = %error.class, cause = %error.message,
                "child flow run cannot start; its step's task fails");
            let rec = sh
                .ctx
                .tasks
                .fail_unstarted(&task, error)
                .await
                .map_err(|e| Fault::Other(e.to_string()))?;
            if let Some(done) = rec.as_ref().and_then(Done::of) {
                let output = rec.as_ref().and_then(|r| r.output.as_ref());
                self.finish_item(&sh.held, i, k, done, output);
            }
        }
        match later {
            // Read again and started again (each start is a no-op once made).
            Some(cause) => Err(Fault::Other(format!("child runs not started yet: {cause}"))),
            None => Ok(()),
        }
    }

    /// Cancels the child runs whose wait tasks ended without them (kept until done).
    pub(super) async fn cancel_orphans(&mut self, sh: &Shared) -> Result<(), Fault> {
        while let Some(child) = self.orphans.last() {
            match super::start::cancel_run(&sh.store, child).await {
                Ok(_) => {
                    debug!(run = %self.id, child = %child, "child run cancelled: its step ended without it")
                }
                Err(e) if e.code == ErrorCode::NotFound => {}
                Err(e) => return Err(Fault::Other(e.message)),
            }
            self.orphans.pop();
        }
        Ok(())
    }

    /// Ends the wait task of this child run's parent step as the run ends (`state`,
    /// `reason`), before the run's final state is written. A task not stored (yet) is
    /// waited for while the parent run runs.
    pub(super) async fn end_parent(
        &self,
        sh: &Shared,
        parent: &ParentRef,
        flow: &str,
        state: RunState,
        reason: &str,
    ) -> Result<(), Fault> {
        let tasks = &sh.ctx.tasks;
        let failed = |class: &str, what: &str| ErrorInfo {
            detail: None,
            class: class.into(),
            message: format!("child run {} of flow {flow:?} {what}: {reason}", self.id),
        };
        let ended = match state {
            RunState::Succeeded => {
                let out = self
                    .leaf_outputs(sh)
                    .await
                    .map_err(|e| Fault::Other(e.message))?;
                let out = TaskOutput {
                    bytes: serde_json::to_vec(&out).expect("JSON").into(),
                    is_json: true,
                };
                let stored = StoredOutput::of(&out, &format!("{}.1", parent.task));
                if let Some(key) = &stored.key {
                    sh.results
                        .put(key, out.bytes.clone())
                        .await
                        .map_err(|e| Fault::Other(format!("storing the child's output: {e}")))?;
                }
                tasks.succeed_unstarted(&parent.task, Some(stored)).await
            }
            RunState::Cancelled => {
                tasks
                    .fail_unstarted(&parent.task, failed(CHILD_CANCELLED, "was cancelled"))
                    .await
            }
            _ => {
                tasks
                    .fail_unstarted(&parent.task, failed(CHILD_FAILED, "failed"))
                    .await
            }
        };
        match ended.map_err(|e| Fault::Other(e.to_string()))? {
            Some(rec) => {
                // The timeout's message is useless now (its dispatch would find it ended).
                if let Some(seq) = rec.delayed_seq {
                    if let Err(cause) = ax_core::admit::delete_delayed(&sh.ctx.js, seq).await {
                        debug!(task_id = %parent.task, %cause, "a child's ended wait keeps its timeout's message; its dispatch finds it ended");
                    }
                }
                Ok(())
            }
            None => match sh.store.run(&parent.run).await? {
                Some((run, _)) if run.state == RunState::Running => Err(Fault::Other(format!(
                    "the parent's wait task {} is not stored yet",
                    parent.task
                ))),
                _ => Ok(()), // the parent ended: nothing waits for this run
            },
        }
    }

    /// The run's output as its parent step sees it: each leaf step (one no step needs)
    /// that succeeded, by name.
    async fn leaf_outputs(&self, sh: &Shared) -> Result<Value, ErrorInfo> {
        let shape = self.shape().clone();
        let mut out = Map::new();
        for (p, step) in shape.def.steps.iter().enumerate() {
            let leaf = shape.children[p].is_empty();
            if leaf && self.steps[p].state == super::model::StepState::Succeeded {
                out.insert(step.name.clone(), self.output_of(sh, p).await?);
            }
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_input_template_reads_the_step_document_at_any_depth() {
        let doc = json!({"input": {"order": 7}, "parents": {"p": [1, 2]}, "item": {"sku": "a"}});
        let t = json!({"order": "$input.order", "lines": ["$parents.p", "$item.sku"],
                       "tag": "$$item", "n": 3});
        assert_eq!(
            resolve_input(&t, &doc).unwrap(),
            json!({"order": 7, "lines": [[1, 2], "a"], "tag": "$item", "n": 3})
        );
        assert_eq!(
            resolve_input(&json!("$item"), &doc).unwrap(),
            json!({"sku": "a"})
        );
        let e = resolve_input(&json!({"x": "$parents.nope"}), &doc).unwrap_err();
        assert_eq!(e.class, "bad_input");
    }

    #[test]
    fn only_an_end_the_child_did_not_make_orphans_it() {
        let done = |state, class: Option<&str>| Done {
            state,
            error: class.map(|c| ErrorInfo {
                detail: None,
                class: c.into(),
                message: String::new(),
            }),
            attempt: 1,
            finished_at_ms: 1,
        };
        let out = StoredOutput::of(
            &TaskOutput {
                bytes: b"{}".to_vec().into(),
                is_json: true,
            },
            "k",
        );
        assert!(!orphaned(&done(TaskState::Succeeded, None), Some(&out)));
        assert!(orphaned(&done(TaskState::Succeeded, None), None));
        assert!(orphaned(&done(TaskState::Cancelled, None), None));
        assert!(orphaned(
            &done(TaskState::Dead, Some("child_timed_out")),
            None
        ));
        assert!(!orphaned(&done(TaskState::Dead, Some(CHILD_FAILED)), None));
        assert!(!orphaned(
            &done(TaskState::Dead, Some(CHILD_CANCELLED)),
            None
        ));
    }
}
