//! Starting and cancelling runs, for the flow API, singleton starts and trigger fires.

use super::def::FlowDef;
use super::model::{valid_run_id, FlowRun, RunState};
use super::store::{FlowStore, FlowStoreError};
use ax_core::metrics as m;
use ax_core::protocol::{ErrorCode, WireError};
use ax_core::time::now_ms;
use serde_json::{json, Value};

/// Most compare-and-set attempts on a run that keeps changing.
const MAX_ATTEMPTS: usize = 20;

/// Where a new run comes from (all optional).
#[derive(Debug, Default)]
pub(crate) struct Start {
    /// A fixed run id (a trigger's fire); default a fresh NUID.
    pub(crate) id: Option<String>,
    /// The run this one re-runs.
    pub(crate) rerun_of: Option<String>,
    /// The trigger, its source and scheduled time.
    pub(crate) trigger: Option<(String, String, u64)>,
    /// The business id every step task carries.
    pub(crate) business_id: Option<String>,
    /// The step whose child run this is.
    pub(crate) parent: Option<super::model::ParentRef>,
}

/// Stores a new run of `def` (`running`); the engine's leader starts its root steps.
/// With a fixed id that exists already (a fire made again), nothing changes. Returns the
/// run id and flow name.
pub(crate) async fn start_run(
    store: &FlowStore,
    limits: &ax_core::task::Limits,
    def: FlowDef,
    input: Value,
    start: Start,
) -> Result<(String, String), WireError> {
    let fixed = start.id.is_some();
    let run = new_run(limits, def, input, start)?;
    match store.put_run(&run, None).await {
        Ok(_) => {
            metrics::counter!(m::FLOW_RUNS_STARTED, "flow" => run.flow.clone()).increment(1);
        }
        Err(FlowStoreError::Stale(_)) if fixed => {} // started by an earlier try of this fire
        Err(e) => return Err(stored_run_error(e)),
    }
    Ok((run.id, run.flow))
}

/// A store error of a new run's write as the start's answer.
pub(super) fn stored_run_error(e: FlowStoreError) -> WireError {
    match e {
        FlowStoreError::TooLarge { bytes, .. } => WireError::field(
            "input",
            format!(
                "the run (definition + input) would be {bytes} bytes, over the server's max \
                 payload"
            ),
        ),
        e => WireError::unavailable(e),
    }
}

/// A new run of `def` (`running`, not stored), checked.
pub(super) fn new_run(
    limits: &ax_core::task::Limits,
    def: FlowDef,
    input: Value,
    start: Start,
) -> Result<FlowRun, WireError> {
    def.validate(limits)?;
    let now = now_ms();
    let (trigger, trigger_source, scheduled_at_ms) = match start.trigger {
        Some((t, s, at)) => (Some(t), Some(s), Some(at)),
        None => (None, None, None),
    };
    let run = FlowRun {
        id: start.id.unwrap_or_else(|| nuid::next().to_string()),
        flow: def.name.clone(),
        def,
        input,
        state: RunState::Running,
        reason: None,
        created_at_ms: now,
        updated_at_ms: now,
        finished_at_ms: None,
        rerun_of: start.rerun_of,
        reruns: 0,
        cancel_requested: false,
        trigger,
        trigger_source,
        scheduled_at_ms,
        business_id: start.business_id,
        parent: start.parent,
        extra: Default::default(),
    };
    Ok(run)
}

/// Requests the cancel of run `id` (the engine's leader cancels its steps): answers its
/// state and whether the cancel is requested.
pub(crate) async fn cancel_run(store: &FlowStore, id: &str) -> Result<Value, WireError> {
    if !valid_run_id(id) {
        return Err(WireError::field("run", "not a run id"));
    }
    for _ in 0..MAX_ATTEMPTS {
        let (mut run, rev) = store
            .run(id)
            .await
            .map_err(WireError::unavailable)?
            .ok_or_else(|| WireError::new(ErrorCode::NotFound, format!("no run {id:?}")))?;
        if run.state != RunState::Running || run.cancel_requested {
            return Ok(
                json!({"run": id, "state": run.state, "cancel_requested": run.cancel_requested}),
            );
        }
        run.cancel_requested = true;
        run.updated_at_ms = now_ms();
        match store.put_run(&run, Some(rev)).await {
            Ok(_) => return Ok(json!({"run": id, "state": run.state, "cancel_requested": true})),
            Err(FlowStoreError::Stale(_)) => continue,
            Err(e) => return Err(WireError::unavailable(e)),
        }
    }
    Err(WireError::new(
        ErrorCode::Unavailable,
        "the run keeps changing; retry",
    ))
}
