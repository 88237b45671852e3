//! Building a [`FlowDef`] in Rust (the same thing as the YAML / JSON form).
//!
//! ```
//! use ax_sdk::flow::{FlowDef, StepDef, TriggerRule};
//! use ax_sdk::TaskSpec;
//! let def = FlowDef::new("thumbnails")
//!     .step(StepDef::new("list", "media", TaskSpec::new("list_images")))
//!     .step(StepDef::new("resize", "media", TaskSpec::new("resize")).needs(["list"]).for_each("list"))
//!     .step(StepDef::new("report", "media", TaskSpec::new("report")).needs(["resize"]))
//!     .step(StepDef::new("cleanup", "media", TaskSpec::new("cleanup"))
//!         .needs(["resize"]).trigger(TriggerRule::OneFailed));
//! assert!(def.validate(&Default::default()).is_ok());
//! ```

use super::def::{
    ApprovalDef, FailurePolicy, FlowDef, OnFailure, SleepDef, StepDef, TriggerRule,
    WaitForEventDef, APPROVAL_TASK, SLEEP_TASK, WAIT_FOR_EVENT_TASK,
};
use crate::client::TaskSpec;
use std::time::Duration;

impl FlowDef {
    /// A flow with no steps yet and the default failure policy (`fail_fast`).
    pub fn new(name: impl Into<String>) -> FlowDef {
        FlowDef {
            name: name.into(),
            failure: FailurePolicy::default(),
            steps: Vec::new(),
        }
    }

    /// Sets the failure policy.
    pub fn failure(mut self, policy: FailurePolicy) -> FlowDef {
        self.failure = policy;
        self
    }

    /// Adds a step.
    pub fn step(mut self, step: StepDef) -> FlowDef {
        self.steps.push(step);
        self
    }
}

impl StepDef {
    /// A step that submits `task` to `queue`, with no parents and rule `all_success`.
    /// The task's payload, if any, reaches it as `args`.
    pub fn new(name: impl Into<String>, queue: impl Into<String>, task: TaskSpec) -> StepDef {
        let mut task = task.into_request();
        task.queue = Some(queue.into());
        StepDef {
            name: name.into(),
            needs: Vec::new(),
            for_each: None,
            trigger: TriggerRule::default(),
            on_failure: OnFailure::default(),
            task,
            sleep: None,
            wait_for_event: None,
            approval: None,
            child_flow: None,
        }
    }

    /// An approval (its timeout held in `queue`'s delayed tasks, never by a process):
    /// the step succeeds when its token is approved, fails when it is rejected, or times
    /// out as `approval.on_timeout` says. `approval.queue` is set to `queue`.
    pub fn approval(
        name: impl Into<String>,
        queue: impl Into<String>,
        approval: ApprovalDef,
    ) -> StepDef {
        let queue = queue.into();
        let mut step = StepDef::new(name, queue.clone(), TaskSpec::new(APPROVAL_TASK));
        step.approval = Some(ApprovalDef {
            queue: Some(queue),
            ..approval
        });
        step
    }

    /// A child flow run of `child.flow` (one per item with [`StepDef::for_each`]; its
    /// timeout held in `queue`'s delayed tasks): the step ends with it, its output the
    /// child's leaf outputs by name. `child.queue` is set to `queue`.
    pub fn child_flow(
        name: impl Into<String>,
        queue: impl Into<String>,
        child: super::child::ChildFlowDef,
    ) -> StepDef {
        let queue = queue.into();
        let task = TaskSpec::new(super::child::CHILD_FLOW_TASK);
        let mut step = StepDef::new(name, queue.clone(), task);
        step.child_flow = Some(super::child::ChildFlowDef {
            queue: Some(queue),
            ..child
        });
        step
    }

    /// A wait for an event (held in `queue`'s delayed tasks until its timeout, never by
    /// a process): the step succeeds with the first matching event's payload, or times
    /// out as `wait.on_timeout` says. `wait.queue` is set to `queue`.
    pub fn wait_for_event(
        name: impl Into<String>,
        queue: impl Into<String>,
        wait: WaitForEventDef,
    ) -> StepDef {
        let queue = queue.into();
        let mut step = StepDef::new(name, queue.clone(), TaskSpec::new(WAIT_FOR_EVENT_TASK));
        step.wait_for_event = Some(WaitForEventDef {
            queue: Some(queue),
            ..wait
        });
        step
    }

    /// A durable sleep of `duration` from the step's start (held in `queue`'s delayed
    /// tasks, never by a process): the step then succeeds, its output `null`.
    pub fn sleep_for(
        name: impl Into<String>,
        queue: impl Into<String>,
        duration: Duration,
    ) -> StepDef {
        Self::sleeping(
            name,
            queue,
            SleepDef {
                for_ms: Some(duration.as_millis().min(u128::from(u64::MAX)) as u64),
                ..SleepDef::default()
            },
        )
    }

    /// A durable sleep until `until` (RFC 3339; a past time ends it at once).
    pub fn sleep_until(
        name: impl Into<String>,
        queue: impl Into<String>,
        until: impl Into<String>,
    ) -> StepDef {
        Self::sleeping(
            name,
            queue,
            SleepDef {
                until: Some(until.into()),
                ..SleepDef::default()
            },
        )
    }

    fn sleeping(name: impl Into<String>, queue: impl Into<String>, sleep: SleepDef) -> StepDef {
        let queue = queue.into();
        let mut step = StepDef::new(name, queue.clone(), TaskSpec::new(SLEEP_TASK));
        step.sleep = Some(SleepDef {
            queue: Some(queue),
            ..sleep
        });
        step
    }

    /// The steps this one waits for.
    pub fn needs<I: IntoIterator<Item = S>, S: Into<String>>(mut self, parents: I) -> StepDef {
        self.needs = parents.into_iter().map(Into::into).collect();
        self
    }

    /// Fan out over `parent`'s output (a JSON array): one task per item.
    pub fn for_each(mut self, parent: impl Into<String>) -> StepDef {
        self.for_each = Some(parent.into());
        self
    }

    /// When the step runs.
    pub fn trigger(mut self, rule: TriggerRule) -> StepDef {
        self.trigger = rule;
        self
    }

    /// What the step's failure does to the run (default [`OnFailure::Fail`]).
    pub fn on_failure(mut self, policy: OnFailure) -> StepDef {
        self.on_failure = policy;
        self
    }
}
