//! Child flows: a step that runs another flow and ends with it — its output the child's
//! leaf outputs by name, a fan-out running one child per item, a failed child failing
//! the step, the parent's cancel and the step's timeout cancelling the child, nesting
//! bounded, and every child run once through killed servers.

use crate::flow_events::endings;
use crate::flows::{finish, flow_worker, step, waiting, Calls, TwoServers, SERVER_ARGS};
use crate::procs::{self, AxProc};
use crate::support::Env;
use ax_sdk::flow::model::{child_run_id, step_task_id};
use ax_sdk::flow::{ChildFlowDef, FlowDef, OnTimeout, RunState, StepDef, StepState};
use ax_sdk::{TaskSpec, TaskState};
use serde_json::{json, Value};
use std::time::Duration;

/// How deep child runs nest (docs/PROTOCOL.md §6, "Child flows").
const MAX_FLOW_DEPTH: u32 = 8;

/// Child flow `times10`: `s1` takes input.x, `s2` (its leaf) multiplies it by 10.
fn times10() -> FlowDef {
    FlowDef::new("times10")
        .step(step("s1", "seed"))
        .step(StepDef::new("s2", "q", TaskSpec::new("mul").json(&json!({"k": 10}))).needs(["s1"]))
}

/// Child flow `slowkid`: one step that takes `ms` milliseconds.
fn slowkid(ms: u64) -> FlowDef {
    FlowDef::new("slowkid").step(StepDef::new(
        "nap",
        "q",
        TaskSpec::new("slow").json(&json!({"ms": ms})),
    ))
}

fn child(flow: &str, input: Value) -> ChildFlowDef {
    ChildFlowDef {
        input: Some(input),
        ..ChildFlowDef::new(flow)
    }
}

/// The output of `run`'s step `name` (its one task's).
async fn output(ax: &ax_sdk::Client, run: &str, name: &str) -> Value {
    let view = ax.flow("get", &json!({ "run": run })).await.unwrap();
    let s = view["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == name)
        .unwrap();
    let done = ax.wait(s["task_id"].as_str().unwrap()).await.unwrap();
    done.output
        .map(|o| o.json().unwrap())
        .unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_s_leaf_outputs_are_its_step_s_output_and_a_fan_out_runs_one_child_per_item() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    env.ax.put_flow(&times10()).await.unwrap();
    env.ax.put_flow(&slowkid(1500)).await.unwrap();
    let def = FlowDef::new("parent")
        .step(step("a", "range"))
        .step(StepDef::child_flow(
            "one",
            "q",
            child("times10", json!({"x": "$input.n"})),
        ))
        .step(
            StepDef::child_flow("kids", "q", child("times10", json!({"x": "$item"})))
                .needs(["a"])
                .for_each("a"),
        )
        .step(step("total", "echo").needs(["one", "kids"]));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("parent", json!({"n": 3})).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    // The next step sees each child's leaf by name: one object, or a list in item order.
    assert_eq!(
        output(&env.ax, &run, "total").await,
        json!({"one": {"s2": 30}, "kids": [{"s2": 0}, {"s2": 10}, {"s2": 20}]})
    );
    // Each child is a run of its own that names its parent step, ran once.
    let view = env.ax.flow("get", &json!({ "run": run })).await.unwrap();
    let kids = &view["steps"][2];
    assert_eq!(
        (kids["items"].clone(), kids["task"].clone()),
        (json!(3), json!("ax.child_flow"))
    );
    for k in 0..3 {
        let task = step_task_id("q", &run, "kids", 0, k);
        let (child, steps) = env
            .ax
            .flow_run(&child_run_id(&task))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(child.state, RunState::Succeeded);
        assert_eq!(
            (child.input.clone(), child.flow.as_str()),
            (json!({"x": k}), "times10")
        );
        let parent = child.parent.unwrap();
        assert_eq!(
            (
                parent.run.as_str(),
                parent.step.as_str(),
                parent.task.as_str(),
                parent.depth
            ),
            (run.as_str(), "kids", task.as_str(), 1)
        );
        assert!(steps.iter().all(|s| s.state == StepState::Succeeded));
        assert_eq!(
            endings(&env.ax, &task).await,
            1,
            "the child's wait task ended once"
        );
    }
    // 1 range + 4 children × 2 steps + 1 echo, each once; no wait task ran on a worker.
    let seen = calls.lock().unwrap().clone();
    assert_eq!(seen.len(), 10, "{seen:?}");
    assert!(seen.values().all(|n| *n == 1), "a task ran twice: {seen:?}");
    assert!(
        seen.keys()
            .all(|id| !id.contains(".one.") && !id.contains(".kids.")),
        "{seen:?}"
    );

    // While a child runs, the step shows it waiting for its runs, and the child its parent.
    let def = FlowDef::new("waits_for_kid").step(StepDef::child_flow(
        "kid",
        "q",
        ChildFlowDef::new("slowkid"),
    ));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("waits_for_kid", json!(null)).await.unwrap();
    let kid = waiting(&env.ax, &run, "kid", "flow").await;
    let task = kid["task_id"].as_str().unwrap();
    assert_eq!(kid["waiting"]["runs"], json!([child_run_id(task)]), "{kid}");
    assert_eq!(kid["waiting"]["flow"], "slowkid");
    // The step is written beside its wait task's submit; the child starts once that is
    // stored: a moment after the step shows it.
    let child_view =
        crate::support::eventually(Duration::from_secs(10), "the child run", || async {
            env.ax
                .flow("get", &json!({ "run": child_run_id(task) }))
                .await
                .ok()
        })
        .await;
    assert_eq!(child_view["parent"]["run"], json!(run), "{child_view}");
    // `ax flow get` says what the step waits for, and the child whose child it is.
    let url = env.nats.url();
    let get = |id: String| {
        let url = url.clone();
        async move {
            let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_ax"))
                .args(["flow", "get", &id])
                .env("NATS_URL", url)
                .output()
                .await
                .unwrap();
            String::from_utf8_lossy(&out.stdout).to_string()
        }
    };
    let text = get(run.clone()).await;
    let want = format!("for flow slowkid (1 run: {})", child_run_id(task));
    assert!(text.contains(&want), "{text}");
    let text = get(child_run_id(task)).await;
    assert!(
        text.contains(&format!("child of run {run} (step kid)")),
        "{text}"
    );
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    assert_eq!(output(&env.ax, &run, "kid").await, json!({"nap": 1}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_child_fails_its_step_and_a_cancel_or_a_timeout_cancels_the_child() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    env.ax
        .put_flow(&FlowDef::new("bad").step(step("boom", "fail")))
        .await
        .unwrap();
    env.ax.put_flow(&slowkid(60_000)).await.unwrap();
    let def = FlowDef::new("fails")
        .step(StepDef::child_flow("kid", "q", ChildFlowDef::new("bad")))
        .step(
            step("after", "note")
                .needs(["kid"])
                .trigger(ax_sdk::flow::TriggerRule::AllDone),
        );
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("fails", json!(null)).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Failed);
    let (_, steps) = env.ax.flow_run(&run).await.unwrap().unwrap();
    let error = steps[0].error.clone().unwrap();
    assert_eq!(
        (steps[0].state, error.class.as_str()),
        (StepState::Failed, "child_failed"),
        "{error:?}"
    );
    assert!(
        error.message.contains("boom"),
        "the child's reason: {error:?}"
    );
    assert_eq!(
        output(&env.ax, &run, "after").await["kid"]["class"],
        "child_failed"
    );

    // The parent's cancel cancels its running child.
    let def = FlowDef::new("cancelled").step(StepDef::child_flow(
        "kid",
        "q",
        ChildFlowDef::new("slowkid"),
    ));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("cancelled", json!(null)).await.unwrap();
    let kid = waiting(&env.ax, &run, "kid", "flow").await;
    let child = child_run_id(kid["task_id"].as_str().unwrap());
    env.ax.flow("cancel", &json!({ "run": run })).await.unwrap();
    assert_eq!(finish(&env.ax, &run).await.state, RunState::Cancelled);
    let ended = finish(&env.ax, &child).await;
    assert_eq!(
        ended.state,
        RunState::Cancelled,
        "the child is cancelled with its parent"
    );

    // A timeout that continues passes null on and cancels the child; one that fails
    // fails the step, class child_timed_out.
    for (on_timeout, state) in [
        (OnTimeout::Continue, RunState::Succeeded),
        (OnTimeout::Fail, RunState::Failed),
    ] {
        let name = format!("timed_{}", state.as_str());
        let kid = ChildFlowDef {
            timeout_ms: Some(800),
            on_timeout,
            ..ChildFlowDef::new("slowkid")
        };
        let def = FlowDef::new(&name)
            .step(StepDef::child_flow("kid", "q", kid))
            .step(step("after", "echo").needs(["kid"]));
        env.ax.put_flow(&def).await.unwrap();
        let run = env.ax.run_flow(&name, json!(null)).await.unwrap();
        let ended = finish(&env.ax, &run).await;
        assert_eq!(ended.state, state, "{:?}", ended.reason);
        let (_, steps) = env.ax.flow_run(&run).await.unwrap().unwrap();
        let task = step_task_id("q", &run, "kid", 0, 0);
        if state == RunState::Succeeded {
            assert_eq!(output(&env.ax, &run, "after").await, json!({"kid": null}));
        } else {
            assert_eq!(steps[0].error.as_ref().unwrap().class, "child_timed_out");
        }
        let child = finish(&env.ax, &child_run_id(&task)).await;
        assert_eq!(
            child.state,
            RunState::Cancelled,
            "{name}: the timed-out child is cancelled"
        );
    }

    // An unknown flow fails the step; a flow that starts itself ends at the depth limit.
    let def =
        FlowDef::new("orphan").step(StepDef::child_flow("kid", "q", ChildFlowDef::new("nope")));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("orphan", json!(null)).await.unwrap();
    assert_eq!(finish(&env.ax, &run).await.state, RunState::Failed);
    let (_, steps) = env.ax.flow_run(&run).await.unwrap().unwrap();
    assert_eq!(steps[0].error.as_ref().unwrap().class, "unknown_flow");
    let def = FlowDef::new("forever").step(StepDef::child_flow(
        "again",
        "q",
        ChildFlowDef::new("forever"),
    ));
    env.ax.put_flow(&def).await.unwrap();
    let mut run = env.ax.run_flow("forever", json!(null)).await.unwrap();
    assert_eq!(finish(&env.ax, &run).await.state, RunState::Failed);
    for depth in 0..=MAX_FLOW_DEPTH {
        let (r, steps) = env.ax.flow_run(&run).await.unwrap().unwrap();
        assert_eq!(r.parent.map_or(0, |p| p.depth), depth);
        let class = &steps[0].error.as_ref().unwrap().class;
        let want = if depth == MAX_FLOW_DEPTH {
            "too_deep"
        } else {
            "child_failed"
        };
        assert_eq!(class, want, "depth {depth}");
        run = child_run_id(&step_task_id("q", &run, "again", 0, 0));
    }
    assert!(
        env.ax.flow_run(&run).await.unwrap().is_none(),
        "no run below the limit"
    );
    assert!(
        calls.lock().unwrap().keys().all(|id| !id.contains(".kid.")),
        "no wait task ran on a worker"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_runs_outlive_killed_servers_and_each_runs_once() {
    let TwoServers {
        env,
        url,
        mut servers,
        calls,
        worker: _worker,
    } = TwoServers::start().await;
    let kid = FlowDef::new("kid")
        .step(StepDef::new(
            "nap",
            "q",
            TaskSpec::new("slow").json(&json!({"ms": 400})),
        ))
        .step(step("s1", "seed").needs(["nap"]));
    env.ax.put_flow(&kid).await.unwrap();
    let def = FlowDef::new("many")
        .step(step("a", "range"))
        .step(
            StepDef::child_flow("kids", "q", child("kid", json!({"x": "$item"})))
                .needs(["a"])
                .for_each("a"),
        )
        .step(step("total", "sum").needs(["kids"]));
    env.ax.put_flow(&def).await.unwrap();
    let runs: Vec<String> =
        futures::future::join_all((0..4).map(|_| env.ax.run_flow("many", json!({"n": 12}))))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
    // Servers killed while children start, run and end, one at a time and both at once.
    for round in 0..4 {
        tokio::time::sleep(Duration::from_millis(300 + 150 * round)).await;
        let k = (round % 2) as usize;
        servers[k].kill9();
        if round == 3 {
            servers[1 - k].kill9();
            tokio::time::sleep(Duration::from_millis(500)).await;
            servers[1 - k] = AxProc::spawn(&url, &SERVER_ARGS);
        }
        servers[k] = AxProc::spawn(&url, &SERVER_ARGS);
    }
    for run in &runs {
        let ended = finish(&env.ax, run).await;
        assert_eq!(
            ended.state,
            RunState::Succeeded,
            "{run}: {:?}",
            ended.reason
        );
        // sum of {"s1": x} objects counts 0: the children's outputs reached it as objects.
        for k in 0..12 {
            let task = step_task_id("q", run, "kids", 0, k);
            assert_eq!(
                endings(&env.ax, &task).await,
                1,
                "{run}: child {k}'s wait ended once"
            );
            let (child, _) = env
                .ax
                .flow_run(&child_run_id(&task))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(child.state, RunState::Succeeded, "{run}: child {k}");
        }
    }
    let calls = calls.lock().unwrap();
    // Per run: range, total, and 12 children × 2 steps.
    assert_eq!(calls.len(), 4 * 26, "{calls:?}");
    assert!(
        calls.values().all(|n| *n == 1),
        "a task ran twice: {calls:?}"
    );
    drop(servers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_aborted_between_the_wait_task_and_the_child_start_starts_it_on_reload() {
    let env = Env::nats_only().await;
    let url = env.nats.url();
    let args = ["server", "--queue", "q"];
    let mut aborting = AxProc::spawn_env(&url, &args, &[("AX_TEST_ABORT_AFTER_CHILD_SUBMIT", "1")]);
    procs::wait_ready(&env.client).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    env.ax.put_flow(&times10()).await.unwrap();
    let def = FlowDef::new("one_kid").step(StepDef::child_flow(
        "kid",
        "q",
        child("times10", json!({"x": 4})),
    ));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("one_kid", json!(null)).await.unwrap();
    let aborted = aborting.exited_within(Duration::from_secs(20)).await;
    assert!(
        aborted.is_some_and(|s| !s.success()),
        "the abort never came"
    );
    // The wait task is stored; its child is not.
    let task = step_task_id("q", &run, "kid", 0, 0);
    assert_eq!(env.record(&task).await.state, TaskState::Scheduled);
    assert!(env
        .ax
        .flow_run(&child_run_id(&task))
        .await
        .unwrap()
        .is_none());
    let _next = AxProc::spawn(&url, &args);
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    assert_eq!(output(&env.ax, &run, "kid").await, json!({"s2": 40}));
    assert_eq!(endings(&env.ax, &task).await, 1);
}

/// What a re-run does to a failed child and its parent (docs/PROTOCOL.md §6, "Child
/// flows"): the child re-run in place runs again on its own (its parent's step ended with
/// the child's first end and stays failed); the parent re-run (mode `failed`) starts a new
/// child run for the step's new epoch, from its first step, and ends with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_re_run_runs_on_its_own_and_the_parent_s_re_run_starts_a_new_child() {
    use ax_sdk::flow::RerunMode;
    use ax_sdk::worker::{Task, TaskError, Worker};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let env = Env::start(Env::server()).await;
    // `mend` fails while `broken`; every other task succeeds with 1.
    let broken = Arc::new(AtomicBool::new(true));
    let calls = Calls::default();
    let worker = Worker::builder("q")
        .concurrency(8)
        .handler({
            let (broken, calls) = (broken.clone(), calls.clone());
            move |task: Task| {
                let (broken, calls) = (broken.clone(), calls.clone());
                async move {
                    *calls.lock().unwrap().entry(task.id.clone()).or_default() += 1;
                    if task.name == "mend" && broken.load(Ordering::SeqCst) {
                        return Err(TaskError::permanent("broken", "not mended yet"));
                    }
                    ax_sdk::Output::json(&1)
                }
            }
        })
        .build()
        .unwrap();
    let (_stop, _w) = env.spawn_worker(worker);
    env.ax
        .put_flow(&FlowDef::new("kidflow").step(step("k", "mend")))
        .await
        .unwrap();
    let def = FlowDef::new("parent")
        .step(StepDef::child_flow(
            "kid",
            "q",
            ChildFlowDef::new("kidflow"),
        ))
        .step(step("after", "done").needs(["kid"]));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("parent", json!(null)).await.unwrap();
    assert_eq!(finish(&env.ax, &run).await.state, RunState::Failed);
    let first_child = child_run_id(&step_task_id("q", &run, "kid", 0, 0));
    assert_eq!(finish(&env.ax, &first_child).await.state, RunState::Failed);

    // The child re-run in place succeeds; its parent does not move.
    broken.store(false, Ordering::SeqCst);
    env.ax
        .rerun_flow(&first_child, RerunMode::Failed, None)
        .await
        .unwrap();
    let mended =
        crate::support::eventually(Duration::from_secs(30), "the child re-run", || async {
            let run = env.ax.flow_run(&first_child).await.ok()??.0;
            (run.state == RunState::Succeeded).then_some(run)
        })
        .await;
    assert_eq!(mended.reruns, 1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (parent, steps) = env.ax.flow_run(&run).await.unwrap().unwrap();
    assert_eq!(
        (parent.state, parent.reruns, steps[0].state, steps[0].epoch),
        (RunState::Failed, 0, StepState::Failed, 0),
        "the parent's step ended with the child's first end"
    );
    let after = |epoch: u32| step_task_id("q", &run, "after", epoch, 0);
    assert!(!calls.lock().unwrap().contains_key(&after(0)));

    // The parent re-run starts a new child for the step's epoch 1, which runs `k` anew.
    env.ax
        .rerun_flow(&run, RerunMode::Failed, None)
        .await
        .unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    let second_child = child_run_id(&step_task_id("q", &run, "kid", 1, 0));
    assert_ne!(second_child, first_child);
    assert_eq!(
        finish(&env.ax, &second_child).await.state,
        RunState::Succeeded
    );
    let k = step_task_id("q", &second_child, "k", 0, 0);
    assert_eq!(
        calls.lock().unwrap().get(&k),
        Some(&1),
        "the new child ran k"
    );
    assert_eq!(output(&env.ax, &run, "kid").await, json!({"k": 1}));
}
