//! Trigger definitions (`AX_TRIGGERS`) and runtime state (`AX_TRIGGER_STATE`) in KV.

use super::model::TriggerDef;
use super::plan::TriggerState;
use async_nats::jetstream::{self, kv};
use ax_sdk::names::{TRIGGERS_BUCKET, TRIGGER_STATE_BUCKET};
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Errors of the trigger store.
#[derive(Debug, thiserror::Error)]
pub enum TriggerStoreError {
    /// Another writer changed the key since it was read.
    #[error("trigger {0}: changed concurrently")]
    Stale(String),
    /// A stored value does not decode.
    #[error("trigger {name}: corrupt value: {source}")]
    Corrupt {
        /// Trigger name.
        name: String,
        /// Decode error.
        source: serde_json::Error,
    },
    /// The broker failed.
    #[error("trigger {name}: {op}: {source}")]
    Broker {
        /// Trigger name.
        name: String,
        /// Operation.
        op: &'static str,
        /// Underlying error.
        source: async_nats::Error,
    },
}

impl TriggerStoreError {
    /// What kind of failure this is.
    pub fn kind(&self) -> ax_sdk::error::ErrorKind {
        use ax_sdk::error::ErrorKind;
        match self {
            TriggerStoreError::Stale(_) => ErrorKind::Conflict,
            TriggerStoreError::Corrupt { .. } => ErrorKind::Invalid,
            TriggerStoreError::Broker { source, .. } => ErrorKind::of(source.as_ref()),
        }
    }
}

fn broker(name: &str, op: &'static str, e: impl Into<async_nats::Error>) -> TriggerStoreError {
    TriggerStoreError::Broker {
        name: name.to_string(),
        op,
        source: e.into(),
    }
}

/// Both trigger buckets.
#[derive(Debug, Clone)]
pub struct TriggerStore {
    defs: kv::Store,
    states: kv::Store,
}

async fn get<T: DeserializeOwned>(
    kv: &kv::Store,
    name: &str,
) -> Result<Option<(T, u64)>, TriggerStoreError> {
    // From the leader: a new trigger leader decides from what it reads (`kv_read`).
    let entry = ax_sdk::kv_read::latest(kv, name)
        .await
        .map_err(|e| broker(name, "get", e))?;
    match entry {
        Some(e) if e.operation == kv::Operation::Put => {
            let value =
                serde_json::from_slice(&e.value).map_err(|source| TriggerStoreError::Corrupt {
                    name: name.to_string(),
                    source,
                })?;
            Ok(Some((value, e.revision)))
        }
        _ => Ok(None),
    }
}

/// Writes `value`: create if `revision` is `None`, else compare-and-set.
async fn write<T: Serialize>(
    kv: &kv::Store,
    name: &str,
    value: &T,
    revision: Option<u64>,
) -> Result<u64, TriggerStoreError> {
    let body: bytes::Bytes = serde_json::to_vec(value).expect("serializes").into();
    let result = match revision {
        None => kv
            .create(name, body)
            .await
            .map_err(|e| match ax_sdk::state::create_lost(&e) {
                true => TriggerStoreError::Stale(name.to_string()),
                false => broker(name, "create", e),
            }),
        Some(rev) => kv
            .update(name, body, rev)
            .await
            .map_err(|e| match e.kind() {
                kv::UpdateErrorKind::WrongLastRevision => {
                    TriggerStoreError::Stale(name.to_string())
                }
                _ => broker(name, "update", e),
            }),
    };
    result
}

impl TriggerStore {
    /// Opens the buckets (created by `ax streams apply`).
    pub async fn open(js: &jetstream::Context) -> Result<TriggerStore, TriggerStoreError> {
        let defs = js
            .get_key_value(TRIGGERS_BUCKET)
            .await
            .map_err(|e| broker("*", "open", e))?;
        let states = js
            .get_key_value(TRIGGER_STATE_BUCKET)
            .await
            .map_err(|e| broker("*", "open", e))?;
        Ok(TriggerStore { defs, states })
    }

    /// The definitions bucket (the engine watches it).
    pub fn defs(&self) -> &kv::Store {
        &self.defs
    }

    /// The state bucket (the engine watches it for manual runs made elsewhere).
    pub fn states(&self) -> &kv::Store {
        &self.states
    }

    /// A definition and its revision.
    pub async fn def(&self, name: &str) -> Result<Option<(TriggerDef, u64)>, TriggerStoreError> {
        get(&self.defs, name).await
    }

    /// Creates (`revision` `None`) or updates a definition.
    pub async fn put_def(
        &self,
        def: &TriggerDef,
        revision: Option<u64>,
    ) -> Result<u64, TriggerStoreError> {
        write(&self.defs, &def.name, def, revision).await
    }

    /// Runtime state and its revision.
    pub async fn state(
        &self,
        name: &str,
    ) -> Result<Option<(TriggerState, u64)>, TriggerStoreError> {
        get(&self.states, name).await
    }

    /// Creates (`revision` `None`) or updates runtime state.
    pub async fn put_state(
        &self,
        name: &str,
        state: &TriggerState,
        revision: Option<u64>,
    ) -> Result<u64, TriggerStoreError> {
        #[cfg(feature = "test-hooks")]
        {
            use ax_sdk::hooks::StateWriteFault;
            let fault = ax_sdk::hooks::trigger_state_write_fault(name);
            if fault == Some(StateWriteFault::Lost) {
                return Err(broker(name, "update", "injected fault: broker unreachable"));
            }
            let written = write(&self.states, name, state, revision).await;
            if fault == Some(StateWriteFault::AckLost) && written.is_ok() {
                return Err(broker(
                    name,
                    "update",
                    "injected fault: acknowledgement lost",
                ));
            }
            written
        }
        #[cfg(not(feature = "test-hooks"))]
        write(&self.states, name, state, revision).await
    }

    /// Deletes a trigger's definition and state.
    pub async fn delete(&self, name: &str) -> Result<(), TriggerStoreError> {
        self.defs
            .delete(name)
            .await
            .map_err(|e| broker(name, "delete", e))?;
        self.states
            .delete(name)
            .await
            .map_err(|e| broker(name, "delete", e))?;
        Ok(())
    }

    /// Every stored definition.
    pub async fn all(&self) -> Result<Vec<TriggerDef>, TriggerStoreError> {
        let mut keys = self.defs.keys().await.map_err(|e| broker("*", "list", e))?;
        let mut names = Vec::new();
        while let Some(key) = keys.next().await {
            names.push(key.map_err(|e| broker("*", "list", e))?);
        }
        let mut out = Vec::new();
        for name in names {
            if let Some((def, _)) = self.def(&name).await? {
                out.push(def);
            }
        }
        out.sort_by(|a: &TriggerDef, b| a.name.cmp(&b.name));
        Ok(out)
    }
}
