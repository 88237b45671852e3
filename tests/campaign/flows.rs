//! The flow load: fan-out and gather, chains, child flows, fail-fast and continue
//! failures, cancels and re-runs of every mode, under the nemesis. Flows are put and driven
//! through the public `Client` API; their steps run on queue `x` (the example workers,
//! killed and paused by the second nemesis) except the fan-out's `list` step, whose output
//! (the list to fan out over) the example handler cannot produce: it runs on queue `xl`, in
//! an in-process library worker that journals like the example one.

use crate::journal::Journal;
use ax_core::time::now_ms;
use ax_sdk::flow::model::parse_step_task;
use ax_sdk::worker::{Task, TaskError, Worker};
use ax_sdk::{Client, ClientError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The flows: a fan-out and its gather, a chain, a failure under `fail_fast` (with a
/// cleanup on `one_failed` and a branch beside it) and under `continue` (with an
/// `all_done` step after it). A step named `poison` fails for good (the example handler).
/// How long the `chain` flow's `nap` step sleeps.
pub const NAP_MS: u64 = 700;
/// How long the `paid` flow's `w` step waits for its event (then it goes on, output null).
pub const PAID_TIMEOUT_MS: u64 = 8000;
/// The event the `paid` flow waits for.
pub const PAID_EVENT: &str = "camp.paid";

pub fn defs() -> Vec<Value> {
    let step = |name: &str, needs: &[&str], task: &str, queue: &str| {
        json!({"name": name, "needs": needs,
               "task": {"name": task, "queue": queue, "max_attempts": 6,
                        "backoff": {"base_ms": 100, "max_ms": 1000}}})
    };
    let mut item = step("item", &["list"], "step", "x");
    item["for_each"] = json!("list");
    let mut cleanup = step("cleanup", &["boom"], "step", "x");
    cleanup["trigger"] = json!("one_failed");
    let mut fin = step("fin", &["boom", "side"], "step", "x");
    fin["trigger"] = json!("all_done");
    vec![
        json!({"name": "fan", "steps": [
            step("list", &[], "list", "xl"), item, step("gather", &["item"], "step", "x")]}),
        // `nap` is a durable sleep (a wait task the dispatching server ends): it sleeps
        // through the faults, its end held by the broker.
        json!({"name": "chain", "steps": [
            step("a", &[], "step", "x"),
            {"name": "nap", "needs": ["a"], "sleep": {"for_ms": NAP_MS}},
            step("b", &["nap"], "step", "x"),
            step("c", &["b"], "step", "x"), step("d", &["c"], "step", "x")]}),
        // `w` waits for event `camp.paid` of the run's order (published before the run, in
        // its first 2 s, or never), or 8 s, then goes on.
        json!({"name": "paid", "steps": [
            step("a", &[], "step", "x"),
            {"name": "w", "needs": ["a"], "wait_for_event": {"event": PAID_EVENT,
                "match": {"order": "$input.order"}, "timeout_ms": PAID_TIMEOUT_MS,
                "on_timeout": "continue"}},
            step("b", &["w"], "step", "x")]}),
        crate::approvals::def(),
        // `kids` runs flow `kid` once per item of `list`, each a run of its own that the
        // faults hit as any run; `gather` gets their leaf outputs.
        json!({"name": "kid", "steps": [step("k1", &[], "step", "x"), step("k2", &["k1"], "step", "x")]}),
        json!({"name": "nest", "steps": [
            step("list", &[], "list", "xl"),
            {"name": "kids", "needs": ["list"], "for_each": "list",
             "child_flow": {"flow": "kid", "input": {"n": "$item"}}},
            step("gather", &["kids"], "step", "x")]}),
        json!({"name": "ff", "failure": "fail_fast", "steps": [
            step("a", &[], "step", "x"), step("boom", &["a"], "poison", "x"),
            step("after", &["boom"], "step", "x"), cleanup, step("side", &["a"], "step", "x")]}),
        json!({"name": "cont", "failure": "continue", "steps": [
            step("a", &[], "step", "x"), step("boom", &["a"], "poison", "x"),
            step("after", &["boom"], "step", "x"), step("side", &["a"], "step", "x"), fin]}),
    ]
}

/// An acknowledged cancel of a run.
#[derive(Debug, Clone)]
pub struct CancelAck {
    pub ack_ms: u64,
    /// The run's state in the answer (`running`: the cancel is requested).
    pub state: String,
}

/// An acknowledged re-run (`failed`, `failed_and_downstream` or `whole`).
#[derive(Debug, Clone)]
pub struct RerunAck {
    pub mode: &'static str,
    pub ack_ms: u64,
}

/// The event of a `paid` run's order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Paid {
    /// Never published.
    #[default]
    Never,
    /// Published and stored: acknowledged at this time.
    Acked(u64),
    /// Published without an answer: stored or not.
    Unknown,
}

/// A run the campaign started (or got from a `whole` re-run), and what it asked of it.
#[derive(Debug, Clone, Default)]
pub struct RunNote {
    pub run: String,
    pub flow: String,
    pub input: Value,
    pub cancels: Vec<CancelAck>,
    pub reruns: Vec<RerunAck>,
    /// Requests about it that got no answer (their effect is unknown).
    pub unanswered: usize,
    /// A `paid` run: its order's event.
    pub paid: Paid,
    /// A `gate` run: the decisions its approval's completions were answered with, and when.
    pub decided: Vec<(String, u64)>,
}

/// What the flow load did.
#[derive(Debug, Default)]
pub struct FlowLog {
    pub runs: Vec<RunNote>,
    /// Run requests without an answer (a run may exist that no note names).
    pub unanswered_starts: usize,
}

/// The `list` step's worker (queue `xl`, in this process): outputs `[0, 1, …, n − 1]` for
/// the run's input `n`, and fails for good at epoch 0 when the input says `fail_first` (a
/// re-run of the failed step then succeeds). Journals each invocation.
pub fn lister(journal: Journal) -> Worker {
    Worker::builder("xl")
        .concurrency(8)
        .id("lister")
        .handler(move |task: Task| {
            let journal = journal.clone();
            async move {
                let token = if task.id.as_bytes().last().is_some_and(|b| b % 2 == 0) {
                    task.fencing_token().await?
                } else {
                    0
                };
                let mut run = journal.start(&task, token, "lister");
                let pause = rand::rng().random_range(20..80);
                tokio::time::sleep(Duration::from_millis(pause)).await;
                let payload: Value = task.json()?;
                let n = payload["input"]["n"].as_u64().unwrap_or(0);
                let epoch = parse_step_task(&task.id).map_or(0, |s| s.epoch);
                let result = if payload["input"]["fail_first"] == json!(true) && epoch == 0 {
                    Err(TaskError::permanent("planned", "the list fails at epoch 0"))
                } else {
                    Ok(Value::Array((0..n).map(Value::from).collect()))
                };
                run.end(result.as_ref().map(|_| ()).map_err(|e| e.class.as_str()));
                result
            }
        })
        .build()
        .expect("the lister builds")
}

/// Polls run `run` until it has ended (at most `limit`): its final state, or `None`.
async fn ended(ax: &Client, run: &str, limit: Duration) -> Option<String> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(Some((r, _))) = ax.flow_run(run).await {
            if r.state != ax_sdk::flow::RunState::Running {
                return Some(r.state.to_string());
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    None
}

pub fn note(log: &Mutex<FlowLog>, run: &str, f: impl FnOnce(&mut RunNote)) {
    let mut log = log.lock().unwrap();
    if let Some(n) = log.runs.iter_mut().find(|n| n.run == run) {
        f(n);
    }
}

/// What happens to a run after it starts.
async fn follow(
    ax: Client,
    log: Arc<Mutex<FlowLog>>,
    run: String,
    flow: String,
    input: Value,
    rng: &mut StdRng,
) {
    let cancel_after = match flow.as_str() {
        "chain" if rng.random_bool(0.4) => Some(rng.random_range(0..800)),
        _ if rng.random_bool(0.1) => Some(rng.random_range(0..500)),
        _ => None,
    };
    if let Some(ms) = cancel_after {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        match ax.flow("cancel", &json!({"run": run})).await {
            Ok(v) => {
                let ack = CancelAck {
                    ack_ms: now_ms(),
                    state: v["state"].as_str().unwrap_or_default().to_string(),
                };
                note(&log, &run, |n| n.cancels.push(ack));
            }
            Err(ClientError::Refused(_)) => {}
            Err(_) => note(&log, &run, |n| n.unanswered += 1),
        }
        return;
    }
    let mode = match flow.as_str() {
        "fan" if input["fail_first"] == json!(true) => "failed",
        "ff" | "cont" if rng.random_bool(0.5) => {
            ["failed", "failed_and_downstream", "whole"][rng.random_range(0..3)]
        }
        _ => return,
    };
    if ended(&ax, &run, Duration::from_secs(60)).await.is_none() {
        return; // the checker reports a run that never ends
    }
    match ax.flow("rerun", &json!({"run": run, "mode": mode})).await {
        Ok(v) => {
            let ack = RerunAck {
                mode,
                ack_ms: now_ms(),
            };
            note(&log, &run, |n| n.reruns.push(ack));
            if mode == "whole" {
                let new = v["run"].as_str().unwrap_or_default().to_string();
                log.lock().unwrap().runs.push(RunNote {
                    run: new,
                    flow,
                    input,
                    ..RunNote::default()
                });
            }
        }
        Err(ClientError::Refused(_)) => {}
        Err(_) => note(&log, &run, |n| n.unanswered += 1),
    }
}

/// Publishes the event of `order` (its id the order: a retry is one event).
async fn pay(ax: &Client, order: &str) -> Paid {
    let event = json!({ "order": order });
    match ax.publish_event(PAID_EVENT, &event, Some(order)).await {
        Ok(_) => Paid::Acked(now_ms()),
        Err(_) => Paid::Unknown,
    }
}

/// Starts a run every 0.6–1.4 s until `until`, each followed (cancel, re-run) on its own;
/// a `paid` run's event is published before it starts, in its first 2 s, or never.
pub async fn load(
    ax: Client,
    nats: async_nats::Client,
    log: Arc<Mutex<FlowLog>>,
    seed: u64,
    until: Instant,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xf10f_10f1);
    let tokens = crate::approvals::Tokens::listen(nats).await;
    let mut follows = Vec::new();
    while Instant::now() < until {
        let (flow, input) = match rng.random_range(0..100) {
            0..=29 => (
                "fan",
                json!({"n": rng.random_range(1..=5), "fail_first": rng.random_bool(0.3)}),
            ),
            30..=51 => ("chain", json!({})),
            52..=67 => ("ff", json!({})),
            68..=79 => ("cont", json!({})),
            80..=84 => ("gate", json!({})),
            85..=89 => ("nest", json!({"n": rng.random_range(1..=4)})),
            _ => (
                "paid",
                json!({"order": format!("o{}", rng.random::<u32>())}),
            ),
        };
        let order = input["order"].as_str().map(str::to_string);
        // When its event comes: 0 before the run, 1 in its first 2 s, 2 never.
        let when = rng.random_range(0..3);
        let mut paid = Paid::Never;
        if let (Some(order), 0) = (&order, when) {
            paid = pay(&ax, order).await;
        }
        match ax.flow("run", &json!({"flow": flow, "input": input})).await {
            Ok(v) => {
                let run = v["run"].as_str().unwrap_or_default().to_string();
                log.lock().unwrap().runs.push(RunNote {
                    run: run.clone(),
                    flow: flow.to_string(),
                    input: input.clone(),
                    paid,
                    ..RunNote::default()
                });
                let mut rng = StdRng::seed_from_u64(rng.random());
                let (ax, log) = (ax.clone(), log.clone());
                if flow == "gate" {
                    let decide = crate::approvals::decide(
                        ax.clone(),
                        log.clone(),
                        tokens.clone(),
                        run.clone(),
                        rng.random(),
                    );
                    follows.push(tokio::spawn(decide));
                }
                if let (Some(order), 1) = (order, when) {
                    let pause = Duration::from_millis(rng.random_range(0..2000));
                    let (ax, log, run) = (ax.clone(), log.clone(), run.clone());
                    follows.push(tokio::spawn(async move {
                        tokio::time::sleep(pause).await;
                        let paid = pay(&ax, &order).await;
                        note(&log, &run, |n| n.paid = paid);
                    }));
                }
                follows.push(tokio::spawn(async move {
                    follow(ax, log, run, flow.to_string(), input, &mut rng).await
                }));
            }
            Err(ClientError::Refused(_)) => {}
            Err(_) => log.lock().unwrap().unanswered_starts += 1,
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(600..1400))).await;
    }
    for f in follows {
        let _ = f.await;
    }
}

/// True once every noted run has ended.
pub async fn all_ended(ax: &Client, log: &Mutex<FlowLog>) -> bool {
    let runs: Vec<String> = log
        .lock()
        .unwrap()
        .runs
        .iter()
        .map(|n| n.run.clone())
        .collect();
    for run in runs {
        match ax.flow_run(&run).await {
            Ok(Some((r, _))) if r.state != ax_sdk::flow::RunState::Running => {}
            _ => return false,
        }
    }
    true
}
