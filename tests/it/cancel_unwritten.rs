//! A cancel of a task whose attempt starts without a `running` record (an unrecorded
//! task's first attempt): the worker holding the message is signalled, its handler stops
//! and the record counts the attempt; a start the signal missed, coming late after its
//! claim, writes `running` first and meets the `cancelled` record (docs/PROTOCOL.md §8).

use crate::limits::workers_env;
use crate::support::{eventually, within, Env};
use ax_sdk::{TaskSpec, TaskState};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_in_the_first_second_stops_the_unwritten_attempt_and_counts_it() {
    within(Duration::from_secs(60), "cancel unwritten", async {
        // A long ack wait: the attempt stays unwritten for its first second.
        let env = Env::start(Env::server().ack_wait(Duration::from_secs(30))).await;
        let (started, finished) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let (s, f) = (started.clone(), finished.clone());
        let worker = ax_sdk::worker::Worker::builder("q")
            .handler(move |_task| {
                let (s, f) = (s.clone(), f.clone());
                async move {
                    s.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    f.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                }
            })
            .build()
            .unwrap();
        let _w = env.spawn_worker(worker);
        let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
        eventually(Duration::from_secs(5), "the handler to start", || async {
            (started.load(Ordering::SeqCst) == 1).then_some(())
        })
        .await;
        let store = env.store().await;
        assert!(
            store.get(&id).await.unwrap().is_none(),
            "the attempt runs unwritten (no record yet)"
        );
        let out = env.ax.cancel_task(&id).await.unwrap();
        assert_eq!(out.state, TaskState::Cancelled, "{out:?}");
        assert!(out.worker.is_some(), "the holder answered: {out:?}");
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(
            finished.load(Ordering::SeqCst),
            0,
            "the handler was stopped"
        );
        assert_eq!(started.load(Ordering::SeqCst), 1, "and not run again");
        let rec = env.record(&id).await;
        assert_eq!(
            (rec.state, rec.attempt),
            (TaskState::Cancelled, 1),
            "the started attempt is counted"
        );
    })
    .await
}

/// Found by the R3 campaign (seed 4955772603497125947, `cancel_in_progress` fires meeting
/// a resumed worker's backlog): a message the consumer had not delivered when the cancel
/// looked for a holder, delivered before its `cancelled` write to a worker whose claim
/// read the record first. That worker starts unwritten, within its `LATE_START`, and no
/// signal told it; the cancel now looks again after its write and signals it. Red
/// without the second look: no worker answered, and the attempt went uncounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_delivered_while_a_cancel_writes_is_signalled_after_the_write() {
    within(
        Duration::from_secs(60),
        "delivered during a cancel",
        async {
            let faults = ax_core::faults::Faults::armed();
            // The cancel writes its record 800 ms after it looked for a holder.
            faults.cancel_write_delay(Duration::from_millis(800));
            let env = Env::start(
                Env::server()
                    .ack_wait(Duration::from_secs(30))
                    .faults(faults),
            )
            .await;
            env.ax.pause_queue("q", None).await.unwrap();
            let (started, finished) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
            let (s, f) = (started.clone(), finished.clone());
            let worker = ax_sdk::worker::Worker::builder("q")
                .handler(move |_task| {
                    let (s, f) = (s.clone(), f.clone());
                    async move {
                        s.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(3000)).await;
                        f.fetch_add(1, Ordering::SeqCst);
                        Ok(())
                    }
                })
                .build()
                .unwrap();
            let _w = env.spawn_worker(worker);
            let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
            tokio::time::sleep(Duration::from_millis(700)).await;
            let cancel = {
                let (ax, id) = (env.ax.clone(), id.clone());
                tokio::spawn(async move { ax.cancel_task(&id).await })
            };
            // The cancel has looked (not delivered: the queue is paused); now it is.
            tokio::time::sleep(Duration::from_millis(200)).await;
            env.ax.resume_queue("q").await.unwrap();
            eventually(Duration::from_secs(3), "the handler to start", || async {
                (started.load(Ordering::SeqCst) == 1).then_some(())
            })
            .await;
            let out = cancel.await.unwrap().unwrap();
            assert_eq!(out.state, TaskState::Cancelled, "{out:?}");
            assert!(
                out.worker.is_some(),
                "the worker that got the message answered: {out:?}"
            );
            tokio::time::sleep(Duration::from_millis(3000)).await;
            assert_eq!(
                finished.load(Ordering::SeqCst),
                0,
                "the handler was stopped"
            );
            let rec = env.record(&id).await;
            assert_eq!(
                (rec.state, rec.attempt),
                (TaskState::Cancelled, 1),
                "the started attempt is counted"
            );
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unwritten_start_late_after_its_claim_meets_a_cancel_it_was_not_told_of() {
    within(Duration::from_secs(60), "late start", async {
        let env = Env::start(Env::server().ack_wait(Duration::from_secs(30))).await;
        // The worker process waits 1.5 s between its claim and its start.
        let w = workers_env(&env.nats.url(), 1, 4, &[("AX_TEST_CLAIM_DELAY_MS", "1500")]);
        let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
        // Delivered (and so claimed: no record was read), then cancelled by writing the
        // record alone, as a cancel whose signal was lost leaves it.
        let consumer = ax_core::names::consumer_name("q", ax_core::names::Priority::Normal);
        eventually(Duration::from_secs(10), "the delivery", || {
            let (js, consumer) = (env.js.clone(), consumer.clone());
            async move {
                let stream = js.get_stream("AX_READY_NORMAL").await.ok()?;
                let info = stream.consumer_info(&consumer).await.ok()?;
                (info.num_ack_pending == 1).then_some(())
            }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let store = env.store().await;
        let found = env.record(&id).await;
        let cancelled = found.transition(TaskState::Cancelled);
        store.create(&cancelled).await.unwrap();
        tokio::time::sleep(Duration::from_millis(3000)).await;
        let started = crate::limits::runs_started(&w.journals);
        assert!(!started.contains(&id), "the handler never started");
        assert_eq!(env.record(&id).await.state, TaskState::Cancelled);
        // The worker does run what is not cancelled (the check above could not pass for
        // a worker that runs nothing).
        let other = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
        eventually(Duration::from_secs(10), "the other task to start", || {
            let journals = w.journals.clone();
            let other = other.clone();
            async move {
                crate::limits::runs_started(&journals)
                    .contains(&other)
                    .then_some(())
            }
        })
        .await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_fetches_nothing_before_it_hears_cancel_signals() {
    within(Duration::from_secs(60), "cancel before subscribed", async {
        let env = Env::start(Env::server().ack_wait(Duration::from_secs(30))).await;
        let (started, finished) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let (s, f) = (started.clone(), finished.clone());
        // The worker's cancel-signal subscription reaches the server 2 s after it starts
        // (a slow connection); a worker that fetched meanwhile would run the first task
        // unwritten and never hear the cancel below.
        let faults = ax_core::faults::Faults::armed();
        faults.cancel_subscribe_delay(Duration::from_secs(2));
        let worker = ax_sdk::worker::Worker::builder("q")
            .handler(move |_task| {
                let (s, f) = (s.clone(), f.clone());
                async move {
                    s.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    f.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                }
            })
            .faults(faults)
            .build()
            .unwrap();
        let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
        let _w = env.spawn_worker(worker);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let out = env.ax.cancel_task(&id).await.unwrap();
        assert_eq!(out.state, TaskState::Cancelled, "{out:?}");
        tokio::time::sleep(Duration::from_millis(3500)).await;
        assert_eq!(
            (
                started.load(Ordering::SeqCst),
                finished.load(Ordering::SeqCst)
            ),
            (0, 0),
            "the cancelled task's handler never ran"
        );
        assert_eq!(env.record(&id).await.state, TaskState::Cancelled);
        // The worker does run what is not cancelled.
        env.ax.submit("q", TaskSpec::new("t")).await.unwrap();
        eventually(
            Duration::from_secs(10),
            "the other task to finish",
            || async { (finished.load(Ordering::SeqCst) == 1).then_some(()) },
        )
        .await;
    })
    .await
}
