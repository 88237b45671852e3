//! The `AX_WAITS` bucket: the flows' pending waits for events (docs/PROTOCOL.md §6,
//! "Events"), one key per wait task (its id), the value a [`WaitRegistration`]. Opened
//! on first use, so a server started against a broker without the bucket runs, and its
//! waits' submits answer `unavailable` until `ax streams apply` (or a server) makes it.

use crate::names::WAITS_BUCKET;
use crate::wire::event::WaitRegistration;
use async_nats::jetstream::{self, kv};
use std::sync::Arc;
use tokio::sync::OnceCell;

/// The `AX_WAITS` bucket, opened on first use (shared by clones).
#[derive(Clone, Debug)]
pub struct Waits {
    js: jetstream::Context,
    kv: Arc<OnceCell<kv::Store>>,
}

impl Waits {
    /// The bucket over `js` (not opened yet).
    pub fn new(js: jetstream::Context) -> Waits {
        Waits {
            js,
            kv: Arc::default(),
        }
    }

    /// The opened bucket.
    pub async fn store(&self) -> Result<&kv::Store, async_nats::Error> {
        self.kv
            .get_or_try_init(|| async { Ok(self.js.get_key_value(WAITS_BUCKET).await?) })
            .await
    }

    /// Stores `reg` under its task id (the same value again is harmless: a submit
    /// retried writes it again).
    pub async fn put(&self, reg: &WaitRegistration) -> Result<u64, async_nats::Error> {
        let value = serde_json::to_vec(reg).expect("a registration serializes");
        Ok(self.store().await?.put(&reg.task, value.into()).await?)
    }

    /// Stores `reg` under its task id unless one is stored already, and answers the one
    /// stored: an approval's retried submit keeps the secret its first one drew.
    pub async fn create_or_get(
        &self,
        reg: &WaitRegistration,
    ) -> Result<WaitRegistration, async_nats::Error> {
        let store = self.store().await?;
        let value = serde_json::to_vec(reg).expect("a registration serializes");
        match store.create(&reg.task, value.into()).await {
            Ok(_) => Ok(reg.clone()),
            Err(e) if crate::typed_kv::create_lost(&e) => match self.get(&reg.task).await? {
                Some(stored) => Ok(stored),
                None => Err(format!("the wait {} went while it was read", reg.task).into()),
            },
            Err(e) => Err(e.into()),
        }
    }

    /// Task `id`'s registration, if it has one (one that does not decode is none). Asked
    /// again if the client connects anew while it waits: a read the broker had when it
    /// stopped is never answered, and held an approval's completion (or the matcher) for
    /// the client's request timeout (10 s).
    pub async fn get(&self, id: &str) -> Result<Option<WaitRegistration>, async_nats::Error> {
        let store = self.store().await?;
        let entry = crate::follow::across_reconnects(&self.js.client(), || store.get(id)).await?;
        Ok(entry.and_then(|v| serde_json::from_slice(&v).ok()))
    }

    /// Whether task `id` is registered, as the bucket stream's leader has it (a replica
    /// behind it may not have a registration just stored, or may still have one just
    /// removed). A wait for an event's timeout ends it only once this says no: the
    /// matcher removes a registration when it has matched it, or has read every event
    /// stored up to its timeout and none matched (docs/PROTOCOL.md §6, "Events").
    pub async fn registered(&self, id: &str) -> Result<bool, async_nats::Error> {
        let store = self.store().await?;
        let read = || crate::kv_read::latest(store, id);
        let entry = crate::follow::across_reconnects(&self.js.client(), read).await?;
        Ok(entry.is_some_and(|e| e.operation == kv::Operation::Put))
    }

    /// Every registration stored (ones that do not decode are left out), read in one
    /// pass (the bucket's last values, pulled in batches) rather than a read per key: a
    /// listing of approvals beside 10,000 waits for events took 10,001 round trips.
    pub async fn all(&self) -> Result<Vec<WaitRegistration>, async_nats::Error> {
        let store = self.store().await?;
        let regs = crate::typed_kv::scan::<WaitRegistration>(store, ">").await?;
        Ok(regs.into_iter().map(|(_, reg)| reg).collect())
    }

    /// Removes task `id`'s registration (its wait ended). Sent again if the client
    /// connects anew while it waits, as [`get`](Waits::get) is: a purge stored twice
    /// removes the same registration.
    pub async fn remove(&self, id: &str) -> Result<(), async_nats::Error> {
        let store = self.store().await?;
        Ok(crate::follow::across_reconnects(&self.js.client(), || store.purge(id)).await?)
    }
}
