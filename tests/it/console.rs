//! The web console in a real headless Chromium, driven over WebDriver (Debian's `chromium`
//! and `chromium-driver`; `./dev test` installs them when missing). With
//! AX_SCREENSHOTS=1 the tests save the screenshots the README shows (docs/console-*.png).

use crate::browser::{http, Browser};
use crate::procs::free_port;
use crate::support::{within, Env};
use ax_sdk::flow::{FlowDef, StepDef};
use ax_sdk::worker::{Task, TaskError, Worker};
use ax_sdk::{TaskSpec, TaskState};
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A worker on `q` whose tasks named `name` fail for good with `class` until `fixed` is
/// set; every other task succeeds.
fn failing_until_fixed(name: &'static str, class: &'static str) -> (Worker, Arc<AtomicBool>) {
    let fixed = Arc::new(AtomicBool::new(false));
    let flag = fixed.clone();
    let w = Worker::builder("q")
        .handler(move |task: Task| {
            let fixed = flag.clone();
            async move {
                if task.name == name && !fixed.load(Ordering::SeqCst) {
                    return Err(TaskError::permanent(class, "failed until fixed")
                        .with_detail("Traceback:\n  at charge (billing.rs:42)"));
                }
                Ok(())
            }
        })
        .build()
        .unwrap();
    (w, fixed)
}

fn console_env_server(port: u16) -> ax_server::ServerBuilder {
    Env::server().queues(["q", "tenants"]).console(
        ax_server::console::ConsoleConfig::new(format!("127.0.0.1:{port}").parse().unwrap())
            .token("s3cret-admin")
            .readonly_token("viewer-token"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn find_a_dead_task_by_error_class_retry_it_and_watch_it_succeed() {
    within(Duration::from_secs(120), "console: dead task", async {
        let port = free_port();
        let faults = ax_core::faults::Faults::armed();
        let env = Env::start(console_env_server(port).faults(faults.clone())).await;
        let site = format!("http://127.0.0.1:{port}");
        let (w, fixed) = failing_until_fixed("charge", "card_declined");
        let _w = env.spawn_worker(w);
        for i in 0..30 {
            env.ax.submit("q", TaskSpec::new("send").json(&i)).await.unwrap();
        }
        let dead = env
            .ax
            .submit("q", TaskSpec::new("charge").json(&json!({"card": "4242"})).max_attempts(1))
            .await
            .unwrap()
            .id;
        env.wait_state(&dead, TaskState::Dead, Duration::from_secs(10)).await;

        // The API refuses without a token, and the read-only token may not act.
        let (status, _) = http("POST", &format!("{site}/api/task/list"), &[], Some(json!({}))).await;
        assert_eq!(status, 401);
        let viewer = [("authorization", "Bearer viewer-token")];
        // The listing answers from the task index, which follows the records a moment
        // behind (the record said dead; the index may not have read it yet).
        crate::support::eventually(Duration::from_secs(10), "the dead task listed to the viewer", || async {
            let (status, found) = http("POST", &format!("{site}/api/task/list"), &viewer, Some(json!({"state": "dead"}))).await;
            assert_eq!(status, 200, "{found}");
            (found["ok"]["total"].as_u64() == Some(1)).then_some(())
        })
        .await;
        let (status, _) = http("POST", &format!("{site}/api/task/retry"), &viewer, Some(json!({"id": dead}))).await;
        assert_eq!(status, 403);

        let b = Browser::start().await;
        b.login(&site).await;
        // The overview charts this hour's throughput (30 tasks succeeded this minute).
        b.until("the throughput chart with points", 15,
            "return document.querySelectorAll('#chart-throughput circle').length > 0").await;
        b.screenshot("console-overview.png").await;
        // The overview lists the server's services as its supervisor keeps them; one that
        // panicked shows its restart and, to a logged-in user, why.
        b.until("every service up on the overview", 15,
            "const r = [...document.querySelectorAll('#services tr[data-service]')]; \
             return r.length === 16 && r.every((t) => t.querySelector('.up').textContent.trim() === 'up')").await;
        faults.panic_service("alerts");
        crate::support::eventually(Duration::from_secs(15), "the alerts service restarted", || async {
            env.ax.submit("q", TaskSpec::new("send").json(&98)).await.unwrap();
            b.script("const r = document.querySelector('#services tr[data-service=alerts]'); \
                      return !!r && r.querySelector('.restarts').textContent.trim() === '1' \
                      && r.querySelector('.last-stop').textContent.startsWith('panic')").await
                .as_bool().unwrap_or(false).then_some(())
        })
        .await;
        // A live refresh changes what changed and keeps the rest: the Pause button under
        // the pointer is the same element after it.
        b.script("window.keep = document.querySelector('[data-act^=\"pause:\"]'); window.before = window.axRenders;").await;
        env.ax.submit("q", TaskSpec::new("send").json(&99)).await.unwrap();
        b.until("a live refresh", 15, "return window.axRenders > window.before").await;
        let kept = b.script("return document.querySelector('[data-act^=\"pause:\"]') === window.keep && document.contains(window.keep)").await;
        assert_eq!(kept, json!(true), "the refresh replaced the Pause button");
        // Pausing asks why; who paused and why show on the overview and to the API.
        b.script("window.prompt = () => 'deploy freeze';").await;
        b.click("[data-act^='pause:']").await;
        b.until("the pause reason on the overview", 15,
            "const s = document.querySelector('tr[data-queue=q] .status'); \
             return !!s && s.textContent.includes('paused by console') && s.textContent.includes('deploy freeze')").await;
        let q = env.ax.queues().await.unwrap();
        assert_eq!(q["queues"][0]["pause"]["reason"], "deploy freeze", "{q}");
        b.click("tr[data-queue=q] [data-act^='task/resume']").await;
        b.until("the queue active again", 15,
            "return document.querySelector('tr[data-queue=q] .status')?.textContent.trim() === 'active'").await;
        // A queue's page charts its throughput and latency.
        b.go(&format!("{site}/#/queue/q")).await;
        b.until("the queue's charts", 15,
            "return !!document.querySelector('#chart-queue-latency') && document.querySelectorAll('#chart-queue-throughput circle').length > 0").await;
        b.screenshot("console-queue.png").await;

        b.go(&format!("{site}/#/tasks")).await;
        b.until("the task search", 15, "return !!document.querySelector('#filters select[name=state]')").await;
        b.script(
            "const s = document.querySelector('#filters select[name=state]'); s.value = 'dead'; \
             s.dispatchEvent(new Event('change', {bubbles: true}));",
        )
        .await;
        b.type_in("#filters input[name=error_class]", "card_declined").await;
        b.click("#search").await;
        let link = format!("#results a[href='#/task/{dead}']");
        b.until("the dead task in the results", 15, &format!(
            "return document.querySelectorAll('#results tr').length === 2 && !!document.querySelector(\"{link}\")"
        ))
        .await;
        b.screenshot("console-tasks.png").await;
        b.click(&link).await;
        b.until("the task page", 15, "return document.querySelector('#state')?.textContent === 'dead'").await;
        let attempts = b.script("return document.querySelectorAll('#attempts tr').length").await;
        assert_eq!(attempts, json!(2), "one attempt row");
        // What Bull Board shows: the payload, the options, the error's detail.
        b.until("payload, retry policy and error detail", 15,
            "return document.querySelector('#payload')?.textContent.includes('4242') && \
             document.querySelector('#fields').textContent.includes('retry policy') && \
             document.querySelector('#error-detail')?.textContent.includes('billing.rs:42')").await;
        let head = b.script("return document.querySelector('#state').parentElement.textContent.trim()").await;
        assert_eq!(head, json!("dead"), "the state is shown once");

        fixed.store(true, Ordering::SeqCst);
        b.click("[data-act=retry]").await;
        // No reload: the page follows the change through the live updates.
        b.until("the retried task to succeed on the page", 20,
            "return document.querySelector('#state')?.textContent === 'succeeded'").await;
        b.screenshot("console-task.png").await;
        let rec = env.record(&dead).await;
        assert_eq!((rec.state, rec.attempt), (TaskState::Succeeded, 2));
        assert_eq!(rec.op.unwrap().by, "console");
        // The limits page lists a batch that fills, by key, items and task.
        let spec = TaskSpec::new("invoice").json(&json!({"order": 1})).batch("invoices", 50, Duration::from_secs(60));
        let batch = env.ax.submit("q", spec.clone()).await.unwrap().id;
        env.ax.submit("q", spec).await.unwrap();
        b.go(&format!("{site}/#/limits")).await;
        b.until("the waiting batch on the limits page", 15, &format!(
            "const r = document.querySelector('#windows a[href=\"#/task/{}\"]')?.closest('tr'); \
             return !!r && r.textContent.includes('invoices') && r.cells[3].textContent.trim() === '2'",
            batch.replace('=', "%3D")
        ))
        .await;
        // And a queue's tenants with tasks held (depth 1, no worker on `tenants`).
        env.ax.limits("fair_put", &json!({"queue": "tenants", "depth": 1, "weights": {"acme": 3}})).await.unwrap();
        for _ in 0..3 {
            env.ax.submit("tenants", TaskSpec::new("report").fair_key("acme")).await.unwrap();
        }
        crate::support::eventually(Duration::from_secs(10), "the dispatcher's report", || async {
            let all = env.ax.limits("fair_get", &json!({})).await.ok()?;
            (all["reports"]["tenants"]["tenants"][0]["held"] == 2).then_some(())
        })
        .await;
        // Away and back (the limits page renders when it is shown), the overview drawn
        // first so its render cannot land over the limits page's.
        b.go(&format!("{site}/#/")).await;
        b.until("the overview", 15, "return !!document.querySelector('#services')").await;
        b.go(&format!("{site}/#/limits")).await;
        b.until("the tenant with two held on the limits page", 15,
            "const r = [...document.querySelectorAll('#fair tr')].find((t) => t.textContent.includes('acme')); \
             return !!r && r.cells[3].textContent.trim() === '3' && r.cells[4].textContent.trim() === '2'")
        .await;
        b.close().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_flow_step_shows_red_and_is_re_run() {
    within(Duration::from_secs(120), "console: flow", async {
        let port = free_port();
        let env = Env::start(console_env_server(port)).await;
        let site = format!("http://127.0.0.1:{port}");
        let (w, fixed) = failing_until_fixed("boom", "boom");
        let _w = env.spawn_worker(w);
        let def = FlowDef::new("pipeline")
            .step(StepDef::new("extract", "q", TaskSpec::new("ok")))
            .step(StepDef::new("transform", "q", TaskSpec::new("boom").max_attempts(1)).needs(["extract"]))
            .step(StepDef::new("load", "q", TaskSpec::new("ok")).needs(["transform"]));
        env.ax.put_flow(&def).await.unwrap();
        let run = env.ax.run_flow("pipeline", json!({})).await.unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(30), env.ax.wait_flow(&run))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ended.state, ax_sdk::flow::RunState::Failed);

        let b = Browser::start().await;
        b.login(&site).await;
        b.go(&format!("{site}/#/run/{run}")).await;
        b.until("the failed step drawn red", 15,
            "const g = document.querySelector('g[data-step=transform]'); \
             return !!g && g.dataset.state === 'failed' && g.querySelector('rect').getAttribute('fill') === '#fda29b'").await;
        let load = b.script("return document.querySelector('g[data-step=load]').dataset.state").await;
        assert_eq!(load, json!("upstream_failed"));
        b.screenshot("console-flow.png").await;
        // The Flows page charts runs per minute and run time per flow.
        b.go(&format!("{site}/#/runs")).await;
        b.until("the flow charts with the run", 15,
            "return document.querySelectorAll('#chart-flow-runs circle').length > 0 && \
             document.querySelectorAll('#chart-flow-time circle').length > 0").await;
        b.go(&format!("{site}/#/run/{run}")).await;
        b.until("the run page again", 15, "return !!document.querySelector('[data-act=rerun]')").await;

        fixed.store(true, Ordering::SeqCst);
        b.click("[data-act=rerun]").await;
        b.until("the re-run dialog", 10, "return !!document.querySelector('#rerun-dialog[open]')").await;
        b.click("#rerun-go").await;
        b.until("the run to succeed on the page", 30,
            "return document.querySelector('#run-state')?.textContent === 'succeeded' && \
             document.querySelector('g[data-step=transform]').dataset.state === 'succeeded'").await;
        let done = env.ax.flow_run(&run).await.unwrap().unwrap();
        assert_eq!(done.0.state, ax_sdk::flow::RunState::Succeeded);

        // An approval: listed on the Flows page, shown waiting on its run's graph, and
        // approved with its button.
        let gated = FlowDef::new("gated")
            .step(StepDef::new("extract", "q", TaskSpec::new("ok")))
            .step(
                StepDef::approval("sign_off", "q", ax_sdk::flow::ApprovalDef {
                    message: Some("ship <b>it</b>?".into()),
                    ..Default::default()
                })
                .needs(["extract"]),
            )
            .step(StepDef::new("load", "q", TaskSpec::new("ok")).needs(["sign_off"]));
        env.ax.put_flow(&gated).await.unwrap();
        let run = env.ax.run_flow("gated", json!({})).await.unwrap();
        b.go(&format!("{site}/#/runs")).await;
        b.until("the approval listed", 20, &format!(
            "const r = document.querySelector('#approvals tr:nth-child(2)');              return !!r && r.textContent.includes('{run}') && r.textContent.includes('ship <b>it</b>?')")).await;
        b.go(&format!("{site}/#/run/{run}")).await;
        b.until("the step waiting for approval", 15,
            "return document.querySelector('g[data-step=sign_off]')?.textContent.includes('waiting for approval until')").await;
        b.go(&format!("{site}/#/runs")).await;
        b.until("the approve button", 15, "return !!document.querySelector('#approvals button.primary')").await;
        b.click("#approvals button.primary").await;
        let ended = tokio::time::timeout(Duration::from_secs(30), env.ax.wait_flow(&run))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ended.state, ax_sdk::flow::RunState::Succeeded, "{:?}", ended.reason);
        b.until("the approval gone from the list", 15, "return !document.querySelector('#approvals')").await;

        // A child flow step: the parent's page says what it waits for and links the child,
        // whose page links back (the child waits for its approval meanwhile).
        let parent = FlowDef::new("parent").step(StepDef::child_flow("sub", "q", ax_sdk::flow::ChildFlowDef::new("gated")));
        env.ax.put_flow(&parent).await.unwrap();
        let run = env.ax.run_flow("parent", json!({})).await.unwrap();
        b.go(&format!("{site}/#/run/{run}")).await;
        b.until("the step waiting for its child", 15,
            "return document.querySelector('g[data-step=sub]')?.textContent.includes('waiting for flow gated (1 run) until') \
             && !!document.querySelector('a.child-run')").await;
        // The child starts once its wait task is stored, a moment after the step shows.
        let task = ax_sdk::flow::model::step_task_id("q", &run, "sub", 0, 0);
        let child = ax_sdk::flow::model::child_run_id(&task);
        crate::support::eventually(Duration::from_secs(10), "the child run", || async {
            env.ax.flow_run(&child).await.ok().flatten().map(|_| ())
        })
        .await;
        b.click("a.child-run").await;
        b.until("the child's page naming its parent", 15, &format!(
            "return !!document.querySelector('a[href=\"#/run/{run}\"]') && document.body.textContent.includes('child of')")).await;
        env.ax.flow("cancel", &json!({ "run": run })).await.unwrap();
        b.close().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selected_rows_are_cancelled_and_finished_tasks_purged() {
    within(
        Duration::from_secs(120),
        "console: selection and purge",
        async {
            let port = free_port();
            let env = Env::start(console_env_server(port)).await;
            let site = format!("http://127.0.0.1:{port}");
            let mut ids = Vec::new();
            for i in 0..5 {
                let spec = TaskSpec::new("later")
                    .json(&i)
                    .delay(Duration::from_secs(3600));
                ids.push(env.ax.submit("q", spec).await.unwrap().id);
            }
            let b = Browser::start().await;
            b.login(&site).await;
            b.go(&format!("{site}/#/tasks?state=scheduled")).await;
            b.until(
                "five scheduled tasks",
                15,
                "return document.querySelectorAll('#results input.pick').length === 5",
            )
            .await;
            b.script("window.confirm = () => true; window.prompt = () => '0';")
                .await;
            for id in &ids[..2] {
                b.click(&format!("#results input.pick[value='{id}']")).await;
            }
            b.until(
                "two selected",
                5,
                "return document.querySelector('#picked').textContent === '2 selected'",
            )
            .await;
            b.click("[data-act=cancel-picked]").await;
            for id in &ids[..2] {
                env.wait_state(id, TaskState::Cancelled, Duration::from_secs(10))
                    .await;
            }
            for id in &ids[2..] {
                assert_eq!(
                    env.record(id).await.state,
                    TaskState::Scheduled,
                    "{id} was not selected"
                );
            }
            // Purge the cancelled ones (older than 0 days): their records go.
            b.go(&format!("{site}/#/tasks?state=cancelled")).await;
            b.until(
                "two cancelled tasks",
                15,
                "return document.querySelectorAll('#results input.pick').length === 2",
            )
            .await;
            b.click("[data-act=purge]").await;
            let store = env.store().await;
            for id in &ids[..2] {
                crate::support::eventually(Duration::from_secs(10), "the record purged", || {
                    let store = store.clone();
                    async move { store.get(id).await.ok()?.is_none().then_some(()) }
                })
                .await;
            }
            assert_eq!(env.record(&ids[2]).await.state, TaskState::Scheduled);
            b.close().await;
        },
    )
    .await
}

/// The console's live feed (`GET /api/live`, server-sent events) as a page reads it.
struct LiveFeed {
    tcp: tokio::net::TcpStream,
}

impl LiveFeed {
    async fn open(port: u16) -> LiveFeed {
        use tokio::io::AsyncWriteExt;
        let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let request = format!(
            "GET /api/live HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nauthorization: Bearer s3cret-admin\r\n\r\n"
        );
        tcp.write_all(request.as_bytes()).await.unwrap();
        LiveFeed { tcp }
    }

    /// True if a `change` event arrives within `limit`.
    async fn change_within(&mut self, limit: Duration) -> bool {
        use tokio::io::AsyncReadExt;
        let deadline = tokio::time::Instant::now() + limit;
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout_at(deadline, self.tcp.read(&mut buf)).await {
                Err(_) => return false,
                Ok(read) => {
                    let n = read.unwrap();
                    assert!(n > 0, "the live feed closed");
                    if String::from_utf8_lossy(&buf[..n]).contains("event: change") {
                        return true;
                    }
                }
            }
        }
    }

    /// Reads until a second passes without a `change` event.
    async fn settle(&mut self) {
        while self.change_within(Duration::from_secs(1)).await {}
    }
}

/// A flow run's end, a step that starts to wait or a wait that is met is often written
/// after the last task change it follows: a page refreshed on task changes alone went on
/// showing such a run as it was (CI at 7982363: `a_failed_flow_step_shows_red_and_is_re_run`
/// did not see its re-run end on the page). The live feed ticks on a change of a flow
/// run or of a wait too, no task changing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_feed_ticks_when_a_flow_run_a_wait_a_trigger_or_a_limit_changes() {
    within(Duration::from_secs(60), "console: live feed", async {
        let port = free_port();
        let env = Env::start(console_env_server(port)).await;
        let mut live = LiveFeed::open(port).await;
        live.settle().await;
        use ax_core::names::{
            FLOW_RUNS_BUCKET, LIMITS_BUCKET, TRIGGERS_BUCKET, TRIGGER_STATE_BUCKET, WAITS_BUCKET,
        };
        for bucket in [
            FLOW_RUNS_BUCKET,
            WAITS_BUCKET,
            TRIGGERS_BUCKET,
            TRIGGER_STATE_BUCKET,
            LIMITS_BUCKET,
        ] {
            let kv = env.js.get_key_value(bucket).await.unwrap();
            // A delete of a key nobody holds: a change that no reader can mistake.
            kv.delete("console-live-test").await.unwrap();
            assert!(
                live.change_within(Duration::from_secs(3)).await,
                "no change event after a write to {bucket}"
            );
            live.settle().await;
        }
        // And none when nothing changes.
        assert!(!live.change_within(Duration::from_secs(2)).await);
    })
    .await
}
