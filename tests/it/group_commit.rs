//! `ax_core::atomic::Grouped`, the group commit, against a real stream: a commit that panics
//! fails only its own callers; with `GroupCommit::Auto` it changes between batches and
//! single publishes while writes are in flight, and every write is stored once.

use async_nats::jetstream;
use ax_core::atomic::{GroupCommit, Grouped, Outgoing};
use ax_testkit::LocalNats;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

async fn stream(nats: &LocalNats) -> jetstream::Context {
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.create_stream(jetstream::stream::Config {
        name: "G".into(),
        subjects: vec!["g.>".into()],
        allow_atomic_publish: true,
        ..Default::default()
    })
    .await
    .unwrap();
    js
}

fn msg(subject: &str, header: (&str, &str)) -> Outgoing {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(header.0, header.1);
    Outgoing {
        subject: subject.into(),
        headers,
        payload: "x".into(),
    }
}

/// A group commit that panics (a bug; here an armed fault's subject) fails its own callers
/// and its lane goes on: after more panics than there are lanes, publishes still work.
#[tokio::test]
async fn a_group_commit_that_panics_fails_its_callers_and_the_lanes_go_on() {
    let nats = LocalNats::start().unwrap();
    let js = stream(&nats).await;
    let faults = ax_core::faults::Faults::armed();
    faults.panic_group_commits();
    let grouped = Grouped::start_with_faults(js.clone(), GroupCommit::Always, "G", false, faults);
    for i in 0..10 {
        let lost = grouped
            .publish(msg(
                ax_core::faults::PANIC_GROUP_SUBJECT,
                ("Nats-Msg-Id", &format!("p{i}")),
            ))
            .await;
        assert!(lost.is_err(), "{lost:?}");
    }
    let seq = grouped
        .publish(msg("g.x", ("Nats-Msg-Id", "ok")))
        .await
        .unwrap();
    assert_eq!(seq, 1);
}

/// 64 writers, each a chain of compare-and-sets on its own subject (each write expects the
/// sequence the last one answered), through one `Auto` group commit while it measures
/// both ways: a write lost, stored twice or answered with a wrong sequence breaks the
/// chain. Runs until both ways were used.
#[tokio::test]
async fn auto_changes_ways_with_writes_in_flight_and_stores_each_once() {
    let nats = LocalNats::start().unwrap();
    let js = stream(&nats).await;
    let grouped = Grouped::start_distinct(js.clone(), GroupCommit::Auto, "G");
    assert!(grouped.grouping(), "Auto starts by grouping");
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..64)
        .map(|w| {
            let (grouped, stop) = (grouped.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut last, mut writes) = (0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let expected = last.to_string();
                    let subject = format!("g.{w}");
                    let header = ("Nats-Expected-Last-Subject-Sequence", expected.as_str());
                    last = grouped.publish(msg(&subject, header)).await.unwrap();
                    writes += 1;
                }
                (w, last, writes)
            })
        })
        .collect();
    let (mut grouped_seen, mut single_seen) = (false, false);
    let began = Instant::now();
    while !(grouped_seen && single_seen) && began.elapsed() < Duration::from_secs(20) {
        match grouped.grouping() {
            true => grouped_seen = true,
            false => single_seen = true,
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    assert!(grouped_seen && single_seen, "both ways were used");
    let mut total = 0;
    let mut s = js.get_stream("G").await.unwrap();
    for writer in writers {
        let (w, last, writes) = writer.await.unwrap();
        let stored = s
            .get_last_raw_message_by_subject(&format!("g.{w}"))
            .await
            .unwrap();
        assert_eq!(
            stored.sequence, last,
            "writer {w}'s last answer is its last write"
        );
        total += writes;
    }
    assert_eq!(
        s.info().await.unwrap().state.messages,
        total,
        "each write stored once"
    );
}
