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

/// A page of `ax.trigger.names`.
#[derive(Deserialize)]
struct NamesPage {
    names: Vec<String>,
    more: bool,
}

/// A manual run (`ax.trigger.run`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManualRun {
    /// The tasks it made.
    pub task_ids: Vec<String>,
    /// It ran although the previous fire's tasks were unfinished.
    pub forced: bool,
}

/// One line of an apply's report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    /// Trigger name.
    pub name: String,
    /// `created`, `updated`, `unchanged` or `deleted`.
    pub outcome: String,
}

/// Which part of [`Client::apply_triggers`] a progress report is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyStage {
    /// Definitions checked by the server (nothing stored yet).
    Checking,
    /// Definitions stored.
    Storing,
    /// Stored triggers the file does not name, deleted (`prune`).
    Pruning,
}

/// Deletes in flight while [`Client::apply_triggers`] prunes.
const DELETES_IN_FLIGHT: usize = 32;

/// Parts of a large file in flight while [`Client::apply_triggers`] checks or stores them
/// (each stores 64 definitions at a time on the server).
const PARTS_IN_FLIGHT: usize = 3;

impl Client {
    /// Applies a whole set of trigger definitions (`ax apply -f`): stores each, and with
    /// `prune` deletes the stored triggers the set does not name. Nothing changes if any
    /// definition is invalid (the error names it: `triggers[<i>].<field>`).
    ///
    /// A set that fits in one request (the server's max payload) is one `apply`. A larger
    /// one goes in parts: every part checked first (`apply` with `check`), then every part
    /// stored (three parts in flight), then the stored names read a page at a time
    /// (`names`) and the others deleted. Killed midway, it has stored some parts and not
    /// others: apply it again.
    /// `progress(stage, done, total)` is called after each part.
    pub async fn apply_triggers(
        &self,
        triggers: &[Value],
        prune: bool,
        mut progress: impl FnMut(ApplyStage, usize, usize),
    ) -> Result<Vec<Applied>, ClientError> {
        let max_bytes = self.nats.server_info().max_payload.max(64 * 1024) - 4096;
        let mut parts: Vec<(usize, usize)> = Vec::new(); // (first, end)
        let (mut first, mut bytes) = (0, 0);
        for (i, def) in triggers.iter().enumerate() {
            let size = serde_json::to_vec(def).map(|b| b.len()).unwrap_or(0) + 1;
            if size > max_bytes {
                return Err(ClientError::Refused(crate::protocol::WireError::field(
                    &format!("triggers[{i}]"),
                    format!("{size} bytes: over the server's max payload ({max_bytes} with the request around it)"),
                )));
            }
            if bytes + size > max_bytes {
                parts.push((first, i));
                (first, bytes) = (i, 0);
            }
            bytes += size;
        }
        parts.push((first, triggers.len()));
        let total = triggers.len();
        let request = |(a, b): (usize, usize), check: bool, prune: bool| {
            TriggerRequest::Apply(super::TriggerApply {
                triggers: triggers[a..b].to_vec(),
                prune,
                check,
                offset: a,
            })
        };
        if parts.len() == 1 {
            let ok = self.call(&request(parts[0], false, prune)).await?;
            progress(ApplyStage::Storing, total, total);
            return Ok(serde_json::from_value(ok)?);
        }
        // A few parts in flight (answers taken in file order): the server's work on one
        // part waits on the broker, which another part's can use.
        use futures::StreamExt;
        let mut checks = futures::stream::iter(parts.iter().map(|&part| async move {
            self.call(&request(part, true, false)).await.map(|_| part.1)
        }))
        .buffered(PARTS_IN_FLIGHT);
        while let Some(checked) = checks.next().await {
            progress(ApplyStage::Checking, checked?, total);
        }
        let mut report: Vec<Applied> = Vec::with_capacity(total);
        let mut stores = futures::stream::iter(parts.iter().map(|&part| async move {
            let ok = self.call(&request(part, false, false)).await?;
            Ok::<_, ClientError>((serde_json::from_value::<Vec<Applied>>(ok)?, part.1))
        }))
        .buffered(PARTS_IN_FLIGHT);
        while let Some(stored) = stores.next().await {
            let (applied, end) = stored?;
            report.extend(applied);
            progress(ApplyStage::Storing, end, total);
        }
        if prune {
            let wanted: std::collections::HashSet<&str> =
                report.iter().map(|a| a.name.as_str()).collect();
            let mut gone = Vec::new();
            let mut after = None;
            loop {
                let page = TriggerRequest::Names(super::TriggerNames { after });
                let page: NamesPage = serde_json::from_value(self.call(&page).await?)?;
                after = page.names.last().cloned();
                gone.extend(
                    page.names
                        .into_iter()
                        .filter(|n| !wanted.contains(n.as_str())),
                );
                if !page.more || after.is_none() {
                    break;
                }
            }
            let n = gone.len();
            let mut deletes = futures::stream::iter(gone.into_iter().map(|name| async move {
                match self.delete_trigger(&name).await {
                    Ok(()) => Ok(Some(name)),
                    Err(ClientError::Refused(e)) if e.code == ErrorCode::NotFound => Ok(None),
                    Err(e) => Err(e),
                }
            }))
            .buffer_unordered(DELETES_IN_FLIGHT);
            let mut done = 0;
            let mut deleted = Vec::new();
            while let Some(one) = deletes.next().await {
                deleted.extend(one?);
                done += 1;
                if done % 1000 == 0 || done == n {
                    progress(ApplyStage::Pruning, done, n);
                }
            }
            deleted.sort();
            report.extend(deleted.into_iter().map(|name| Applied {
                name,
                outcome: "deleted".into(),
            }));
        }
        Ok(report)
    }

    /// Calls the trigger API: `op` is `put`, `apply`, `get`, `list`, `names`, `leader`,
    /// `pause`, `resume`, `delete` or `run` (PROTOCOL.md §5); returns the `ok` value. The typed
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
