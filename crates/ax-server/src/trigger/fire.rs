//! One fire of a trigger: its task ids, submitting its tasks, and which of a trigger's
//! tasks are still unfinished. Shared by the engine (scheduled fires), the API (manual
//! runs) and the event router.

use super::model::TriggerDef;
use super::plan::{Source, TriggerState};
use crate::context::Context;
use crate::flow::model::trigger_run_id;
use crate::flow::start::{start_run, Start};
use ax_core::protocol::{ErrorCode, WireError};
use ax_core::task::{Lineage, TaskMeta};
use std::collections::HashSet;

/// The task id of template `i` of a trigger's fire `tag`:
/// `<queue>.tr.<trigger>.<tag>.<i>`. A scheduled fire's tag is its scheduled time in ms,
/// the same on every server and every retry, so the record's create-if-absent (and the
/// message id) make a re-fire a no-op; an event's is `e<hex of its Nats-Msg-Id>`; a manual
/// run's `m<nuid>`, chosen once per request. The `tr` token lets the leader follow only
/// trigger tasks' records (`$KV.AX_TASKS.*.tr.>`).
pub(crate) fn trigger_task_id(queue: &str, trigger: &str, tag: &str, i: usize) -> String {
    format!("{queue}.tr.{trigger}.{tag}.{i}")
}

/// The fire tag of a scheduled time.
pub(crate) fn scheduled_tag(scheduled_ms: u64) -> String {
    scheduled_ms.to_string()
}

/// A fresh manual-run tag.
pub(crate) fn manual_tag() -> String {
    format!("m{}", nuid::next())
}

/// Longest `Nats-Msg-Id` of an event, in bytes (it becomes part of task ids).
pub(crate) const MAX_EVENT_ID: usize = 64;

/// The fire tag of an event: from its `Nats-Msg-Id` when it has one (so a re-sent event is
/// the same fire), else fresh.
pub(crate) fn event_tag(msg: &async_nats::Message) -> Result<String, WireError> {
    match msg.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")) {
        Some(id) if id.as_str().is_empty() || id.as_str().len() > MAX_EVENT_ID => Err(
            WireError::field("Nats-Msg-Id", format!("must be 1..={MAX_EVENT_ID} bytes")),
        ),
        Some(id) => Ok(format!(
            "e{}",
            id.as_str()
                .bytes()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        )),
        None => Ok(format!("e{}", nuid::next())),
    }
}

/// Submits one fire's tasks, named by `tag` (see [`trigger_task_id`]); returns their ids.
/// An event's body becomes the payload of templates without one (JSON if it parses, bytes
/// otherwise).
pub(crate) async fn fire(
    ctx: &Context,
    def: &TriggerDef,
    scheduled_ms: u64,
    source: Source,
    tag: &str,
    event: Option<&async_nats::Message>,
) -> Result<Vec<String>, WireError> {
    let mut ids = Vec::with_capacity(def.tasks.len());
    for (i, template) in def.tasks.iter().enumerate() {
        let mut req = template.clone();
        if let Some(msg) = event {
            if req.payload.is_none() && req.payload_base64.is_none() {
                match serde_json::from_slice::<serde_json::Value>(&msg.payload) {
                    Ok(v) => req.payload = Some(v),
                    Err(_) => {
                        use base64::Engine as _;
                        req.payload_base64 =
                            Some(base64::engine::general_purpose::STANDARD.encode(&msg.payload));
                    }
                }
            }
        }
        let queue = req.queue.clone().unwrap_or_default();
        let (mut meta, payload) = TaskMeta::from_request(&queue, req, &ctx.limits)?;
        meta.id = trigger_task_id(&queue, &def.name, tag, i);
        meta.lineage = Some(Lineage {
            trigger: def.name.clone(),
            source: source.as_str().to_string(),
            scheduled_at_ms: scheduled_ms,
        });
        ids.push(ctx.submit_prepared(meta, payload).await?.id);
    }
    for (j, start) in def.flows.iter().enumerate() {
        let input = match (&start.input, event) {
            (Some(input), _) => input.clone(),
            (None, Some(msg)) => serde_json::from_slice(&msg.payload).unwrap_or_else(|_| {
                use base64::Engine as _;
                serde_json::json!({"base64": base64::engine::general_purpose::STANDARD.encode(&msg.payload)})
            }),
            (None, None) => serde_json::Value::Null,
        };
        let flow = ctx
            .flows
            .def(&start.flow)
            .await
            .map_err(|e| WireError::new(ErrorCode::Unavailable, e.to_string()))?
            .ok_or_else(|| {
                WireError::new(
                    ErrorCode::NotFound,
                    format!("trigger {}: no flow {:?}", def.name, start.flow),
                )
            })?;
        let origin = Start {
            id: Some(trigger_run_id(&def.name, tag, j)),
            rerun_of: None,
            trigger: Some((def.name.clone(), source.as_str().to_string(), scheduled_ms)),
            business_id: None,
            parent: None,
        };
        let (run, _) = start_run(&ctx.flows, &ctx.limits, flow, input, origin).await?;
        ids.push(format!("{FLOW_RUN_PREFIX}{run}"));
    }
    Ok(ids)
}

/// How a fire's flow run is listed among its "task ids" (`flow:<run id>`): overlap and
/// fixed-delay wait for the run to end, read from its key in `AX_FLOW_RUNS`.
pub(crate) const FLOW_RUN_PREFIX: &str = "flow:";

/// Task ids among `ids` whose records are not finished (and flow runs, `flow:<run>`, not
/// ended), read concurrently. This is how completion tracking recovers: whatever the
/// completion feed missed, the records tell (flow runs are only seen this way).
pub(crate) async fn unfinished<'a>(
    ctx: &Context,
    ids: impl IntoIterator<Item = &'a String>,
) -> HashSet<String> {
    let ids: HashSet<&String> = ids.into_iter().collect();
    let tasks = &ctx.tasks;
    // Asked again on a reconnect (see `TriggerStore::def`).
    let client = ctx.js.client();
    let client = &client;
    let reads = ids.into_iter().map(|id| async move {
        use ax_core::follow::across_reconnects;
        if let Some(run) = id.strip_prefix(FLOW_RUN_PREFIX) {
            return match across_reconnects(client, || ctx.flows.run(run)).await {
                Ok(Some((r, _))) if r.state != crate::flow::RunState::Running => None,
                _ => Some(id.clone()),
            };
        }
        match across_reconnects(client, || tasks.get_latest(id)).await {
            Ok(Some((rec, _))) if rec.state.is_terminal() => None,
            // Unknown or unreadable counts as running: never fire over a task we cannot see.
            _ => Some(id.clone()),
        }
    });
    futures::future::join_all(reads)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// The trigger name in a trigger task's id (`<queue>.tr.<trigger>.<tag>.<i>`).
pub(crate) fn trigger_of_task(id: &str) -> Option<&str> {
    let mut parts = id.split('.');
    let (_queue, tr, name) = (parts.next()?, parts.next()?, parts.next()?);
    (tr == "tr").then_some(name)
}

/// The task ids a state says may still run: its active list and its last fire's tasks.
pub(crate) fn tracked_ids(state: &TriggerState) -> impl Iterator<Item = &String> {
    state
        .active
        .iter()
        .chain(state.last_fire.iter().flat_map(|f| f.task_ids.iter()))
}
