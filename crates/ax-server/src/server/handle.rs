//! One request: decode, act, answer. A request path never takes the process down: a panic
//! (a bug) is caught here, answered `unavailable` and counted in
//! `ax_request_panics_total{api}`.

use crate::context::Context;
use async_nats::service::Request;
use ax_core::metrics as m;
use ax_core::protocol::{ErrorCode, SubmitAccepted, SubmitReply, WireError};
use ax_sdk::api::Api;
use futures::FutureExt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use tracing::{error, warn};

/// Runs `work`; a panic becomes an `unavailable` answer and a counted, logged bug.
pub(crate) async fn guarded<T>(
    api: &'static str,
    work: impl Future<Output = Result<T, WireError>>,
) -> Result<T, WireError> {
    match AssertUnwindSafe(work).catch_unwind().await {
        Ok(result) => result,
        Err(panic) => {
            let what = ax_core::error::panic_text(panic.as_ref());
            error!(api, cause = %what, "request handler panicked (a bug); answered unavailable");
            metrics::counter!(m::REQUEST_PANICS, "api" => api).increment(1);
            Err(WireError::new(
                ErrorCode::Unavailable,
                "internal error while handling the request; retry later",
            ))
        }
    }
}

/// Answers a request (through the service endpoint, which counts it in `$SRV.STATS`).
async fn answer(req: &Request, body: Vec<u8>) {
    if req.message.reply.is_some() {
        if let Err(e) = req.respond(Ok(body.into())).await {
            warn!(cause = %e, "could not send a reply");
        }
    }
}

pub(crate) async fn submit(ops: &crate::ops::actions::Ops, req: Request) {
    let ctx: &Context = &ops.ctx;
    let msg = &req.message;
    let queue = msg
        .subject
        .strip_prefix("ax.submit.")
        .unwrap_or_default()
        .to_string();
    // Labels name declared queues only: a request to a made-up queue creates no series.
    // Each branch's future is boxed: inline, the two side by side made every submit in
    // flight hold 14,504 B (CHANGELOG.md, "Design history"); boxed, it holds the one it runs.
    let body = if crate::submit::is_batch(&msg.payload) {
        let result = guarded("submit", Box::pin(ctx.submit_batch(&queue, &msg.payload))).await;
        let label = ctx.queues.label(&queue);
        match result {
            Ok(answers) => {
                let replies: Vec<SubmitReply> = answers
                    .into_iter()
                    .map(|a| submit_reply(&queue, &label, a))
                    .collect();
                serde_json::to_vec(&replies)
            }
            Err(error) => serde_json::to_vec(&submit_reply(&queue, &label, Err(error))),
        }
    } else {
        let result = guarded(
            "submit",
            Box::pin(crate::intake::submit(ops, &queue, &msg.payload)),
        )
        .await;
        let label = ctx.queues.label(&queue);
        serde_json::to_vec(&submit_reply(&queue, &label, result))
    };
    answer(&req, body.expect("a reply serializes")).await;
}

/// The reply to one submitted task, counted in the submit metrics.
fn submit_reply(
    queue: &str,
    label: &str,
    result: Result<SubmitAccepted, WireError>,
) -> SubmitReply {
    match result {
        Ok(accepted) => {
            if !accepted.duplicate {
                metrics::counter!(m::SUBMITTED, "queue" => label.to_string()).increment(1);
            }
            SubmitReply::Accepted(accepted)
        }
        Err(error) => {
            metrics::counter!(m::SUBMIT_REJECTED, "queue" => label.to_string(), "code" => error.code.as_str())
                .increment(1);
            if error.code == ErrorCode::Unavailable {
                warn!(queue = %queue, cause = %error.message, "submit failed");
            }
            SubmitReply::Error { error }
        }
    }
}

/// Answers one request of a management API (`ax.trigger.<op>`, `ax.flow.<op>`):
/// `{"ok": value}` or `{"error": …}`.
pub(crate) async fn management_api<F, Fut>(api: &'static str, prefix: &str, req: Request, handle: F)
where
    F: FnOnce(String, bytes::Bytes) -> Fut,
    Fut: Future<Output = Result<serde_json::Value, WireError>>,
{
    let op = req
        .message
        .subject
        .strip_prefix(prefix)
        .unwrap_or_default()
        .to_string();
    let reply = match guarded(api, handle(op, req.message.payload.clone())).await {
        Ok(value) => serde_json::json!({ "ok": value }),
        Err(error) => serde_json::json!({ "error": error }),
    };
    answer(
        &req,
        serde_json::to_vec(&reply).expect("a reply serializes"),
    )
    .await;
}

/// The management APIs a server answers (`ax.trigger.*`, `ax.flow.*`, `ax.limit.*`,
/// `ax.task.*`).
pub(crate) struct Apis {
    pub(crate) triggers: Option<std::sync::Arc<crate::trigger::api::TriggerApi>>,
    pub(crate) flows: crate::flow::api::FlowApi,
    pub(crate) limits: crate::limits::api::LimitApi,
    pub(crate) tasks: crate::ops::actions::Ops,
}

impl Apis {
    /// Runs `op` of the API `api` (`task`, `flow`, `limit`, `trigger`) in this server, as
    /// a request to `ax.<api>.<op>` would; `None` for an unknown API.
    pub(crate) async fn call(
        &self,
        api: &str,
        op: &str,
        body: bytes::Bytes,
    ) -> Option<Result<serde_json::Value, WireError>> {
        let api = Api::from_name(api)?;
        if api == Api::Trigger && self.triggers.is_none() {
            return None;
        }
        Some(guarded(api.name(), self.run(api, op, &body)).await)
    }

    /// Runs operation `op` of `api`. Each handler decodes the request through its API's
    /// typed request (`ax_sdk::api::Request::decode`), which refuses an operation the
    /// registry does not list before anything else. The callers guard it (a panic becomes
    /// an `unavailable` answer).
    async fn run(&self, api: Api, op: &str, body: &[u8]) -> Result<serde_json::Value, WireError> {
        if self.tasks.ctx.faults.request_panics(body) {
            panic!("injected fault: request {}.{op} made to panic", api.name());
        }
        match (api, &self.triggers) {
            (Api::Task, _) => self.tasks.handle(op, body).await,
            (Api::Flow, _) => self.flows.handle(&self.tasks, op, body).await,
            (Api::Limit, _) => self.limits.handle(op, body).await,
            (Api::Trigger, Some(t)) => t.handle(op, body).await,
            (Api::Trigger, None) => Err(ax_sdk::api::unknown_operation(api, op)),
        }
    }

    /// Answers one management request, routed by its subject's prefix.
    pub(crate) async fn handle(&self, req: Request) {
        let subject = req.message.subject.clone();
        let Some(api) = Api::ALL
            .into_iter()
            .find(|a| subject.starts_with(a.prefix()))
        else {
            return;
        };
        management_api(api.name(), api.prefix(), req, |op, body| async move {
            self.run(api, &op, &body).await
        })
        .await
    }
}
