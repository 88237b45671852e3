//! Triggers held lean, through the `ax server` binary: the leader holds a trigger whole
//! only while it is due within `--trigger-hold`, the rest as their names (resting), and
//! says how many of each in `ax_triggers_held{how}`; a new leader reads every stored
//! definition (pulled in batches) and holds each the same way.

use crate::procs::{free_port, scrape, wait_ready, AxProc};
use crate::support::{eventually, Env};
use crate::triggers::interval;
use serde_json::json;
use std::time::Duration;

/// How many triggers the leader behind metrics port `port` holds `how`.
async fn held(port: u16, how: &str) -> Option<u64> {
    let text = scrape(port).await;
    let prefix = format!("ax_triggers_held{{how=\"{how}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

async fn holds(port: u16, whole: u64, resting: u64) {
    eventually(
        Duration::from_secs(20),
        &format!("the leader to hold {whole} whole and {resting} resting"),
        || async {
            (held(port, "whole").await == Some(whole)
                && held(port, "resting").await == Some(resting))
            .then_some(())
        },
    )
    .await;
}

fn server(env: &Env, port: u16) -> AxProc {
    AxProc::spawn_with_metrics(
        &env.nats.url(),
        &["server", "--queue", "q", "--trigger-hold", "30s"],
        &format!("127.0.0.1:{port}"),
    )
}

/// More definitions than one pull asks for (128), so a new leader reads several batches.
const FAR: usize = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_triggers_due_within_the_hold_time_are_held_whole_by_every_leader() {
    let env = Env::nats_only().await;
    let first = free_port();
    let mut a = server(&env, first);
    wait_ready(&env.client).await;
    let far = |name: String| {
        json!({"name": name, "kind": "once", "at": "2030-01-01T00:00:00Z",
               "tasks": [{"name": "t", "queue": "q"}]})
    };
    env.ax
        .trigger("put", &interval("soon", 5_000))
        .await
        .unwrap();
    for i in 0..FAR {
        env.ax
            .trigger("put", &far(format!("far-{i:03}")))
            .await
            .unwrap();
    }
    env.ax.trigger("put", &far("gone".into())).await.unwrap();
    env.ax.delete_trigger("gone").await.unwrap();
    holds(first, 1, FAR as u64).await;
    // A new leader (the first killed) reads every stored definition, a batch at a time.
    a.kill9();
    let second = free_port();
    let _b = server(&env, second);
    holds(second, 1, FAR as u64).await;
    // A resting trigger changed to be due soon is read back and held whole.
    env.ax
        .trigger("put", &interval("far-007", 5_000))
        .await
        .unwrap();
    holds(second, 2, FAR as u64 - 1).await;
}
