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
use ax_core::error::ErrorKind;
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

/// What the writes of one race came to.
#[derive(Default)]
struct Outcome {
    won: usize,
    /// Lost races read as such (`Stale`).
    lost: usize,
    /// Lost races read as broker errors: what this test is about.
    misread: Vec<String>,
    /// Other failures (a write timed out on a loaded machine): the race is not judged.
    unsure: usize,
}

/// `WRITERS` concurrent writes of `id` at `revision`.
async fn race(store: &TaskStore, id: &str, revision: u64) -> Outcome {
    let writes = (0..WRITERS).map(|w| {
        let rec = record(id, &format!("w{w}"));
        async move { store.cas(&rec, revision).await }
    });
    let mut out = Outcome::default();
    for result in futures::future::join_all(writes).await {
        match result {
            Ok(_) => out.won += 1,
            Err(StateError::Stale { .. }) => out.lost += 1,
            Err(e) if e.kind() == ErrorKind::Conflict => out.misread.push(format!("{e:?}")),
            Err(e) => {
                println!("{id}: a write failed otherwise: {e}");
                out.unsure += 1;
            }
        }
    }
    out
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
        let (mut lost, mut judged, mut misread) = (0, 0, Vec::new());
        for round in 0..ROUNDS {
            let id = format!("{name}-{round}");
            // Creates racing, then compare-and-sets of the record one of them stored.
            let created = race(store, &id, 0).await;
            let Some((_, revision)) = store.get_latest(&id).await.expect("read") else {
                assert_eq!(created.won, 0, "{id}: a create won but nothing is stored");
                continue;
            };
            let updated = race(store, &id, revision).await;
            for o in [created, updated] {
                assert!(o.won <= 1, "{name}: {} writers won one race", o.won);
                if o.unsure == 0 {
                    assert_eq!(o.won, 1, "{name}: exactly one writer wins each race");
                    judged += 1;
                }
                lost += o.lost;
                misread.extend(o.misread);
            }
        }
        println!(
            "{name}: {judged} races judged, {lost} lost as stale, {} lost races read as errors",
            misread.len()
        );
        assert!(
            misread.is_empty(),
            "{name}: a lost race read as an error: {misread:?}"
        );
        assert!(
            lost >= judged * (WRITERS - 1),
            "{name}: {lost} losers in {judged} races"
        );
    }
}
