//! The approvals' hook (docs/PROTOCOL.md §6, "Approvals"): `POST
//! /hooks/approvals/<token>/approve` (the body, JSON or empty, is the payload) and
//! `…/reject` (the body, empty or `{"reason"}`). The token is the credential: no session
//! is asked for, as a payment provider or a mail link's landing page has none. A wrong
//! token counts as a failed login for the caller's address (the same throttle), so
//! tokens cannot be guessed at speed; the answer does not say whether a task exists.

use super::session::Sessions;
use crate::server::handle::Apis;
use ax_core::event::{ApprovalCompletion, Decision};
use ax_core::protocol::ErrorCode;
use http::StatusCode;
use serde_json::{json, Value};
use std::net::IpAddr;
use tracing::warn;

/// Where the hooks are served.
pub(super) const PREFIX: &str = "/hooks/approvals/";

fn refused(status: StatusCode, code: &str, message: &str) -> (StatusCode, Value) {
    (status, json!({"error": {"code": code, "message": message}}))
}

/// Answers `POST <path>` with `body` from `client` (the caller checked its throttle):
/// the status and the JSON to send.
pub(super) async fn approval(
    sessions: &Sessions,
    apis: &Apis,
    path: &str,
    body: &[u8],
    client: IpAddr,
) -> (StatusCode, Value) {
    let usage = "POST …/<token>/approve or …/<token>/reject";
    let Some((token, action)) = path.trim_start_matches(PREFIX).rsplit_once('/') else {
        return refused(StatusCode::NOT_FOUND, "not_found", usage);
    };
    let decision = match action {
        "approve" => Decision::Approve,
        "reject" => Decision::Reject,
        _ => return refused(StatusCode::NOT_FOUND, "not_found", usage),
    };
    let given: Option<Value> = match body.iter().all(u8::is_ascii_whitespace) {
        true => None,
        false => match serde_json::from_slice(body) {
            Ok(v) => Some(v),
            Err(e) => {
                let message = format!("the body is not JSON: {e}");
                return refused(StatusCode::BAD_REQUEST, "bad_request", &message);
            }
        },
    };
    let reason = match (decision, &given) {
        (Decision::Reject, Some(v)) => match v.get("reason") {
            Some(Value::String(r)) => Some(r.clone()),
            None => None,
            Some(_) => {
                return refused(StatusCode::BAD_REQUEST, "invalid_field", "reason: a string")
            }
        },
        _ => None,
    };
    let completion = ApprovalCompletion {
        token: Some(token.to_string()),
        task: None,
        decision,
        payload: given.filter(|_| decision == Decision::Approve),
        reason,
    };
    let request = serde_json::to_vec(&completion).expect("serializes");
    match apis.call("flow", "approve", request.into()).await {
        Some(Ok(value)) => {
            sessions.succeeded(client);
            (StatusCode::OK, json!({"ok": value}))
        }
        Some(Err(e)) => {
            let status = match e.code {
                ErrorCode::NotFound => {
                    sessions.failed(client);
                    warn!(%client, "console: an approval hook with an unknown token");
                    StatusCode::NOT_FOUND
                }
                ErrorCode::Conflict => StatusCode::CONFLICT,
                ErrorCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
                ErrorCode::BadRequest | ErrorCode::InvalidField => StatusCode::BAD_REQUEST,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            (status, json!({"error": e}))
        }
        None => refused(StatusCode::NOT_FOUND, "not_found", "no flow API"),
    }
}
