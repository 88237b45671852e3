//! The `AX_RESULTS` bucket: outputs too large for their task record, under
//! `<task id>.<attempt>` (docs/PROTOCOL.md §3, "Outputs").

use crate::names::RESULTS_BUCKET;
use crate::wire::output::{StoredOutput, TaskOutput, JSON};
use bytes::Bytes;

/// The `AX_RESULTS` bucket.
#[derive(Clone)]
pub struct ResultStore {
    kv: async_nats::jetstream::kv::Store,
}

impl ResultStore {
    /// Opens the bucket (it must exist: `ax streams apply` or the server creates it).
    pub async fn open(
        js: &async_nats::jetstream::Context,
    ) -> Result<ResultStore, async_nats::Error> {
        Ok(ResultStore {
            kv: js.get_key_value(RESULTS_BUCKET).await?,
        })
    }

    /// Stores an output's bytes under `key` (`<task id>.<attempt>`).
    pub async fn put(&self, key: &str, bytes: Bytes) -> Result<(), async_nats::Error> {
        self.kv.put(key, bytes).await?;
        Ok(())
    }

    /// Removes an output (its task is purged).
    pub async fn delete(&self, key: &str) -> Result<(), async_nats::Error> {
        self.kv.purge(key).await?;
        Ok(())
    }

    /// The bytes of an output kept here (`stored.key`); `None` if the entry is gone.
    pub async fn read(
        &self,
        stored: &StoredOutput,
    ) -> Result<Option<TaskOutput>, async_nats::Error> {
        let Some(key) = &stored.key else {
            return Ok(None);
        };
        Ok(self.kv.get(key).await?.map(|bytes| TaskOutput {
            bytes,
            is_json: stored.content_type == JSON,
        }))
    }
}
