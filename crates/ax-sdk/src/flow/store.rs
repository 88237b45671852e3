//! Flow definitions (`AX_FLOWS`) and runs (`AX_FLOW_RUNS`: key `<run>` the run, key
//! `<run>.<step>` one step) in KV. Every write is a create or a compare-and-set.

use super::def::FlowDef;
use super::model::{step_key, FlowRun, StepRun};
use crate::names::{FLOWS_BUCKET, FLOW_RUNS_BUCKET};
use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Errors of the flow store.
#[derive(Debug, thiserror::Error)]
pub enum FlowStoreError {
    /// Another writer changed the key since it was read (or created it first).
    #[error("{0}: changed concurrently")]
    Stale(String),
    /// A stored value does not decode.
    #[error("{key}: corrupt value: {source}")]
    Corrupt {
        /// Key.
        key: String,
        /// Decode error.
        source: serde_json::Error,
    },
    /// The value is larger than the server accepts in one message (`max_payload`).
    #[error("{key}: {bytes} bytes is over the server's max payload")]
    TooLarge {
        /// Key.
        key: String,
        /// Size of the value.
        bytes: usize,
    },
    /// The broker failed.
    #[error("{key}: {op}: {source}")]
    Broker {
        /// Key.
        key: String,
        /// Operation.
        op: &'static str,
        /// Underlying error.
        source: async_nats::Error,
    },
}

impl FlowStoreError {
    /// What kind of failure this is.
    pub fn kind(&self) -> crate::error::ErrorKind {
        use crate::error::ErrorKind;
        match self {
            FlowStoreError::Stale(_) => ErrorKind::Conflict,
            FlowStoreError::Corrupt { .. } | FlowStoreError::TooLarge { .. } => ErrorKind::Invalid,
            FlowStoreError::Broker { source, .. } => ErrorKind::of(source.as_ref()),
        }
    }
}

fn broker(key: &str, op: &'static str, e: impl Into<async_nats::Error>) -> FlowStoreError {
    FlowStoreError::Broker {
        key: key.to_string(),
        op,
        source: e.into(),
    }
}

/// Both flow buckets.
#[derive(Debug, Clone)]
pub struct FlowStore {
    defs: kv::Store,
    runs: kv::Store,
}

async fn get<T: DeserializeOwned>(
    kv: &kv::Store,
    key: &str,
) -> Result<Option<(T, u64)>, FlowStoreError> {
    // From the leader: the engine loads a run it was told of a moment ago (`kv_read`).
    let entry = crate::kv_read::latest(kv, key)
        .await
        .map_err(|e| broker(key, "get", e))?;
    match entry {
        Some(e) if e.operation == kv::Operation::Put => {
            let value =
                serde_json::from_slice(&e.value).map_err(|source| FlowStoreError::Corrupt {
                    key: key.to_string(),
                    source,
                })?;
            Ok(Some((value, e.revision)))
        }
        _ => Ok(None),
    }
}

/// Creates (`revision` None) or compare-and-sets `key`.
async fn put<T: Serialize>(
    kv: &kv::Store,
    key: &str,
    value: &T,
    revision: Option<u64>,
) -> Result<u64, FlowStoreError> {
    let body: bytes::Bytes = serde_json::to_vec(value).expect("serializes").into();
    let bytes = body.len();
    let too_large = |e: &(dyn std::error::Error + 'static)| {
        crate::error::is_max_payload(e).then(|| FlowStoreError::TooLarge {
            key: key.to_string(),
            bytes,
        })
    };
    match revision {
        None => kv.create(key, body).await.map_err(|e| {
            if crate::state::create_lost(&e) {
                FlowStoreError::Stale(key.to_string())
            } else {
                too_large(&e).unwrap_or_else(|| broker(key, "create", e))
            }
        }),
        Some(rev) => kv.update(key, body, rev).await.map_err(|e| {
            if e.kind() == kv::UpdateErrorKind::WrongLastRevision {
                FlowStoreError::Stale(key.to_string())
            } else {
                too_large(&e).unwrap_or_else(|| broker(key, "update", e))
            }
        }),
    }
}

/// Every current value of keys matching `filter`, read from a watch with history.
async fn scan<T: DeserializeOwned>(
    kv: &kv::Store,
    filter: &str,
) -> Result<Vec<(String, T)>, FlowStoreError> {
    let mut watch = kv
        .watch_with_history(filter)
        .await
        .map_err(|e| broker(filter, "list", e))?;
    let mut out: std::collections::BTreeMap<String, T> = Default::default();
    // An empty bucket delivers nothing, so look first. (Fresh stream info: `status()`
    // answers from what was cached when the bucket was opened.)
    let pending = kv
        .stream
        .get_info()
        .await
        .map_err(|e| broker(filter, "list", e))?
        .state
        .messages;
    if pending == 0 {
        return Ok(Vec::new());
    }
    loop {
        let next = tokio::time::timeout(std::time::Duration::from_secs(2), watch.next()).await;
        let Ok(Some(entry)) = next else { break };
        let entry = entry.map_err(|e| broker(filter, "list", e))?;
        match entry.operation {
            kv::Operation::Put => {
                if let Ok(v) = serde_json::from_slice(&entry.value) {
                    out.insert(entry.key.clone(), v);
                }
            }
            _ => {
                out.remove(&entry.key);
            }
        }
        if entry.delta == 0 {
            break;
        }
    }
    Ok(out.into_iter().collect())
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
        Ok(FlowStore { defs, runs })
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

    /// A run and its revision.
    pub async fn run(&self, id: &str) -> Result<Option<(FlowRun, u64)>, FlowStoreError> {
        get(&self.runs, id).await
    }

    /// Creates (`revision` None) or compare-and-sets a run.
    pub async fn put_run(
        &self,
        run: &FlowRun,
        revision: Option<u64>,
    ) -> Result<u64, FlowStoreError> {
        put(&self.runs, &run.id, run, revision).await
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

    /// Creates (`revision` None) or compare-and-sets one step's record.
    pub async fn put_step(
        &self,
        run: &str,
        step: &str,
        value: &StepRun,
        revision: Option<u64>,
    ) -> Result<u64, FlowStoreError> {
        put(&self.runs, &step_key(run, step), value, revision).await
    }

    /// Every run (keys without a dot) now and every later write to one, as KV entries.
    pub async fn watch_runs(&self) -> Result<kv::Watch, FlowStoreError> {
        self.runs
            .watch_with_history("*")
            .await
            .map_err(|e| broker("*", "watch runs", e))
    }

    /// Every write to a run from now on (its final state included).
    pub async fn watch_run(&self, id: &str) -> Result<kv::Watch, FlowStoreError> {
        self.runs
            .watch_with_history(id)
            .await
            .map_err(|e| broker(id, "watch run", e))
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
