//! Runs every rule of the checker over what the campaign saw, and sums it up.

use crate::checker::{self, Histories, Invocation, TriggerRun};
use crate::checker_flows::{self, RunSeen};
use crate::cluster::Timeline;
use crate::{
    checker_admission, checker_fairness, checker_limits, checker_ops, flows, hex, limits, ops, Log,
    TRIGGERS,
};
use ax_sdk::flow::model::parse_step_task;
use ax_sdk::flow::{FlowRun, RunState, StepRun};
use ax_sdk::{Client, TaskRecord, TaskState};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

/// The violations found, and how many each rule found.
#[derive(Default)]
pub struct Verdict {
    pub violations: Vec<String>,
    pub by_rule: BTreeMap<&'static str, usize>,
}

impl Verdict {
    pub fn add(&mut self, rule: &'static str, found: Vec<String>) {
        if !found.is_empty() {
            *self.by_rule.entry(rule).or_default() += found.len();
        }
        self.violations.extend(found);
    }
}

/// What the run left to check.
pub struct Seen {
    pub journal: HashMap<String, Vec<Invocation>>,
    pub histories: Histories,
    /// When each revision of `histories` was stored.
    pub stored_at: crate::checker::StoredAt,
    pub timeline: Timeline,
    pub log: Log,
    pub flows: flows::FlowLog,
    pub limits: limits::LimitLog,
    pub ops: ops::OpsLog,
    pub admission: crate::admission::AdmissionLog,
    pub fairness: crate::fairness::FairnessLog,
    /// An R3 cluster (not one node).
    pub cluster: bool,
    /// When the triggers were paused (the end of their window).
    pub paused_ms: u64,
}

/// The core rules: tasks, tokens, triggers, stored fires, manual runs, refused
/// submits; and that every start is one its record counts. Returns the summary's parts.
pub async fn check_core(
    ax: &Client,
    js: &async_nats::jetstream::Context,
    seen: &Seen,
    verdict: &mut Verdict,
) -> Vec<String> {
    let (log, histories, invocations) = (&seen.log, &seen.histories, &seen.journal);
    verdict.add(
        "tasks",
        checker::check_tasks(&log.accepted, histories, invocations),
    );
    verdict.add("tokens", checker::check_tokens(invocations));
    verdict.add("debounce", checker_limits::check_debounce(&log.debounced));
    verdict.add(
        "batching",
        crate::checker_batches::check_batches(&log.batched, invocations),
    );
    verdict.add(
        "counted starts",
        checker::check_counted(invocations, histories, &seen.timeline),
    );
    let mut violations = Vec::new();
    let records: Vec<&TaskRecord> = histories
        .values()
        .filter_map(|h| h.last().map(|(_, r)| r))
        .collect();
    let mut fired_report = Vec::new();
    for (name, policy) in TRIGGERS {
        let got = ax
            .trigger("get", &serde_json::json!({"name": name}))
            .await
            .unwrap();
        let state = &got["state"];
        verdict.add(
            "triggers",
            checker::check_trigger(
                &TriggerRun {
                    name,
                    policy,
                    state,
                    paused_ms: seen.paused_ms,
                },
                &records,
            ),
        );
        if policy == "cancel_in_progress" {
            verdict.add(
                "cancel in progress",
                checker::check_cancel_in_progress(name, &records, invocations, &seen.timeline),
            );
        }
        fired_report.push(format!(
            "{name}: fired {} skipped {}",
            state["fires"].as_u64().unwrap_or(0) - state["manual"].as_u64().unwrap_or(0),
            state["skipped"]
        ));
    }
    let trigger_tasks = records.iter().filter(|r| r.trigger.is_some()).count() as u64;
    // The low messages but the fairness load's (one each: a retried submit keeps its id)
    // are the fires' — and copies of a publish sent again that a restarted broker stored
    // anew: the ready stream, a work queue, forgets the ids of the messages its consumer
    // removed when it restarts (nats-server #3272; tests/it/resend.rs
    // `a_task_message_stored_again_after_a_broker_restart_is_not_run_again`). A copy is
    // claimed without being run, so runs are what is judged (`check_counted`: a fire made
    // twice is a start its record does not count; `check_tokens`); copies are printed.
    let fq_low = records
        .iter()
        .filter(|r| r.queue == crate::fairness::FQ && r.priority == ax_sdk::Priority::Low)
        .count() as u64;
    let mut low = js.get_stream("AX_READY_LOW").await.unwrap();
    let stored_fires = low.info().await.unwrap().state.last_sequence - fq_low;
    let copies = stored_fires.saturating_sub(trigger_tasks);
    // Manual runs: each answered run made its task; nothing more than the runs sent.
    let manual_made: Vec<&str> = records
        .iter()
        .filter(|r| r.trigger_source.as_deref() == Some("manual"))
        .map(|r| r.id.as_str())
        .collect();
    for id in &log.manual_answered {
        if !manual_made.contains(&id.as_str()) {
            violations.push(format!("manual run {id} answered but never made"));
        }
    }
    if manual_made.len() > log.manual_answered.len() + log.manual_unanswered {
        violations.push(format!(
            "{} manual tasks made for {} answered and {} unanswered runs",
            manual_made.len(),
            log.manual_answered.len(),
            log.manual_unanswered
        ));
    }
    // Refused submits stored nothing.
    let idem = js.get_key_value("AX_IDEMPOTENCY").await.unwrap();
    let mut busy = 0;
    for (queue, key, code, clean) in &log.refused {
        busy += usize::from(code == "busy");
        if !clean {
            // An earlier attempt with this key went unanswered or was `unavailable`: it
            // may have stored the key (and the task, which a later retry finishes).
            continue;
        }
        let kv_key = format!("{queue}.{}", hex(key.as_bytes()));
        if let Ok(Some(v)) = idem.get(&kv_key).await {
            violations.push(format!(
                "refused submit ({code}) left its idempotency key, task {}",
                String::from_utf8_lossy(&v)
            ));
        }
    }
    verdict.add("fires, manual runs, refused submits", violations);
    let outcomes = |s: TaskState| {
        histories
            .values()
            .filter(|h| h.last().is_some_and(|(_, r)| r.state == s))
            .count()
    };
    let runs: usize = invocations.values().map(Vec::len).sum();
    vec![
        format!(
            "{} tasks accepted ({} direct, {} debounced from {} submits, {} batches from {} \
             items; {} succeeded, {} dead, {} cancelled in all records), {} refused ({busy} \
             busy), {} submit retries; {runs} handler invocations",
            log.accepted.len(),
            log.direct_accepted,
            log.debounced
                .iter()
                .map(|d| d.id.as_str())
                .collect::<std::collections::HashSet<_>>()
                .len(),
            log.debounced.len(),
            log.batched
                .iter()
                .filter_map(|b| b.id.as_deref())
                .collect::<std::collections::HashSet<_>>()
                .len(),
            log.batched.len(),
            outcomes(TaskState::Succeeded),
            outcomes(TaskState::Dead),
            outcomes(TaskState::Cancelled),
            log.refused.len(),
            log.unanswered_retries,
        ),
        format!(
            "manual runs {} answered / {} refused running / {} unanswered; triggers \
             {fired_report:?}, {stored_fires} fire messages stored ({copies} beyond one a \
             trigger task: copies a restarted broker stored again, claimed without a run)",
            log.manual_answered.len(),
            log.manual_refused,
            log.manual_unanswered,
        ),
    ]
}

/// Reads run `id` with its steps, asking again while the broker settles.
async fn read_run(ax: &Client, id: &str) -> Option<(FlowRun, Vec<StepRun>)> {
    for _ in 0..60 {
        match ax.flow_run(id).await {
            Ok(found) => return found,
            Err(e) => {
                eprintln!("reading flow run {id} failed ({e}); retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    None
}

/// The rules of the extended load: flows, limits, operations.
pub async fn check_new(ax: &Client, seen: &Seen, verdict: &mut Verdict) -> Vec<String> {
    let (journal, histories, timeline) = (&seen.journal, &seen.histories, &seen.timeline);
    // Flows: every run the campaign noted, and every run a started step task names.
    let mut ids: BTreeSet<String> = seen.flows.runs.iter().map(|n| n.run.clone()).collect();
    ids.extend(
        journal
            .keys()
            .filter_map(|id| parse_step_task(id).map(|t| t.run.to_string())),
    );
    let mut stored = BTreeMap::new();
    for id in &ids {
        if let Some(found) = read_run(ax, id).await {
            stored.insert(id.clone(), found);
        }
    }
    let runs: BTreeMap<String, RunSeen<'_>> = ids
        .iter()
        .map(|id| {
            let seen_run = RunSeen {
                note: seen.flows.runs.iter().find(|n| &n.run == id),
                run: stored.get(id),
            };
            (id.clone(), seen_run)
        })
        .collect();
    verdict.add("flow ends", checker_flows::check_ends(&runs));
    verdict.add(
        "flow steps",
        checker_flows::check_steps(&runs, journal, histories),
    );
    let (v, sleeps) = checker_flows::check_sleeps(histories, journal);
    verdict.add("flow sleeps", v);
    let (v, waits) = crate::checker_waits::check_waits(histories, journal, &seen.flows.runs);
    verdict.add("flow waits", v);
    let (v, approvals, decided) =
        crate::checker_approvals::check_approvals(histories, journal, &seen.flows.runs);
    verdict.add("flow approvals", v);
    let mut children = BTreeMap::new();
    for task in crate::checker_children::wait_tasks(histories) {
        let id = ax_sdk::flow::model::child_run_id(&task);
        let found = read_run(ax, &id).await;
        children.insert(id, found);
    }
    let (v, child_steps, child_ok) =
        crate::checker_children::check_children(histories, journal, &children);
    verdict.add("flow children", v);
    let ended = |s: RunState| stored.values().filter(|(r, _)| r.state == s).count();
    let reruns: usize = seen.flows.runs.iter().map(|n| n.reruns.len()).sum();
    let cancels: usize = seen.flows.runs.iter().map(|n| n.cancels.len()).sum();
    // Limits, from the journals.
    let keyed = &seen.limits.keyed;
    let (rated, left_out) = checker_limits::starts_by_key("rated", keyed, journal, timeline);
    let (v, tightest) = checker_limits::check_rate(limits::RATE, limits::BURST, &rated);
    verdict.add("rate", v);
    let mut most = Vec::new();
    for (limit, cap) in [("capped", limits::CAP), ("single", 1)] {
        let holds = checker_limits::holds_by_key(limit, keyed, journal, timeline);
        let (v, at_once) = checker_limits::check_cap(limit, cap, &holds);
        verdict.add(if cap == 1 { "singleton" } else { "cap" }, v);
        most.push(format!("{limit} {at_once}/{cap}"));
    }
    let rated_starts: usize = rated.values().map(Vec::len).sum();
    // Admission: singleton keys and the dropping rate.
    let a = &seen.admission;
    verdict.add(
        "singleton keys",
        checker_admission::check_singletons(
            &a.singletons,
            histories,
            &seen.stored_at,
            journal,
            timeline,
        ),
    );
    let (v, drop_tightest) = checker_admission::check_drops(
        &a.drops,
        crate::admission::DROP_RATE,
        crate::admission::DROP_BURST,
    );
    verdict.add("dropped rate", v);
    let count = |notes: &mut dyn Iterator<Item = bool>| notes.filter(|ok| *ok).count();
    let singles_ok = count(&mut a.singletons.iter().map(|n| n.seen.outcome.is_ok()));
    let cancels_in_progress = a.singletons.iter().filter(|n| n.cancel_in_progress).count();
    let drops_ok = count(&mut a.drops.iter().map(|d| d.outcome.is_ok()));
    // Fair shares and priority aging on `fq`.
    let f = &seen.fairness;
    let (v, fair) = checker_fairness::check_fair(&f.episodes, journal, timeline, seen.cluster);
    verdict.add("fair shares", v);
    let (v, aging) = checker_fairness::check_aging(&f.episodes, journal, timeline, seen.cluster);
    verdict.add("aging", v);
    // Operations.
    let o = &seen.ops;
    verdict.add(
        "cancel",
        checker_ops::check_cancels(&o.cancels, journal, histories),
    );
    verdict.add(
        "retry",
        checker_ops::check_retries(&o.retries, journal, histories),
    );
    verdict.add(
        "run now",
        checker_ops::check_run_nows(&o.run_nows, journal, histories),
    );
    verdict.add(
        "pause",
        checker_ops::check_pauses("x", &o.pauses, journal, timeline),
    );
    vec![
        format!(
            "flows: {} runs noted ({} seen), {} succeeded / {} failed / {} cancelled, {reruns} \
             re-runs and {cancels} cancels acknowledged, {} starts unanswered, {sleeps} sleeps \
             and {waits} waits for events judged ({paid} events acknowledged), {approvals} \
             approvals judged ({decided} with an answered completion), {child_steps} child \
             runs' steps judged ({child_ok} succeeded with their child)",
            seen.flows.runs.len(),
            ids.len(),
            ended(RunState::Succeeded),
            ended(RunState::Failed),
            ended(RunState::Cancelled),
            seen.flows.unanswered_starts,
            paid = seen
                .flows
                .runs
                .iter()
                .filter(|n| matches!(n.paid, crate::flows::Paid::Acked(_)))
                .count(),
        ),
        format!(
            "limits: {rated_starts} rated starts over {} keys ({left_out} left out after a \
             resume or during a broker fault), tightest window {tightest:+.2} starts over burst + rate × w (a slack of \
             {:.3} s would hold them); most at once: {}",
            rated.len(),
            tightest.max(0.0) / limits::RATE,
            most.join(", ")
        ),
        format!(
            "admission: singleton keys {singles_ok} of {} submits accepted ({cancels_in_progress} \
             cancel_in_progress); dropping rate {drops_ok} of {} accepted, at most {:.2} over \
             rate × w in a span (burst {}); {} unanswered",
            a.singletons.len(),
            a.drops.len(),
            drop_tightest.max(0.0),
            crate::admission::DROP_BURST,
            a.unanswered
        ),
        format!(
            "fairness: {} episodes; small tasks judged {} of {} (the rest waited through a \
             fault), most big starts passing one {} (bound {}); low tasks judged {} of {}, \
             longest wait {} ms (bound {} ms); {} unanswered",
            f.episodes.len(),
            fair.judged,
            fair.seen,
            fair.most,
            fair.bound,
            aging.judged,
            aging.seen,
            aging.most,
            aging.bound,
            f.unanswered
        ),
        format!(
            "operations: {} cancels, {} retries, {} run-nows acknowledged, {} pauses, {} refused, \
             {} unanswered",
            o.cancels.len(),
            o.retries.len(),
            o.run_nows.len(),
            o.pauses.len(),
            o.refused,
            o.unanswered
        ),
    ]
}
