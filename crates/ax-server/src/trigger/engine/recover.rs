//! Recovering what a leader cannot see directly: fires made but not recorded (a leader
//! died, its state write failed, or it lost the lease with a fire in flight), completion
//! times only an old leader knew, and fires to merge into a state changed meanwhile.

use super::held::{known_fire, tracks_every_fire, Held, Recorded, MERGE_ATTEMPTS, REPAIR_WINDOW};
use super::Engine;
use crate::trigger::fire::{scheduled_tag, tracked_ids, trigger_task_id, unfinished};
use crate::trigger::plan::{Source, TriggerState};
use crate::trigger::store::{TriggerStore, TriggerStoreError};
use ax_core::state::TaskRecord;
use tokio::time::Instant;
use tracing::warn;

impl Engine {
    /// Records in `h` the fires that exist as tasks but not in its state: a leader that
    /// fired a scheduled time and died (or failed to write its state) before recording it.
    /// Without this the next plan could count that time as skipped or buffered while its
    /// task runs, and overlap would not wait for it. Looks at the latest
    /// [`REPAIR_WINDOW`] scheduled times (and a buffered one), a read each. Returns
    /// whether it found any, or `None` if a read got no answer: then nothing is decided (a
    /// fire whose task could not be read is not "not fired": counting it skipped would
    /// let a fire go missing from the counts) and the caller tries again before
    /// planning. What it finds is only in `h`: [`Engine::record_unrecorded`] writes it.
    pub(super) async fn repair(&self, h: &mut Held) -> Option<bool> {
        let now = self.clock.now_ms();
        let (total, times) = crate::trigger::plan::times_due(&h.rec, &h.state, now, REPAIR_WINDOW);
        let mut candidates = times.clone();
        candidates.extend(h.state.buffered_ms);
        let def = &h.def;
        let ids_of = |t: u64| -> Vec<String> {
            def.tasks
                .iter()
                .enumerate()
                .map(|(i, task)| {
                    let queue = task.queue.as_deref().unwrap_or_default();
                    trigger_task_id(queue, &def.name, &scheduled_tag(t), i)
                })
                .collect()
        };
        let tasks = &self.ctx.tasks;
        let client = self.ctx.js.client();
        let client = &client;
        // Fired by this leader and its state write failed: fired, whatever the records say
        // (the same fault may have kept its record from being written).
        h.made.retain(|t| candidates.contains(t));
        let made: Vec<u64> = h.made.iter().copied().collect();
        let checks = candidates.iter().map(|&t| {
            let first = ids_of(t).into_iter().next();
            let made = made.contains(&t);
            async move {
                if made {
                    return (t, Some(true));
                }
                let exists = match first {
                    Some(id) => {
                        ax_core::follow::across_reconnects(client, || tasks.get_latest(&id))
                            .await
                            .ok()
                            .map(|found| found.is_some())
                    }
                    None => Some(false),
                };
                (t, exists)
            }
        });
        let answers = futures::future::join_all(checks).await;
        if answers.iter().any(|(_, exists)| exists.is_none()) {
            warn!(trigger = %h.def.name, "cannot read the fires to repair; trying again before planning");
            return None;
        }
        let fired: Vec<u64> = answers
            .into_iter()
            .filter_map(|(t, exists)| (exists == Some(true)).then_some(t))
            .collect();
        if fired.is_empty() {
            return Some(false);
        }
        if let Some(b) = h.state.buffered_ms.filter(|b| fired.contains(b)) {
            h.state.record_fire(&[b], now, Source::Schedule, &ids_of(b));
            known_fire(&mut h.known, b);
            h.active.extend(ids_of(b));
            h.state.buffered_ms = None;
        }
        let mut last = None;
        for &t in fired.iter().filter(|t| times.contains(t)) {
            h.state.record_fire(&[t], now, Source::Schedule, &ids_of(t));
            known_fire(&mut h.known, t);
            h.active.extend(ids_of(t));
            last = Some(t);
        }
        if let Some(last) = last {
            // Times before it that did not fire were skipped by whoever planned them.
            let older = total - times.len() as u64;
            let handled = older + times.iter().filter(|&&t| t <= last).count() as u64;
            let made = fired.iter().filter(|t| times.contains(t)).count() as u64;
            h.state.skipped += handled - made;
            h.state.last_scheduled_ms = Some(last);
        }
        h.checked_at = None;
        warn!(trigger = %h.def.name, fires = ?fired,
            "found fires a leader made but did not record; recording them");
        Some(true)
    }

    /// Brings an unsure trigger's stored state up to every fire made, before anything of
    /// it is planned: reads the state again unless `h` holds it as stored, looks for fires
    /// made but missing from it ([`Engine::repair`]), and writes them (compare-and-set; on
    /// a conflict it reads and looks again). Only when this says [`Recorded::Yes`] may the
    /// trigger fire again, so a fire is never followed by another while it is unrecorded.
    pub(super) async fn record_unrecorded(
        &self,
        store: &TriggerStore,
        h: &mut Held,
        token: u64,
    ) -> Recorded {
        let name = h.def.name.clone();
        for _ in 0..MERGE_ATTEMPTS {
            if !h.fresh {
                let (state, revision) = match store.state(&name).await {
                    Ok(Some(found)) => found,
                    // Deleted meanwhile: the definition watch removes it.
                    Ok(None) => return Recorded::Later,
                    Err(e) => {
                        warn!(trigger = %name, cause = %e, "cannot read trigger state; firing nothing until it is read");
                        return Recorded::Later;
                    }
                };
                if state.leader > token {
                    return Recorded::StepDown;
                }
                h.unstored = false;
                self.take_state(h, state, revision).await;
            }
            let Some(found) = self.repair(h).await else {
                return Recorded::Later;
            };
            if !found && !h.unstored {
                h.unsure = false;
                return Recorded::Yes;
            }
            h.state.leader = token;
            match store.put_state(&name, &h.state, Some(h.revision)).await {
                Ok(revision) => {
                    h.revision = revision;
                    h.unsure = false;
                    h.unstored = false;
                    h.dirty = false;
                    return Recorded::Yes;
                }
                Err(TriggerStoreError::Stale(_)) => {
                    // Changed meanwhile: read it and look again (what was found is found
                    // again from the tasks; an adopted fire is lost, and logged).
                    if h.unstored {
                        warn!(trigger = %name, "trigger state changed before an adopted fire was written; it is not counted");
                    }
                    h.fresh = false;
                    h.unsure = true;
                }
                Err(e) => {
                    warn!(trigger = %name, cause = %e, "cannot write the fires found unrecorded; firing nothing until they are written");
                    h.fresh = false;
                    h.unsure = true;
                    return Recorded::Later;
                }
            }
        }
        Recorded::Later
    }

    /// A trigger whose last fire's tasks are all finished but whose stored state does not
    /// say when (the leader that saw them finish kept it in memory, then died or changed):
    /// they finished by now. Without this a fixed-delay trigger, whose next time counts
    /// from that completion, never fired again after a leader change.
    pub(super) fn settle(&self, h: &mut Held) {
        h.settle(self.clock.now_ms());
    }

    /// Takes in `state` at `revision` as read from the store (a write seen on the state
    /// feed, or a read before recording): its unfinished tasks looked up again, settled.
    pub(super) async fn take_state(&self, h: &mut Held, state: TriggerState, revision: u64) {
        h.active = unfinished(&self.ctx, tracked_ids(&state)).await;
        h.checked_at = Some(Instant::now());
        h.state = state;
        h.revision = revision;
        h.fresh = true;
        h.dirty = false;
        self.settle(h);
    }
}

impl Held {
    /// A trigger with fires and no unfinished task has completed: at `now` if its state
    /// does not say when.
    pub(super) fn settle(&mut self, now: u64) {
        if self.active.is_empty()
            && self.state.last_fire.is_some()
            && self.state.last_completed_ms.is_none()
        {
            self.state.last_completed_ms = Some(now);
            self.dirty = true;
        }
    }

    /// A trigger task was just created that this leader did not fire: a previous leader's
    /// fire landed late (it planned the time before losing the lease and submitted after).
    /// If this leader already handled that scheduled time (counted it skipped, or holds it
    /// buffered), the time did fire after all: record it so, and follow its tasks.
    /// Answers the scheduled time adopted, if one was.
    pub(super) fn adopt(&mut self, id: &str, rec: &TaskRecord, now_ms: u64) -> Option<u64> {
        // With overlap `allow` no time is ever skipped for a running fire: nothing to fix.
        if !tracks_every_fire(&self.def)
            || self.active.contains(id)
            || rec.trigger_source.as_deref() != Some("schedule")
        {
            return None;
        }
        let t = rec.scheduled_at_ms?;
        if self.known.contains(&t) {
            return None; // fired or recorded here: counted already
        }
        let ids: Vec<String> = self
            .def
            .tasks
            .iter()
            .enumerate()
            .map(|(i, task)| {
                let queue = task.queue.as_deref().unwrap_or_default();
                trigger_task_id(queue, &self.def.name, &scheduled_tag(t), i)
            })
            .collect();
        let handled = self.state.last_scheduled_ms.is_some_and(|last| t <= last);
        let ours = self
            .state
            .last_fire
            .as_ref()
            .is_some_and(|f| f.task_ids.iter().any(|f| ids.contains(f)));
        // Counted once per fire: by its first template's task.
        if ours || ids.first().map(String::as_str) != Some(id) {
            return None;
        }
        if !handled {
            // A previous leader's fire of a time this leader has not planned yet (it
            // fired late, after a slow step such as `cancel_in_progress`'s cancels): the
            // plan that handles the time must count it fired, not skipped, so the tasks
            // are looked at again before anything is planned (`record_unrecorded`).
            self.unsure = true;
            return None;
        }
        if self.state.buffered_ms == Some(t) {
            self.state.buffered_ms = None;
        } else {
            self.state.skipped = self.state.skipped.saturating_sub(1);
        }
        self.state.record_fire(&[t], now_ms, Source::Schedule, &ids);
        known_fire(&mut self.known, t);
        self.active.extend(ids);
        // Written before anything else is planned (`record_unrecorded`).
        self.unstored = true;
        Some(t)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::trigger::engine::held::merge_fire;
    use crate::trigger::model::TriggerDef;
    use crate::trigger::plan::FireRecord;
    use crate::trigger::Validate;
    use serde_json::json;
    use std::collections::HashSet;

    pub(in crate::trigger::engine) fn held() -> Held {
        let def = TriggerDef::decode(json!({"name": "t", "kind": "interval", "every_ms": 1000,
            "overlap": "skip", "tasks": [{"name": "t", "queue": "q"}]}))
        .expect("valid");
        let rec = def.validate().expect("valid");
        Held {
            def,
            rec,
            state: TriggerState::default(),
            revision: 1,
            active: HashSet::new(),
            early_done: HashSet::new(),
            checked_at: None,
            unsure: false,
            fresh: true,
            unstored: false,
            dirty: false,
            known: Default::default(),
            made: Default::default(),
            planned: Vec::new(),
        }
    }

    pub(in crate::trigger::engine) fn created(id: &str, scheduled: u64) -> TaskRecord {
        serde_json::from_value(json!({"id": id, "queue": "q", "name": "t",
            "priority": "normal", "state": "pending", "attempt": 0, "max_attempts": 3,
            "created_at_ms": scheduled, "updated_at_ms": scheduled, "trigger": "t",
            "trigger_source": "schedule", "scheduled_at_ms": scheduled}))
        .expect("a record")
    }

    /// A previous leader's fire that lands before this leader has planned its time (the R3
    /// fixed seed 4955772603497125947 after `cancel_in_progress` came: `t-cancel` counted
    /// 39 fires for 40 made): the plan must find it among the tasks, not count it skipped.
    #[test]
    fn a_fire_of_a_time_not_planned_yet_makes_the_trigger_unsure() {
        let mut h = held();
        h.state.last_scheduled_ms = Some(1000);
        let id = "q.tr.t.2000.0";
        assert_eq!(h.adopt(id, &created(id, 2000), 2500), None);
        assert!(
            h.unsure,
            "its fires are looked for in the tasks before the next plan"
        );
        assert_eq!(h.state.skipped, 0);
    }

    /// A fire's creation seen twice (a late event after its fire was recorded here, a
    /// watch that delivers again) is counted once: the R3 10-minute campaign (seed
    /// 4368398716054781219) found a `skip` trigger's state counting 301 fires for 300 made.
    #[test]
    fn a_late_fire_is_adopted_once_however_often_its_creation_is_seen() {
        let mut h = held();
        // This leader handled 1000 as skipped; a previous leader's fire of it lands now.
        h.state.last_scheduled_ms = Some(1000);
        h.state.skipped = 1;
        let id = "q.tr.t.1000.0";
        assert_eq!(h.adopt(id, &created(id, 1000), 1500), Some(1000));
        assert_eq!((h.state.fires, h.state.skipped), (1, 0));
        // Its task ends; this leader fires 2000.
        h.active.remove(id);
        h.state.last_scheduled_ms = Some(2000);
        h.state
            .record_fire(&[2000], 2001, Source::Schedule, &["q.tr.t.2000.0".into()]);
        // The creation of 1000's task is seen again.
        assert_eq!(h.adopt(id, &created(id, 1000), 2500), None);
        assert_eq!(
            (h.state.fires, h.state.skipped),
            (2, 0),
            "1000 and 2000 fired, once each"
        );
    }

    #[test]
    fn a_fire_merges_into_a_state_changed_by_a_manual_run() {
        let base = TriggerState {
            created_at_ms: 0,
            last_scheduled_ms: Some(1000),
            fires: 1,
            skipped: 2,
            ..Default::default()
        };
        let mut ours = base.clone();
        ours.last_scheduled_ms = Some(2000);
        ours.record_fire(&[2000], 2001, Source::Schedule, &["q.tr.t.2000.0".into()]);
        let mut current = base.clone();
        current.fires += 1;
        current.manual += 1;
        current.active = vec!["q.tr.t.mX.0".into()];
        current.last_fire = Some(FireRecord {
            scheduled_ms: 1500,
            fired_at_ms: 1500,
            source: Source::Manual,
            task_ids: vec!["q.tr.t.mX.0".into()],
        });
        let merged = merge_fire(&base, &ours, current, 7);
        assert_eq!(merged.fires, 3, "the manual run and our fire");
        assert_eq!(merged.manual, 1);
        assert_eq!(merged.skipped, 2);
        assert_eq!(merged.last_scheduled_ms, Some(2000));
        assert_eq!(
            merged.active,
            vec!["q.tr.t.mX.0".to_string(), "q.tr.t.2000.0".to_string()]
        );
        assert_eq!(merged.last_fire.unwrap().scheduled_ms, 2000);
        assert_eq!(merged.leader, 7);
    }
}
