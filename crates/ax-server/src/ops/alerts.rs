//! Alerts on terminal failures only: a task that ends `dead`, a flow run that ends
//! `failed`. One alert per (queue, task name, error class) — or (flow, error class) — per
//! window: the first failure of a burst is published on `ax.events.alert.<queue>` (and
//! POSTed to the webhook, if one is set); repeats within the window are counted, and the
//! next alert after it says how many were suppressed.
//!
//! Every server sees every task change, so the window's state is a KV record in
//! `AX_ALERTS` written by compare-and-set, carrying the highest task-state revision it
//! has counted: a change is counted by exactly one server (the one whose write wins),
//! however many servers run. An alert is published after its window write succeeds: a
//! server killed between the two loses that alert (at most once, never twice).

use async_nats::jetstream::kv;
use ax_core::metrics as m;
use ax_core::names::ALERTS_BUCKET;
use ax_core::time::now_ms;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::time::Duration;
use tracing::{info, warn};

/// Alert settings of a server.
#[derive(Debug, Clone)]
pub struct AlertConfig {
    /// Repeats of the same (queue, name, class) within this window are folded into one
    /// alert (default 10 min).
    pub window: Duration,
    /// POST every alert as JSON here (`http://` or `https://`), if set.
    pub webhook: Option<String>,
    /// Base URL of the console, for the alert's `link` (e.g. `http://ax.internal:8080`).
    pub console_url: Option<String>,
}

impl Default for AlertConfig {
    fn default() -> Self {
        AlertConfig {
            window: Duration::from_secs(600),
            webhook: None,
            console_url: None,
        }
    }
}

/// Checks a webhook URL: `http://` or `https://` with a host.
pub fn check_webhook(url: &str) -> Result<(), String> {
    super::webhook::check(url)
}

/// The state of one alert key's window (`AX_ALERTS`).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Window {
    start_ms: u64,
    /// Highest revision counted (task record or flow run): a change at or below it was
    /// counted already.
    last_rev: u64,
    /// Failures in this window, the first included.
    count: u64,
    /// Failures folded into the previous alert's window and not yet reported.
    #[serde(default)]
    suppressed_before: u64,
}

/// One terminal failure to alert on.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    /// `task_dead` or `flow_failed`.
    pub(crate) kind: &'static str,
    /// The queue (tasks) or `flows`.
    pub(crate) queue: String,
    /// Task name or flow name.
    pub(crate) name: String,
    pub(crate) class: String,
    pub(crate) message: String,
    /// Task id or run id.
    pub(crate) subject_id: String,
    pub(crate) attempts: u32,
    /// Revision of the record that says it failed (orders changes across servers).
    pub(crate) revision: u64,
}

/// The console page of what failed: `<base>/#/task/<task id>` or `<base>/#/run/<run id>`
/// (the console's routes).
fn console_link(base: &str, kind: &str, id: &str) -> String {
    let base = base.trim_end_matches('/');
    match kind {
        "flow_failed" => format!("{base}/#/run/{id}"),
        _ => format!("{base}/#/task/{id}"),
    }
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

/// Sends alerts; cheap to clone.
#[derive(Clone)]
pub(crate) struct Alerts {
    kv: kv::Store,
    /// `AX_LIMITS`, where a task name's stored settings may name its `alert_group`.
    settings: kv::Store,
    client: async_nats::Client,
    config: AlertConfig,
}

impl Alerts {
    pub(crate) async fn open(
        js: &async_nats::jetstream::Context,
        config: AlertConfig,
    ) -> Result<Alerts, async_nats::Error> {
        Ok(Alerts {
            kv: js.get_key_value(ALERTS_BUCKET).await?,
            settings: js.get_key_value(ax_core::names::LIMITS_BUCKET).await?,
            client: js.client(),
            config,
        })
    }

    /// Counts a failure in its window; publishes an alert if it opens a new window.
    pub(crate) async fn failed(&self, f: Failure) {
        let key = format!("{}.{}.{}", f.queue, hex(&f.name), hex(&f.class));
        let now = now_ms();
        let window = self.config.window.as_millis() as u64;
        for _ in 0..10 {
            let found = match self.kv.entry(&key).await {
                Ok(found) => found.filter(|e| e.operation == kv::Operation::Put),
                Err(e) => {
                    warn!(cause = %e, "alert window not readable; alert skipped");
                    return;
                }
            };
            let current = found
                .as_ref()
                .and_then(|e| serde_json::from_slice::<Window>(&e.value).ok());
            let (next, alert_with) = match &current {
                Some(w) if f.revision <= w.last_rev => return, // counted already
                Some(w) if now.saturating_sub(w.start_ms) < window => (
                    Window {
                        last_rev: f.revision,
                        count: w.count + 1,
                        ..w.clone()
                    },
                    None,
                ),
                Some(w) => (
                    Window {
                        start_ms: now,
                        last_rev: f.revision,
                        count: 1,
                        suppressed_before: w.count.saturating_sub(1),
                    },
                    Some(w.count.saturating_sub(1)),
                ),
                None => (
                    Window {
                        start_ms: now,
                        last_rev: f.revision,
                        count: 1,
                        suppressed_before: 0,
                    },
                    Some(0),
                ),
            };
            let value = serde_json::to_vec(&next).expect("serializes").into();
            let written = match &found {
                Some(e) => self.kv.update(&key, value, e.revision).await.is_ok(),
                None => self.kv.create(&key, value).await.is_ok(),
            };
            if !written {
                continue; // another server moved the window: read it again
            }
            match alert_with {
                Some(suppressed) => self.publish(&f, suppressed, window).await,
                None => {
                    metrics::counter!(m::ALERTS_SUPPRESSED, "queue" => f.queue.clone()).increment(1)
                }
            }
            return;
        }
        warn!(key, "alert window contended; alert skipped");
    }

    /// The `alert_group` of a dead task's name, from its stored settings, if set (a read
    /// that fails leaves the alert without a group rather than losing it).
    async fn group_of(&self, f: &Failure) -> Option<String> {
        if f.kind != "task_dead" {
            return None;
        }
        let key = ax_sdk::settings::key(&f.queue, &f.name).ok()?;
        let value = self.settings.get(&key).await.ok().flatten()?;
        serde_json::from_slice::<ax_sdk::settings::TaskSettings>(&value)
            .ok()?
            .alert_group
    }

    async fn publish(&self, f: &Failure, suppressed: u64, window_ms: u64) {
        let link = self
            .config
            .console_url
            .as_deref()
            .map(|base| console_link(base, f.kind, &f.subject_id));
        let (id_field, name_field) = match f.kind {
            "flow_failed" => ("run", "flow"),
            _ => ("task", "name"),
        };
        let mut alert = json!({
            "kind": f.kind,
            "queue": f.queue,
            "error_class": f.class,
            "error_message": f.message,
            "attempts": f.attempts,
            "at_ms": now_ms(),
            "window_ms": window_ms,
            "suppressed_since_last": suppressed,
            "link": link,
        });
        alert[id_field] = Value::String(f.subject_id.clone());
        alert[name_field] = Value::String(f.name.clone());
        if let Some(group) = self.group_of(f).await {
            alert["group"] = Value::String(group);
        }
        let body = serde_json::to_vec(&alert).expect("serializes");
        let subject = format!("ax.events.alert.{}", f.queue);
        if let Err(e) = self.client.publish(subject, body.clone().into()).await {
            warn!(cause = %e, "alert not published");
        }
        metrics::counter!(m::ALERTS, "queue" => f.queue.clone(), "kind" => f.kind).increment(1);
        info!(kind = f.kind, queue = %f.queue, name = %f.name, class = %f.class,
            id = %f.subject_id, suppressed, "alert");
        if let Some(url) = &self.config.webhook {
            let url = url.clone();
            tokio::spawn(async move {
                if let Err(e) = super::webhook::post(&url, body).await {
                    warn!(url = %url, cause = %e, "alert webhook failed");
                }
            });
        }
    }

    /// A flow run ended `failed` (its run key written at `revision`).
    pub(crate) async fn flow_failed(
        &self,
        run: &crate::flow::model::FlowRun,
        reason: &str,
        revision: u64,
    ) {
        // The reason names the failed step and its error class: "step <s> failed: <class>: …".
        let class = reason
            .split(": ")
            .nth(1)
            .filter(|c| !c.is_empty() && c.len() <= 64 && !c.contains(' '))
            .unwrap_or("failed")
            .to_string();
        self.failed(Failure {
            kind: "flow_failed",
            queue: "flows".into(),
            name: run.flow.clone(),
            class,
            message: reason.to_string(),
            subject_id: run.id.clone(),
            attempts: 0,
            revision,
        })
        .await;
    }

    /// Follows the dead letters (`AX_DEAD`, headers only) from a minute before now, so a
    /// failure during a quick restart still alerts: every task that ends `dead` is a
    /// failure, its dead letter's sequence its revision.
    pub(crate) async fn follow(self, shutdown: tokio_util::sync::CancellationToken) {
        use async_nats::jetstream::consumer;
        use ax_core::task::header;
        use futures::StreamExt;
        let js = async_nats::jetstream::new(self.client.clone());
        loop {
            let since_ns = (now_ms().saturating_sub(60_000) as i128) * 1_000_000;
            let start_time = async_nats::datetime::from_nanos(since_ns)
                .unwrap_or_else(|_| async_nats::datetime::now());
            let opened =
                ax_core::retry::until_ok("the dead-letter feed (AX_DEAD)", &shutdown, || {
                    let js = js.clone();
                    async move {
                        let config = consumer::pull::OrderedConfig {
                            deliver_policy: consumer::DeliverPolicy::ByStartTime { start_time },
                            headers_only: true,
                            ..Default::default()
                        };
                        ax_core::follow::ordered(&js, ax_core::names::DEAD_STREAM, config).await
                    }
                })
                .await;
            let Some(mut messages) = opened else { return };
            loop {
                let msg = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    msg = messages.next() => msg,
                };
                let Some(Ok(msg)) = msg else {
                    warn!("dead-letter feed broke; following it again");
                    break;
                };
                let Ok(info) = msg.info() else { continue };
                let revision = info.stream_sequence;
                let h = msg.headers.clone().unwrap_or_default();
                let get = |name: &str| h.get(name).map(|v| v.as_str().to_string());
                let queue = get(header::QUEUE).unwrap_or_else(|| {
                    msg.subject
                        .split('.')
                        .nth(2)
                        .unwrap_or_default()
                        .to_string()
                });
                let f = Failure {
                    kind: "task_dead",
                    queue,
                    name: get(header::NAME).unwrap_or_else(|| "(unreadable)".into()),
                    class: get(header::ERROR_CLASS).unwrap_or_else(|| "dead".into()),
                    message: get(header::ERROR_MESSAGE).unwrap_or_default(),
                    subject_id: get(header::ID).unwrap_or_default(),
                    attempts: get(header::ATTEMPTS)
                        .and_then(|a| a.parse().ok())
                        .unwrap_or(0),
                    revision,
                };
                self.failed(f).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::console_link;

    #[test]
    fn links_use_the_consoles_routes() {
        assert_eq!(
            console_link("http://ax.internal:8080/", "task_dead", "billing.7Xq"),
            "http://ax.internal:8080/#/task/billing.7Xq"
        );
        assert_eq!(
            console_link("https://ax.example/console", "flow_failed", "r-42"),
            "https://ax.example/console/#/run/r-42"
        );
    }
}
