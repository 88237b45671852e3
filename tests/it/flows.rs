//! Flows: DAGs of tasks with data passing, fan-out / fan-in, failure policies,
//! re-runs and cancel, against a real nats-server. No run may hang: every test waits for
//! the run's final state with a deadline, and counts handler invocations per task id.

use crate::procs::AxProc;
use crate::support::Env;
use ax_sdk::flow::{FailurePolicy, FlowDef, RerunMode, RunState, StepDef, StepState, TriggerRule};
use ax_sdk::worker::{Task, TaskError, Worker};
use ax_sdk::{Client, ErrorKind, Output, TaskSpec};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Handler invocations per task id.
pub(crate) type Calls = Arc<Mutex<HashMap<String, u32>>>;

/// A worker for queue `q` whose handlers work on the flow payload:
/// `seed` → input.x; `mul` → the one parent × args.k; `sum` → sum of all parents (lists
/// summed too); `range` → [0, input.n); `square` → item²; `fail` → fails for good;
/// `flaky` → fails for good unless input.fixed; `slow` → sleeps args.ms, returns 1;
/// `big` → an output over the cap; `note` → the `errors` it was given; `echo` → its
/// `parents`.
pub(crate) fn flow_worker(calls: Calls) -> Worker {
    Worker::builder("q")
        .concurrency(16)
        .handler(move |task: Task| {
            let calls = calls.clone();
            async move {
                *calls.lock().unwrap().entry(task.id.clone()).or_default() += 1;
                let p: Value = task.json()?;
                let num = |v: &Value| -> i64 {
                    match v {
                        Value::Array(list) => list.iter().map(|x| x.as_i64().unwrap_or(0)).sum(),
                        v => v.as_i64().unwrap_or(0),
                    }
                };
                let parents = p["parents"].as_object().cloned().unwrap_or_default();
                match task.name.as_str() {
                    "seed" => Ok(Output::json(&p["input"]["x"])?),
                    "mul" => {
                        let one = parents.values().next().map(num).unwrap_or(0);
                        Ok(Output::json(&(one * p["args"]["k"].as_i64().unwrap_or(1)))?)
                    }
                    "sum" => Ok(Output::json(&parents.values().map(num).sum::<i64>())?),
                    "range" => {
                        let n = p["input"]["n"].as_i64().unwrap_or(0);
                        Ok(Output::json(&(0..n).collect::<Vec<i64>>())?)
                    }
                    "square" => {
                        let i = p["item"].as_i64().unwrap_or(0);
                        Ok(Output::json(&(i * i))?)
                    }
                    "fail" => Err(TaskError::permanent("boom", "this step always fails")),
                    "late_fail" => {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        Err(TaskError::permanent("boom", "this step always fails"))
                    }
                    "flaky" if p["input"]["fixed"] != json!(true) => {
                        Err(TaskError::permanent("bad_data", "input not fixed yet"))
                    }
                    "slow" => {
                        let ms = p["args"]["ms"].as_u64().unwrap_or(100);
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        Ok(Output::json(&1)?)
                    }
                    "big" => Ok(Output::bytes(vec![
                        7u8;
                        ax_sdk::output::MAX_OUTPUT_BYTES + 1
                    ])),
                    "note" => Ok(Output::json(&p["errors"])?),
                    "echo" => Ok(Output::json(&p["parents"])?),
                    _ => Ok(Output::json(&1)?),
                }
            }
        })
        .build()
        .unwrap()
}

pub(crate) fn step(name: &str, task: &str) -> StepDef {
    StepDef::new(name, "q", TaskSpec::new(task))
}

/// Flow `name`: step `a` sleeps 1.5 s, then `b` (a seed) runs.
pub(crate) fn slow_chain(name: &str) -> FlowDef {
    FlowDef::new(name)
        .step(StepDef::new(
            "a",
            "q",
            TaskSpec::new("slow").json(&json!({"ms": 1500})),
        ))
        .step(step("b", "seed").needs(["a"]))
}

pub(crate) async fn finish(ax: &Client, run: &str) -> ax_sdk::flow::FlowRun {
    tokio::time::timeout(Duration::from_secs(60), ax.wait_flow(run))
        .await
        .unwrap_or_else(|_| panic!("run {run} ended within 60 s (a run must never hang)"))
        .unwrap()
}

/// How the flow tests start an `ax server` process of queue `q`.
pub(crate) const SERVER_ARGS: [&str; 3] = ["server", "--queue", "q"];

/// What the flow tests that kill servers start from: a broker, two `ax server` processes
/// of queue `q` (`SERVER_ARGS`), and the flow worker counting its calls.
pub(crate) struct TwoServers {
    pub(crate) env: Env,
    pub(crate) url: String,
    pub(crate) servers: Vec<crate::procs::AxProc>,
    pub(crate) calls: Calls,
    pub(crate) worker: (
        tokio_util::sync::CancellationToken,
        tokio::task::JoinHandle<()>,
    ),
}

impl TwoServers {
    pub(crate) async fn start() -> TwoServers {
        let env = Env::nats_only().await;
        let url = env.nats.url();
        let spawn = || crate::procs::AxProc::spawn(&url, &SERVER_ARGS);
        let servers = vec![spawn(), spawn()];
        crate::procs::wait_ready(&env.client).await;
        let calls = Calls::default();
        let worker = env.spawn_worker(flow_worker(calls.clone()));
        TwoServers {
            env,
            url,
            servers,
            calls,
            worker,
        }
    }
}

/// Polls `get` until step `name` of `run` shows it waits for `kind` (`sleep`, `event`,
/// `approval`, `flow`); the step's view.
pub(crate) async fn waiting(ax: &Client, run: &str, name: &str, kind: &str) -> Value {
    let what = format!("step {name} to be waiting ({kind})");
    crate::support::eventually(Duration::from_secs(20), &what, || async {
        let view = ax.flow("get", &json!({ "run": run })).await.ok()?;
        let s = view["steps"]
            .as_array()?
            .iter()
            .find(|s| s["name"] == name)?
            .clone();
        (s["waiting"]["kind"] == kind).then_some(s)
    })
    .await
}

/// Step states and outputs (JSON) of a run, by step name.
async fn steps(ax: &Client, run: &str) -> HashMap<String, (StepState, Value)> {
    let view = ax.flow("get", &json!({ "run": run })).await.unwrap();
    let mut out = HashMap::new();
    for s in view["steps"].as_array().unwrap() {
        let state: StepState = serde_json::from_value(s["state"].clone()).unwrap();
        let mut output = Value::Null;
        if let (Some(id), StepState::Succeeded) = (s["task_id"].as_str(), state) {
            if s["items"] == json!(1) {
                let done = ax.wait(id).await.unwrap();
                output = done
                    .output
                    .map(|o| o.json().unwrap())
                    .unwrap_or(Value::Null);
            }
        }
        out.insert(s["name"].as_str().unwrap().to_string(), (state, output));
    }
    out
}

fn max_calls(calls: &Calls) -> u32 {
    calls.lock().unwrap().values().copied().max().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_diamond_passes_outputs_by_step_name() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    let def = FlowDef::new("diamond")
        .step(step("a", "seed"))
        .step(StepDef::new("b", "q", TaskSpec::new("mul").json(&json!({"k": 2}))).needs(["a"]))
        .step(StepDef::new("c", "q", TaskSpec::new("mul").json(&json!({"k": 3}))).needs(["a"]))
        .step(step("d", "sum").needs(["b", "c"]));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("diamond", json!({"x": 5})).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    let s = steps(&env.ax, &run).await;
    assert_eq!(s["a"].1, json!(5));
    assert_eq!((s["b"].1.clone(), s["c"].1.clone()), (json!(10), json!(15)));
    assert_eq!(s["d"].1, json!(25), "d sums its parents' outputs");
    assert_eq!(calls.lock().unwrap().len(), 4);
    assert_eq!(max_calls(&calls), 1, "each step ran once");
    // Listing (the server opened the buckets while they were empty).
    let listed = env
        .ax
        .flow("list", &json!({"flow": "diamond"}))
        .await
        .unwrap();
    assert_eq!(listed[0]["run"], json!(run));
    assert_eq!(listed[0]["state"], "succeeded");
    let defs = env.ax.flow("defs", &json!({})).await.unwrap();
    assert_eq!(defs[0]["name"], "diamond");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_of_100_is_gathered_in_item_order() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    let def = FlowDef::new("fan")
        .step(step("list", "range"))
        .step(step("square", "square").needs(["list"]).for_each("list"))
        .step(step("total", "sum").needs(["square"]))
        .step(step("echo", "echo").needs(["square"]));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("fan", json!({"n": 100})).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    let s = steps(&env.ax, &run).await;
    let expected: i64 = (0..100).map(|i| i * i).sum();
    assert_eq!(s["total"].1, json!(expected));
    // The gather got the outputs as one list, in item order.
    let squares: Vec<i64> = (0..100).map(|i| i * i).collect();
    assert_eq!(s["echo"].1["square"], json!(squares));
    let (_, steps_now) = env.ax.flow_run(&run).await.unwrap().unwrap();
    assert_eq!(steps_now[1].items, Some(100));
    assert_eq!(calls.lock().unwrap().len(), 103);
    assert_eq!(max_calls(&calls), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_fast_cancels_what_has_not_started_and_runs_cleanup() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    // a fails (after 300 ms, so slow is surely running by then); b after a; slow runs
    // alongside (finishes); after_slow must never start; cleanup (one_failed after a)
    // runs and sees a's error.
    let def = FlowDef::new("ff")
        .step(step("a", "late_fail"))
        .step(step("b", "seed").needs(["a"]))
        .step(StepDef::new(
            "slow",
            "q",
            TaskSpec::new("slow").json(&json!({"ms": 1500})),
        ))
        .step(step("after_slow", "seed").needs(["slow"]))
        .step(
            step("cleanup", "note")
                .needs(["a"])
                .trigger(TriggerRule::OneFailed),
        )
        // 40 tasks of 1 s on a worker running 16 at a time: most are queued at the failure.
        .step(step("list", "range"))
        .step(
            StepDef::new(
                "many",
                "q",
                TaskSpec::new("slow").json(&json!({"ms": 1000})),
            )
            .needs(["list"])
            .for_each("list"),
        );
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("ff", json!({"n": 40})).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Failed);
    let reason = ended.reason.unwrap();
    assert!(reason.contains("step \"a\" failed: boom"), "{reason}");
    let s = steps(&env.ax, &run).await;
    assert_eq!(s["a"].0, StepState::Failed);
    assert_eq!(s["b"].0, StepState::UpstreamFailed);
    assert_eq!(s["slow"].0, StepState::Succeeded, "running steps finish");
    assert_eq!(s["after_slow"].0, StepState::Cancelled);
    let (_, st) = env.ax.flow_run(&run).await.unwrap().unwrap();
    assert_eq!(
        st[3].items, None,
        "after_slow was never started (no task submitted)"
    );
    assert_eq!(s["cleanup"].0, StepState::Succeeded);
    assert_eq!(
        s["cleanup"].1["a"]["class"], "boom",
        "cleanup sees the error"
    );
    let ran: Vec<String> = calls.lock().unwrap().keys().cloned().collect();
    assert!(
        !ran.iter()
            .any(|id| id.contains(".b.") || id.contains(".after_slow.")),
        "{ran:?}"
    );
    // The fan-out's queued tasks were cancelled; those running finished.
    assert_eq!(s["many"].0, StepState::Cancelled);
    let many = ran.iter().filter(|id| id.contains(".many.")).count();
    assert!((1..40).contains(&many), "{many} of 40 fan-out tasks ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continue_lets_other_branches_finish_and_all_done_runs_after_a_failure() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    let def = FlowDef::new("cont")
        .failure(FailurePolicy::Continue)
        .step(step("a", "fail"))
        .step(StepDef::new(
            "slow",
            "q",
            TaskSpec::new("slow").json(&json!({"ms": 300})),
        ))
        .step(step("after_slow", "seed").needs(["slow"]))
        .step(
            step("report", "note")
                .needs(["a", "after_slow"])
                .trigger(TriggerRule::AllDone),
        )
        .step(step("never", "seed").needs(["a"]))
        .step(
            step("tidy", "seed")
                .needs(["slow"])
                .trigger(TriggerRule::OneFailed),
        );
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("cont", json!({"x": 1})).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Failed);
    let s = steps(&env.ax, &run).await;
    assert_eq!(
        s["after_slow"].0,
        StepState::Succeeded,
        "the other branch went on"
    );
    assert_eq!(s["report"].0, StepState::Succeeded);
    assert_eq!(s["report"].1["a"]["state"], "failed");
    assert_eq!(s["never"].0, StepState::UpstreamFailed);
    assert_eq!(s["tidy"].0, StepState::Skipped);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_definitions_are_refused_by_field_and_bad_runs_end_with_a_reason() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    let cycle = FlowDef::new("cyc")
        .step(step("a", "seed").needs(["c"]))
        .step(step("b", "seed").needs(["a"]))
        .step(step("c", "seed").needs(["b"]));
    let e = env.ax.put_flow(&cycle).await.unwrap_err();
    let ax_sdk::ClientError::Refused(wire) = &e else {
        panic!("{e}")
    };
    assert_eq!(wire.code.as_str(), "invalid_field");
    assert!(wire.message.contains("cycle: "), "{}", wire.message);
    let unknown = FlowDef::new("unk").step(step("a", "seed").needs(["nope"]));
    let e = env.ax.put_flow(&unknown).await.unwrap_err();
    let ax_sdk::ClientError::Refused(wire) = &e else {
        panic!("{e}")
    };
    assert_eq!(wire.field.as_deref(), Some("steps[0].needs"));
    // A step on a queue no server declared is refused at put, not when a run reaches it.
    let undeclared = FlowDef::new("undeclared")
        .step(step("a", "seed"))
        .step(StepDef::new("b", "nowhere", TaskSpec::new("seed")).needs(["a"]));
    let e = env.ax.put_flow(&undeclared).await.unwrap_err();
    let ax_sdk::ClientError::Refused(wire) = &e else {
        panic!("{e}")
    };
    assert_eq!(
        wire.field.as_deref(),
        Some("steps[1].task.queue"),
        "{wire:?}"
    );
    let e = env
        .ax
        .run_flow("no-such-flow", json!({}))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    // An output over the cap fails its step, and the run ends failed: never stuck.
    let big = FlowDef::new("big")
        .step(step("a", "big"))
        .step(step("b", "seed").needs(["a"]));
    env.ax.put_flow(&big).await.unwrap();
    let run = env.ax.run_flow("big", json!({})).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Failed);
    assert!(
        ended
            .reason
            .as_deref()
            .unwrap()
            .contains("output_too_large"),
        "{:?}",
        ended.reason
    );
    // A fan-out over something that is not a list fails the step with a clear class.
    let notlist = FlowDef::new("notlist")
        .step(step("a", "seed"))
        .step(step("b", "square").needs(["a"]).for_each("a"));
    env.ax.put_flow(&notlist).await.unwrap();
    let run = env.ax.run_flow("notlist", json!({"x": 3})).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Failed);
    assert!(
        ended.reason.as_deref().unwrap().contains("bad_fan_out"),
        "{:?}",
        ended.reason
    );
    // An input that fits a request but not the run record (definition + input) is
    // refused by field, never answered "unavailable" (which a client retries forever).
    let max = env.client.server_info().max_payload;
    let input = json!("x".repeat(max - 200));
    let e = env.ax.run_flow("notlist", input).await.unwrap_err();
    let ax_sdk::ClientError::Refused(wire) = &e else {
        panic!("{e}")
    };
    assert_eq!(
        (wire.code.as_str(), wire.field.as_deref()),
        ("invalid_field", Some("input")),
        "{wire:?}"
    );
    assert_eq!(e.kind(), ErrorKind::Invalid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reruns_restart_failed_steps_keep_outputs_and_whole_reruns_link_back() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    // a ok → b flaky (fails) → c after b; d = all_done after b (runs, succeeds).
    let def = FlowDef::new("re")
        .step(step("a", "seed"))
        .step(step("b", "flaky").needs(["a"]))
        .step(step("c", "seed").needs(["b"]))
        .step(step("d", "note").needs(["b"]).trigger(TriggerRule::AllDone));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("re", json!({"x": 1})).await.unwrap();
    assert_eq!(finish(&env.ax, &run).await.state, RunState::Failed);
    // Failed only: b (failed) and c (upstream_failed) again; a and d keep their results.
    let same = env
        .ax
        .rerun_flow(&run, RerunMode::Failed, None)
        .await
        .unwrap();
    assert_eq!(same, run);
    let again = finish(&env.ax, &run).await;
    assert_eq!(again.state, RunState::Failed, "the data is still bad");
    assert_eq!(again.reruns, 1);
    let (_, st) = env.ax.flow_run(&run).await.unwrap().unwrap();
    assert_eq!(
        (st[0].epoch, st[1].epoch, st[2].epoch, st[3].epoch),
        (0, 1, 1, 0)
    );
    // Failed + downstream: d runs again too.
    env.ax
        .rerun_flow(&run, RerunMode::FailedAndDownstream, None)
        .await
        .unwrap();
    finish(&env.ax, &run).await;
    let (_, st) = env.ax.flow_run(&run).await.unwrap().unwrap();
    assert_eq!((st[0].epoch, st[1].epoch, st[3].epoch), (0, 2, 1));
    let a_calls = calls
        .lock()
        .unwrap()
        .iter()
        .filter(|(id, _)| id.contains(&format!("{run}.a.")))
        .count();
    assert_eq!(a_calls, 1, "a succeeded once and was never run again");
    // The whole run, with fixed data, as a new run linked to the first.
    let new = env
        .ax
        .rerun_flow(&run, RerunMode::Whole, Some(json!({"x": 1, "fixed": true})))
        .await
        .unwrap();
    assert_ne!(new, run);
    let ended = finish(&env.ax, &new).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    assert_eq!(ended.rerun_of.as_deref(), Some(run.as_str()));
    // A running run cannot be re-run from its failed steps; nothing succeeded → refused.
    let e = env
        .ax
        .rerun_flow(&new, RerunMode::Failed, None)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
    assert_eq!(max_calls(&calls), 1, "no task ran twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_run_ends_at_once_and_its_queued_tasks_never_run() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    // No worker yet: the fan-out's tasks sit in the queue.
    let def = FlowDef::new("cx")
        .step(step("list", "range"))
        .step(step("each", "square").needs(["list"]).for_each("list"))
        .step(step("after", "seed").needs(["each"]));
    env.ax.put_flow(&def).await.unwrap();
    let (stop, w) = env.spawn_worker(flow_worker(calls.clone()));
    let run = env.ax.run_flow("cx", json!({"n": 50})).await.unwrap();
    // Wait until list ran, then stop the worker so `each` stays queued.
    crate::support::eventually(Duration::from_secs(15), "list to succeed", || {
        let ax = env.ax.clone();
        let run = run.clone();
        async move {
            let (_, st) = ax.flow_run(&run).await.ok()??;
            (st[1].state == StepState::Running).then_some(())
        }
    })
    .await;
    stop.cancel();
    w.await.unwrap();
    let before = calls.lock().unwrap().len();
    env.ax.cancel_flow(&run).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Cancelled);
    let (_, st) = env.ax.flow_run(&run).await.unwrap().unwrap();
    assert!(st
        .iter()
        .all(|s| s.state != StepState::Waiting && s.state != StepState::Running));
    // A worker now finds the queued tasks cancelled and does not run them.
    let (_stop2, _w2) = env.spawn_worker(flow_worker(calls.clone()));
    let each0 = ax_sdk::flow::model::step_task_id("q", &run, "each", 0, 49);
    let rec = env.record(&each0).await;
    assert_eq!(rec.state, ax_sdk::TaskState::Cancelled);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let ran_each = calls
        .lock()
        .unwrap()
        .keys()
        .filter(|id| id.contains(".each."))
        .count();
    assert!(
        ran_each <= before,
        "cancelled tasks ran: {ran_each} > {before}"
    );
}

/// The flow engine lives in `ax server` processes; killing the leader mid-flow loses no
/// step and runs none twice (handler invocations counted per task id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leading_server_mid_flow_loses_nothing_and_runs_nothing_twice() {
    let TwoServers {
        env,
        url,
        mut servers,
        calls,
        worker: _worker,
    } = TwoServers::start().await;
    // A chain of 30 slow-ish steps plus a fan-out of 40: long enough to kill mid-way.
    let mut def = FlowDef::new("chain").step(step("list", "range"));
    def = def.step(step("each", "slow").needs(["list"]).for_each("list"));
    let mut prev = "each".to_string();
    for i in 0..30 {
        let name = format!("s{i}");
        def = def.step(
            StepDef::new(&name, "q", TaskSpec::new("slow").json(&json!({"ms": 30})))
                .needs([prev.clone()]),
        );
        prev = name;
    }
    env.ax.put_flow(&def).await.unwrap();
    let runs: Vec<String> =
        futures::future::join_all((0..3).map(|_| env.ax.run_flow("chain", json!({"n": 40}))))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
    for round in 0..4 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        if round == 0 {
            let run = env.ax.flow_run(&runs[0]).await.unwrap().unwrap().0;
            assert_eq!(
                run.state,
                RunState::Running,
                "the first kill lands mid-flow"
            );
        }
        let victim = round % 2;
        servers[victim].kill9();
        tokio::time::sleep(Duration::from_millis(300)).await;
        servers[victim] = AxProc::spawn(&url, &SERVER_ARGS);
    }
    for run in &runs {
        let ended = finish(&env.ax, run).await;
        assert_eq!(
            ended.state,
            RunState::Succeeded,
            "{run}: {:?}",
            ended.reason
        );
    }
    let calls = calls.lock().unwrap();
    assert_eq!(calls.len(), 3 * (1 + 40 + 30), "every step task ran");
    let twice: Vec<_> = calls.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "tasks run twice: {twice:?}");
    drop(servers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_starts_flow_runs_and_counts_a_running_run_as_its_fire_s_work() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    let def = slow_chain("nightly");
    env.ax.put_flow(&def).await.unwrap();
    let missing = json!({"name": "t-missing", "kind": "interval", "every_ms": 3_600_000,
                         "flows": [{"flow": "nope"}]});
    let e = env.ax.trigger("put", &missing).await.unwrap_err();
    let ax_sdk::ClientError::Refused(wire) = &e else {
        panic!("{e}")
    };
    assert_eq!(wire.field.as_deref(), Some("flows[0].flow"), "{wire:?}");
    let trigger = json!({"name": "nightly", "kind": "interval", "every_ms": 3_600_000,
                         "overlap": "skip", "flows": [{"flow": "nightly", "input": {"x": 7}}]});
    env.ax.trigger("put", &trigger).await.unwrap();
    let fired = env
        .ax
        .trigger("run", &json!({"name": "nightly"}))
        .await
        .unwrap();
    let id = fired["task_ids"][0].as_str().unwrap().to_string();
    let run = id.strip_prefix("flow:").expect("a flow run").to_string();
    // While the run runs, it is the fire's work: a second manual run is refused.
    let e = env
        .ax
        .trigger("run", &json!({"name": "nightly"}))
        .await
        .unwrap_err();
    let ax_sdk::ClientError::Refused(wire) = &e else {
        panic!("{e}")
    };
    assert_eq!(wire.code.as_str(), "running", "{wire:?}");
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    assert_eq!(ended.trigger.as_deref(), Some("nightly"));
    assert_eq!(ended.trigger_source.as_deref(), Some("manual"));
    assert_eq!(steps(&env.ax, &run).await["b"].1, json!(7));
    // The API shows the lineage the run records (get and list), and who leads the engine.
    let view = env.ax.flow("get", &json!({ "run": run })).await.unwrap();
    assert_eq!(
        (view["trigger"].as_str(), view["trigger_source"].as_str()),
        (Some("nightly"), Some("manual")),
        "{view}"
    );
    assert!(view["scheduled_at_ms"].is_u64(), "{view}");
    let list = env
        .ax
        .flow("list", &json!({"flow": "nightly"}))
        .await
        .unwrap();
    assert_eq!(list[0]["trigger"], "nightly", "{list}");
    let lead = env.ax.flow("leader", &json!({})).await.unwrap();
    assert!(
        lead["leader"].as_str().is_some_and(|l| !l.is_empty()),
        "{lead}"
    );
    // Once it has ended, the trigger runs again (a new run).
    let again = env
        .ax
        .trigger("run", &json!({"name": "nightly"}))
        .await
        .unwrap();
    assert_ne!(again["task_ids"][0].as_str().unwrap(), id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_takes_an_input_from_a_file_or_stdin_and_prints_json() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    env.ax
        .put_flow(&FlowDef::new("echo").step(step("a", "seed")))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Over 128 KiB: more than a command line carries.
    let big = json!({"blob": "y".repeat(200_000)});
    let file = dir.path().join("input.json");
    std::fs::write(&file, big.to_string()).unwrap();
    let url = env.nats.url();
    let ax = |args: Vec<String>, stdin: Option<String>| {
        let url = url.clone();
        async move {
            let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_ax"));
            cmd.args(["--url", &url])
                .args(&args)
                .env("RUST_BACKTRACE", "1");
            cmd.stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            let mut child = cmd.spawn().unwrap();
            let mut pipe = child.stdin.take().unwrap();
            if let Some(text) = stdin {
                use tokio::io::AsyncWriteExt;
                pipe.write_all(text.as_bytes()).await.unwrap();
            }
            drop(pipe);
            child.wait_with_output().await.unwrap()
        }
    };
    let at_file = format!("@{}", file.display());
    for (input, stdin) in [(at_file.as_str(), None), ("-", Some(big.to_string()))] {
        let out = ax(
            ["flow", "run", "echo", "--input", input]
                .map(String::from)
                .to_vec(),
            stdin,
        )
        .await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let run = String::from_utf8(out.stdout).unwrap().trim().to_string();
        let ended = finish(&env.ax, &run).await;
        assert_eq!(ended.input, big);
    }
    let bad = ax(
        ["flow", "run", "echo", "--input", "@/no/such/file"]
            .map(String::from)
            .to_vec(),
        None,
    )
    .await;
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("/no/such/file") && !err.contains("stack backtrace"),
        "{err}"
    );
    // -o json on list, defs and get: documents a program can read.
    for args in [
        vec!["flow", "list"],
        vec!["flow", "defs"],
        vec!["flow", "leader"],
    ] {
        let mut all = vec!["-o", "json"];
        all.extend(args.clone());
        let out = ax(all.into_iter().map(String::from).collect(), None).await;
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{args:?} printed no JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        });
        assert!(!v.is_null(), "{args:?}");
    }
}

/// A step task's retry starts without a `running` write; a fail-fast cancel in its first
/// second signals the worker holding it (ops::holder) instead of leaving its handler to
/// run on beside the `cancelled` record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_fast_stops_a_step_retry_that_started_unwritten() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    let env = Env::start(Env::server()).await;
    let retry_started = Arc::new(AtomicBool::new(false));
    let finished = Arc::new(AtomicU32::new(0));
    let retried_id: Arc<Mutex<Option<String>>> = Arc::default();
    let (started, done, seen) = (retry_started.clone(), finished.clone(), retried_id.clone());
    let worker = Worker::builder("q")
        .concurrency(4)
        .handler(move |task: Task| {
            let (started, done, seen) = (started.clone(), done.clone(), seen.clone());
            async move {
                match task.name.as_str() {
                    "flaky_slow" if task.attempt == 1 => {
                        Err(TaskError::new("transient", "fails once"))
                    }
                    "flaky_slow" => {
                        *seen.lock().unwrap() = Some(task.id.clone());
                        started.store(true, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        done.fetch_add(1, Ordering::SeqCst);
                        Ok(Output::json(&1)?)
                    }
                    _ => {
                        // Fails for good while the retry is in its first second.
                        for _ in 0..400 {
                            if started.load(Ordering::SeqCst) {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(25)).await;
                        }
                        Err(TaskError::permanent("boom", "fails while the retry runs"))
                    }
                }
            }
        })
        .build()
        .unwrap();
    let (_stop, _w) = env.spawn_worker(worker);
    let quick = Duration::from_millis(100);
    let def = FlowDef::new("ffr")
        .step(StepDef::new(
            "r",
            "q",
            TaskSpec::new("flaky_slow").backoff(quick, quick, 0.0),
        ))
        .step(StepDef::new("f", "q", TaskSpec::new("fail_now")));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("ffr", json!({})).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Failed);
    assert!(retry_started.load(Ordering::SeqCst), "the retry started");
    assert_eq!(steps(&env.ax, &run).await["r"].0, StepState::Cancelled);
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "the retry's handler was stopped"
    );
    let id = retried_id
        .lock()
        .unwrap()
        .clone()
        .expect("the retry's task id");
    let rec = env.record(&id).await;
    assert_eq!(
        (rec.state, rec.attempt),
        (ax_sdk::TaskState::Cancelled, 2),
        "the started retry is counted"
    );
}
