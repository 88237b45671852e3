//! Trigger definitions (`AX_TRIGGERS`) and runtime state (`AX_TRIGGER_STATE`) in KV.

use super::model::TriggerDef;
use super::plan::TriggerState;
use async_nats::jetstream::{self, kv};
use ax_core::names::{TRIGGERS_BUCKET, TRIGGER_STATE_BUCKET};
use ax_core::typed_kv::{broker, get, put as write, KvError};
use futures::StreamExt;

/// Errors of the trigger store: those of every typed KV store.
pub type TriggerStoreError = KvError;

/// Both trigger buckets.
#[derive(Debug, Clone)]
pub struct TriggerStore {
    defs: kv::Store,
    states: kv::Store,
    /// Faults a test armed: state writes that fail.
    faults: ax_core::faults::Faults,
    /// The connection, whose reconnects make a read be asked again (see [`TriggerStore::def`]).
    client: async_nats::Client,
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
        Ok(TriggerStore {
            defs,
            states,
            faults: Default::default(),
            client: js.client(),
        })
    }

    /// This store with the faults of `faults` (tests).
    pub(crate) fn faults(mut self, faults: ax_core::faults::Faults) -> TriggerStore {
        self.faults = faults;
        self
    }

    /// A definition and its revision. Asked again if the client connects anew meanwhile (as
    /// is [`TriggerStore::state`]): a read the broker had when it stopped is never answered,
    /// and the leader, which plans on these reads, would wait out the request timeout.
    pub async fn def(&self, name: &str) -> Result<Option<(TriggerDef, u64)>, TriggerStoreError> {
        ax_core::follow::across_reconnects(&self.client, || get(&self.defs, name)).await
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
        ax_core::follow::across_reconnects(&self.client, || get(&self.states, name)).await
    }

    /// Creates (`revision` `None`) or updates runtime state.
    pub async fn put_state(
        &self,
        name: &str,
        state: &TriggerState,
        revision: Option<u64>,
    ) -> Result<u64, TriggerStoreError> {
        use ax_core::faults::StateWriteFault;
        let fault = self.faults.trigger_state_write(name);
        if matches!(
            fault,
            Some(StateWriteFault::Lost | StateWriteFault::LostWithRecords)
        ) {
            return Err(broker(name, "update", "injected fault: broker unreachable"));
        }
        let written =
            ax_core::typed_kv::put_again(&self.client, &self.states, name, state, revision).await;
        if fault == Some(StateWriteFault::AckLost) && written.is_ok() {
            return Err(broker(
                name,
                "update",
                "injected fault: acknowledgement lost",
            ));
        }
        written
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

    /// Every stored definition's name, sorted (read from the keys alone).
    pub async fn names(&self) -> Result<Vec<String>, TriggerStoreError> {
        let mut keys = self.defs.keys().await.map_err(|e| broker("*", "list", e))?;
        let mut names = Vec::new();
        while let Some(key) = keys.next().await {
            names.push(key.map_err(|e| broker("*", "list", e))?);
        }
        names.sort();
        Ok(names)
    }

    /// Every stored definition.
    pub async fn all(&self) -> Result<Vec<TriggerDef>, TriggerStoreError> {
        let mut out = Vec::new();
        for name in self.names().await? {
            if let Some((def, _)) = self.def(&name).await? {
                out.push(def);
            }
        }
        out.sort_by(|a: &TriggerDef, b| a.name.cmp(&b.name));
        Ok(out)
    }
}
