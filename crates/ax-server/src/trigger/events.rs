//! Event triggers: every ax server serves each event trigger's subject in the queue
//! group `ax-events`, so each message starts exactly one fire while any server runs.
//!
//! Core NATS delivers at most once: publish events as requests (the reply is
//! `{"ok": {"task_ids": [...]}}` or `{"error": …}`) and retry on no answer, with a
//! `Nats-Msg-Id` header so a retried event is the same fire. For events that must survive
//! ax being down entirely, capture the subject in a stream and re-publish from there.

use super::engine::EngineError;
use super::fire::fire;
use super::model::{Kind, TriggerDef};
use super::plan::Source;
use crate::context::Context;
use crate::trigger::Validate;
use ax_core::time::now_ms;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// Queue group of the event subscriptions.
const EVENTS_QUEUE_GROUP: &str = "ax-events";

pub(crate) struct EventRouter {
    pub(crate) ctx: Arc<Context>,
}

impl EventRouter {
    pub(crate) async fn run(self, shutdown: CancellationToken) -> Result<(), EngineError> {
        let watch = super::feed::definitions(&self.ctx.js).await?;
        tokio::pin!(watch);
        let mut served: HashMap<String, (TriggerDef, JoinHandle<()>)> = HashMap::new();
        // A watch that fails or ends stops the router: its supervisor starts it again,
        // which follows every definition anew (it used to stop following changes).
        let outcome = loop {
            tokio::select! {
                _ = shutdown.cancelled() => break Ok(()),
                write = watch.next() => {
                    let super::feed::KvWrite { name, value, .. } = match write {
                        Some(Ok(write)) => write,
                        Some(Err(e)) => break Err(e),
                        None => break Err(EngineError::Broker {
                            op: "follow definitions",
                            source: "the definition feed ended".into(),
                        }),
                    };
                    let def = value
                        .and_then(|v| serde_json::from_slice::<TriggerDef>(&v).ok())
                        .filter(|d| d.enabled && matches!(d.kind, Kind::Event { .. }) && d.validate().is_ok());
                    if let Some((old, _)) = served.get(&name) {
                        if def.as_ref() == Some(old) {
                            continue;
                        }
                    }
                    if let Some((_, task)) = served.remove(&name) {
                        task.abort();
                    }
                    if let Some(def) = def {
                        let task = tokio::spawn(serve(self.ctx.clone(), def.clone()));
                        served.insert(name, (def, task));
                    }
                }
            }
        };
        for (_, (_, task)) in served {
            task.abort();
        }
        outcome
    }
}

async fn serve(ctx: Arc<Context>, def: TriggerDef) {
    let Kind::Event { subject } = &def.kind else {
        return;
    };
    let client = ctx.js.client();
    let mut sub = match client
        .queue_subscribe(subject.clone(), EVENTS_QUEUE_GROUP.to_string())
        .await
    {
        Ok(sub) => sub,
        Err(e) => {
            warn!(trigger = %def.name, cause = %e, "cannot subscribe to the event subject");
            return;
        }
    };
    while let Some(msg) = sub.next().await {
        let fired = match super::fire::event_tag(&msg) {
            Ok(tag) => fire(&ctx, &def, now_ms(), Source::Event, &tag, Some(&msg)).await,
            Err(e) => Err(e),
        };
        let answer = match fired {
            Ok(ids) => {
                debug!(trigger = %def.name, tasks = ids.len(), "event fired");
                serde_json::json!({ "ok": { "task_ids": ids } })
            }
            Err(error) => {
                warn!(trigger = %def.name, cause = %error, "event not fired");
                serde_json::json!({ "error": error })
            }
        };
        if let Some(reply) = msg.reply {
            let body = serde_json::to_vec(&answer).expect("serializes");
            let _ = client.publish(reply, body.into()).await;
        }
    }
}
