//! Batch submit: one request on `ax.submit.<queue>` whose body is a JSON array carries up
//! to [`MAX_BATCH`] tasks of that queue and gets one answer per task, in order.
//!
//! Each task is admitted exactly as a single submit would be (validation, idempotency key,
//! `busy`, store-then-answer), on its own: one refused task does not refuse the others.
//! What a batch buys is pipelining: the tasks' publishes and record writes are in flight
//! together instead of one request round trip per task. Tasks that share an idempotency
//! key within one batch are admitted in order, after the others, so the second one is a
//! duplicate of the first rather than a race with it.

use crate::context::Context;
use ax_core::protocol::{ErrorCode, SubmitAccepted, WireError};
use ax_core::task::decode_submit;
use bytes::Bytes;
use serde_json::value::RawValue;
use std::collections::HashSet;

pub use ax_core::protocol::MAX_BATCH;

/// One answer per task of a batch, in the request's order.
pub type BatchAnswers = Vec<Result<SubmitAccepted, WireError>>;

/// True if a submit body is a batch (a JSON array) rather than one request.
pub(crate) fn is_batch(body: &[u8]) -> bool {
    body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[')
}

impl Context {
    /// Handles one batch request for `queue`. A request-level problem (not a JSON array,
    /// more than [`MAX_BATCH`] tasks, an undeclared queue, JetStream unreachable for the
    /// queue lookup) refuses the whole batch; everything else is answered per task.
    pub(crate) async fn submit_batch(
        &self,
        queue: &str,
        body: &[u8],
    ) -> Result<BatchAnswers, WireError> {
        let items: Vec<&RawValue> = serde_json::from_slice(body).map_err(|e| {
            WireError::new(
                ErrorCode::BadRequest,
                format!("a batch is a JSON array of submit requests: {e}"),
            )
        })?;
        if items.len() > MAX_BATCH {
            return Err(WireError::new(
                ErrorCode::BadRequest,
                format!(
                    "a batch holds at most {MAX_BATCH} tasks, this one {}",
                    items.len()
                ),
            ));
        }
        self.queues.check(&self.js, queue).await?;
        let mut answers: Vec<Option<Result<SubmitAccepted, WireError>>> = vec![None; items.len()];
        let mut first = Vec::with_capacity(items.len());
        let mut repeated = Vec::new();
        let mut keys = HashSet::new();
        for (i, item) in items.iter().enumerate() {
            match decode_submit(queue, item.get().as_bytes(), &self.limits) {
                Err(e) => answers[i] = Some(Err(e)),
                Ok((meta, payload)) => {
                    // Over a rate limit that drops its excess: refused, nothing stored.
                    if self.drops.may_apply(&meta) {
                        if let Err(e) = self.drops.check(&meta).await {
                            answers[i] = Some(Err(e));
                            continue;
                        }
                    }
                    let again = meta
                        .idempotency_key
                        .as_ref()
                        .is_some_and(|k| !keys.insert(k.clone()));
                    let job: (usize, ax_core::task::TaskMeta, Bytes) =
                        (i, super::unrecorded(meta), payload);
                    if again {
                        repeated.push(job);
                    } else {
                        first.push(job);
                    }
                }
            }
        }
        let admitted =
            futures::future::join_all(first.into_iter().map(|(i, meta, payload)| async move {
                (i, self.submit_prepared(meta, payload).await)
            }))
            .await;
        for (i, answer) in admitted {
            answers[i] = Some(answer);
        }
        for (i, meta, payload) in repeated {
            answers[i] = Some(self.submit_prepared(meta, payload).await);
        }
        Ok(answers
            .into_iter()
            .map(|a| a.expect("every task answered"))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_a_json_array() {
        assert!(is_batch(b"[]"));
        assert!(is_batch(b" \n\t[{\"name\":\"a\"}]"));
        assert!(!is_batch(b"{\"name\":\"a\"}"));
        assert!(!is_batch(b""));
        assert!(!is_batch(b"  "));
    }
}
