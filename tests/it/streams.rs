//! `ax streams apply`: idempotent, updates what it may, refuses what it may not.

use ax_server::streams::{apply, Outcome, StreamsError, Topology};
use ax_testkit::LocalNats;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_is_idempotent_and_refuses_incompatible_changes() {
    let nats = LocalNats::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let queues = vec!["a".to_string(), "b".to_string()];
    let first = apply(&js, &Topology::default(), &queues).await.unwrap();
    // Every stream but the optional AX_TASK_EVENTS, and 2 queues × 3 consumers.
    assert_eq!(first.len(), ax_server::streams::STREAM_FILES.len() - 1 + 6);
    assert!(
        first.iter().all(|a| a.outcome == Outcome::Created),
        "{first:?}"
    );
    let again = apply(&js, &Topology::default(), &queues).await.unwrap();
    assert!(
        again.iter().all(|a| a.outcome == Outcome::Unchanged),
        "{again:?}"
    );
    let events = Topology {
        task_events: true,
        ..Topology::default()
    };
    let with_events = apply(&js, &events, &queues).await.unwrap();
    let created: Vec<&str> = with_events
        .iter()
        .filter(|a| a.outcome == Outcome::Created)
        .map(|a| a.object.as_str())
        .collect();
    assert_eq!(created, ["stream AX_TASK_EVENTS"]);

    let bigger = Topology {
        capacity: [10, 5000, 10000],
        ..Topology::default()
    };
    let changed = apply(&js, &bigger, &queues).await.unwrap();
    let updated: Vec<_> = changed
        .iter()
        .filter(|a| a.outcome == Outcome::Updated)
        .map(|a| a.object.as_str())
        .collect();
    assert_eq!(updated, ["stream AX_READY_HIGH"]);
    let mut high = js.get_stream("AX_READY_HIGH").await.unwrap();
    assert_eq!(
        high.info().await.unwrap().config.max_messages_per_subject,
        10
    );

    // A stream with the same name but another retention cannot be changed in place.
    js.delete_stream("AX_DEAD").await.unwrap();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "AX_DEAD".into(),
        subjects: vec!["ax.dead.*".into()],
        retention: async_nats::jetstream::stream::RetentionPolicy::Interest,
        ..Default::default()
    })
    .await
    .unwrap();
    match apply(&js, &Topology::default(), &queues).await {
        Err(StreamsError::Incompatible { object, field, .. }) => {
            assert_eq!(
                (object.as_str(), field.as_str()),
                ("stream AX_DEAD", "retention")
            );
        }
        other => panic!("expected an incompatible-change error, got {other:?}"),
    }
}

/// Defect 7.1.7: a server restarted with default flags keeps what the operator set; only
/// `ax streams apply` changes an existing stream or consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_keeps_operator_settings() {
    let mut env = crate::support::Env::start(
        ax_server::Server::builder()
            .queues(["q"])
            .ack_wait(std::time::Duration::from_secs(300))
            .capacity([7, 5000, 10000]),
    )
    .await;
    env.stop_server().await;
    env.start_server(ax_server::Server::builder().queues(["q"]))
        .await;
    let stream = env.js.get_stream("AX_READY_NORMAL").await.unwrap();
    let consumer = stream.consumer_info("ax_q_normal").await.unwrap();
    assert_eq!(
        consumer.config.ack_wait,
        std::time::Duration::from_secs(300)
    );
    let mut high = env.js.get_stream("AX_READY_HIGH").await.unwrap();
    assert_eq!(
        high.info().await.unwrap().config.max_messages_per_subject,
        7
    );
    // A setting this version needs (atomic batches for flow re-runs) is turned on in a
    // bucket made before it, and the operator's settings are kept.
    let mut runs = env.js.get_stream("KV_AX_FLOW_RUNS").await.unwrap();
    let mut old = runs.info().await.unwrap().config.clone();
    assert!(old.allow_atomic_publish);
    old.allow_atomic_publish = false;
    old.max_age = std::time::Duration::from_secs(3600);
    env.js.update_stream(&old).await.unwrap();
    env.stop_server().await;
    env.start_server(ax_server::Server::builder().queues(["q"]))
        .await;
    let now = runs.info().await.unwrap().config.clone();
    assert!(now.allow_atomic_publish);
    assert_eq!(now.max_age, std::time::Duration::from_secs(3600));
    // A queue the server has not seen yet is still created.
    env.stop_server().await;
    env.start_server(ax_server::Server::builder().queues(["q", "fresh"]))
        .await;
    assert!(stream.consumer_info("ax_fresh_normal").await.is_ok());
}

/// The memory setting ax ships for nats-server (docs/PERFORMANCE.md, W4): the harness that
/// `./dev`, the demo and these tests use runs nats-server with it, and docker-compose sets
/// the same value.
#[test]
fn nats_server_runs_with_the_shipped_gomemlimit() {
    if std::env::var_os("GOMEMLIMIT").is_some() {
        return; // the operator's value wins; nothing of ours to check
    }
    let nats = LocalNats::start().unwrap();
    let environ = std::fs::read(format!("/proc/{}/environ", nats.pid().unwrap())).unwrap();
    let want = format!("GOMEMLIMIT={}", ax_testkit::NATS_GOMEMLIMIT);
    assert!(
        environ.split(|b| *b == 0).any(|v| v == want.as_bytes()),
        "nats-server's environment lacks {want}"
    );
    let compose = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/docker-compose.yml"
    ))
    .unwrap();
    let shipped = format!(
        "GOMEMLIMIT: ${{NATS_GOMEMLIMIT:-{}}}",
        ax_testkit::NATS_GOMEMLIMIT
    );
    assert!(compose.contains(&shipped), "docker-compose lacks {shipped}");
}
