//! A least-privilege nats-server (deploy/nats-auth.conf): each role can do its job and no
//! more.

use crate::support::eventually;
use ax::natsd::LocalNats;
use ax::worker::{Task, Worker};
use ax::{Client, TaskSpec, TaskState};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

fn auth_server() -> (LocalNats, tempfile::TempDir) {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/nats-auth.conf"
    ))
    .unwrap()
    .replace("$AX_ADMIN_PASSWORD", "\"pw-admin\"")
    .replace("$AX_SERVER_PASSWORD", "\"pw-server\"")
    .replace("$AX_PRODUCER_PASSWORD", "\"pw-producer\"")
    .replace("$AX_WORKER_PASSWORD", "\"pw-worker\"");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("auth.conf");
    std::fs::write(&path, text).unwrap();
    let nats = LocalNats::start_with_args(vec!["-c".into(), path.display().to_string()]).unwrap();
    (nats, dir)
}

async fn connect(
    url: &str,
    user: &str,
    password: &str,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    async_nats::ConnectOptions::with_user_and_password(user.into(), password.into())
        .request_timeout(Some(Duration::from_secs(2)))
        .connect(url)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_has_least_privilege() {
    let (nats, _dir) = auth_server();
    let url = nats.url();
    assert!(
        connect(&url, "producer", "wrong").await.is_err(),
        "a wrong password is refused"
    );

    // Admin applies the topology; the server runs without stream-management rights.
    let admin = connect(&url, "admin", "pw-admin").await.unwrap();
    let queues = vec!["default".to_string(), "reports".to_string()];
    ax::streams::apply(
        &async_nats::jetstream::new(admin),
        &Default::default(),
        &queues,
    )
    .await
    .unwrap();
    let server_conn = connect(&url, "ax-server", "pw-server").await.unwrap();
    let stop = CancellationToken::new();
    let server = tokio::spawn(
        ax::Server::builder()
            .queues(["default"])
            .apply_streams(false)
            .build()
            .run(server_conn, stop.clone()),
    );

    // The producer can submit (immediate and delayed) ...
    let producer = Client::new(connect(&url, "producer", "pw-producer").await.unwrap());
    let now = eventually(Duration::from_secs(10), "a submit to succeed", || async {
        producer.submit("default", TaskSpec::new("t")).await.ok()
    })
    .await;
    let later = producer
        .submit(
            "default",
            TaskSpec::new("t").delay(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    // ... but not read task state, nor touch JetStream.
    assert!(producer.task(&now.id).await.is_err());
    let raw_producer = connect(&url, "producer", "pw-producer").await.unwrap();
    let js = async_nats::jetstream::new(raw_producer);
    assert!(js.create_stream("EVIL").await.is_err());

    // The worker runs its queue's tasks ...
    let worker_conn = connect(&url, "worker-default", "pw-worker").await.unwrap();
    let worker = Worker::builder("default")
        .handler(|_t: Task| async { Ok(()) })
        .build()
        .unwrap();
    let wstop = CancellationToken::new();
    let wh = tokio::spawn(worker.run(worker_conn.clone(), wstop.clone()));
    let admin_view = Client::new(connect(&url, "admin", "pw-admin").await.unwrap());
    for id in [&now.id, &later.id] {
        eventually(
            Duration::from_secs(10),
            "the worker to finish the task",
            || async {
                let (rec, _) = admin_view.task(id).await.ok()??;
                (rec.state == TaskState::Succeeded).then_some(())
            },
        )
        .await;
    }
    // ... but cannot read another queue, submit, or manage streams.
    let other = Worker::builder("reports")
        .handler(|_t: Task| async { Ok(()) })
        .build()
        .unwrap();
    assert!(other
        .run(worker_conn.clone(), CancellationToken::new())
        .await
        .is_err());
    assert!(Client::new(worker_conn.clone())
        .submit("default", TaskSpec::new("t"))
        .await
        .is_err());
    let wjs = async_nats::jetstream::new(worker_conn);
    assert!(wjs.create_stream("EVIL").await.is_err());
    assert!(wjs.delete_stream("AX_READY_NORMAL").await.is_err());

    // The server cannot change the topology either.
    let sjs = async_nats::jetstream::new(connect(&url, "ax-server", "pw-server").await.unwrap());
    assert!(sjs.delete_stream("AX_DEAD").await.is_err());

    wstop.cancel();
    wh.await.unwrap().unwrap();
    stop.cancel();
    server.await.unwrap().unwrap();
}
