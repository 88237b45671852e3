//! Singleton keys of flow runs (docs/PROTOCOL.md §6, "Singleton runs"): a start with
//! `"singleton": {"key", "on_collision"}` stores its run together with the key
//! `=singleton.<flow>.<key in hex>` of `AX_FLOW_RUNS` naming it, in one atomic batch that
//! checks the key's revision. So no key ever names a run that was not stored (unlike a
//! task's key, no grace), and of two starts racing for a key one wins and the other looks
//! again.
//!
//! A key whose run has not ended refuses the start (`cancel_new`: `running`, `run_id` the
//! holder) or has that run cancelled first (`cancel_in_progress`: the run's cancel, and
//! every step task of it that has not ended cancelled as `ax task cancel` does, so a
//! running handler is told). A run that has ended holds nothing: the next start takes its
//! key over.

use super::def::FlowDef;
use super::model::{step_task_id, FlowRun, RunState, StepState};
use super::start::{cancel_run, new_run, stored_run_error, Start};
use super::store::FlowStore;
use super::store::FlowStoreError;
use crate::ops::actions::Ops;
use crate::ops::stop::Stopping;
use ax_core::metrics as m;
use ax_core::protocol::{ErrorCode, WireError};
use ax_core::singleton::{Collision, Singleton};
use futures::StreamExt;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// How long a start keeps trying to take a contended key before it answers `unavailable`.
const CLAIM_FOR: Duration = Duration::from_secs(30);
/// Pause before looking at a key again after a lost race.
const AGAIN_AFTER: Duration = Duration::from_millis(50);
/// Step tasks cancelled at once when a holder is cancelled in progress.
const CANCELS_AT_ONCE: usize = 16;

/// Starts a run of `def` holding singleton key `s`.
pub(super) async fn start(
    store: &FlowStore,
    ops: &Ops,
    s: &Singleton,
    def: FlowDef,
    input: Value,
    start: Start,
) -> Result<Value, WireError> {
    let run = new_run(&ops.ctx.limits, def, input, start)?;
    let until = Instant::now() + CLAIM_FOR;
    loop {
        if Instant::now() > until {
            return Err(WireError::unavailable(format!(
                "singleton key {} of flow {} stayed contended for {CLAIM_FOR:?}: retry",
                s.key, run.flow
            )));
        }
        let held = store
            .singleton_holder(&run.flow, &s.key)
            .await
            .map_err(WireError::unavailable)?;
        let revision = match held {
            None => None,
            Some((holder, revision)) => {
                collide(store, ops, s, &holder).await?;
                Some(revision)
            }
        };
        match store.create_holding(&run, &s.key, revision).await {
            Ok(()) => {
                metrics::counter!(m::FLOW_RUNS_STARTED, "flow" => run.flow.clone()).increment(1);
                return Ok(json!({"run": run.id, "flow": run.flow}));
            }
            Err(FlowStoreError::Stale(_)) => {
                debug!(flow = %run.flow, key = %s.key, "flow singleton key changed while being taken; looking again");
                tokio::time::sleep(AGAIN_AFTER).await;
            }
            Err(e) => return Err(stored_run_error(e)),
        }
    }
}

/// Looks at the run a key names: one that has ended (or is gone: kept 90 days) holds
/// nothing; one still running refuses the start or is cancelled, as `s` says.
async fn collide(
    store: &FlowStore,
    ops: &Ops,
    s: &Singleton,
    holder: &str,
) -> Result<(), WireError> {
    let found = store.run(holder).await.map_err(WireError::unavailable)?;
    let Some((run, _)) = found.filter(|(run, _)| run.state == RunState::Running) else {
        return Ok(());
    };
    match s.on_collision {
        Collision::CancelNew => {
            let mut e = WireError::new(
                ErrorCode::Running,
                format!(
                    "singleton key {} of flow {} is held by run {holder}, which has not ended; on_collision cancel_new refuses this run",
                    s.key, run.flow
                ),
            );
            e.run_id = Some(holder.to_string());
            Err(e)
        }
        Collision::CancelInProgress => {
            cancel_run(store, holder).await?;
            cancel_step_tasks(store, ops, &run, &format!("singleton:{}", s.key)).await?;
            info!(run = %holder, flow = %run.flow, key = %s.key, "flow run cancelled: a new run took its singleton key");
            Ok(())
        }
    }
}

/// Cancels every step task of `run`'s running steps that has not ended, as an operator's
/// cancel does (a running attempt's handler is told); the engine ends the run `cancelled`.
async fn cancel_step_tasks(
    store: &FlowStore,
    ops: &Ops,
    run: &FlowRun,
    by: &str,
) -> Result<(), WireError> {
    let steps = store.steps(run).await.map_err(WireError::unavailable)?;
    let mut ids = Vec::new();
    for (def, step) in run.def.steps.iter().zip(steps) {
        let Some((step, _)) = step.filter(|(s, _)| s.state == StepState::Running) else {
            continue;
        };
        let queue = def.task.queue.as_deref().unwrap_or_default();
        ids.extend(
            (0..step.items.unwrap_or(0))
                .map(|i| step_task_id(queue, &run.id, &def.name, step.epoch, i)),
        );
    }
    // Each until it is stopped, ended meanwhile, or not submitted yet (the engine will not
    // submit it: the run's cancel is requested).
    let answers: Vec<Result<Stopping, WireError>> = futures::stream::iter(ids)
        .map(|id| async move { ops.cancel_until_stopped(&id, by).await })
        .buffer_unordered(CANCELS_AT_ONCE)
        .collect()
        .await;
    for answer in answers {
        if answer? == Stopping::Live {
            warn!(run = %run.id, by, "a step task still live after its cancels");
        }
    }
    Ok(())
}
