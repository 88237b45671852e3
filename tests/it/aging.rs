//! Priority aging (`Worker::aging`): under a sustained high-priority backlog, low tasks
//! that have waited past the threshold are served as normal, then as high.

use crate::support::Env;
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Priority, TaskSpec, TaskState};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const LOWS: usize = 4;
const HIGHS: usize = 900;

/// Runs a backlog of `LOWS` low tasks (stored first) and `HIGHS` high ones through one
/// worker with weights 200 / 20 / 1 and concurrency 1: how many high tasks had started
/// when the last low one started.
async fn highs_before_the_last_low(env: &Env, queue: &str, aging: Option<Duration>) -> usize {
    let lows: Vec<TaskSpec> = (0..LOWS)
        .map(|_| TaskSpec::new("low").priority(Priority::Low))
        .collect();
    let highs: Vec<TaskSpec> = (0..HIGHS)
        .map(|_| TaskSpec::new("high").priority(Priority::High))
        .collect();
    let low_ids: Vec<String> = env
        .ax
        .submit_many(queue, lows)
        .await
        .into_iter()
        .map(|a| a.unwrap().id)
        .collect();
    for a in env.ax.submit_many(queue, highs).await {
        a.unwrap();
    }
    let order: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = order.clone();
    let mut worker = Worker::builder(queue)
        .concurrency(1)
        .weights([200, 20, 1])
        .handler(move |task: Task| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(task.name);
                tokio::time::sleep(Duration::from_millis(2)).await;
                Ok(())
            }
        });
    if let Some(after) = aging {
        worker = worker.aging(after);
    }
    let (stop, handle) = env.spawn_worker(worker.build().unwrap());
    for id in &low_ids {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(60))
            .await;
    }
    stop.cancel();
    handle.await.unwrap();
    let order = order.lock().unwrap().clone();
    let last_low = order.iter().rposition(|n| n == "low").unwrap();
    order[..last_low].iter().filter(|n| *n == "high").count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aged_low_tasks_are_served_as_high_under_a_high_backlog() {
    let env = Env::start(Env::server().queues(["q", "q2"])).await;
    // Without aging, a low task is picked first once in 221 rounds: the last of four
    // starts after most of the high backlog.
    let plain = highs_before_the_last_low(&env, "q", None).await;
    // With a 150 ms threshold the waiting low tasks are picked as normal after 150 ms and
    // as high after 300 ms: they start early in the backlog.
    let aged = highs_before_the_last_low(&env, "q2", Some(Duration::from_millis(150))).await;
    println!("high tasks started before the last low one: {plain} without aging, {aged} with");
    assert!(plain >= 600, "without aging the low tasks wait: {plain}");
    assert!(
        aged <= 300,
        "aged low tasks are served as high: {aged} highs first"
    );
}
