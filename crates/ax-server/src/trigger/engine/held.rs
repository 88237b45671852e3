//! What the leader holds of each trigger, what firing one came to, and the pure rules
//! over them (no I/O): the book (`book.rs`), the recovery (`recover.rs`) and the pump
//! (`mod.rs`) share these.

use crate::trigger::model::TriggerDef;
use crate::trigger::plan::TriggerState;
use crate::trigger::recur::Recurrence;
use std::collections::HashSet;
use std::time::Duration;
use tokio::time::Instant;

/// How many of the latest scheduled times a new leader checks for unrecorded fires.
pub(super) const REPAIR_WINDOW: usize = 128;

/// How often, at most, a trigger waiting on unfinished tasks re-checks their records.
pub(super) const RECHECK: Duration = Duration::from_secs(3);

/// Most attempts to record a fire into a state that keeps changing.
pub(super) const MERGE_ATTEMPTS: usize = 10;

/// How soon a trigger whose state could not be read or written is looked at again, ms.
pub(super) const RETRY_MS: u64 = 1000;

/// One trigger as the leader holds it.
pub(super) struct Held {
    pub(super) def: TriggerDef,
    pub(super) rec: Recurrence,
    pub(super) state: TriggerState,
    pub(super) revision: u64,
    /// Task ids of its fires not yet seen finished.
    pub(super) active: HashSet<String>,
    /// Completions seen while a fire was in flight, before its ids were known.
    pub(super) early_done: HashSet<String>,
    /// When `active` was last checked against the records (`None`: it must be).
    pub(super) checked_at: Option<Instant>,
    /// The stored state may lack fires a leader made but could not record (it died, or its
    /// state write failed or went unanswered): find them and write them into the stored
    /// state before planning anything (`recover::record_unrecorded`).
    pub(super) unsure: bool,
    /// `state` and `revision` are the stored ones as last read or written (not after a
    /// failed write, whose outcome is unknown).
    pub(super) fresh: bool,
    /// `state` holds a change the store must get before anything is planned (a late fire
    /// adopted from a previous leader).
    pub(super) unstored: bool,
    /// `state` holds what the store does not have yet and no plan would write: the end
    /// and results of its last fire's tasks (written with the next fire's state). A
    /// trigger is held as its name alone only after that is written (`Book::rest`).
    pub(super) dirty: bool,
    /// Scheduled times this leader fired, recorded from the tasks it found, or adopted:
    /// the creation of their tasks, seen late through a lagging watch, is never adopted
    /// again (it would count one fire twice). The latest [`KNOWN_FIRES`].
    pub(super) known: std::collections::VecDeque<u64>,
    /// Scheduled times this leader fired whose state write failed
    /// ([`Outcome::Unrecorded`]): fired, whatever their records say, until the stored
    /// state has them. The latest [`KNOWN_FIRES`].
    pub(super) made: std::collections::VecDeque<u64>,
    /// Scheduled times the fire job in flight is to fire: noted in `known` when its state
    /// is stored ([`Outcome::Stored`]), dropped otherwise. Noted at planning instead, a
    /// time whose submit went unanswered (stored, as it turned out, and claimed seconds
    /// later) was known here though no state counted it: counted skipped by the next
    /// plan, its late task was never adopted (the fixed R3 seed 4955772603497125947 in
    /// CI: `t-cancel` counted 29 scheduled fires for 30 made).
    pub(super) planned: Vec<u64>,
}

impl Held {
    /// A fire job of scheduled times `fires` is about to run (see [`Held::planned`]).
    pub(super) fn planning(&mut self, fires: &[u64]) {
        self.planned = fires.to_vec();
    }
}

/// Notes in `known` ([`Held::known`]) that scheduled time `t` fired.
pub(super) fn known_fire(known: &mut std::collections::VecDeque<u64>, t: u64) {
    if !known.contains(&t) {
        if known.len() == KNOWN_FIRES {
            known.pop_front();
        }
        known.push_back(t);
    }
}

/// How many scheduled times a leader keeps in [`Held::known`] per trigger (the watch of
/// task records lags by seconds at most; a trigger fires at most once a second).
pub(super) const KNOWN_FIRES: usize = 256;

impl Held {
    /// True if planning this trigger depends on whether its tasks still run.
    pub(super) fn waits_on_tasks(&self) -> bool {
        !self.active.is_empty()
            && (self.rec.is_fixed_delay()
                || self.def.overlap != crate::trigger::model::OverlapPolicy::Allow
                || self.state.buffered_ms.is_some())
    }
}

/// Whether a trigger's planning waits on the tasks of every earlier fire (overlap `skip` or
/// `buffer_one`, fixed-delay). With overlap `allow` nothing does, and only the latest fire's
/// tasks are followed (for `last_completed_ms` / `last_result`), so `active` stays small
/// however long its tasks take.
pub(super) fn tracks_every_fire(def: &TriggerDef) -> bool {
    use crate::trigger::model::{IntervalMode, Kind, OverlapPolicy};
    def.overlap != OverlapPolicy::Allow
        || matches!(
            def.kind,
            Kind::Interval {
                mode: IntervalMode::FixedDelay,
                ..
            }
        )
}

/// What firing one trigger came to.
pub(super) enum Outcome {
    Stored {
        state: TriggerState,
        revision: u64,
        ids: Vec<String>,
        next_wake_ms: Option<u64>,
    },
    /// A fire was refused (busy, unavailable: its task may be stored all the same), or made
    /// and its state write failed, went unanswered or kept conflicting: the stored state
    /// may lack it. Recorded before anything else is planned.
    Unrecorded {
        /// The scheduled times this job fired (their publishes answered): the repair counts
        /// them fired without reading their records, which the same fault may have kept
        /// from being written (the task is then found by its message only, and a plan
        /// would count its time skipped while it runs).
        made: Vec<u64>,
    },
    /// Nothing was fired and the state changed elsewhere: plan again from this state.
    Reload(TriggerState, u64),
    /// A newer leader wrote the state.
    StepDown,
}

/// What recording a trigger's unrecorded fires came to.
pub(super) enum Recorded {
    /// The stored state has every fire found (or none was missing): plan as usual.
    Yes,
    /// The broker did not answer, or the state kept changing: fire nothing, try again.
    Later,
    /// A newer leader wrote the state.
    StepDown,
}

/// `ours` was planned from `base`; `current` is what is stored now. Applies our changes
/// (scheduled times handled, counters, the buffered fire, our fire) to `current`.
pub(super) fn merge_fire(
    base: &TriggerState,
    ours: &TriggerState,
    mut current: TriggerState,
    token: u64,
) -> TriggerState {
    current.last_scheduled_ms = current.last_scheduled_ms.max(ours.last_scheduled_ms);
    current.skipped += ours.skipped.saturating_sub(base.skipped);
    current.fires += ours.fires.saturating_sub(base.fires);
    current.buffered_ms = ours.buffered_ms;
    for id in &ours.active {
        if !current.active.contains(id) {
            current.active.push(id.clone());
        }
    }
    if let Some(fire) = &ours.last_fire {
        let newer = current
            .last_fire
            .as_ref()
            .is_none_or(|f| f.fired_at_ms <= fire.fired_at_ms);
        if newer {
            current.last_fire = Some(fire.clone());
            current.last_result.clear();
            current.last_completed_ms = None;
        }
    }
    current.leader = token;
    current
}
