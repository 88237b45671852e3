//! The trigger management API: requests on `ax.trigger.<op>` with JSON bodies, answered
//! `{"ok": …}` or `{"error": {"code", "message", "field"}}` (docs/PROTOCOL.md §5).

use super::clock::Clock;
use super::fire::{fire, manual_tag, tracked_ids as tracked, unfinished};
use super::model::TriggerDef;
use super::plan::{Source, TriggerState};
use super::recur::Recurrence;
use super::store::{TriggerStore, TriggerStoreError};
use crate::context::Context;
use crate::trigger::Validate;
use ax_core::protocol::{ErrorCode, WireError};
use ax_sdk::api::{unknown_operation, Api, Request};
use ax_sdk::trigger::TriggerRequest;
use serde_json::{json, Value};
use std::sync::Arc;

/// Most compare-and-set attempts to record a manual run in a changing trigger state.
const MAX_RECORD_ATTEMPTS: usize = 50;

pub(crate) struct TriggerApi {
    pub(crate) ctx: Arc<Context>,
    pub(crate) store: TriggerStore,
    pub(crate) clock: Arc<dyn Clock>,
}

fn rfc3339(ms: u64) -> String {
    ax_core::time::format_rfc3339_ms(ms)
}

/// The next `n` fire times from `now` (ignoring overlap, which depends on running tasks).
fn upcoming(
    def: &TriggerDef,
    rec: &Recurrence,
    state: &TriggerState,
    now: u64,
    n: usize,
) -> Vec<String> {
    if !def.enabled {
        return Vec::new();
    }
    let anchor = if rec.is_fixed_delay() {
        state.last_completed_ms.unwrap_or(state.created_at_ms)
    } else {
        state.created_at_ms
    };
    let mut t = state.last_scheduled_ms.unwrap_or(0).max(now);
    let mut out = Vec::new();
    while out.len() < n {
        match rec.next_after(t, anchor) {
            Some(next) => {
                out.push(rfc3339(next));
                t = next;
                if rec.is_fixed_delay() {
                    break;
                }
            }
            None => break,
        }
    }
    out
}

impl TriggerApi {
    pub(crate) async fn handle(&self, op: &str, body: &[u8]) -> Result<Value, WireError> {
        let request = TriggerRequest::decode(op, body)?;
        match &request {
            TriggerRequest::Get(r)
            | TriggerRequest::Pause(r)
            | TriggerRequest::Resume(r)
            | TriggerRequest::Delete(r)
            | TriggerRequest::Run(r)
                if !ax_core::names::valid_token(&r.name, 64) =>
            {
                return Err(WireError::field(
                    "name",
                    "must be 1..=64 of A-Z a-z 0-9 _ -",
                ))
            }
            _ => {}
        }
        match request {
            TriggerRequest::Put(value) => {
                let outcome = self.put(TriggerDef::decode(value)?).await?;
                Ok(json!({ "outcome": outcome }))
            }
            TriggerRequest::Apply(req) => self.apply(req).await,
            TriggerRequest::Names(req) => self.names(req.after).await,
            // The trigger engine's lease: who fires the scheduled triggers now.
            TriggerRequest::Leader {} => {
                crate::lease::leader(&self.ctx.js, crate::lease::TRIGGERS_KEY).await
            }
            TriggerRequest::List {} => {
                let now = self.clock.now_ms();
                let mut out = Vec::new();
                for def in self.store.all().await.map_err(WireError::unavailable)? {
                    let state = self.state_of(&def.name).await?.0;
                    let next = def
                        .validate()
                        .map(|r| upcoming(&def, &r, &state, now, 1))
                        .unwrap_or_default();
                    out.push(json!({
                        "name": def.name, "kind": def.kind, "enabled": def.enabled,
                        "next": next.first(), "fires": state.fires,
                        "last_fired_at_ms": state.last_fire.as_ref().map(|f| f.fired_at_ms),
                        "last_result": state.last_result,
                    }));
                }
                Ok(Value::Array(out))
            }
            TriggerRequest::Get(r) => self.describe(&r.name).await,
            TriggerRequest::Pause(r) => self.set_enabled(&r.name, false).await,
            TriggerRequest::Resume(r) => self.set_enabled(&r.name, true).await,
            TriggerRequest::Delete(r) => {
                self.def_of(&r.name).await?;
                self.store
                    .delete(&r.name)
                    .await
                    .map_err(WireError::unavailable)?;
                Ok(json!({ "name": r.name, "deleted": true }))
            }
            TriggerRequest::Run(r) => self.run(&r.name, r.force).await,
            TriggerRequest::Unknown => Err(unknown_operation(Api::Trigger, op)),
        }
    }

    /// Pauses or resumes a trigger; a resumed one skips the times it was paused for.
    async fn set_enabled(&self, name: &str, enabled: bool) -> Result<Value, WireError> {
        let (mut def, _) = self.def_of(name).await?;
        if enabled && !def.enabled {
            self.skip_paused_times(name).await?;
        }
        def.enabled = enabled;
        self.put(def).await?;
        Ok(json!({ "name": name, "enabled": enabled }))
    }

    async fn def_of(&self, name: &str) -> Result<(TriggerDef, u64), WireError> {
        self.store
            .def(name)
            .await
            .map_err(WireError::unavailable)?
            .ok_or_else(|| WireError::new(ErrorCode::NotFound, format!("no trigger {name:?}")))
    }

    async fn state_of(&self, name: &str) -> Result<(TriggerState, Option<u64>), WireError> {
        Ok(
            match self
                .store
                .state(name)
                .await
                .map_err(WireError::unavailable)?
            {
                Some((s, rev)) => (s, Some(rev)),
                None => (self.new_state(), None),
            },
        )
    }

    /// The state of a trigger created now.
    fn new_state(&self) -> TriggerState {
        TriggerState {
            created_at_ms: self.clock.now_ms(),
            ..Default::default()
        }
    }

    /// Marks the times that passed while a trigger was paused as handled, so resuming does
    /// not fire them as missed.
    async fn skip_paused_times(&self, name: &str) -> Result<(), WireError> {
        for _ in 0..3 {
            let (mut state, rev) = self.state_of(name).await?;
            let now = self.clock.now_ms();
            if state.last_scheduled_ms.is_some_and(|t| t >= now) {
                return Ok(());
            }
            state.last_scheduled_ms = Some(now);
            match self.store.put_state(name, &state, rev).await {
                Ok(_) => return Ok(()),
                Err(TriggerStoreError::Stale(_)) => continue,
                Err(e) => return Err(WireError::unavailable(e)),
            }
        }
        Err(WireError::new(
            ErrorCode::Unavailable,
            "trigger state kept changing; retry",
        ))
    }

    /// The flows a trigger starts must exist when it is stored (a flow deleted later makes
    /// its fires fail and retry, logged, until it is back).
    async fn check_flows(&self, def: &TriggerDef) -> Result<(), WireError> {
        for (i, start) in def.flows.iter().enumerate() {
            let found = self
                .ctx
                .flows
                .def(&start.flow)
                .await
                .map_err(|e| WireError::new(ErrorCode::Unavailable, e.to_string()))?;
            if found.is_none() {
                return Err(WireError::field(
                    &format!("flows[{i}].flow"),
                    format!("no flow {:?} (put it first)", start.flow),
                ));
            }
        }
        Ok(())
    }

    /// Validates and stores a definition; `created`, `updated` or `unchanged`.
    async fn put(&self, def: TriggerDef) -> Result<&'static str, WireError> {
        self.check(&def).await?;
        self.store_checked(def).await
    }

    /// What a definition must pass to be stored: its fields, its task templates, its
    /// flows and queues existing.
    pub(super) async fn check(&self, def: &TriggerDef) -> Result<(), WireError> {
        def.validate()?;
        def.check_templates(&self.ctx.limits)?;
        self.check_flows(def).await?;
        for queue in def.queues() {
            self.ctx.queues.check(&self.ctx.js, queue).await?;
        }
        Ok(())
    }

    /// Stores a definition that passed [`TriggerApi::check`].
    pub(super) async fn store_checked(&self, def: TriggerDef) -> Result<&'static str, WireError> {
        // Most puts of a bulk load name a new trigger: its state, then its definition, each
        // created only if absent, without reading first (one round trip less a put). A
        // name found taken goes the read, compare and update way below, and so does one
        // whose state could not be written (an update of an existing trigger needs none).
        if self
            .store
            .put_state(&def.name, &self.new_state(), None)
            .await
            .is_ok()
        {
            match self.store.put_def(&def, None).await {
                Ok(_) => return Ok("created"),
                Err(TriggerStoreError::Stale(_)) => {}
                Err(e) => return Err(WireError::unavailable(e)),
            }
        }
        let existing = self
            .store
            .def(&def.name)
            .await
            .map_err(WireError::unavailable)?;
        let outcome = match &existing {
            Some((old, _)) if *old == def => return Ok("unchanged"),
            Some(_) => "updated",
            None => "created",
        };
        // A new definition's state is created if absent without reading it first.
        let (state, rev) = match existing {
            Some(_) => self.state_of(&def.name).await?,
            None => (self.new_state(), None),
        };
        if rev.is_none() {
            match self.store.put_state(&def.name, &state, None).await {
                Ok(_) | Err(TriggerStoreError::Stale(_)) => {}
                Err(e) => return Err(WireError::unavailable(e)),
            }
        }
        self.store
            .put_def(&def, existing.map(|(_, rev)| rev))
            .await
            .map_err(|e| match e {
                TriggerStoreError::Stale(name) => WireError::new(
                    ErrorCode::Unavailable,
                    format!("trigger {name} changed concurrently; retry"),
                ),
                e => WireError::unavailable(e),
            })?;
        Ok(outcome)
    }

    async fn describe(&self, name: &str) -> Result<Value, WireError> {
        let (def, _) = self.def_of(name).await?;
        let (state, _) = self.state_of(name).await?;
        let rec = def.validate()?;
        let mut running: Vec<String> = unfinished(&self.ctx, tracked(&state))
            .await
            .into_iter()
            .collect();
        running.sort();
        Ok(json!({
            "definition": def,
            "state": state,
            "next": upcoming(&def, &rec, &state, self.clock.now_ms(), 5),
            "running": running,
        }))
    }

    /// A manual run: refused while an earlier fire's tasks are unfinished, unless
    /// `force`. One request is one fire: its task ids are chosen once, the tasks submitted
    /// once, and a state that changed meanwhile gets the fire merged in, never fired again.
    async fn run(&self, name: &str, force: bool) -> Result<Value, WireError> {
        let (def, _) = self.def_of(name).await?;
        let (state, rev) = self.state_of(name).await?;
        let known: Vec<String> = tracked(&state).cloned().collect();
        let running = unfinished(&self.ctx, known.iter()).await;
        if !running.is_empty() && !force {
            let mut running: Vec<String> = running.into_iter().collect();
            running.sort();
            return Err(WireError::new(
                ErrorCode::Running,
                format!(
                    "trigger {name} is running (tasks {}); pass force to run anyway",
                    running.join(", ")
                ),
            ));
        }
        let finished: Vec<&String> = known.iter().filter(|id| !running.contains(*id)).collect();
        let now = self.clock.now_ms();
        let task_ids = fire(&self.ctx, &def, now, Source::Manual, &manual_tag(), None).await?;
        let forced = force && !running.is_empty();
        let (mut state, mut rev) = (state, rev);
        for attempt in 0..MAX_RECORD_ATTEMPTS {
            if attempt > 0 {
                // Many runs at once: spread the retries out.
                let ms = rand::random_range(1..=20u64);
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            }
            state.active.retain(|id| !finished.contains(&id));
            state.record_fire(&[now], now, Source::Manual, &task_ids);
            match self.store.put_state(name, &state, rev).await {
                Ok(_) => return Ok(json!({ "task_ids": task_ids, "forced": forced })),
                Err(TriggerStoreError::Stale(_)) => {
                    // Changed meanwhile: record this same fire into what is stored now.
                    (state, rev) = self.state_of(name).await?;
                }
                Err(e) => {
                    tracing::warn!(trigger = %name, cause = %e, "manual run made but not recorded in the trigger state");
                    return Ok(json!({ "task_ids": task_ids, "forced": forced }));
                }
            }
        }
        tracing::warn!(trigger = %name, "trigger state kept changing; manual run made but not recorded");
        Ok(json!({ "task_ids": task_ids, "forced": forced }))
    }
}
