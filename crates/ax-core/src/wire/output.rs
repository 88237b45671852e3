//! A task's output as the protocol carries it (docs/PROTOCOL.md §3, "Outputs"): the
//! `output` field of a record (inline JSON, inline base64, or the key of its bytes in
//! `AX_RESULTS`). Pure data: storing outputs is [`crate::results`] (and what a handler returns, `ax_sdk::output`).

use base64::Engine;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// Outputs up to this size are stored in the task record (1 KiB).
pub const INLINE_OUTPUT_BYTES: usize = 1024;
/// The largest output a task may return (512 KiB, half of NATS' default `max_payload`).
pub const MAX_OUTPUT_BYTES: usize = 512 * 1024;

/// The content type of a JSON output.
pub const JSON: &str = "application/json";
/// The content type of a binary output.
pub const BYTES: &str = "application/octet-stream";

/// A stored output, as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskOutput {
    /// The output bytes (JSON text when `is_json`).
    pub bytes: Bytes,
    /// True if the output is JSON.
    pub is_json: bool,
}

impl TaskOutput {
    /// Decodes a JSON output.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.bytes)
    }
}

/// The `output` field of a task record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredOutput {
    /// `application/json` or `application/octet-stream`.
    pub content_type: String,
    /// Size of the output in bytes.
    pub size: usize,
    /// An inline JSON output: the value itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<serde_json::Value>,
    /// An inline binary output: standard base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base64: Option<String>,
    /// A larger output: its key in the `AX_RESULTS` bucket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

impl StoredOutput {
    /// The inline form of `out` if it is small enough, else a reference to `key`.
    pub fn of(out: &TaskOutput, key: &str) -> StoredOutput {
        let content_type = if out.is_json { JSON } else { BYTES }.to_string();
        let mut stored = StoredOutput {
            content_type,
            size: out.bytes.len(),
            json: None,
            base64: None,
            key: None,
        };
        let value = out
            .is_json
            .then(|| serde_json::from_slice::<serde_json::Value>(&out.bytes).ok())
            .flatten();
        match value {
            _ if out.bytes.len() > INLINE_OUTPUT_BYTES => stored.key = Some(key.to_string()),
            Some(value) => stored.json = Some(value),
            None => {
                stored.base64 = Some(base64::engine::general_purpose::STANDARD.encode(&out.bytes))
            }
        }
        stored
    }

    /// True if the bytes live in `AX_RESULTS`.
    pub fn is_external(&self) -> bool {
        self.key.is_some()
    }

    /// The inline output, if it is inline.
    pub fn inline(&self) -> Option<TaskOutput> {
        let is_json = self.content_type == JSON;
        if let Some(value) = &self.json {
            return Some(TaskOutput {
                bytes: serde_json::to_vec(value)
                    .expect("a JSON value serializes")
                    .into(),
                is_json,
            });
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(self.base64.as_deref()?)
            .ok()?;
        Some(TaskOutput {
            bytes: bytes.into(),
            is_json,
        })
    }
}
