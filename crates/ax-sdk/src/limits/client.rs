//! The limits calls of [`Client`]: typed requests to `ax.limit.<op>` (PROTOCOL.md §7).

use super::model::LimitDef;
use super::request::{LimitFilter, LimitName, LimitRequest};
use crate::client::{Client, ClientError};
use crate::error::ErrorCode;
use crate::names::LIMIT_API_PREFIX;
use serde::{Deserialize, Serialize};

/// A limit and what it holds now (`ax.limit.status`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LimitStatus {
    /// The definition.
    pub limit: LimitDef,
    /// Tokens left in a queue- or name-wide rate bucket; `None` for per-key buckets (they
    /// are many) or without a rate.
    pub tokens: Option<f64>,
    /// An adaptive limit's rate in force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_now: Option<f64>,
    /// The concurrency slots held, and by whom.
    pub slots_held: Vec<SlotHeld>,
}

/// One concurrency slot held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotHeld {
    /// The slot's key in `AX_LIMIT_SLOTS`.
    pub slot: String,
    /// Who holds it: `<worker> <task id> <attempt>`.
    pub holder: String,
}

impl Client {
    /// Calls the limits API: `op` is `put` (a limit definition), `get` / `delete`
    /// (`{"queue", "name"}`), `list` or `status` (`{"queue"?}`) (PROTOCOL.md §7); returns
    /// the `ok` value. The typed calls below are the same requests.
    pub async fn limits(
        &self,
        op: &str,
        body: &serde_json::Value,
    ) -> Result<serde_json::Value, ClientError> {
        self.management(LIMIT_API_PREFIX, op, body).await
    }

    /// Stores a limit (checked by the server first: refused `invalid_field` naming the
    /// field, or `unknown_queue`); answers it as stored.
    pub async fn put_limit(&self, def: &LimitDef) -> Result<LimitDef, ClientError> {
        decode(self.call(&LimitRequest::Put(def.clone())).await?)
    }

    /// The limit `name` of `queue`, or `None` if there is none.
    pub async fn get_limit(
        &self,
        queue: &str,
        name: &str,
    ) -> Result<Option<LimitDef>, ClientError> {
        match self.call(&LimitRequest::Get(named(queue, name))).await {
            Ok(v) => decode(v).map(Some),
            Err(ClientError::Refused(e)) if e.code == ErrorCode::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The limits of `queue` (of every queue with `None`), by queue and name.
    pub async fn list_limits(&self, queue: Option<&str>) -> Result<Vec<LimitDef>, ClientError> {
        decode(self.call(&LimitRequest::List(filter(queue))).await?)
    }

    /// Deletes the limit `name` of `queue`: `true` if there was one.
    pub async fn delete_limit(&self, queue: &str, name: &str) -> Result<bool, ClientError> {
        let v = self.call(&LimitRequest::Delete(named(queue, name))).await?;
        Ok(v["deleted"].as_bool().unwrap_or(false))
    }

    /// Each limit of `queue` (every queue with `None`) with its tokens, adaptive rate and
    /// slots held now.
    pub async fn limit_status(&self, queue: Option<&str>) -> Result<Vec<LimitStatus>, ClientError> {
        decode(self.call(&LimitRequest::Status(filter(queue))).await?)
    }
}

fn named(queue: &str, name: &str) -> LimitName {
    LimitName {
        queue: queue.to_string(),
        name: name.to_string(),
    }
}

fn filter(queue: Option<&str>) -> LimitFilter {
    LimitFilter {
        queue: queue.map(str::to_string),
    }
}

fn decode<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T, ClientError> {
    Ok(serde_json::from_value(v)?)
}
