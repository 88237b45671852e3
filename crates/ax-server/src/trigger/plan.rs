//! Deciding what a trigger fires now: a pure function of (definition, state, now, active),
//! so misfire, overlap, drift and clock steps are tested without a clock or a broker.
//!
//! Clock steps: `last_scheduled_ms` is stored, and only scheduled times strictly
//! after it are ever fired, so a wall clock stepping back never fires a time twice; a step
//! forward makes the skipped times "missed", handled by the misfire policy (fire once by
//! default).

use super::model::{MisfirePolicy, OverlapPolicy, TriggerDef};
use super::recur::Recurrence;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Why a fire happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Its schedule.
    Schedule,
    /// `ax trigger run` / the run API.
    Manual,
    /// A message on the trigger's subject.
    Event,
}

impl Source {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Schedule => "schedule",
            Source::Manual => "manual",
            Source::Event => "event",
        }
    }
}

/// One fire of a trigger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FireRecord {
    /// The scheduled time it stands for.
    pub scheduled_ms: u64,
    /// When it was submitted.
    pub fired_at_ms: u64,
    /// Why.
    pub source: Source,
    /// The tasks it created.
    pub task_ids: Vec<String>,
}

/// Runtime state of a trigger (bucket `AX_TRIGGER_STATE`, key = name).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TriggerState {
    /// When the trigger was first stored (anchor of fixed-rate and fixed-delay).
    pub created_at_ms: u64,
    /// The latest scheduled time handled (fired, buffered or skipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scheduled_ms: Option<u64>,
    /// The latest fire.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_fire: Option<FireRecord>,
    /// A fire held back by `buffer_one` while the previous one runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffered_ms: Option<u64>,
    /// When the latest fire's tasks had all finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_completed_ms: Option<u64>,
    /// Final states of the latest finished fire's tasks (`succeeded` / `dead`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub last_result: Vec<String>,
    /// Fires made (scheduled and manual).
    pub fires: u64,
    /// Of those, manual runs.
    #[serde(default)]
    pub manual: u64,
    /// Scheduled times not fired (misfire `skip`, overlap `skip`, dropped catch-ups).
    pub skipped: u64,
    /// Tasks of this trigger's fires not yet seen finished (scheduled and manual fires): the
    /// overlap policies and fixed-delay wait for these. A reader re-checks them against
    /// their records, so a completion missed by any feed is recovered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub active: Vec<String>,
    /// Fencing token (lease revision) of the engine leader that last wrote this state; an
    /// engine holding an older token steps down instead of writing.
    #[serde(default)]
    pub leader: u64,
}

impl TriggerState {
    /// Records a fire (its scheduled times, the last of which it stands for, and its tasks):
    /// counts it, makes it the last fire, and adds its tasks to the unfinished ones.
    pub fn record_fire(
        &mut self,
        scheduled: &[u64],
        fired_at_ms: u64,
        source: Source,
        ids: &[String],
    ) {
        let Some(&last) = scheduled.last() else {
            return;
        };
        self.fires += scheduled.len() as u64;
        if source == Source::Manual {
            self.manual += 1;
        }
        self.last_result.clear();
        self.last_completed_ms = None;
        self.last_fire = Some(FireRecord {
            scheduled_ms: last,
            fired_at_ms,
            source,
            task_ids: ids.to_vec(),
        });
        self.active.extend(ids.iter().cloned());
    }
}

/// What to do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Scheduled times to fire now, oldest first.
    pub fires: Vec<u64>,
    /// The state to store (before the fires are recorded in `last_fire`).
    pub state: TriggerState,
    /// When to look again (ms since the epoch); `None`: on a completion or a change only.
    pub next_wake_ms: Option<u64>,
    /// Cancel the previous fire's unfinished tasks before these fires (overlap
    /// `cancel_in_progress`).
    pub cancel_active: bool,
}

/// Most scheduled times walked through in one plan (a 1 s cron over 11 days of outage).
const MAX_WALK: usize = 1_000_000;

/// Where the walk through scheduled times starts (the last time handled) and its anchor
/// (creation, or for fixed-delay the last completion).
fn cursor(rec: &Recurrence, st: &TriggerState) -> (u64, u64) {
    let anchor = if rec.is_fixed_delay() {
        st.last_completed_ms.unwrap_or(st.created_at_ms)
    } else {
        st.created_at_ms
    };
    let start_after = match rec {
        Recurrence::Once { .. } | Recurrence::FixedDelay { .. } => 0,
        _ => st.created_at_ms,
    };
    (st.last_scheduled_ms.unwrap_or(start_after), anchor)
}

/// The scheduled times after the last one handled, up to `now_ms`: how many there are in
/// all, and the latest `limit` of them, oldest first.
pub fn times_due(
    rec: &Recurrence,
    state: &TriggerState,
    now_ms: u64,
    limit: usize,
) -> (u64, Vec<u64>) {
    let (mut t, anchor) = cursor(rec, state);
    let mut total = 0u64;
    let mut latest: VecDeque<u64> = VecDeque::new();
    while let Some(next) = rec.next_after(t, anchor) {
        if next > now_ms || total as usize >= MAX_WALK {
            break;
        }
        total += 1;
        latest.push_back(next);
        if latest.len() > limit {
            latest.pop_front();
        }
        t = next;
    }
    (total, latest.into())
}

/// Plans the trigger at `now_ms`; `active` says whether the latest fire's tasks still run.
pub fn plan(
    def: &TriggerDef,
    rec: &Recurrence,
    state: &TriggerState,
    now_ms: u64,
    active: bool,
) -> Plan {
    let mut st = state.clone();
    let none = |st| Plan {
        fires: Vec::new(),
        state: st,
        next_wake_ms: None,
        cancel_active: false,
    };
    if !def.enabled {
        return none(st);
    }
    let fixed_delay = rec.is_fixed_delay();
    if fixed_delay && active {
        return none(st);
    }
    let (mut t, anchor) = cursor(rec, &st);
    let keep = def.max_catch_up as usize;
    let mut due: VecDeque<u64> = VecDeque::new();
    let mut total = 0u64;
    while let Some(next) = rec.next_after(t, anchor) {
        if next > now_ms || total as usize >= MAX_WALK {
            break;
        }
        total += 1;
        due.push_back(next);
        if due.len() > keep.max(1) {
            due.pop_front();
        }
        t = next;
    }
    let next_wake_ms = if fixed_delay {
        rec.next_after(t, anchor)
    } else {
        rec.next_after(t.max(now_ms), anchor)
    };
    let Some(&latest) = due.back() else {
        // Nothing newly due; a buffered fire goes as soon as the running one ended.
        let fires = match (active, st.buffered_ms.take()) {
            (false, Some(b)) => vec![b],
            (_, b) => {
                st.buffered_ms = b;
                Vec::new()
            }
        };
        return Plan {
            fires,
            state: st,
            next_wake_ms,
            cancel_active: false,
        };
    };
    st.last_scheduled_ms = Some(latest);
    let late = |d: &u64| now_ms - d > def.grace_ms;
    let candidates: Vec<u64> = if !due.iter().any(late) && total == due.len() as u64 {
        due.iter().copied().collect()
    } else {
        match def.misfire {
            MisfirePolicy::FireOnce => vec![latest],
            MisfirePolicy::Skip => due.iter().copied().filter(|d| !late(d)).collect(),
            MisfirePolicy::FireAll => due.iter().copied().collect(),
        }
    };
    st.skipped += total - candidates.len() as u64;
    let mut cancel_active = false;
    let fires = if active {
        match def.overlap {
            OverlapPolicy::Allow => candidates,
            OverlapPolicy::CancelInProgress => {
                cancel_active = !candidates.is_empty();
                st.skipped += candidates.len().saturating_sub(1) as u64;
                candidates.last().copied().into_iter().collect()
            }
            OverlapPolicy::Skip => {
                st.skipped += candidates.len() as u64;
                Vec::new()
            }
            OverlapPolicy::BufferOne => {
                if let Some(&last) = candidates.last() {
                    st.skipped += candidates.len() as u64 - 1 + u64::from(st.buffered_ms.is_some());
                    st.buffered_ms = Some(last);
                }
                Vec::new()
            }
        }
    } else {
        if st.buffered_ms.take().is_some() && !candidates.is_empty() {
            // The buffered fire is overtaken by a newer scheduled time.
            st.skipped += 1;
        }
        match def.overlap {
            // Times missed at once fire as the latest even when nothing runs: each would
            // cancel the one before it as soon as it fired (the 10-minute R3 campaign,
            // seed 17212415938155834024, saw eight fired one after another after an
            // engine stall, all running at once).
            OverlapPolicy::CancelInProgress if candidates.len() > 1 => {
                st.skipped += candidates.len() as u64 - 1;
                candidates.last().copied().into_iter().collect()
            }
            _ => candidates,
        }
    };
    Plan {
        fires,
        state: st,
        next_wake_ms,
        cancel_active,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trigger::model::{IntervalMode, Kind};
    use crate::trigger::Validate;

    fn def(every_ms: u64, mode: IntervalMode) -> TriggerDef {
        serde_json::from_value(serde_json::json!({
            "name": "t",
            "kind": "interval",
            "every_ms": every_ms,
            "mode": mode,
            "tasks": [{"name": "x", "queue": "q"}],
        }))
        .unwrap()
    }

    fn rec(d: &TriggerDef) -> Recurrence {
        d.validate().unwrap()
    }

    fn state(last: Option<u64>) -> TriggerState {
        TriggerState {
            created_at_ms: 0,
            last_scheduled_ms: last,
            ..TriggerState::default()
        }
    }

    #[test]
    fn fixed_rate_fires_on_the_grid() {
        let d = def(1000, IntervalMode::FixedRate);
        let r = rec(&d);
        let p = plan(&d, &r, &state(None), 999, false);
        assert_eq!((p.fires.clone(), p.next_wake_ms), (vec![], Some(1000)));
        let p = plan(&d, &r, &state(None), 1003, false);
        assert_eq!(p.fires, vec![1000]);
        assert_eq!(p.state.last_scheduled_ms, Some(1000));
        assert_eq!(p.next_wake_ms, Some(2000));
    }

    #[test]
    fn misfire_policies_after_an_outage() {
        let mut d = def(1000, IntervalMode::FixedRate);
        let r = rec(&d);
        // Down from t=1000 to t=100_500: 99 scheduled times passed (2000..=100_000).
        let p = plan(&d, &r, &state(Some(1000)), 100_500, false);
        assert_eq!(p.fires, vec![100_000], "fire_once: once, at the latest");
        assert_eq!(p.state.skipped, 98);
        d.misfire = MisfirePolicy::Skip;
        d.grace_ms = 200;
        let p = plan(&d, &r, &state(Some(1000)), 100_500, false);
        assert_eq!(p.fires, Vec::<u64>::new(), "skip: all were late");
        assert_eq!(p.state.skipped, 99);
        d.misfire = MisfirePolicy::FireAll;
        let p = plan(&d, &r, &state(Some(1000)), 100_500, false);
        assert_eq!(p.fires, (91..=100).map(|k| k * 1000).collect::<Vec<_>>());
        assert_eq!(p.state.skipped, 89);
    }

    #[test]
    fn clock_steps() {
        let d = def(1000, IntervalMode::FixedRate);
        let r = rec(&d);
        // Back: nothing at or before the last scheduled time fires again.
        let p = plan(&d, &r, &state(Some(5000)), 3000, false);
        assert!(p.fires.is_empty());
        assert_eq!(p.next_wake_ms, Some(6000));
        // Forward by an hour: fires once.
        let p = plan(&d, &r, &state(Some(5000)), 5000 + 3_600_000, false);
        assert_eq!(p.fires, vec![3_605_000]);
    }

    #[test]
    fn overlap_policies() {
        let mut d = def(1000, IntervalMode::FixedRate);
        let r = rec(&d);
        d.overlap = OverlapPolicy::Skip;
        let p = plan(&d, &r, &state(Some(1000)), 2000, true);
        assert!(p.fires.is_empty());
        assert_eq!(p.state.skipped, 1);
        d.overlap = OverlapPolicy::Allow;
        assert_eq!(
            plan(&d, &r, &state(Some(1000)), 2000, true).fires,
            vec![2000]
        );
        // buffer_one: held while running, fired right after, then back to cadence.
        d.overlap = OverlapPolicy::BufferOne;
        let p = plan(&d, &r, &state(Some(1000)), 2000, true);
        assert!(p.fires.is_empty());
        assert_eq!(p.state.buffered_ms, Some(2000));
        let p2 = plan(&d, &r, &p.state, 3000, true);
        assert_eq!(p2.state.buffered_ms, Some(3000), "still one buffered");
        assert_eq!(p2.state.skipped, 1);
        let p3 = plan(&d, &r, &p2.state, 3400, false);
        assert_eq!(p3.fires, vec![3000], "fires right after the overrun");
        assert_eq!(p3.state.buffered_ms, None);
        let p4 = plan(&d, &r, &p3.state, 4000, false);
        assert_eq!(p4.fires, vec![4000], "then the normal cadence");
        assert!(!p4.cancel_active);
        // cancel_in_progress: the new fire wins, the running one is cancelled; times
        // missed at once fire as the latest.
        d.overlap = OverlapPolicy::CancelInProgress;
        let p = plan(&d, &r, &state(Some(1000)), 2000, true);
        assert_eq!((p.fires, p.cancel_active), (vec![2000], true));
        let p = plan(&d, &r, &state(Some(1000)), 4000, true);
        assert_eq!(
            (p.fires, p.cancel_active, p.state.skipped),
            (vec![4000], true, 2)
        );
        let p = plan(&d, &r, &state(Some(1000)), 2000, false);
        assert_eq!(
            (p.fires, p.cancel_active),
            (vec![2000], false),
            "nothing to cancel"
        );
        // Missed at once while nothing runs: still the latest alone.
        let p = plan(&d, &r, &state(Some(1000)), 4000, false);
        assert_eq!(
            (p.fires, p.cancel_active, p.state.skipped),
            (vec![4000], false, 2)
        );
    }

    #[test]
    fn fixed_delay_waits_for_completion() {
        let d = def(1000, IntervalMode::FixedDelay);
        let r = rec(&d);
        let p = plan(&d, &r, &state(None), 1000, false);
        assert_eq!(p.fires, vec![1000]);
        assert!(plan(&d, &r, &p.state, 5000, true).fires.is_empty());
        let mut done = p.state.clone();
        done.last_completed_ms = Some(4200);
        assert!(plan(&d, &r, &done, 5000, false).fires.is_empty());
        assert_eq!(plan(&d, &r, &done, 5200, false).fires, vec![5200]);
    }

    #[test]
    fn once_fires_once_and_paused_never() {
        let mut d = def(1000, IntervalMode::FixedRate);
        d.kind = Kind::Once {
            at: "1970-01-01T00:00:05Z".into(),
        };
        let r = rec(&d);
        let p = plan(&d, &r, &state(None), 5001, false);
        assert_eq!(p.fires, vec![5000]);
        assert!(plan(&d, &r, &p.state, 99_999, false).fires.is_empty());
        d.enabled = false;
        assert!(plan(&d, &r, &state(None), 5001, false).fires.is_empty());
    }
}
