//! Approvals (docs/PROTOCOL.md §6, "Approvals"): a flow step that waits until someone
//! holding its token approves or rejects it.
//!
//! - **Register** (the submit of the step's wait task, before it is stored): draw the
//!   token's secret and store it in `AX_WAITS` under the wait task's id (a retried submit
//!   keeps the first secret: create, or read what is there).
//! - **Announce** (the same submit, once the wait task and its record are stored, so a
//!   completion that follows finds the record): publish the token on
//!   `ax.events.approval.requested` (stored in `AX_EVENTS`, one event per approval by its
//!   `Nats-Msg-Id`).
//! - **Complete** (`ax.flow.approve`, the console's hook and buttons): check the token
//!   against the stored secret in constant time (or take a wait task id from a caller of
//!   the management API), then end the wait task by compare-and-set — `succeeded` with
//!   `{"decision": "approved", "payload"}`, or `dead` with class `approval_rejected` — and
//!   delete its timeout's delayed message. The first completion wins; the same decision
//!   again answers the same; another answers `conflict`. The registration stays until
//!   its timeout has passed (the event matcher's sweep removes it then), so a repeated
//!   completion is still recognised.

use crate::context::Context;
use ax_core::event::{
    approval_token, parse_approval_token, ApprovalCompletion, Decision, WaitRegistration,
};
use ax_core::protocol::{ErrorCode, WireError};
use ax_core::results::ResultStore;
use ax_core::state::{ErrorInfo, TaskRecord, TaskState};
use ax_core::wire::output::{StoredOutput, TaskOutput, MAX_OUTPUT_BYTES};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{json, Value};
use subtle::ConstantTimeEq;
use tracing::{debug, info};

/// The event an approval's start announces its token on (`ax.events.<this>`).
pub(crate) const REQUESTED_EVENT: &str = "approval.requested";
/// Class of a rejected approval's error.
pub(crate) const REJECTED: &str = "approval_rejected";
/// Class of an approval that timed out (policy `fail`).
pub(crate) const TIMED_OUT: &str = "approval_timed_out";
/// Records of approvals a listing reads at once.
const READS_AT_ONCE: usize = 32;
/// Longest reason a rejection may give, in bytes.
const MAX_REASON: usize = 1_000;

fn unavailable(what: &str, e: impl std::fmt::Display) -> WireError {
    WireError::new(ErrorCode::Unavailable, format!("{what}: {e}"))
}

/// Stores approval `payload`'s registration with its token's secret (keeping a secret a
/// first submit drew); answers the one stored. Runs before the wait task is stored.
pub(crate) async fn register(
    ctx: &Context,
    payload: &Bytes,
) -> Result<WaitRegistration, WireError> {
    let mut reg: WaitRegistration = serde_json::from_slice(payload).map_err(|e| {
        WireError::new(
            ErrorCode::BadRequest,
            format!("an approval's payload is not its registration: {e}"),
        )
    })?;
    let Some(approval) = reg.approval.as_mut() else {
        return Err(WireError::new(
            ErrorCode::BadRequest,
            "an approval's registration names no approval",
        ));
    };
    approval.secret = Some(secret());
    let stored = ctx
        .waits
        .create_or_get(&reg)
        .await
        .map_err(|e| unavailable("storing the approval in AX_WAITS", e))?;
    if stored.approval.is_none() {
        return Err(WireError::new(
            ErrorCode::Conflict,
            format!("{} is registered as another kind of wait", reg.task),
        ));
    }
    Ok(stored)
}

/// Announces the token of approval `stored` (as [`register`] answered it). Runs once the
/// wait task and its record are stored, so a completion that follows the announcement
/// finds the record (a retried submit announces again: one event by its id).
pub(crate) async fn announce(ctx: &Context, stored: &WaitRegistration) -> Result<(), WireError> {
    let Some(approval) = stored.approval.as_ref() else {
        return Ok(());
    };
    let token = approval_token(&stored.task, approval.secret.as_deref().unwrap_or_default());
    let mut announcement = json!({
        "token": token,
        "task": stored.task,
        "flow": approval.flow,
        "run": approval.run,
        "step": approval.step,
        "message": approval.message,
        "until_ms": stored.until_ms,
    });
    if let Some(base) = &ctx.console_url {
        announcement["url"] = json!(format!(
            "{}/hooks/approvals/{token}",
            base.trim_end_matches('/')
        ));
    }
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", format!("approval:{}", stored.task).as_str());
    let body = serde_json::to_vec(&announcement).expect("JSON serializes");
    ctx.js
        .publish_with_headers(
            ax_core::names::event_subject(REQUESTED_EVENT),
            headers,
            body.into(),
        )
        .await
        .map_err(|e| unavailable("announcing the approval", e))?
        .await
        .map_err(|e| unavailable("storing the approval's announcement in AX_EVENTS", e))?;
    Ok(())
}

/// 128 random bits, hex.
fn secret() -> String {
    let bits: u128 = rand::random();
    format!("{bits:032x}")
}

/// The approval `req` names, by token (checked against its secret) or by task.
async fn find(ctx: &Context, req: &ApprovalCompletion) -> Result<WaitRegistration, WireError> {
    let unknown = || {
        WireError::new(
            ErrorCode::NotFound,
            "no approval waits for this token (unknown, wrong, or its timeout passed long ago)",
        )
    };
    let (task, secret) = match (&req.token, &req.task) {
        (Some(token), None) => {
            let (task, secret) = parse_approval_token(token).ok_or_else(unknown)?;
            (task, Some(secret))
        }
        (None, Some(task)) => (task.as_str(), None),
        _ => {
            return Err(WireError::field(
                "token",
                "give a token or a task, one of them",
            ))
        }
    };
    let reg = ctx
        .waits
        .get(task)
        .await
        .map_err(|e| unavailable("reading AX_WAITS", e))?
        .ok_or_else(unknown)?;
    let Some(approval) = &reg.approval else {
        return Err(unknown());
    };
    if let Some(given) = secret {
        let stored = approval.secret.as_deref().unwrap_or_default();
        if !bool::from(given.as_bytes().ct_eq(stored.as_bytes())) || stored.is_empty() {
            return Err(unknown());
        }
    }
    Ok(reg)
}

/// How an approval's wait task ended, as a completion reports it.
fn outcome(rec: &TaskRecord) -> &'static str {
    match rec.state {
        TaskState::Succeeded if rec.output.is_some() => "approved",
        TaskState::Succeeded => "timed_out",
        TaskState::Dead => match rec.last_error.as_ref().map(|e| e.class.as_str()) {
            Some(REJECTED) => "rejected",
            Some(TIMED_OUT) => "timed_out",
            _ => "failed",
        },
        TaskState::Cancelled => "cancelled",
        _ => "waiting",
    }
}

/// Approves or rejects the approval `req` names (`ax.flow.approve`).
pub(crate) async fn complete(ctx: &Context, req: ApprovalCompletion) -> Result<Value, WireError> {
    let reg = find(ctx, &req).await?;
    let approval = reg.approval.as_ref().expect("found approvals have one");
    let task = reg.task.as_str();
    let ended = match req.decision {
        Decision::Approve => {
            let output = json!({"decision": "approved", "payload": req.payload});
            let bytes = serde_json::to_vec(&output).expect("JSON serializes");
            if bytes.len() > MAX_OUTPUT_BYTES {
                return Err(WireError::new(
                    ErrorCode::PayloadTooLarge,
                    format!("the approval's payload is {} bytes, at most {MAX_OUTPUT_BYTES} (it becomes the step's output)", bytes.len()),
                ));
            }
            let out = TaskOutput {
                bytes: bytes.into(),
                is_json: true,
            };
            let stored = StoredOutput::of(&out, &format!("{task}.1"));
            if let Some(key) = &stored.key {
                let results = ResultStore::open(&ctx.js)
                    .await
                    .map_err(|e| unavailable("opening AX_RESULTS", e))?;
                results
                    .put(key, out.bytes.clone())
                    .await
                    .map_err(|e| unavailable("storing the approval's payload", e))?;
            }
            ctx.tasks.succeed_unstarted(task, Some(stored)).await
        }
        Decision::Reject => {
            let reason = req.reason.clone().unwrap_or_else(|| "rejected".into());
            if reason.len() > MAX_REASON {
                return Err(WireError::field("reason", "at most 1,000 bytes"));
            }
            let error = ErrorInfo {
                detail: None,
                class: REJECTED.into(),
                message: reason,
            };
            ctx.tasks.fail_unstarted(task, error).await
        }
    }
    .map_err(|e| unavailable("ending the approval", e))?;
    let Some(rec) = ended else {
        return Err(WireError::new(
            ErrorCode::Unavailable,
            "the approval's record is not stored yet; retry",
        ));
    };
    let got = outcome(&rec);
    let wanted = match req.decision {
        Decision::Approve => "approved",
        Decision::Reject => "rejected",
    };
    if got != wanted {
        return Err(WireError::new(
            ErrorCode::Conflict,
            format!("the approval has ended already: {got}"),
        ));
    }
    if let Some(seq) = rec.delayed_seq {
        // Its timeout is useless now (its dispatch would find the wait ended).
        if let Err(cause) = ax_core::admit::delete_delayed(&ctx.js, seq).await {
            debug!(task_id = %task, seq, %cause, "an approval's timeout message not deleted; its dispatch finds it ended");
        }
    }
    info!(task_id = %task, run = %approval.run, step = %approval.step, decision = wanted, "approval completed");
    Ok(json!({
        "task": task,
        "flow": approval.flow,
        "run": approval.run,
        "step": approval.step,
        "decision": wanted,
    }))
}

/// The approvals waiting, oldest first, without their tokens (`ax.flow.approvals`).
pub(crate) async fn pending(ctx: &Context) -> Result<Value, WireError> {
    let mut regs: Vec<WaitRegistration> = ctx
        .waits
        .all()
        .await
        .map_err(|e| unavailable("reading AX_WAITS", e))?
        .into_iter()
        .filter(|r| r.approval.is_some())
        .collect();
    regs.sort_by_key(|r| r.since_ms);
    // Their records read side by side, answered in the list's order.
    let reads = regs.iter().map(|r| {
        let (tasks, id) = (ctx.tasks.clone(), r.task.clone());
        async move { tasks.get(&id).await }
    });
    let records: Vec<_> = futures::stream::iter(reads.collect::<Vec<_>>())
        .buffered(READS_AT_ONCE)
        .collect()
        .await;
    let mut out = Vec::new();
    for (reg, record) in regs.into_iter().zip(records) {
        let record = record.map_err(|e| unavailable("reading an approval's record", e))?;
        let Some((rec, _)) = record else { continue };
        if rec.state.is_terminal() {
            continue;
        }
        let approval = reg.approval.expect("filtered");
        out.push(json!({
            "task": reg.task,
            "flow": approval.flow,
            "run": approval.run,
            "step": approval.step,
            "message": approval.message,
            "since_ms": reg.since_ms,
            "until_ms": reg.until_ms,
        }));
    }
    Ok(Value::Array(out))
}
