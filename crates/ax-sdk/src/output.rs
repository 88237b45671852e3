//! Task outputs: what a handler returns, stored with the task's `succeeded` write
//! (docs/PROTOCOL.md §3, "Outputs").
//!
//! An output of at most [`INLINE_OUTPUT_BYTES`] lives in the task record itself (field
//! `output`); a larger one is put in the `AX_RESULTS` bucket under `<task id>.<attempt>`
//! first and the record names that key, so a record never points at an output that is not
//! stored, and a stale attempt's output never overwrites the winner's. An output over
//! [`MAX_OUTPUT_BYTES`] fails the attempt for good with class `output_too_large`.

pub(crate) use crate::wire::output::StoredOutput;
pub use crate::wire::output::{TaskOutput, INLINE_OUTPUT_BYTES, MAX_OUTPUT_BYTES};
use crate::worker::TaskError;
pub(crate) use ax_core::results::ResultStore;
use bytes::Bytes;
use serde::Serialize;

/// What a handler returns on success: nothing, JSON, or bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Output(pub(crate) Option<TaskOutput>);

impl Output {
    /// No output.
    pub fn none() -> Output {
        Output(None)
    }
    /// A JSON output.
    pub fn json<T: Serialize>(value: &T) -> Result<Output, TaskError> {
        let bytes = serde_json::to_vec(value)
            .map_err(|e| TaskError::permanent("bad_output", format!("not JSON: {e}")))?;
        Ok(Output(Some(TaskOutput {
            bytes: bytes.into(),
            is_json: true,
        })))
    }
    /// A JSON output already serialized (by another language's binding): checked to be
    /// JSON text, stored as is; text that is not JSON is a non-retryable `bad_output`.
    pub fn json_text(text: impl Into<Bytes>) -> Result<Output, TaskError> {
        let bytes = text.into();
        serde_json::from_slice::<serde::de::IgnoredAny>(&bytes)
            .map_err(|e| TaskError::permanent("bad_output", format!("not JSON: {e}")))?;
        Ok(Output(Some(TaskOutput {
            bytes,
            is_json: true,
        })))
    }
    /// A binary output.
    pub fn bytes(bytes: impl Into<Bytes>) -> Output {
        Output(Some(TaskOutput {
            bytes: bytes.into(),
            is_json: false,
        }))
    }
}

/// What a handler may return: `()` (no output), [`Output`], or a [`serde_json::Value`].
pub trait IntoOutput {
    /// The output.
    fn into_output(self) -> Output;
}

impl IntoOutput for () {
    fn into_output(self) -> Output {
        Output::none()
    }
}

impl IntoOutput for Output {
    fn into_output(self) -> Output {
        self
    }
}

impl IntoOutput for serde_json::Value {
    fn into_output(self) -> Output {
        Output(Some(TaskOutput {
            bytes: serde_json::to_vec(&self)
                .expect("a JSON value serializes")
                .into(),
            is_json: true,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_outputs_are_inline_and_large_ones_named() {
        let json = Output::json(&serde_json::json!({"w": 3}))
            .unwrap()
            .0
            .unwrap();
        let s = StoredOutput::of(&json, "q.a.1");
        assert_eq!(serde_json::to_value(&s).unwrap()["json"]["w"], 3);
        assert_eq!(s.inline().unwrap(), json);
        let bin = Output::bytes(vec![0u8, 255, 7]).0.unwrap();
        let s = StoredOutput::of(&bin, "q.a.1");
        assert_eq!(s.base64.as_deref(), Some("AP8H"));
        assert_eq!(s.inline().unwrap(), bin);
        let big = Output::bytes(vec![1u8; INLINE_OUTPUT_BYTES + 1]).0.unwrap();
        let s = StoredOutput::of(&big, "q.a.1");
        assert_eq!(
            (s.key.as_deref(), s.size),
            (Some("q.a.1"), INLINE_OUTPUT_BYTES + 1)
        );
        assert!(s.inline().is_none() && s.is_external());
        let back: StoredOutput = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }
}
