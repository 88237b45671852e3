//! Task outputs : what a handler returns is stored with its `succeeded`
//! write — inline when small, in `AX_RESULTS` when large, refused over the cap — and
//! `Client::wait` / `ax task get --wait --result` hand it back.

use crate::support::Env;
use ax_sdk::output::{INLINE_OUTPUT_BYTES, MAX_OUTPUT_BYTES};
use ax_sdk::worker::{Task, TaskError, Worker};
use ax_sdk::{Output, TaskSpec, TaskState};
use std::time::Duration;

/// A worker whose handler answers by task name: `double` doubles its JSON number,
/// `blob` returns as many bytes as its payload says (byte i = i % 251), `fail` fails for
/// good, anything else returns nothing.
fn answering_worker() -> Worker {
    Worker::builder("q")
        .handler(|task: Task| async move {
            match task.name.as_str() {
                "double" => {
                    let n: i64 = task.json()?;
                    Output::json(&serde_json::json!({ "doubled": n * 2 }))
                }
                "blob" => {
                    let len: usize = task.json()?;
                    Ok(Output::bytes(
                        (0..len).map(|i| (i % 251) as u8).collect::<Vec<u8>>(),
                    ))
                }
                "fail" => Err(TaskError::permanent("nope", "this task always fails")),
                _ => Ok(Output::none()),
            }
        })
        .build()
        .unwrap()
}

async fn wait(env: &Env, id: &str) -> ax_sdk::client::Finished {
    tokio::time::timeout(Duration::from_secs(15), env.ax.wait(id))
        .await
        .expect("the task finishes")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_come_back_inline_or_from_the_results_bucket() {
    let env = Env::start(Env::server()).await;
    let small = env
        .ax
        .submit("q", TaskSpec::new("double").json(&21))
        .await
        .unwrap()
        .id;
    let big_len = INLINE_OUTPUT_BYTES * 100;
    let big = env
        .ax
        .submit("q", TaskSpec::new("blob").json(&big_len))
        .await
        .unwrap()
        .id;
    let none = env.ax.submit("q", TaskSpec::new("quiet")).await.unwrap().id;
    // Waiting starts before any worker runs: the answer is pushed when the task ends.
    let waiting = tokio::spawn({
        let ax = env.ax.clone();
        let id = small.clone();
        async move { ax.wait(&id).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "wait returned before the task ran");
    let (stop, handle) = env.spawn_worker(answering_worker());

    let done = tokio::time::timeout(Duration::from_secs(15), waiting)
        .await
        .expect("wait resolves when the task ends")
        .unwrap()
        .unwrap();
    assert_eq!(done.record.state, TaskState::Succeeded);
    let out = done.output.expect("an output");
    assert!(out.is_json);
    assert_eq!(
        out.json::<serde_json::Value>().unwrap(),
        serde_json::json!({"doubled": 42})
    );
    let stored = done.record.output.as_ref().unwrap();
    assert!(
        !stored.is_external(),
        "a small output is inline: {stored:?}"
    );

    let done = wait(&env, &big).await;
    let stored = done.record.output.clone().unwrap();
    assert_eq!(
        (stored.key.clone(), stored.size),
        (Some(format!("{big}.1")), big_len),
        "a large output is in AX_RESULTS under <id>.<attempt>"
    );
    let out = done.output.expect("an output");
    assert!(!out.is_json);
    assert_eq!(out.bytes.len(), big_len);
    assert!(out
        .bytes
        .iter()
        .enumerate()
        .all(|(i, b)| *b == (i % 251) as u8));

    let done = wait(&env, &none).await;
    assert_eq!(done.record.state, TaskState::Succeeded);
    assert!(done.output.is_none() && done.record.output.is_none());

    // A finished task: wait answers at once, and the CLI prints the output.
    let again = wait(&env, &small).await;
    assert_eq!(again.revision, done_revision(&env, &small).await);
    let cli = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_ax"))
            .args(args)
            .env("NATS_URL", env.nats.url())
            .output()
            .unwrap()
    };
    let printed = cli(&["task", "get", &small, "--result"]);
    assert!(printed.status.success(), "{printed:?}");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&printed.stdout).unwrap(),
        serde_json::json!({"doubled": 42})
    );
    let printed = cli(&["task", "get", &big, "--wait", "--timeout", "5s", "--result"]);
    assert!(printed.status.success(), "{printed:?}");
    assert_eq!(printed.stdout.len(), big_len);
    stop.cancel();
    handle.await.unwrap();
}

async fn done_revision(env: &Env, id: &str) -> u64 {
    env.ax.task(id).await.unwrap().unwrap().1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_output_over_the_cap_fails_the_task_and_wait_sees_dead_ones() {
    let env = Env::start(Env::server()).await;
    let huge = env
        .ax
        .submit("q", TaskSpec::new("blob").json(&(MAX_OUTPUT_BYTES + 1)))
        .await
        .unwrap()
        .id;
    let failing = env.ax.submit("q", TaskSpec::new("fail")).await.unwrap().id;
    let (stop, handle) = env.spawn_worker(answering_worker());
    let done = wait(&env, &huge).await;
    assert_eq!(done.record.state, TaskState::Dead, "never a stuck task");
    let error = done.record.last_error.unwrap();
    assert_eq!(error.class, "output_too_large");
    assert_eq!(done.record.attempt, 1, "not retried: {}", error.message);
    assert!(done.output.is_none());
    let done = wait(&env, &failing).await;
    assert_eq!(done.record.state, TaskState::Dead);
    assert_eq!(done.record.last_error.unwrap().class, "nope");
    // The CLI says there is no output, and a task still running has no result yet.
    let printed = std::process::Command::new(env!("CARGO_BIN_EXE_ax"))
        .args(["task", "get", &failing, "--result"])
        .env("NATS_URL", env.nats.url())
        .output()
        .unwrap();
    assert!(!printed.status.success());
    assert!(
        String::from_utf8_lossy(&printed.stderr).contains("has no output"),
        "{printed:?}"
    );
    stop.cancel();
    handle.await.unwrap();
}
