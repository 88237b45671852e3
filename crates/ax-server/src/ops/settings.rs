//! `ax.task.options_<op>`: task settings stored apart from code (`AX_LIMITS`, key
//! `<queue>.=task.<name>`; PROTOCOL.md §8), applied by every worker of the queue to its
//! next attempts of that name.

use super::actions::Ops;
use async_nats::jetstream::kv;
use ax_core::protocol::{ErrorCode, WireError};
use ax_sdk::settings::{self, SettingsFilter, SettingsName, StoredSettings, TaskSettings};
use futures::StreamExt;
use serde_json::{json, Value};
use tracing::info;

impl Ops {
    /// Stores one name's settings (checked; the queue must be declared).
    pub(crate) async fn put_settings(&self, s: StoredSettings) -> Result<Value, WireError> {
        let key = settings::key(&s.queue, &s.name)?;
        s.settings.validate()?;
        self.ctx.queues.check(&self.ctx.js, &s.queue).await?;
        let value = serde_json::to_vec(&s.settings).expect("serializes");
        self.limits
            .put(&key, value.into())
            .await
            .map_err(WireError::unavailable)?;
        info!(queue = %s.queue, task = %s.name, settings = %serde_json::to_string(&s.settings).unwrap_or_default(),
            "task settings stored");
        Ok(serde_json::to_value(&s).expect("serializes"))
    }

    /// One name's stored settings, `not_found` if none.
    pub(crate) async fn get_settings(&self, n: SettingsName) -> Result<Value, WireError> {
        let key = settings::key(&n.queue, &n.name)?;
        let Some(v) = self
            .limits
            .get(&key)
            .await
            .map_err(WireError::unavailable)?
        else {
            return Err(WireError::new(
                ErrorCode::NotFound,
                format!(
                    "no stored settings for task {:?} of queue {:?}",
                    n.name, n.queue
                ),
            ));
        };
        let settings: TaskSettings = serde_json::from_slice(&v).map_err(WireError::unavailable)?;
        let stored = StoredSettings {
            queue: n.queue,
            name: n.name,
            settings,
        };
        Ok(serde_json::to_value(&stored).expect("serializes"))
    }

    /// The stored settings of a queue's names or of every queue's, by queue and name
    /// (values that do not decode, written by hand, are left out).
    pub(crate) async fn list_settings(&self, f: SettingsFilter) -> Result<Value, WireError> {
        if let Some(q) = &f.queue {
            if !ax_core::names::valid_queue(q) {
                return Err(WireError::field("queue", "not a queue name"));
            }
        }
        let mut out: Vec<StoredSettings> = Vec::new();
        let info = self
            .limits
            .stream
            .get_info()
            .await
            .map_err(WireError::unavailable)?;
        if info.state.messages > 0 {
            let mut keys = self.limits.keys().await.map_err(WireError::unavailable)?;
            while let Some(key) = keys.next().await {
                let key = key.map_err(WireError::unavailable)?;
                let Some((queue, rest)) = key.split_once('.') else {
                    continue;
                };
                let Some(name) = rest.strip_prefix(settings::KEY_MARK) else {
                    continue;
                };
                if f.queue.as_deref().is_some_and(|q| q != queue) {
                    continue;
                }
                if let Some(v) = self
                    .limits
                    .get(&key)
                    .await
                    .map_err(WireError::unavailable)?
                {
                    if let Ok(settings) = serde_json::from_slice(&v) {
                        out.push(StoredSettings {
                            queue: queue.to_string(),
                            name: name.to_string(),
                            settings,
                        });
                    }
                }
            }
        }
        out.sort_by(|a, b| (&a.queue, &a.name).cmp(&(&b.queue, &b.name)));
        Ok(json!(out))
    }

    /// Deletes one name's stored settings: `deleted` says if there were some.
    pub(crate) async fn delete_settings(&self, n: SettingsName) -> Result<Value, WireError> {
        let key = settings::key(&n.queue, &n.name)?;
        let entry = self
            .limits
            .entry(&key)
            .await
            .map_err(WireError::unavailable)?;
        let existed = entry.is_some_and(|e| e.operation == kv::Operation::Put);
        if existed {
            self.limits
                .delete(&key)
                .await
                .map_err(WireError::unavailable)?;
            info!(queue = %n.queue, task = %n.name, "task settings deleted");
        }
        Ok(json!({"queue": n.queue, "name": n.name, "deleted": existed}))
    }
}
