//! Delayed dispatch shared among servers: each server owns about 1/N of the
//! delayed-task partitions; a killed owner's partitions are taken over, and nothing is
//! lost or dispatched twice.

use crate::procs::{free_port, scrape, wait_ready, AxProc};
use crate::support::eventually;
use ax_core::names::DELAYED_PARTITIONS;
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, TaskSpec};
use ax_testkit::LocalNats;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio_util::sync::CancellationToken;

/// Holder of each partition lease (empty: released).
async fn owners(kv: &async_nats::jetstream::kv::Store) -> HashMap<u32, String> {
    let mut out = HashMap::new();
    for p in 0..DELAYED_PARTITIONS {
        if let Ok(Some(v)) = kv.get(format!("delayed.{p}")).await {
            let v: serde_json::Value = serde_json::from_slice(&v).unwrap();
            out.insert(p, v["holder"].as_str().unwrap_or_default().to_string());
        }
    }
    out
}

fn count_by_holder(owners: &HashMap<u32, String>) -> HashMap<String, usize> {
    let mut n = HashMap::new();
    for h in owners.values().filter(|h| !h.is_empty()) {
        *n.entry(h.clone()).or_default() += 1;
    }
    n
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_servers_share_delayed_dispatch_and_survive_a_kill() {
    let nats = LocalNats::start().unwrap();
    let url = nats.url();
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut servers: Vec<Option<AxProc>> = (0..3)
        .map(|i| {
            Some(AxProc::spawn_with_metrics(
                &url,
                &["server", "--queue", "q", "--id", &format!("s{i}")],
                &format!("127.0.0.1:{}", ports[i]),
            ))
        })
        .collect();
    let client = async_nats::connect(&url).await.unwrap();
    wait_ready(&client).await;
    let js = async_nats::jetstream::new(client.clone());
    let leases = eventually(Duration::from_secs(10), "the lease bucket", || async {
        js.get_key_value("AX_LEASES").await.ok()
    })
    .await;
    // Every partition owned, about a third each (ceil(16 / 3) = 6 at most).
    let split = eventually(
        Duration::from_secs(15),
        "partitions shared by three",
        || async {
            let owners = owners(&leases).await;
            let by = count_by_holder(&owners);
            (owners.values().filter(|h| !h.is_empty()).count() == DELAYED_PARTITIONS as usize
                && by.len() == 3
                && by.values().all(|&n| n <= 6))
            .then_some(by)
        },
    )
    .await;

    // Load: 3,000 delayed tasks due over 6 s from 2 s on; a worker counts runs.
    let runs: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let worker = Worker::builder("q")
        .concurrency(64)
        .handler({
            let runs = runs.clone();
            move |task: Task| {
                *runs.lock().unwrap().entry(task.id).or_default() += 1;
                async { Ok(()) }
            }
        })
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let worker = tokio::spawn(worker.run(client.clone(), stop.clone()));
    let ax = Client::new(client.clone());
    let n = 3000;
    let base = SystemTime::now() + Duration::from_secs(2);
    let ids: Vec<String> = futures::stream::iter(0..n)
        .map(|i| {
            let ax = ax.clone();
            let at = base + Duration::from_millis(6000 * i / n);
            async move {
                let text = humantime::format_rfc3339_millis(at).to_string();
                ax.submit("q", TaskSpec::new("t").run_at(text))
                    .await
                    .unwrap()
                    .id
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    // Kill the owner of partition 0 while tasks fall due.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let victim = owners(&leases).await[&0].clone();
    let k: usize = victim[1..].parse().unwrap();
    let dispatched_before: Vec<f64> = {
        let mut v = Vec::new();
        for port in &ports {
            v.push(metric(&scrape(*port).await, "ax_delayed_dispatched_total"));
        }
        v
    };
    servers[k].take().unwrap().kill9();
    let killed_at = Instant::now();
    let taken = eventually(
        Duration::from_secs(15),
        "the killed server's partitions taken over",
        || async {
            let owners = owners(&leases).await;
            (owners.len() == DELAYED_PARTITIONS as usize
                && owners.values().all(|h| !h.is_empty() && *h != victim))
            .then(|| killed_at.elapsed())
        },
    )
    .await;
    eventually(Duration::from_secs(30), "every task ran", || async {
        (runs.lock().unwrap().len() >= n as usize).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.cancel();
    worker.await.unwrap().unwrap();
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), n as usize);
    assert!(
        ids.iter().all(|id| runs.get(id) == Some(&1)),
        "a task ran twice or not at all"
    );
    // Nothing dispatched twice: the ready stream stored exactly one message per task.
    let mut ready = js.get_stream("AX_READY_NORMAL").await.unwrap();
    assert_eq!(ready.info().await.unwrap().state.last_sequence, n);
    println!(
        "partitions: split before the kill {split:?}; dispatched per server by then {dispatched_before:?}; \
         s{k} killed, its partitions taken over in {taken:?}"
    );
    // Each server did part of the dispatching.
    assert!(
        dispatched_before.iter().all(|&d| d > 0.0),
        "{dispatched_before:?}"
    );
}
