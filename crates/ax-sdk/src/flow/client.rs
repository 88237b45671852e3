//! The flow calls of [`Client`]: define, start, watch, cancel and re-run flows.

use super::def::FlowDef;
use super::model::{FlowRun, RunState, StepRun};
use super::request::{FlowRequest, FlowRerun, FlowStart, RunRef};
use super::rerun::RerunMode;
use super::store::FlowStore;
use crate::client::{Client, ClientError};
use crate::names::FLOW_API_PREFIX;
use serde_json::Value;

impl Client {
    /// Calls the flow API: `op` is `put`, `def`, `defs`, `delete`, `run`, `get`, `list`,
    /// `cancel` or `rerun` (docs/PROTOCOL.md §6); returns the `ok` value.
    pub async fn flow(&self, op: &str, body: &Value) -> Result<Value, ClientError> {
        self.management(FLOW_API_PREFIX, op, body).await
    }

    /// Approves or rejects an approval (docs/PROTOCOL.md §6, "Approvals"), by its token
    /// (`ax.flow.approve`) or its wait task id (`ax.flow.approve_task`, an operator's).
    /// Answers `{"task", "flow", "run", "step", "decision": "approved" |
    /// "rejected"}`; the same decision again answers the same (idempotent). Refused: an
    /// unknown or wrong token (`not_found`), an approval already ended otherwise
    /// (`conflict`, the message says how).
    pub async fn complete_approval(
        &self,
        completion: &ax_core::event::ApprovalCompletion,
    ) -> Result<Value, ClientError> {
        match completion.task {
            Some(_) => {
                self.call(&FlowRequest::ApproveTask(completion.clone()))
                    .await
            }
            None => self.call(&FlowRequest::Approve(completion.clone())).await,
        }
    }

    /// The approvals waiting, oldest first: `[{"task", "flow", "run", "step", "message",
    /// "since_ms", "until_ms"}]` (their tokens are not shown).
    pub async fn approvals(&self) -> Result<Value, ClientError> {
        self.call(&FlowRequest::Approvals {}).await
    }

    /// Stores a flow definition (checked by the server first; refused with
    /// `invalid_field` naming the field, or the steps of a cycle).
    pub async fn put_flow(&self, def: &FlowDef) -> Result<(), ClientError> {
        let body = serde_json::to_value(def).expect("serializes");
        self.call(&FlowRequest::Put(body)).await.map(|_| ())
    }

    /// Starts a run of flow `name` with `input`; returns the run id.
    pub async fn run_flow(&self, name: &str, input: Value) -> Result<String, ClientError> {
        self.start_flow(FlowStart {
            flow: name.to_string(),
            input,
            ..FlowStart::default()
        })
        .await
    }

    /// Publishes event `name` (`ax.events.<name>`, stored in `AX_EVENTS`) with `payload`;
    /// the flows' waits for it whose `match` it meets end with it as their output. With
    /// `id`, a publish retried within two minutes is the same event (`Nats-Msg-Id`).
    /// Returns its `AX_EVENTS` sequence. Refused: a bad name (`invalid_field`), a payload
    /// over 512 KiB (`payload_too_large`); no stream or no broker: `unavailable`.
    pub async fn publish_event(
        &self,
        name: &str,
        payload: &Value,
        id: Option<&str>,
    ) -> Result<u64, ClientError> {
        use crate::protocol::{ErrorCode, WireError};
        if !crate::names::valid_event_name(name) {
            return Err(WireError::field(
                "event",
                "1..=8 dot-separated tokens of A-Z a-z 0-9 _ - (200 bytes at most)",
            )
            .into());
        }
        let mut headers = async_nats::HeaderMap::new();
        if let Some(id) = id {
            headers.insert("Nats-Msg-Id", id);
        }
        let body = serde_json::to_vec(payload).expect("a JSON value serializes");
        let most = ax_core::wire::output::MAX_OUTPUT_BYTES;
        if body.len() > most {
            return Err(WireError::new(
                ErrorCode::PayloadTooLarge,
                format!(
                    "the event is {} bytes, at most {most} (it becomes a step's output)",
                    body.len()
                ),
            )
            .into());
        }
        let js = async_nats::jetstream::new(self.nats.clone());
        let unavailable = |e: String| WireError::new(ErrorCode::Unavailable, e);
        let ack = js
            .publish_with_headers(crate::names::event_subject(name), headers, body.into())
            .await
            .map_err(|e| unavailable(format!("publishing the event: {e}")))?
            .await
            .map_err(|e| unavailable(format!("storing the event in AX_EVENTS: {e}")))?;
        Ok(ack.sequence)
    }

    /// Starts a run as `start` says (its input, the business id its step tasks carry);
    /// returns the run id.
    pub async fn start_flow(&self, start: FlowStart) -> Result<String, ClientError> {
        let ok = self.call(&FlowRequest::Run(start)).await?;
        Ok(ok["run"].as_str().unwrap_or_default().to_string())
    }

    /// Cancels a run: steps not started never start, queued tasks are cancelled, running
    /// ones finish; the run ends `cancelled`.
    pub async fn cancel_flow(&self, run: &str) -> Result<(), ClientError> {
        let run = RunRef {
            run: run.to_string(),
        };
        self.call(&FlowRequest::Cancel(run)).await.map(|_| ())
    }

    /// Re-runs an ended run: its failed steps (keeping succeeded steps' outputs), those and
    /// everything downstream, or the whole run as a new run (`input`: a new input, mode
    /// `Whole` only). Returns the run id (the same one, or the new run's).
    pub async fn rerun_flow(
        &self,
        run: &str,
        mode: RerunMode,
        input: Option<Value>,
    ) -> Result<String, ClientError> {
        let rerun = FlowRerun {
            run: run.to_string(),
            mode,
            input,
        };
        let ok = self.call(&FlowRequest::Rerun(rerun)).await?;
        Ok(ok["run"].as_str().unwrap_or_default().to_string())
    }

    async fn flows(&self) -> Result<FlowStore, ClientError> {
        let open =
            || async { FlowStore::open(&async_nats::jetstream::new(self.nats.clone())).await };
        Ok(self.flows.get_or_try_init(open).await?.clone())
    }

    /// A run and its steps (in definition order), read from `AX_FLOW_RUNS`.
    pub async fn flow_run(
        &self,
        run: &str,
    ) -> Result<Option<(FlowRun, Vec<StepRun>)>, ClientError> {
        let store = self.flows().await?;
        let Some((found, _)) = store.run(run).await? else {
            return Ok(None);
        };
        let steps = store.steps(&found).await?;
        let steps = steps
            .into_iter()
            .map(|s| s.map(|(s, _)| s).unwrap_or_default())
            .collect();
        Ok(Some((found, steps)))
    }

    /// Waits until run `run` has ended (`succeeded`, `failed` or `cancelled`) and returns
    /// it. Pushed, not polled, and without a consumer: a core subscription to the run's
    /// key wakes it and a read from the bucket's leader confirms ([`crate::key_wait`]);
    /// nothing is left on the server after it. No deadline of its own.
    pub async fn wait_flow(&self, run: &str) -> Result<FlowRun, ClientError> {
        let store = self.flows().await?;
        crate::key_wait::until(
            &self.nats,
            store.run_subject(run),
            |msg| {
                serde_json::from_slice::<FlowRun>(&msg.payload)
                    .map_or(true, |found| found.state != RunState::Running)
            },
            || async {
                Ok::<_, ClientError>(
                    store
                        .run(run)
                        .await?
                        .map(|(found, _)| found)
                        .filter(|found| found.state != RunState::Running),
                )
            },
        )
        .await
    }
}
