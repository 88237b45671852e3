//! The settings calls of a [`Client`]: put, get, list and delete a task name's stored
//! settings (`ax.task.options.*`).

use super::{SettingsFilter, SettingsName, StoredSettings, TaskSettings};
use crate::client::{Client, ClientError};
use crate::error::ErrorCode;
use crate::ops::TaskRequest;

impl Client {
    /// Stores `settings` for task `name` of `queue`, replacing what was stored (checked by
    /// the server: `invalid_field` naming the field, `unknown_queue`). Every worker of the
    /// queue applies them to its next attempts of that name.
    pub async fn put_task_settings(
        &self,
        queue: &str,
        name: &str,
        settings: &TaskSettings,
    ) -> Result<StoredSettings, ClientError> {
        let body = StoredSettings {
            queue: queue.to_string(),
            name: name.to_string(),
            settings: settings.clone(),
        };
        decode(self.call(&TaskRequest::OptionsPut(body)).await?)
    }

    /// The stored settings of task `name` of `queue`, `None` if there are none.
    pub async fn task_settings(
        &self,
        queue: &str,
        name: &str,
    ) -> Result<Option<TaskSettings>, ClientError> {
        match self
            .call(&TaskRequest::OptionsGet(named(queue, name)))
            .await
        {
            Ok(v) => decode::<StoredSettings>(v).map(|s| Some(s.settings)),
            Err(ClientError::Refused(e)) if e.code == ErrorCode::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The stored settings of `queue`'s names (every queue's with `None`), by queue and
    /// name.
    pub async fn list_task_settings(
        &self,
        queue: Option<&str>,
    ) -> Result<Vec<StoredSettings>, ClientError> {
        let filter = SettingsFilter {
            queue: queue.map(str::to_string),
        };
        decode(self.call(&TaskRequest::OptionsList(filter)).await?)
    }

    /// Deletes the stored settings of task `name` of `queue`: `true` if there were some.
    /// The workers go back to their declared options from the next attempt.
    pub async fn delete_task_settings(&self, queue: &str, name: &str) -> Result<bool, ClientError> {
        let v = self
            .call(&TaskRequest::OptionsDelete(named(queue, name)))
            .await?;
        Ok(v["deleted"].as_bool().unwrap_or(false))
    }
}

fn named(queue: &str, name: &str) -> SettingsName {
    SettingsName {
        queue: queue.to_string(),
        name: name.to_string(),
    }
}

fn decode<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T, ClientError> {
    Ok(serde_json::from_value(v)?)
}
