//! Flows that wait for an approval: the step's token is announced, whoever presents it
//! approves (with a payload) or rejects once, a timeout follows its policy, and the
//! approval outlives every ax server.

use crate::browser::http;
use crate::flow_events::endings;
use crate::flows::{finish, flow_worker, step, Calls, TwoServers, SERVER_ARGS};
use crate::procs::{self, free_port, AxProc};
use crate::support::{eventually, Env};
use ax_core::event::WaitRegistration;
use ax_core::protocol::ErrorCode;
use ax_sdk::flow::{
    ApprovalCompletion, ApprovalDef, Decision, FlowDef, OnTimeout, RunState, StepDef, StepState,
};
use ax_sdk::TaskState;
use futures::StreamExt;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::Duration;

fn approval(timeout: Duration, on_timeout: OnTimeout) -> ApprovalDef {
    ApprovalDef {
        message: Some("ship it?".into()),
        timeout_ms: Some(timeout.as_millis() as u64),
        on_timeout,
        queue: None,
    }
}

/// `a` → approval `ok` → `b` (an echo of its parents' outputs).
fn gated(name: &str, timeout: Duration, on_timeout: OnTimeout) -> FlowDef {
    FlowDef::new(name)
        .step(step("a", "seed"))
        .step(StepDef::approval("ok", "q", approval(timeout, on_timeout)).needs(["a"]))
        .step(step("b", "echo").needs(["ok"]))
}

/// The announcements of approvals (`ax.events.approval.requested`), by run.
struct Announcements(async_nats::Subscriber, HashMap<String, Value>);

impl Announcements {
    async fn follow(client: &async_nats::Client) -> Announcements {
        let sub = client
            .subscribe("ax.events.approval.requested")
            .await
            .unwrap();
        Announcements(sub, HashMap::new())
    }

    async fn of(&mut self, run: &str) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(a) = self.1.get(run) {
                return a.clone();
            }
            let msg = tokio::time::timeout_at(deadline, self.0.next())
                .await
                .unwrap_or_else(|_| panic!("no announcement for run {run}"))
                .unwrap();
            let a: Value = serde_json::from_slice(&msg.payload).unwrap();
            self.1.insert(a["run"].as_str().unwrap().to_string(), a);
        }
    }
}

async fn echoed(ax: &ax_sdk::Client, run: &str) -> Value {
    let view = ax.flow("get", &json!({ "run": run })).await.unwrap();
    let id = view["steps"][2]["task_id"].as_str().unwrap().to_string();
    ax.wait(&id).await.unwrap().output.unwrap().json().unwrap()
}

fn by_token(token: &str, decision: Decision) -> ApprovalCompletion {
    ApprovalCompletion {
        token: Some(token.into()),
        task: None,
        decision,
        payload: None,
        reason: None,
    }
}

fn code(e: ax_sdk::ClientError) -> ErrorCode {
    match e {
        ax_sdk::ClientError::Refused(w) => w.code,
        e => panic!("not a wire error: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_is_announced_shown_and_approved_once_through_its_hook() {
    let port = free_port();
    let site = format!("http://127.0.0.1:{port}");
    let console =
        ax_server::console::ConsoleConfig::new(format!("127.0.0.1:{port}").parse().unwrap())
            .token("s3cret-admin")
            .url(&site);
    let env = Env::start(Env::server().console(console)).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    let mut announced = Announcements::follow(&env.client).await;
    env.ax
        .put_flow(&gated("ship", Duration::from_secs(60), OnTimeout::Fail))
        .await
        .unwrap();
    let run = env.ax.run_flow("ship", json!({"order": 1})).await.unwrap();
    let a = announced.of(&run).await;
    let token = a["token"].as_str().unwrap().to_string();
    assert_eq!(
        (a["flow"].as_str(), a["step"].as_str()),
        (Some("ship"), Some("ok"))
    );
    assert_eq!(a["message"], "ship it?");
    assert_eq!(a["url"], json!(format!("{site}/hooks/approvals/{token}")));
    let task = a["task"].as_str().unwrap().to_string();
    assert!(token.starts_with(&format!("{task}~")), "{token}");

    // Shown waiting for approval until its timeout, and listed without its token.
    let view = env.ax.flow("get", &json!({ "run": run })).await.unwrap();
    let ok = &view["steps"][1];
    let started = ok["started_at_ms"].as_u64().unwrap();
    assert_eq!(ok["waiting"]["kind"], "approval", "{ok}");
    assert_eq!(ok["waiting"]["until_ms"].as_u64(), Some(started + 60_000));
    assert_eq!(env.record(&task).await.state, TaskState::Scheduled);
    let list = env.ax.approvals().await.unwrap();
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
    assert_eq!(
        (list[0]["task"].as_str(), list[0]["run"].as_str()),
        (Some(task.as_str()), Some(run.as_str()))
    );
    let secret = token.rsplit_once('~').unwrap().1;
    assert!(
        !list.to_string().contains(secret),
        "the list shows no token: {list}"
    );
    // The secret is not in the wait task's message (workers' streams hold those).
    let seq = env.record(&task).await.delayed_seq.unwrap();
    let stream = env.js.get_stream("AX_DELAYED").await.unwrap();
    let msg = stream.get_raw_message(seq).await.unwrap();
    let text = String::from_utf8_lossy(&msg.payload);
    assert!(
        text.contains("ship it?") && !text.contains(secret),
        "the message holds no secret: {text}"
    );

    // A wrong secret, a forged task and a token of nothing are one answer: unknown.
    let forged = format!("{task}~{}", "0".repeat(32));
    for bad in [forged.as_str(), "q.fl.nope.ok.0.0~abc", "not-a-token"] {
        let (status, body) = http(
            "POST",
            &format!("{site}/hooks/approvals/{bad}/approve"),
            &[],
            None,
        )
        .await;
        assert_eq!(status, 404, "{bad}: {body}");
        assert_eq!(
            code(
                env.ax
                    .complete_approval(&by_token(bad, Decision::Approve))
                    .await
                    .unwrap_err()
            ),
            ErrorCode::NotFound
        );
    }
    // By task id only through approve_task (an operator's), never through approve.
    let by_task_on_approve = ax_sdk::flow::FlowRequest::Approve(ApprovalCompletion {
        task: Some(task.clone()),
        ..by_token(&token, Decision::Approve)
    });
    let e = env.ax.call(&by_task_on_approve).await.unwrap_err();
    assert_eq!(code(e), ErrorCode::InvalidField);

    // The hook approves with the body as payload, with no session; again is the same
    // answer; a reject after it is a conflict.
    let hook = format!("{site}/hooks/approvals/{token}");
    let (status, body) = http(
        "POST",
        &format!("{hook}/approve"),
        &[],
        Some(json!({"by": "ann"})),
    )
    .await;
    assert_eq!(
        (status, body["ok"]["decision"].as_str()),
        (200, Some("approved")),
        "{body}"
    );
    let (status, body) = http(
        "POST",
        &format!("{hook}/approve"),
        &[],
        Some(json!({"by": "bob"})),
    )
    .await;
    assert_eq!(
        (status, body["ok"]["decision"].as_str()),
        (200, Some("approved")),
        "{body}"
    );
    let (status, body) = http("POST", &format!("{hook}/reject"), &[], None).await;
    assert_eq!(status, 409, "{body}");

    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    assert_eq!(
        echoed(&env.ax, &run).await,
        json!({"ok": {"decision": "approved", "payload": {"by": "ann"}}}),
        "the first approval's payload is the step's output"
    );
    assert_eq!(endings(&env.ax, &task).await, 1, "the approval ended once");
    let ran: Vec<String> = calls.lock().unwrap().keys().cloned().collect();
    assert!(
        ran.iter().all(|id| !id.contains(".ok.")),
        "no worker ran it: {ran:?}"
    );
    assert_eq!(env.ax.approvals().await.unwrap(), json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_fails_the_step_and_a_timeout_follows_its_policy() {
    let env = Env::start(Env::server()).await;
    let (_stop, _w) = env.spawn_worker(flow_worker(Calls::default()));
    let mut announced = Announcements::follow(&env.client).await;

    // Rejected by an operator (by task id): the step fails with the reason; the token
    // then finds it ended.
    env.ax
        .put_flow(&gated("refund", Duration::from_secs(60), OnTimeout::Fail))
        .await
        .unwrap();
    let run = env.ax.run_flow("refund", json!({})).await.unwrap();
    let a = announced.of(&run).await;
    let done = env
        .ax
        .complete_approval(&ApprovalCompletion {
            token: None,
            task: Some(a["task"].as_str().unwrap().into()),
            decision: Decision::Reject,
            payload: None,
            reason: Some("too expensive".into()),
        })
        .await
        .unwrap();
    assert_eq!(done["decision"], "rejected");
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Failed);
    let view = env.ax.flow("get", &json!({ "run": run })).await.unwrap();
    assert_eq!(view["steps"][1]["state"], json!(StepState::Failed));
    assert_eq!(
        view["steps"][1]["error"]["class"], "approval_rejected",
        "{view}"
    );
    assert_eq!(view["steps"][1]["error"]["message"], "too expensive");
    let token = a["token"].as_str().unwrap();
    let e = env
        .ax
        .complete_approval(&by_token(token, Decision::Approve))
        .await
        .unwrap_err();
    assert_eq!(code(e), ErrorCode::Conflict);

    // No one answers: `fail` fails the step (approval_timed_out), `continue` passes null.
    env.ax
        .put_flow(&gated("late", Duration::from_millis(1000), OnTimeout::Fail))
        .await
        .unwrap();
    let run = env.ax.run_flow("late", json!({})).await.unwrap();
    let token = announced.of(&run).await["token"]
        .as_str()
        .unwrap()
        .to_string();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Failed);
    let view = env.ax.flow("get", &json!({ "run": run })).await.unwrap();
    assert_eq!(
        view["steps"][1]["error"]["class"], "approval_timed_out",
        "{view}"
    );
    let e = env
        .ax
        .complete_approval(&by_token(&token, Decision::Approve))
        .await
        .unwrap_err();
    assert_eq!(code(e), ErrorCode::Conflict, "too late");

    // Run now ends it now as its timeout would: by its policy, not approved by no one.
    env.ax
        .put_flow(&gated("hurry", Duration::from_secs(60), OnTimeout::Fail))
        .await
        .unwrap();
    let run = env.ax.run_flow("hurry", json!({})).await.unwrap();
    let task = announced.of(&run).await["task"]
        .as_str()
        .unwrap()
        .to_string();
    env.ax.run_now(&task).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Failed);
    let view = env.ax.flow("get", &json!({ "run": run })).await.unwrap();
    assert_eq!(
        view["steps"][1]["error"]["class"], "approval_timed_out",
        "{view}"
    );

    env.ax
        .put_flow(&gated(
            "optional",
            Duration::from_millis(1000),
            OnTimeout::Continue,
        ))
        .await
        .unwrap();
    let run = env.ax.run_flow("optional", json!({})).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    assert_eq!(echoed(&env.ax, &run).await, json!({"ok": null}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvals_outlive_every_server_and_two_completions_end_each_once() {
    let TwoServers {
        env,
        url,
        mut servers,
        worker: _worker,
        ..
    } = TwoServers::start().await;
    let mut announced = Announcements::follow(&env.client).await;
    env.ax
        .put_flow(&gated(
            "ship_all",
            Duration::from_secs(120),
            OnTimeout::Fail,
        ))
        .await
        .unwrap();
    let mut runs = Vec::new();
    for i in 0..4 {
        runs.push(
            env.ax
                .run_flow("ship_all", json!({ "order": i }))
                .await
                .unwrap(),
        );
    }
    let mut tokens = Vec::new();
    for run in &runs {
        tokens.push(
            announced.of(run).await["token"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    // A submit retried keeps the secret its first one stored.
    let (task0, secret0) = tokens[0].rsplit_once('~').unwrap();
    let waits = ax_core::waits::Waits::new(env.js.clone());
    let mut again: WaitRegistration = waits.get(task0).await.unwrap().unwrap();
    again.approval.as_mut().unwrap().secret = Some("ffff".into());
    let kept = waits.create_or_get(&again).await.unwrap();
    assert_eq!(kept.approval.unwrap().secret.as_deref(), Some(secret0));

    for s in &mut servers {
        s.kill9();
    }
    let _servers = [
        AxProc::spawn(&url, &SERVER_ARGS),
        AxProc::spawn(&url, &SERVER_ARGS),
    ];
    procs::wait_ready(&env.client).await;
    // Each token presented twice at once (a double click, a retried webhook).
    let answers = futures::future::join_all(tokens.iter().flat_map(|t| {
        let ax = env.ax.clone();
        let one = by_token(t, Decision::Approve);
        [0, 1].map(move |_| {
            let (ax, one) = (ax.clone(), one.clone());
            async move {
                eventually(Duration::from_secs(20), "the approval's answer", || async {
                    ax.complete_approval(&one).await.ok()
                })
                .await
            }
        })
    }))
    .await;
    assert!(
        answers.iter().all(|a| a["decision"] == "approved"),
        "{answers:?}"
    );
    for run in &runs {
        let ended = finish(&env.ax, run).await;
        assert_eq!(
            ended.state,
            RunState::Succeeded,
            "{run}: {:?}",
            ended.reason
        );
        let view = env.ax.flow("get", &json!({ "run": run })).await.unwrap();
        let id = view["steps"][1]["task_id"].as_str().unwrap();
        assert_eq!(endings(&env.ax, id).await, 1, "{run}: ended once");
    }
}

/// The listing reads `AX_WAITS` in one pass (ax_core::waits::Waits::all): approvals
/// stored among hundreds of waits for events, before and after them, are all found, and
/// a registration removed is not. (Red with a pass that stops at its first batch: the
/// approvals stored after 300 event waits are missing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvals_are_listed_from_among_many_waits_for_events() {
    let env = Env::start(Env::server()).await;
    let (_stop, _w) = env.spawn_worker(flow_worker(Calls::default()));
    let mut announced = Announcements::follow(&env.client).await;
    let waits = ax_core::waits::Waits::new(async_nats::jetstream::new(env.client.clone()));
    let event_wait = |i: usize| WaitRegistration {
        task: format!("ev.wait.{i}"),
        event: "bench.paid".into(),
        matches: [("i".to_string(), json!(i))].into(),
        since_ms: 1,
        until_ms: u64::MAX / 2,
        approval: None,
        on_timeout: None,
    };
    env.ax
        .put_flow(&gated("ship", Duration::from_secs(600), OnTimeout::Fail))
        .await
        .unwrap();
    let mut runs = Vec::new();
    for round in 0..2 {
        for i in round * 300..(round + 1) * 300 {
            waits.put(&event_wait(i)).await.unwrap();
        }
        let run = env
            .ax
            .run_flow("ship", json!({"round": round}))
            .await
            .unwrap();
        let task = announced.of(&run).await["task"]
            .as_str()
            .unwrap()
            .to_string();
        runs.push((run, task));
    }
    for i in (0..600).step_by(2) {
        waits.remove(&format!("ev.wait.{i}")).await.unwrap();
    }

    let listed = |list: &Value| -> Vec<String> {
        let rows = list.as_array().unwrap_or_else(|| panic!("{list}"));
        rows.iter()
            .map(|r| r["run"].as_str().unwrap().to_string())
            .collect()
    };
    let both: Vec<String> = runs.iter().map(|(run, _)| run.clone()).collect();
    assert_eq!(
        listed(&env.ax.approvals().await.unwrap()),
        both,
        "oldest first"
    );
    assert_eq!(
        waits.all().await.unwrap().len(),
        300 + 2,
        "every registration read"
    );

    // One approved: its record ends, so it leaves the list (its registration stays until
    // its timeout).
    let (first_run, first_task) = &runs[0];
    env.ax
        .complete_approval(&ApprovalCompletion {
            token: None,
            task: Some(first_task.clone()),
            decision: Decision::Approve,
            payload: None,
            reason: None,
        })
        .await
        .unwrap();
    assert_eq!(finish(&env.ax, first_run).await.state, RunState::Succeeded);
    assert_eq!(
        listed(&env.ax.approvals().await.unwrap()),
        vec![runs[1].0.clone()]
    );
}
