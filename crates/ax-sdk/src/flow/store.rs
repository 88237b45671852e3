//! Flow definitions (`AX_FLOWS`) and runs (`AX_FLOW_RUNS`: key `<run>` the run, key
//! `<run>.<step>` one step) in KV. Every write is a create or a compare-and-set.

use super::def::FlowDef;
use super::model::{step_key, FlowRun, StepRun};
use crate::names::{FLOWS_BUCKET, FLOW_RUNS_BUCKET};
use crate::typed_kv::{broker, get, put_again, put_all, scan, KvError};
use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use serde::{Deserialize, Serialize};

/// Errors of the flow store: those of every typed KV store.
pub type FlowStoreError = KvError;

/// A flow singleton key's value: the run holding it.
#[derive(Debug, Serialize, Deserialize)]
struct SingletonHolder {
    run: String,
}

/// The `AX_FLOW_RUNS` key of flow `flow`'s singleton key `key`.
fn singleton_key(flow: &str, key: &str) -> String {
    format!("=singleton.{flow}.{}", crate::names::hex_token(key))
}

/// Both flow buckets.
#[derive(Debug, Clone)]
pub struct FlowStore {
    client: async_nats::Client,
    defs: kv::Store,
    runs: kv::Store,
}

impl FlowStore {
    /// Opens both buckets (they must exist: `ax streams apply`).
    pub async fn open(js: &jetstream::Context) -> Result<FlowStore, FlowStoreError> {
        let defs = js
            .get_key_value(FLOWS_BUCKET)
            .await
            .map_err(|e| broker(FLOWS_BUCKET, "open bucket", e))?;
        let runs = js
            .get_key_value(FLOW_RUNS_BUCKET)
            .await
            .map_err(|e| broker(FLOW_RUNS_BUCKET, "open bucket", e))?;
        Ok(FlowStore {
            client: js.client(),
            defs,
            runs,
        })
    }

    /// Stores a (checked) definition, replacing the previous one.
    pub async fn put_def(&self, def: &FlowDef) -> Result<u64, FlowStoreError> {
        let body = serde_json::to_vec(def).expect("serializes");
        self.defs
            .put(&def.name, body.into())
            .await
            .map_err(|e| broker(&def.name, "put", e))
    }

    /// A definition.
    pub async fn def(&self, name: &str) -> Result<Option<FlowDef>, FlowStoreError> {
        Ok(get(&self.defs, name).await?.map(|(d, _)| d))
    }

    /// Every definition, by name.
    pub async fn defs(&self) -> Result<Vec<FlowDef>, FlowStoreError> {
        Ok(scan(&self.defs, ">")
            .await?
            .into_iter()
            .map(|(_, d)| d)
            .collect())
    }

    /// Deletes a definition (runs already started keep their copy).
    pub async fn delete_def(&self, name: &str) -> Result<(), FlowStoreError> {
        self.defs
            .delete(name)
            .await
            .map_err(|e| broker(name, "delete", e))
    }

    /// The subject a run's writes are published on (`$KV.AX_FLOW_RUNS.<run>`).
    pub fn run_subject(&self, id: &str) -> String {
        format!("{}{id}", self.runs.prefix)
    }

    /// A run and its revision.
    pub async fn run(&self, id: &str) -> Result<Option<(FlowRun, u64)>, FlowStoreError> {
        get(&self.runs, id).await
    }

    /// Creates (`revision` None) or compare-and-sets a run; sent again if the client
    /// connects anew while it waits (`typed_kv::put_again`: a write the broker stored but
    /// never answered is taken as written, not waited out for the request timeout).
    pub async fn put_run(
        &self,
        run: &FlowRun,
        revision: Option<u64>,
    ) -> Result<u64, FlowStoreError> {
        put_again(&self.client, &self.runs, &run.id, run, revision).await
    }

    /// Every step record of a run, in definition order (`None`: never written, i.e.
    /// `waiting` in epoch 0), read concurrently.
    pub async fn steps(
        &self,
        run: &FlowRun,
    ) -> Result<Vec<Option<(StepRun, u64)>>, FlowStoreError> {
        let reads = run.def.steps.iter().map(|s| {
            let key = step_key(&run.id, &s.name);
            async move { get::<StepRun>(&self.runs, &key).await }
        });
        let reads: Vec<_> = reads.collect();
        futures::stream::iter(reads)
            .buffered(64)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect()
    }

    /// Creates (`revision` None) or compare-and-sets one step's record; sent again like
    /// [`FlowStore::put_run`].
    pub async fn put_step(
        &self,
        run: &str,
        step: &str,
        value: &StepRun,
        revision: Option<u64>,
    ) -> Result<u64, FlowStoreError> {
        put_again(
            &self.client,
            &self.runs,
            &step_key(run, step),
            value,
            revision,
        )
        .await
    }

    /// Writes a run and steps of it together: all of them or none (one atomic batch), each
    /// only if its revision is still the one given (`None`: a step never written). A re-run
    /// uses it so that no reader sees its steps reset under a run that has not been.
    pub async fn put_run_and_steps(
        &self,
        run: &FlowRun,
        revision: u64,
        steps: &[(&str, &StepRun, Option<u64>)],
    ) -> Result<(), FlowStoreError> {
        let values: Vec<serde_json::Value> = std::iter::once(serde_json::to_value(run))
            .chain(steps.iter().map(|(_, s, _)| serde_json::to_value(s)))
            .collect::<Result<_, _>>()
            .expect("serializes");
        let keys = std::iter::once((run.id.clone(), Some(revision)))
            .chain(steps.iter().map(|(n, _, r)| (step_key(&run.id, n), *r)));
        let writes: Vec<_> = keys
            .zip(&values)
            .map(|((key, rev), value)| (key, value, rev))
            .collect();
        put_all(&self.client, &self.runs, &writes).await
    }

    /// The run holding singleton key `key` of flow `flow` and the key's revision (`None`:
    /// never held). The key is `=singleton.<flow>.<key in hex>` (three tokens: neither a
    /// run's key nor a step's).
    pub async fn singleton_holder(
        &self,
        flow: &str,
        key: &str,
    ) -> Result<Option<(String, u64)>, FlowStoreError> {
        let found: Option<(SingletonHolder, u64)> =
            get(&self.runs, &singleton_key(flow, key)).await?;
        Ok(found.map(|(h, rev)| (h.run, rev)))
    }

    /// Creates `run` holding singleton key `key` of its flow, together (one atomic batch):
    /// only if the key's revision is still `revision` (`None`: never written), else
    /// [`FlowStoreError::Stale`] and nothing is stored.
    pub async fn create_holding(
        &self,
        run: &FlowRun,
        key: &str,
        revision: Option<u64>,
    ) -> Result<(), FlowStoreError> {
        let holder = SingletonHolder {
            run: run.id.clone(),
        };
        let values = [
            serde_json::to_value(run).expect("serializes"),
            serde_json::to_value(&holder).expect("serializes"),
        ];
        let writes = [
            (run.id.clone(), &values[0], None),
            (singleton_key(&run.flow, key), &values[1], revision),
        ];
        put_all(&self.client, &self.runs, &writes).await
    }

    /// Every run (keys without a dot) now and every later write to one, as KV entries.
    pub async fn watch_runs(&self) -> Result<kv::Watch, FlowStoreError> {
        self.runs
            .watch_with_history("*")
            .await
            .map_err(|e| broker("*", "watch runs", e))
    }

    /// Every run (an operator command: reads every run key).
    pub async fn runs(&self) -> Result<Vec<FlowRun>, FlowStoreError> {
        Ok(scan(&self.runs, "*")
            .await?
            .into_iter()
            .map(|(_, r)| r)
            .collect())
    }
}
