//! The flow API: requests on `ax.flow.<op>` with JSON bodies, answered `{"ok": …}` or
//! `{"error": {"code", "message", "field"}}` (docs/PROTOCOL.md §6). Any server answers;
//! the engine's leader drives the runs these requests create or change.

use super::def::{FlowDef, Plan};
use super::model::{valid_run_id, FlowRun, RunState, StepRun, StepState};
use super::start::{cancel_run, start_run, Start};
use super::store::{FlowStore, FlowStoreError};
use super::RerunMode;
use crate::context::Context;
use crate::ops::actions::Ops;
use ax_core::metrics as m;
use ax_core::protocol::{ErrorCode, WireError};
use ax_core::singleton::Singleton;
use ax_core::time::now_ms;
use ax_sdk::api::{unknown_operation, Api, Request};
use ax_sdk::flow::{FlowName, FlowRequest, FlowRerun, FlowStart, RunRef};
use serde_json::{json, Value};
use std::sync::Arc;

pub(crate) struct FlowApi {
    pub(crate) ctx: Arc<Context>,
    pub(crate) store: FlowStore,
}

/// A lost compare-and-set during a re-run: retryable.
fn changed_meanwhile(e: FlowStoreError) -> WireError {
    match e {
        FlowStoreError::Stale(_) => WireError::new(
            ErrorCode::Unavailable,
            "the run changed while re-running it; retry",
        ),
        e => WireError::unavailable(e),
    }
}

fn not_found(what: String) -> WireError {
    WireError::new(ErrorCode::NotFound, what)
}

/// A flow name is checked before it is used as a KV key (an invalid key would be an
/// `unavailable` broker error, not the caller's `invalid_field`).
fn flow_name(name: &str, field: &str) -> Result<(), WireError> {
    if ax_core::names::valid_token(name, 64) {
        Ok(())
    } else {
        Err(WireError::field(field, "must be 1..=64 of A-Z a-z 0-9 _ -"))
    }
}

impl FlowApi {
    /// Answers `op`; `ops` cancels a singleton key's holder's running tasks.
    pub(crate) async fn handle(
        &self,
        ops: &Ops,
        op: &str,
        body: &[u8],
    ) -> Result<Value, WireError> {
        match FlowRequest::decode(op, body)? {
            FlowRequest::Put(value) => {
                let def = FlowDef::decode(value)?;
                def.validate(&self.ctx.limits)?;
                // A step on a queue no server declared would fail its run later: refuse it
                // now, by field.
                for (i, step) in def.steps.iter().enumerate() {
                    let queue = step.task.queue.as_deref().unwrap_or_default();
                    if let Err(e) = self.ctx.queues.check(&self.ctx.js, queue).await {
                        return Err(match e.code {
                            ErrorCode::UnknownQueue => {
                                WireError::field(&format!("steps[{i}].task.queue"), e.message)
                            }
                            _ => e,
                        });
                    }
                }
                self.store
                    .put_def(&def)
                    .await
                    .map_err(WireError::unavailable)?;
                Ok(json!({"name": def.name, "steps": def.steps.len()}))
            }
            FlowRequest::Def(FlowName { name }) => {
                flow_name(&name, "name")?;
                match self
                    .store
                    .def(&name)
                    .await
                    .map_err(WireError::unavailable)?
                {
                    Some(def) => Ok(serde_json::to_value(def).expect("serializes")),
                    None => Err(not_found(format!("no flow {name:?}"))),
                }
            }
            FlowRequest::Defs {} => {
                let defs = self.store.defs().await.map_err(WireError::unavailable)?;
                Ok(json!(defs
                    .iter()
                    .map(|d| json!({"name": d.name, "steps": d.steps.len(), "failure": d.failure}))
                    .collect::<Vec<_>>()))
            }
            FlowRequest::Delete(FlowName { name }) => {
                flow_name(&name, "name")?;
                self.store
                    .delete_def(&name)
                    .await
                    .map_err(WireError::unavailable)?;
                Ok(json!({"name": name}))
            }
            FlowRequest::Run(FlowStart {
                flow,
                input,
                business_id,
                singleton,
            }) => {
                flow_name(&flow, "flow")?;
                if let Some(id) = &business_id {
                    ax_core::task::check_business_id(id)?;
                }
                let def = self
                    .store
                    .def(&flow)
                    .await
                    .map_err(WireError::unavailable)?
                    .ok_or_else(|| not_found(format!("no flow {flow:?}")))?;
                match singleton {
                    Some(s) => {
                        let s = Singleton::from_request(&s)?;
                        let start = Start {
                            business_id,
                            ..Start::default()
                        };
                        super::singleton::start(&self.store, ops, &s, def, input, start).await
                    }
                    None => self.start(def, input, None, business_id).await,
                }
            }
            FlowRequest::Get(RunRef { run }) => {
                let (run, steps) = self.load(&run).await?;
                Ok(view(&run, &steps, self.ctx.limits.max_delay))
            }
            FlowRequest::List(req) => {
                if let Some(flow) = &req.flow {
                    flow_name(flow, "flow")?;
                }
                let mut runs = self.store.runs().await.map_err(WireError::unavailable)?;
                runs.retain(|r| {
                    req.flow.as_ref().is_none_or(|f| *f == r.flow)
                        && req.state.is_none_or(|s| s == r.state)
                });
                runs.sort_by_key(|r| std::cmp::Reverse(r.created_at_ms));
                runs.truncate(req.limit.unwrap_or(100));
                Ok(json!(runs.iter().map(summary).collect::<Vec<_>>()))
            }
            // The flow engine's lease: which server drives the running runs now.
            FlowRequest::Leader {} => {
                crate::lease::leader(&self.ctx.js, crate::flow::engine::FLOWS_KEY).await
            }
            FlowRequest::Cancel(RunRef { run }) => self.cancel(&run).await,
            FlowRequest::Rerun(req) => self.rerun(req).await,
            // By token: whoever holds it (producers may call this); by task: an operator.
            FlowRequest::Approve(req) if req.task.is_some() => Err(WireError::field(
                "task",
                "approve takes the token; by task id it is approve_task",
            )),
            FlowRequest::ApproveTask(req) if req.token.is_some() => Err(WireError::field(
                "token",
                "approve_task takes the task id; by token it is approve",
            )),
            FlowRequest::Approve(req) | FlowRequest::ApproveTask(req) => {
                crate::approval::complete(&self.ctx, req).await
            }
            FlowRequest::Approvals {} => crate::approval::pending(&self.ctx).await,
            FlowRequest::Unknown => Err(unknown_operation(Api::Flow, op)),
        }
    }

    async fn start(
        &self,
        def: FlowDef,
        input: Value,
        rerun_of: Option<String>,
        business_id: Option<String>,
    ) -> Result<Value, WireError> {
        let start = Start {
            rerun_of,
            business_id,
            ..Start::default()
        };
        let (id, flow) = start_run(&self.store, &self.ctx.limits, def, input, start).await?;
        Ok(json!({"run": id, "flow": flow}))
    }

    async fn load(&self, id: &str) -> Result<(FlowRun, Vec<StepRun>), WireError> {
        if !valid_run_id(id) {
            return Err(WireError::field("run", "not a run id"));
        }
        let (run, _) = self
            .store
            .run(id)
            .await
            .map_err(WireError::unavailable)?
            .ok_or_else(|| not_found(format!("no run {id:?}")))?;
        let steps = self
            .store
            .steps(&run)
            .await
            .map_err(WireError::unavailable)?;
        Ok((
            run,
            steps
                .into_iter()
                .map(|s| s.map(|(s, _)| s).unwrap_or_default())
                .collect(),
        ))
    }

    async fn cancel(&self, id: &str) -> Result<Value, WireError> {
        cancel_run(&self.store, id).await
    }

    async fn rerun(&self, req: FlowRerun) -> Result<Value, WireError> {
        if req.mode == RerunMode::Whole {
            let (run, _) = self.load(&req.run).await?;
            let input = req.input.unwrap_or(run.input);
            return self
                .start(run.def, input, Some(run.id), run.business_id)
                .await;
        }
        if req.input.is_some() {
            return Err(WireError::field(
                "input",
                "a new input starts a new run: use mode \"whole\"",
            ));
        }
        if !valid_run_id(&req.run) {
            return Err(WireError::field("run", "not a run id"));
        }
        let (mut run, rev) = self
            .store
            .run(&req.run)
            .await
            .map_err(WireError::unavailable)?
            .ok_or_else(|| not_found(format!("no run {:?}", req.run)))?;
        if run.state == RunState::Running {
            return Err(WireError::new(
                ErrorCode::Running,
                "the run is still running: re-run it once it has ended, or cancel it first",
            ));
        }
        let plan = run.def.validate(&self.ctx.limits)?;
        let stored = self
            .store
            .steps(&run)
            .await
            .map_err(WireError::unavailable)?;
        let states: Vec<StepState> = stored
            .iter()
            .map(|s| s.as_ref().map(|(s, _)| s.state).unwrap_or_default())
            .collect();
        let chosen = choose(&plan, &states, req.mode);
        if chosen.is_empty() {
            return Err(WireError::field(
                "mode",
                "every step succeeded: nothing to re-run (mode \"whole\" starts a new run)",
            ));
        }
        // The run and its chosen steps in one atomic write: a reader (the engine, `flow
        // get`) sees either the ended run with its old steps or the running run with fresh
        // ones, never steps of a new epoch under a run that was not re-run.
        let fresh: Vec<(StepRun, Option<u64>)> = chosen
            .iter()
            .map(|&i| match &stored[i] {
                Some((old, rev)) => (
                    StepRun {
                        epoch: old.epoch + 1,
                        ..StepRun::default()
                    },
                    Some(*rev),
                ),
                None => (
                    StepRun {
                        epoch: 1,
                        ..StepRun::default()
                    },
                    None,
                ),
            })
            .collect();
        let steps: Vec<(&str, &StepRun, Option<u64>)> = chosen
            .iter()
            .zip(&fresh)
            .map(|(&i, (step, rev))| (run.def.steps[i].name.as_str(), step, *rev))
            .collect();
        run.state = RunState::Running;
        run.reason = None;
        run.finished_at_ms = None;
        run.cancel_requested = false;
        run.reruns += 1;
        run.updated_at_ms = now_ms();
        self.store
            .put_run_and_steps(&run, rev, &steps)
            .await
            .map_err(changed_meanwhile)?;
        metrics::counter!(m::FLOW_RUNS_STARTED, "flow" => run.flow.clone()).increment(1);
        let names: Vec<&str> = chosen
            .iter()
            .map(|&i| run.def.steps[i].name.as_str())
            .collect();
        Ok(json!({"run": run.id, "steps": names}))
    }
}

/// The steps a re-run starts again: those that did not succeed; with
/// `failed_and_downstream` also every step downstream of a failed one.
pub(crate) fn choose(plan: &Plan, states: &[StepState], mode: RerunMode) -> Vec<usize> {
    let mut chosen: Vec<bool> = states.iter().map(|s| *s != StepState::Succeeded).collect();
    if mode == RerunMode::FailedAndDownstream {
        let mut tainted: Vec<bool> = states.iter().map(|s| *s == StepState::Failed).collect();
        for &i in &plan.order {
            if plan.parents[i].iter().any(|&p| tainted[p]) {
                tainted[i] = true;
                chosen[i] = true;
            }
        }
    }
    (0..states.len()).filter(|&i| chosen[i]).collect()
}

fn summary(run: &FlowRun) -> Value {
    json!({
        "run": run.id, "flow": run.flow, "state": run.state, "reason": run.reason,
        "created_at_ms": run.created_at_ms, "finished_at_ms": run.finished_at_ms,
        "rerun_of": run.rerun_of, "reruns": run.reruns,
        "trigger": run.trigger, "trigger_source": run.trigger_source,
        "scheduled_at_ms": run.scheduled_at_ms, "business_id": run.business_id,
        "parent": run.parent,
    })
}

/// A run with its steps, as `get` answers it.
fn view(run: &FlowRun, steps: &[StepRun], max_delay: std::time::Duration) -> Value {
    let mut out = summary(run);
    out["input"] = run.input.clone();
    out["failure"] = json!(run.def.failure);
    out["cancel_requested"] = json!(run.cancel_requested);
    out["steps"] = json!(run
        .def
        .steps
        .iter()
        .zip(steps)
        .map(|(def, s)| {
            let queue = def.task.queue.as_deref().unwrap_or_default();
            let mut v = serde_json::to_value(s).expect("serializes");
            v["name"] = json!(def.name);
            v["needs"] = json!(def.needs);
            v["trigger"] = json!(def.trigger);
            v["task"] = json!(def.task.name);
            if let Some(over) = &def.for_each {
                v["for_each"] = json!(over);
            }
            if let Some(sleep) = &def.sleep {
                v["sleep"] = json!(sleep);
                // Where the sleep is: `sleeping` until `wake_at_ms` while its step runs.
                if let (StepState::Running, Some(started)) = (s.state, s.started_at_ms) {
                    let until = super::waits::wake_at_ms(sleep, started);
                    v["waiting"] = json!({"kind": "sleep", "until_ms": until});
                }
            }
            if let Some(wait) = &def.wait_for_event {
                v["wait_for_event"] = json!(wait);
                // `waiting for event <name>` until its timeout while its step runs.
                if let (StepState::Running, Some(started)) = (s.state, s.started_at_ms) {
                    let until = super::waits::timeout_at_ms(wait.timeout_ms, started, max_delay);
                    v["waiting"] = json!({"kind": "event", "event": wait.event, "until_ms": until});
                }
            }
            if let Some(approval) = &def.approval {
                v["approval"] = json!(approval);
                // `waiting for approval` until its timeout while its step runs.
                if let (StepState::Running, Some(started)) = (s.state, s.started_at_ms) {
                    let until =
                        super::waits::timeout_at_ms(approval.timeout_ms, started, max_delay);
                    v["waiting"] = json!({"kind": "approval", "message": approval.message,
                                          "until_ms": until});
                }
            }
            if let Some(child) = &def.child_flow {
                v["child_flow"] = json!(child);
                // `waiting for flow <name>` (its child runs) until its timeout while its
                // step runs.
                if let (StepState::Running, Some(started)) = (s.state, s.started_at_ms) {
                    let until = super::waits::timeout_at_ms(child.timeout_ms, started, max_delay);
                    let runs: Vec<String> = (0..s.items.unwrap_or(0).min(100))
                        .map(|k| {
                            let task =
                                super::model::step_task_id(queue, &run.id, &def.name, s.epoch, k);
                            super::model::child_run_id(&task)
                        })
                        .collect();
                    v["waiting"] = json!({"kind": "flow", "flow": child.flow, "runs": runs,
                                          "until_ms": until});
                }
            }
            if s.items.is_some() {
                v["task_id"] = json!(super::model::step_task_id(
                    queue, &run.id, &def.name, s.epoch, 0
                ));
            }
            v
        })
        .collect::<Vec<_>>());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ax_core::task::Limits;

    #[test]
    fn a_rerun_chooses_failed_steps_and_optionally_what_ran_after_them() {
        // a → b → c(all_done) ; d independent.
        let def = FlowDef::decode(json!({"name": "f", "steps": [
            {"name": "a", "task": {"name": "a", "queue": "q"}},
            {"name": "b", "needs": ["a"], "task": {"name": "b", "queue": "q"}},
            {"name": "c", "needs": ["b"], "trigger": "all_done", "task": {"name": "c", "queue": "q"}},
            {"name": "d", "task": {"name": "d", "queue": "q"}},
        ]}))
        .unwrap();
        let plan = def.validate(&Limits::default()).unwrap();
        use StepState::*;
        let states = [Succeeded, Failed, Succeeded, Succeeded];
        assert_eq!(choose(&plan, &states, RerunMode::Failed), vec![1]);
        assert_eq!(
            choose(&plan, &states, RerunMode::FailedAndDownstream),
            vec![1, 2]
        );
        let states = [Succeeded, Failed, UpstreamFailed, Cancelled];
        assert_eq!(choose(&plan, &states, RerunMode::Failed), vec![1, 2, 3]);
    }
}
