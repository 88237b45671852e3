//! `ax_core::kv_read::latest` on a three-node cluster: it sees every acknowledged write — a key
//! created through one node and read at once through every node, in steady state and
//! through a node that was down while the keys were written — and answers deletes and
//! purges as `kv::Store::entry` does. A direct get (`entry`: any replica answers) has no
//! read-after-write guarantee (nats-server #6557); its misses here are printed, not
//! asserted (none were seen on this machine: the gap is narrow, which is why the flow
//! leader's loads met it only in long fault campaigns).

use crate::support::within;
use async_nats::jetstream::{self, kv};
use ax_testkit::LocalCluster;
use std::time::Duration;

async fn bucket(url: &str) -> kv::Store {
    let js = jetstream::new(async_nats::connect(url).await.expect("connect"));
    crate::support::eventually(Duration::from_secs(30), "the bucket on a node", || {
        let js = js.clone();
        async move { js.get_key_value("KVR").await.ok() }
    })
    .await
}

/// Creates `n` keys `<tag>.<i>` through `writer` and reads each at once through every
/// reader, both ways; answers (direct misses, leader misses).
async fn round(writer: &kv::Store, readers: &[kv::Store], tag: &str, n: usize) -> (usize, usize) {
    let (mut direct, mut leader) = (0, 0);
    for i in 0..n {
        let key = format!("{tag}.{i}");
        writer.create(&key, "v".into()).await.expect("create");
        for r in readers {
            let (d, l) = tokio::join!(r.entry(&key), ax_core::kv_read::latest(r, &key));
            direct += usize::from(!matches!(d, Ok(Some(_))));
            leader += usize::from(!matches!(l, Ok(Some(ref e)) if e.revision > 0));
        }
    }
    (direct, leader)
}

#[tokio::test]
async fn a_leader_read_sees_every_acknowledged_write_on_a_cluster() {
    let mut cluster = LocalCluster::start(3).expect("cluster");
    let urls = cluster.urls();
    let js = jetstream::new(async_nats::connect(&urls[0]).await.expect("connect"));
    within(Duration::from_secs(60), "the bucket", async {
        loop {
            let made = js
                .create_key_value(kv::Config {
                    bucket: "KVR".into(),
                    num_replicas: 3,
                    history: 1,
                    ..Default::default()
                })
                .await;
            if made.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    let writer = bucket(&urls[0]).await;
    let mut readers = Vec::new();
    for url in &urls {
        readers.push(bucket(url).await);
    }
    assert!(
        readers[0].stream.cached_info().config.allow_direct,
        "the bucket allows direct gets, as ax's do"
    );
    let (direct, leader) = round(&writer, &readers, "steady", 500).await;
    println!("steady state: 1,500 reads just after their write: {direct} direct misses (printed), {leader} leader misses");
    assert_eq!(leader, 0, "a leader read missed an acknowledged write");

    // A node down while keys are written, then read through it while it catches up.
    cluster.nodes[2].kill();
    within(
        Duration::from_secs(60),
        "writes while a node is down",
        async {
            for i in 0..2_000 {
                // Through an election if the node was the stream's leader.
                while writer.put(format!("while.{i}"), "v".into()).await.is_err() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        },
    )
    .await;
    cluster.nodes[2].restart().expect("restart");
    // Through the restarted node, once it answers for the bucket (a loaded machine may
    // take seconds).
    let late = bucket(&urls[2]).await;
    let (mut direct, mut leader) = (0, 0);
    for i in (0..2_000).step_by(10) {
        let key = format!("while.{i}");
        let d = late.entry(&key).await;
        direct += usize::from(!matches!(d, Ok(Some(_))));
        // A read that fails (the node still joining) is tried again; one that answers
        // must find the key.
        let l = crate::support::eventually(Duration::from_secs(30), "a leader read", || {
            let (late, key) = (late.clone(), key.clone());
            async move { ax_core::kv_read::latest(&late, &key).await.ok() }
        })
        .await;
        leader += usize::from(l.is_none());
    }
    println!("a node catching up: 200 reads through it: {direct} direct misses (printed), {leader} leader misses");
    assert_eq!(
        leader, 0,
        "a leader read through a node catching up missed a write"
    );

    // What each kind of write reads as, both ways.
    let op = |e: Option<kv::Entry>| e.map(|e| (e.operation, e.value.len()));
    let rev = writer.put("gone", "value".into()).await.expect("put");
    let put = ax_core::kv_read::latest(&late, "gone").await.expect("read");
    assert_eq!(put.as_ref().map(|e| e.revision), Some(rev));
    assert_eq!(op(put), Some((kv::Operation::Put, 5)));
    writer.delete("gone").await.expect("delete");
    let deleted = ax_core::kv_read::latest(&late, "gone").await.expect("read");
    assert_eq!(op(deleted), Some((kv::Operation::Delete, 0)));
    writer.put("purged", "v".into()).await.expect("put");
    writer.purge("purged").await.expect("purge");
    let purged = ax_core::kv_read::latest(&late, "purged")
        .await
        .expect("read");
    assert_eq!(op(purged), Some((kv::Operation::Purge, 0)));
    let never = ax_core::kv_read::latest(&late, "never")
        .await
        .expect("read");
    assert!(never.is_none(), "a key never written reads as none");
}
