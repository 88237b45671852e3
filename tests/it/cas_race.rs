//! `TaskStore::cas` racing itself on a replicated bucket, as a worker's claim races the
//! submitter's record write or a late worker's: on an R3 stream the leader refuses a
//! compare-and-set while another write of the same key is in flight with its own code
//! (10164, "wrong last sequence" with no sequence) besides the usual 10071. Both are a lost
//! race, so every loser must read `Stale` (it reads again and decides), never a broker
//! error (which a claim answers with a one-second nak). Plain writes and the group commit
//! both; creates (revision 0) and updates.

use crate::support::eventually;
use async_nats::jetstream;
use ax_core::atomic::GroupCommit;
use ax_core::state::{StateError, TaskRecord, TaskStore};
use ax_testkit::LocalCluster;
use std::time::Duration;

/// Writers per race, rounds per kind of store.
const WRITERS: usize = 8;
const ROUNDS: usize = 40;

fn record(id: &str, worker: &str) -> TaskRecord {
    serde_json::from_value(serde_json::json!({
        "id": id, "queue": "q", "name": "t", "priority": "normal", "state": "pending",
        "attempt": 0, "max_attempts": 1, "created_at_ms": 1, "updated_at_ms": 1,
        "worker": worker,
    }))
    .expect("a record")
}

/// `WRITERS` concurrent writes of `id` at `revision`: (wins, lost races, other errors).
async fn race(store: &TaskStore, id: &str, revision: u64) -> (usize, usize, Vec<String>) {
    let writes = (0..WRITERS).map(|w| {
        let rec = record(id, &format!("w{w}"));
        async move { store.cas(&rec, revision).await }
    });
    let (mut won, mut lost, mut other) = (0, 0, Vec::new());
    for out in futures::future::join_all(writes).await {
        match out {
            Ok(_) => won += 1,
            Err(StateError::Stale { .. }) => lost += 1,
            Err(e) => other.push(format!("{e:?}")),
        }
    }
    (won, lost, other)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_of_one_key_on_a_replicated_bucket_lose_as_stale() {
    let cluster = LocalCluster::start(3).expect("cluster");
    let urls = cluster.urls();
    let client = async_nats::connect(&urls[0]).await.expect("connect");
    let js = jetstream::new(client);
    let topology = ax_server::streams::Topology {
        replicas: 3,
        ..Default::default()
    };
    eventually(
        Duration::from_secs(60),
        "the cluster to accept R3 streams",
        || async { ax_server::streams::apply(&js, &topology, &[]).await.ok() },
    )
    .await;
    let plain = TaskStore::open(&js).await.expect("open");
    let grouped = TaskStore::open(&js)
        .await
        .expect("open")
        .grouped(GroupCommit::Always);
    for (name, store) in [("plain", &plain), ("grouped", &grouped)] {
        let (mut won, mut lost, mut other) = (0, 0, Vec::new());
        for round in 0..ROUNDS {
            let id = format!("{name}-{round}");
            // Creates racing, then compare-and-sets of the record one of them stored.
            let (w, l, o) = race(store, &id, 0).await;
            let (_, revision) = store.get(&id).await.expect("read").expect("created");
            let (w2, l2, o2) = race(store, &id, revision).await;
            won += w + w2;
            lost += l + l2;
            other.extend(o.into_iter().chain(o2));
        }
        println!(
            "{name}: {won} won, {lost} lost as stale, {} other errors",
            other.len()
        );
        assert!(
            other.is_empty(),
            "{name}: a lost race read as an error: {other:?}"
        );
        assert_eq!(won, 2 * ROUNDS, "{name}: exactly one writer wins each race");
        assert_eq!(lost, 2 * ROUNDS * (WRITERS - 1), "{name}");
    }
}
