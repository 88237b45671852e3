//! The trigger calls of [`Client`]: typed requests to `ax.trigger.<op>` (PROTOCOL.md §5).

use super::model::{Kind, TriggerDef};
use super::request::{TriggerRef, TriggerRequest};
use crate::client::{Client, ClientError};
use crate::error::ErrorCode;
use crate::names::TRIGGER_API_PREFIX;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What a `put` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PutOutcome {
    /// There was no trigger of that name.
    Created,
    /// The stored definition was different.
    Updated,
    /// The stored definition was the same: nothing was written.
    Unchanged,
}

/// A trigger with its state and its next fires (`ax.trigger.get`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TriggerInfo {
    /// The definition.
    pub definition: TriggerDef,
    /// Its state in `AX_TRIGGER_STATE` (PROTOCOL.md §5: fires, last fire, active tasks, …).
    pub state: Value,
    /// The next five fire times, RFC 3339.
    pub next: Vec<String>,
    /// Tasks of its fires not finished yet.
    pub running: Vec<String>,
}

/// One row of `ax.trigger.list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TriggerSummary {
    /// Name.
    pub name: String,
    /// When it fires.
    pub kind: Kind,
    /// False while paused.
    pub enabled: bool,
    /// The next fire time, RFC 3339.
    pub next: Option<String>,
    /// Fires made, scheduled and manual.
    pub fires: u64,
    /// When the last fire was made, ms since the epoch.
    pub last_fired_at_ms: Option<u64>,
    /// The final states of the last finished fire's tasks.
    pub last_result: Option<Value>,
}

/// A manual run (`ax.trigger.run`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManualRun {
    /// The tasks it made.
    pub task_ids: Vec<String>,
    /// It ran although the previous fire's tasks were unfinished.
    pub forced: bool,
}

impl Client {
    /// Calls the trigger API: `op` is `put`, `apply`, `get`, `list`, `leader`, `pause`,
    /// `resume`, `delete` or `run` (PROTOCOL.md §5); returns the `ok` value. The typed
    /// calls below are the same requests.
    pub async fn trigger(&self, op: &str, body: &Value) -> Result<Value, ClientError> {
        self.management(TRIGGER_API_PREFIX, op, body).await
    }

    /// Stores a trigger (checked by the server first: refused `invalid_field` naming the
    /// field).
    pub async fn put_trigger(&self, def: &TriggerDef) -> Result<PutOutcome, ClientError> {
        let body = serde_json::to_value(def).expect("a definition serializes");
        let ok = self.call(&TriggerRequest::Put(body)).await?;
        Ok(serde_json::from_value(ok["outcome"].clone())?)
    }

    /// The trigger `name` with its state and next fires, or `None` if there is none.
    pub async fn get_trigger(&self, name: &str) -> Result<Option<TriggerInfo>, ClientError> {
        match self.call(&TriggerRequest::Get(TriggerRef::new(name))).await {
            Ok(v) => Ok(Some(serde_json::from_value(v)?)),
            Err(ClientError::Refused(e)) if e.code == ErrorCode::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every trigger, with its next fire and counts.
    pub async fn list_triggers(&self) -> Result<Vec<TriggerSummary>, ClientError> {
        Ok(serde_json::from_value(
            self.call(&TriggerRequest::List {}).await?,
        )?)
    }

    /// Pauses (`enabled` false) or resumes the trigger `name`; a resumed trigger skips
    /// the times it was paused for.
    pub async fn set_trigger_enabled(&self, name: &str, enabled: bool) -> Result<(), ClientError> {
        let named = TriggerRef::new(name);
        let request = match enabled {
            true => TriggerRequest::Resume(named),
            false => TriggerRequest::Pause(named),
        };
        self.call(&request).await.map(drop)
    }

    /// Deletes the trigger `name` (tasks it made are kept); `not_found` if there is none.
    pub async fn delete_trigger(&self, name: &str) -> Result<(), ClientError> {
        let request = TriggerRequest::Delete(TriggerRef::new(name));
        self.call(&request).await.map(drop)
    }

    /// Fires the trigger `name` now; refused `running` while its previous fire's tasks are
    /// unfinished, unless `force`.
    pub async fn run_trigger(&self, name: &str, force: bool) -> Result<ManualRun, ClientError> {
        let request = TriggerRequest::Run(TriggerRef {
            name: name.to_string(),
            force,
        });
        Ok(serde_json::from_value(self.call(&request).await?)?)
    }
}
