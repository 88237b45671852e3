//! A least-privilege nats-server (deploy/nats-auth.conf): each role can do its job and no
//! more.

use crate::support::eventually;
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, TaskSpec, TaskState};
use ax_testkit::LocalNats;
use futures::StreamExt;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

fn auth_server() -> (LocalNats, tempfile::TempDir) {
    auth_server_with(|text| text)
}

/// deploy/nats-auth.conf edited by `edit`, with the test passwords filled in.
fn auth_server_text(edit: impl FnOnce(String) -> String) -> String {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/nats-auth.conf"
    ))
    .unwrap();
    edit(text)
        .replace("$AX_ADMIN_PASSWORD", "\"pw-admin\"")
        .replace("$AX_SERVER_PASSWORD", "\"pw-server\"")
        .replace("$AX_PRODUCER_PASSWORD", "\"pw-producer\"")
        .replace("$AX_WORKER_PASSWORD", "\"pw-worker\"")
}

/// nats-server with deploy/nats-auth.conf, edited by `edit`.
fn auth_server_with(edit: impl FnOnce(String) -> String) -> (LocalNats, tempfile::TempDir) {
    let text = auth_server_text(edit);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("auth.conf");
    std::fs::write(&path, text).unwrap();
    let nats = LocalNats::start_with_args(vec!["-c".into(), path.display().to_string()]).unwrap();
    (nats, dir)
}

/// Writes deploy/nats-auth.conf back as shipped (every right granted) over the edited
/// copy in `dir`, and has `nats` reload it (SIGHUP).
fn reload_unedited(nats: &LocalNats, dir: &tempfile::TempDir) {
    let conf = dir.path().join("auth.conf");
    let granted = auth_server_text(|t| t);
    assert_ne!(
        std::fs::read_to_string(&conf).unwrap(),
        granted,
        "nothing to grant"
    );
    std::fs::write(&conf, granted).unwrap();
    let pid = nats.pid().unwrap().to_string();
    let hup = std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap();
    assert!(hup.success());
}

/// Connects as `user`, with that user's own inbox prefix (`_INBOX.<user>`).
async fn connect(
    url: &str,
    user: &str,
    password: &str,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    async_nats::ConnectOptions::with_user_and_password(user.into(), password.into())
        .custom_inbox_prefix(format!("_INBOX.{user}"))
        .request_timeout(Some(Duration::from_secs(2)))
        .connect(url)
        .await
}

/// The admin applies the topology of `queues`; an ax server for queue `default` runs as
/// user ax-server, without stream-management rights. Returns the admin's connection.
async fn admin_applies_and_server_runs(
    url: &str,
    queues: &[&str],
) -> (
    async_nats::Client,
    CancellationToken,
    tokio::task::JoinHandle<Result<(), ax_server::ServerError>>,
) {
    let admin = connect(url, "admin", "pw-admin").await.unwrap();
    let queues: Vec<String> = queues.iter().map(|q| q.to_string()).collect();
    ax_server::streams::apply(
        &async_nats::jetstream::new(admin.clone()),
        &Default::default(),
        &queues,
    )
    .await
    .unwrap();
    let server_conn = connect(url, "ax-server", "pw-server").await.unwrap();
    let stop = CancellationToken::new();
    let server = tokio::spawn(
        ax_server::Server::builder()
            .task_index(true)
            .queues(["default"])
            .apply_streams(false)
            .build()
            .run(server_conn, stop.clone()),
    );
    (admin, stop, server)
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
    let (_admin, stop, server) = admin_applies_and_server_runs(&url, &["default", "reports"]).await;

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
    // A keyed task: its claim reads the key (the worker's rights on AX_IDEMPOTENCY).
    let keyed = producer
        .submit("default", TaskSpec::new("t").idempotency_key("k-1"))
        .await
        .unwrap();
    // ... but not read task state, nor touch JetStream.
    assert!(producer.task(&now.id).await.is_err());
    let raw_producer = connect(&url, "producer", "pw-producer").await.unwrap();
    let js = async_nats::jetstream::new(raw_producer);
    assert!(js.create_stream("EVIL").await.is_err());

    // The worker runs its queue's tasks ...
    let worker_conn = connect(&url, "worker-default", "pw-worker").await.unwrap();
    // Its outputs are larger than the inline limit: they go to AX_RESULTS.
    let worker = Worker::builder("default")
        .handler(|t: Task| async move {
            if t.payload.as_ref() == b"\"block\"" {
                tokio::time::sleep(Duration::from_secs(60)).await;
            }
            Ok(ax_sdk::Output::bytes(vec![7u8; 2048]))
        })
        .build()
        .unwrap();
    let wstop = CancellationToken::new();
    let wh = tokio::spawn(worker.run(worker_conn.clone(), wstop.clone()));
    let admin_view = Client::new(connect(&url, "admin", "pw-admin").await.unwrap());
    for id in [&now.id, &later.id, &keyed.id] {
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
    // ... but cannot touch the record of a task in another queue: neither mark it
    // `succeeded` (its real worker would then ack it unrun) nor read it.
    let foreign = admin_view
        .submit("reports", TaskSpec::new("t"))
        .await
        .unwrap();
    let wkv = async_nats::jetstream::new(worker_conn.clone())
        .get_key_value("AX_TASKS")
        .await
        .unwrap();
    let forged = br#"{"state":"succeeded"}"#.to_vec();
    assert!(
        wkv.put(&foreign.id, forged.into()).await.is_err(),
        "worker-default rewrote a task record of queue reports"
    );
    let output = admin_view.wait(&now.id).await.unwrap().output.unwrap();
    assert_eq!(output.bytes.len(), 2048, "the worker stored its output");
    let wresults = async_nats::jetstream::new(worker_conn.clone())
        .get_key_value("AX_RESULTS")
        .await
        .unwrap();
    assert!(
        wresults
            .put(format!("{}.1", foreign.id), vec![1u8].into())
            .await
            .is_err(),
        "worker-default wrote an output of queue reports"
    );
    assert!(
        !wkv.get(&foreign.id)
            .await
            .map(|v| v.is_some())
            .unwrap_or(false),
        "worker-default read a task record of queue reports"
    );
    assert_eq!(
        admin_view.task(&foreign.id).await.unwrap().unwrap().0.state,
        TaskState::Pending
    );
    // A producer cannot listen in on other users' replies (task records, payloads).
    let snoop_conn = connect(&url, "producer", "pw-producer").await.unwrap();
    let mut snoop = snoop_conn.subscribe("_INBOX.>").await.unwrap();
    let snooped_submit = admin_view
        .submit("default", TaskSpec::new("t"))
        .await
        .unwrap();
    eventually(
        Duration::from_secs(10),
        "the worker to finish the task",
        || async {
            let (rec, _) = admin_view.task(&snooped_submit.id).await.ok()??;
            (rec.state == TaskState::Succeeded).then_some(())
        },
    )
    .await;
    let heard = tokio::time::timeout(Duration::from_millis(500), snoop.next()).await;
    assert!(
        !matches!(heard, Ok(Some(_))),
        "the producer read a reply meant for another user: {:?}",
        heard.ok().flatten().map(|m| m.subject)
    );
    // ... and cannot read another queue, submit, or manage streams.
    // A worker of another queue on this user's connection waits (it cannot see the
    // queue) and never runs the queue's task.
    let other = Worker::builder("reports")
        .handler(|_t: Task| async { Ok(()) })
        .build()
        .unwrap();
    let ostop = CancellationToken::new();
    let oh = tokio::spawn(other.run(worker_conn.clone(), ostop.clone()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!oh.is_finished());
    assert_eq!(
        admin_view.task(&foreign.id).await.unwrap().unwrap().0.state,
        TaskState::Pending,
        "worker-default ran a task of queue reports"
    );
    ostop.cancel();
    oh.await.unwrap().unwrap();
    assert!(Client::new(worker_conn.clone())
        .submit("default", TaskSpec::new("t"))
        .await
        .is_err());
    let wjs = async_nats::jetstream::new(worker_conn);
    assert!(wjs.create_stream("EVIL").await.is_err());
    assert!(wjs.delete_stream("AX_READY_NORMAL").await.is_err());

    // Triggers are managed by the admin only, and fire under the server's permissions.
    let def = serde_json::json!({"name": "tick", "kind": "interval", "every_ms": 1000,
        "tasks": [{"name": "t", "queue": "default"}]});
    assert!(producer.trigger("put", &def).await.is_err());
    assert!(
        Client::new(connect(&url, "worker-default", "pw-worker").await.unwrap())
            .trigger("put", &def)
            .await
            .is_err()
    );
    admin_view.trigger("put", &def).await.unwrap();
    eventually(
        Duration::from_secs(10),
        "a trigger task to finish",
        || async {
            let recs = admin_view.list(&Default::default()).await.ok()?;
            recs.iter()
                .any(|r| r.trigger.as_deref() == Some("tick") && r.state == TaskState::Succeeded)
                .then_some(())
        },
    )
    .await;

    // Flows: the admin defines them, a producer may start runs, and the server drives
    // them under its own permissions (its flow engine, the worker-default worker).
    let flow = ax_sdk::flow::FlowDef::new("secure").step(ax_sdk::flow::StepDef::new(
        "only",
        "default",
        TaskSpec::new("t"),
    ));
    assert!(producer.put_flow(&flow).await.is_err());
    admin_view.put_flow(&flow).await.unwrap();
    let run = producer
        .run_flow("secure", serde_json::json!({}))
        .await
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(20), admin_view.wait_flow(&run))
        .await
        .expect("the run ends")
        .unwrap();
    assert_eq!(
        ended.state,
        ax_sdk::flow::RunState::Succeeded,
        "{:?}",
        ended.reason
    );
    // A flow that waits for an event: the server registers and matches it under its own
    // grants; a producer publishes the event, but may not publish an alert.
    let wait = ax_sdk::flow::WaitForEventDef {
        event: "order.paid".into(),
        matches: serde_json::json!({"order_id": "$input.order"})
            .as_object()
            .cloned()
            .unwrap(),
        ..Default::default()
    };
    let paid = ax_sdk::flow::FlowDef::new("secure_paid")
        .step(ax_sdk::flow::StepDef::wait_for_event("w", "default", wait))
        .step(ax_sdk::flow::StepDef::new("t", "default", TaskSpec::new("t")).needs(["w"]));
    admin_view.put_flow(&paid).await.unwrap();
    let run = producer
        .run_flow("secure_paid", serde_json::json!({"order": 5}))
        .await
        .unwrap();
    producer
        .publish_event("order.paid", &serde_json::json!({"order_id": 5}), None)
        .await
        .expect("a producer publishes events");
    let ended = tokio::time::timeout(Duration::from_secs(30), admin_view.wait_flow(&run))
        .await
        .expect("the waiting run ends")
        .unwrap();
    assert_eq!(
        ended.state,
        ax_sdk::flow::RunState::Succeeded,
        "{:?}",
        ended.reason
    );
    assert!(
        producer
            .publish_event("alert.default", &serde_json::json!({}), None)
            .await
            .is_err(),
        "a producer published an alert"
    );
    assert!(producer
        .clone()
        .wait_for_server(Duration::ZERO)
        .cancel_flow(&run)
        .await
        .is_err_and(|e| e.kind() != ax_sdk::ErrorKind::NotFound));

    // An approval: the server stores its secret and announces its token under its own
    // grants; a producer holding the token approves it, but may neither approve by task
    // id (an operator's) nor forge an announcement.
    let admin_nats = connect(&url, "admin", "pw-admin").await.unwrap();
    let mut announced = admin_nats
        .subscribe("ax.events.approval.requested")
        .await
        .unwrap();
    let gated = ax_sdk::flow::FlowDef::new("secure_gated")
        .step(ax_sdk::flow::StepDef::approval(
            "ok",
            "default",
            ax_sdk::flow::ApprovalDef::default(),
        ))
        .step(ax_sdk::flow::StepDef::new("t", "default", TaskSpec::new("t")).needs(["ok"]));
    admin_view.put_flow(&gated).await.unwrap();
    let run = producer
        .run_flow("secure_gated", serde_json::json!({}))
        .await
        .unwrap();
    let msg = tokio::time::timeout(Duration::from_secs(20), announced.next())
        .await
        .expect("the approval is announced")
        .unwrap();
    let announcement: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
    let by = |token: Option<&str>, task: Option<&str>| ax_sdk::flow::ApprovalCompletion {
        token: token.map(str::to_string),
        task: task.map(str::to_string),
        decision: ax_sdk::flow::Decision::Approve,
        payload: None,
        reason: None,
    };
    let task = announcement["task"].as_str().unwrap();
    assert!(
        producer
            .clone()
            .wait_for_server(Duration::ZERO)
            .complete_approval(&by(None, Some(task)))
            .await
            .is_err_and(|e| e.kind() != ax_sdk::ErrorKind::NotFound),
        "a producer approved by task id"
    );
    assert!(
        producer
            .publish_event("approval.requested", &announcement, None)
            .await
            .is_err(),
        "a producer forged an announcement"
    );
    producer
        .complete_approval(&by(announcement["token"].as_str(), None))
        .await
        .expect("a producer approves with the token");
    let ended = tokio::time::timeout(Duration::from_secs(30), admin_view.wait_flow(&run))
        .await
        .expect("the approved run ends")
        .unwrap();
    assert_eq!(
        ended.state,
        ax_sdk::flow::RunState::Succeeded,
        "{:?}",
        ended.reason
    );

    // Limits: the admin sets them; the worker follows them and takes tokens and slots
    // under its own queue's keys.
    assert!(producer
        .clone()
        .wait_for_server(Duration::ZERO)
        .limits(
            "put",
            &serde_json::json!({"name": "one", "queue": "default", "concurrency": 1})
        )
        .await
        .is_err());
    admin_view
        .limits(
            "put",
            &serde_json::json!({"name": "one", "queue": "default", "concurrency": 1, "rate": 100.0}),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let limited = admin_view
        .submit("default", TaskSpec::new("t"))
        .await
        .unwrap();
    let done = tokio::time::timeout(Duration::from_secs(20), admin_view.wait(&limited.id))
        .await
        .expect("a limited task runs under least privilege")
        .unwrap();
    assert_eq!(done.record.state, TaskState::Succeeded);
    // A limit shared with another queue: its bucket and slots (`=shared.<name>`) are
    // the worker's to use too.
    admin_view
        .limits(
            "put",
            &serde_json::json!({"name": "partner", "queues": ["default", "reports"],
                                "task": "shared", "concurrency": 1, "rate": 100.0}),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let shared = admin_view
        .submit("default", TaskSpec::new("shared"))
        .await
        .unwrap();
    let done = tokio::time::timeout(Duration::from_secs(20), admin_view.wait(&shared.id))
        .await
        .expect("a task under a shared limit runs under least privilege")
        .unwrap();
    assert_eq!(done.record.state, TaskState::Succeeded);
    admin_view
        .limits(
            "delete",
            &serde_json::json!({"queue": "reports", "name": "partner"}),
        )
        .await
        .unwrap();

    // Operations: the producer may not use them; the admin finds tasks through the
    // server's index, runs a delayed task now, cancels a running one (the worker hears
    // the signal on its queue's subject), pauses and resumes, reads a task's events.
    assert!(producer
        .clone()
        .wait_for_server(Duration::ZERO)
        .task_op("list", &serde_json::json!({}))
        .await
        .is_err());
    eventually(
        Duration::from_secs(10),
        "the index to find the tasks",
        || async {
            let q = ax_sdk::ops::ListRequest {
                query: ax_sdk::ops::TaskQuery {
                    state: Some(TaskState::Succeeded),
                    queue: Some("default".into()),
                    ..Default::default()
                },
                ..Default::default()
            };
            let found = admin_view.find_tasks(&q).await.ok()?;
            (found.total >= Some(3)).then_some(())
        },
    )
    .await;
    let held = admin_view
        .submit(
            "default",
            TaskSpec::new("t").delay(Duration::from_secs(3600)),
        )
        .await
        .unwrap();
    admin_view.run_now(&held.id).await.unwrap();
    let done = tokio::time::timeout(Duration::from_secs(20), admin_view.wait(&held.id))
        .await
        .expect("run now under least privilege")
        .unwrap();
    assert_eq!(done.record.state, TaskState::Succeeded);
    let blocked = admin_view
        .submit("default", TaskSpec::new("t").json(&"block"))
        .await
        .unwrap();
    eventually(
        Duration::from_secs(10),
        "the blocking task to run",
        || async {
            let (rec, _) = admin_view.task(&blocked.id).await.ok()??;
            (rec.state == TaskState::Running).then_some(())
        },
    )
    .await;
    let cancelled = admin_view.cancel_task(&blocked.id).await.unwrap();
    assert_eq!(cancelled.state, TaskState::Cancelled, "{cancelled:?}");
    admin_view.pause_queue("default", None).await.unwrap();
    let queues = admin_view.queues().await.unwrap();
    assert_eq!(queues["queues"][0]["paused"], true, "{queues}");
    admin_view.resume_queue("default").await.unwrap();
    let status = admin_view
        .limits("status", &serde_json::json!({"queue": "default"}))
        .await
        .unwrap();
    assert_eq!(status[0]["limit"]["name"], "one", "{status}");
    assert!(admin_view
        .limits("list", &serde_json::json!({}))
        .await
        .is_ok());
    assert!(admin_view
        .trigger("leader", &serde_json::json!({}))
        .await
        .is_ok());
    assert!(!admin_view
        .task_events(&done.record.id)
        .await
        .unwrap()
        .0
        .is_empty());

    // The server cannot change the topology either.
    let sjs = async_nats::jetstream::new(connect(&url, "ax-server", "pw-server").await.unwrap());
    assert!(sjs.delete_stream("AX_DEAD").await.is_err());

    wstop.cancel();
    wh.await.unwrap().unwrap();
    stop.cancel();
    server.await.unwrap().unwrap();
}

/// A CA and a server certificate for 127.0.0.1, made with the openssl command.
fn make_certs(dir: &std::path::Path) {
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl is installed");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=ax test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        "-out",
        "server.pem",
    ]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ax_binary_connects_with_credentials_and_a_custom_ca() {
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path());
    let p = |name: &str| dir.path().join(name).display().to_string();
    let nats = LocalNats::start_with_args(vec![
        "--tls".into(),
        "--tlscert".into(),
        p("server.pem"),
        "--tlskey".into(),
        p("server.key"),
        "--user".into(),
        "ax".into(),
        "--pass".into(),
        "s3cret-pw".into(),
    ])
    .unwrap();
    let url = nats.url();
    // The ax server process connects over TLS, verifying the server with the custom CA.
    let mut server = std::process::Command::new(env!("CARGO_BIN_EXE_ax"))
        .args([
            "server",
            "--queue",
            "q",
            "--metrics-addr",
            "off",
            "--tls-ca",
            &p("ca.pem"),
            "--user",
            "ax",
        ])
        .env("NATS_URL", &url)
        .env("NATS_PASSWORD", "s3cret-pw")
        .env("RUST_LOG", "debug")
        .stdout(std::process::Stdio::null())
        // A file, not a pipe: nobody drains a pipe while the test runs.
        .stderr(std::fs::File::create(dir.path().join("server.log")).unwrap())
        .spawn()
        .unwrap();
    let client =
        async_nats::ConnectOptions::with_user_and_password("ax".into(), "s3cret-pw".into())
            .add_root_certificates(dir.path().join("ca.pem"))
            .require_tls(true)
            .connect(&url)
            .await
            .unwrap();
    let ax = Client::new(client);
    let accepted = eventually(
        Duration::from_secs(20),
        "the TLS ax server to answer",
        || async { ax.submit("q", TaskSpec::new("t")).await.ok() },
    )
    .await;
    assert_eq!(accepted.state, TaskState::Pending);
    // With the right password but without the CA, the certificate is refused.
    let no_ca = std::process::Command::new(env!("CARGO_BIN_EXE_ax"))
        .args(["streams", "apply", "--user", "ax"])
        .env("NATS_URL", &url)
        .env("NATS_PASSWORD", "s3cret-pw")
        .output()
        .unwrap();
    assert!(!no_ca.status.success());
    let why = String::from_utf8_lossy(&no_ca.stderr).to_lowercase();
    assert!(why.contains("certificate") || why.contains("tls"), "{why}");
    // The password never reaches the logs, even at debug level.
    server.kill().unwrap();
    server.wait().unwrap();
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap();
    assert!(log.contains("ax server ready"), "{log}");
    assert!(!log.contains("s3cret-pw"), "password leaked into the log");
}

/// Defect 7.1.6: a failure to look up a queue is `unavailable` (retry), not
/// `unknown_queue` (give up); a task whose message is stored but whose record write failed
/// is accepted, and runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_failures_get_retryable_codes_and_stored_tasks_are_accepted() {
    let (nats, _dir) = auth_server_with(|text| {
        let marker = "{ user: ax-server, password: $AX_SERVER_PASSWORD, permissions: {\n          publish: {";
        assert!(text.contains(marker), "auth config layout changed");
        text.replace(
            marker,
            &format!("{marker} deny: [\"$KV.AX_TASKS.>\", \"$JS.API.CONSUMER.INFO.AX_READY_NORMAL.ax_reports_normal\"],"),
        )
    });
    let url = nats.url();
    let admin = connect(&url, "admin", "pw-admin").await.unwrap();
    let queues = vec!["default".to_string(), "reports".to_string()];
    ax_server::streams::apply(
        &async_nats::jetstream::new(admin.clone()),
        &Default::default(),
        &queues,
    )
    .await
    .unwrap();
    let stop = CancellationToken::new();
    let server = tokio::spawn(
        ax_server::Server::builder()
            .queues(["default"])
            .apply_streams(false)
            .build()
            .run(
                connect(&url, "ax-server", "pw-server").await.unwrap(),
                stop.clone(),
            ),
    );
    let producer = Client::new(
        async_nats::ConnectOptions::with_user_and_password("producer".into(), "pw-producer".into())
            .custom_inbox_prefix("_INBOX.producer")
            .request_timeout(Some(Duration::from_secs(20)))
            .connect(&url)
            .await
            .unwrap(),
    );
    let accepted = eventually(
        Duration::from_secs(30),
        "a submit to be answered",
        || async {
            match producer.submit("default", TaskSpec::new("t")).await {
                Ok(a) => Some(Ok(a)),
                Err(ax_sdk::ClientError::Refused(e)) => Some(Err(e)),
                Err(_) => None,
            }
        },
    )
    .await
    .expect("stored in its ready subject, so accepted although the record write failed");
    // The worker writes the missing record and runs the task.
    let worker = Worker::builder("default")
        .handler(|_t: Task| async { Ok(()) })
        .build()
        .unwrap();
    let wstop = CancellationToken::new();
    let wh = tokio::spawn(worker.run(
        connect(&url, "worker-default", "pw-worker").await.unwrap(),
        wstop.clone(),
    ));
    let admin_view = Client::new(admin);
    eventually(
        Duration::from_secs(20),
        "the accepted task to run",
        || async {
            let (rec, _) = admin_view.task(&accepted.id).await.ok()??;
            (rec.state == TaskState::Succeeded).then_some(())
        },
    )
    .await;
    match producer.submit("reports", TaskSpec::new("t")).await {
        Err(ax_sdk::ClientError::Refused(e)) => {
            assert_eq!(e.code, ax_core::protocol::ErrorCode::Unavailable, "{e}")
        }
        other => panic!("expected unavailable, got {other:?}"),
    }
    wstop.cancel();
    wh.await.unwrap().unwrap();
    stop.cancel();
    server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_index_that_cannot_start_waits_and_the_server_stays_up() {
    // The ax-server user may not create the delayed-task index consumers (as when the
    // stream has no leader during an election: the request times out). The server must
    // keep serving and retry; once the right is granted (config reload), delayed tasks run.
    const GRANT: &str =
        r#""$JS.API.CONSUMER.CREATE.AX_DELAYED", "$JS.API.CONSUMER.CREATE.AX_DELAYED.>","#;
    let (nats, dir) = auth_server_with(|text| {
        assert!(
            text.contains(GRANT),
            "deploy/nats-auth.conf grants the index consumers"
        );
        text.replace(GRANT, "")
    });
    let url = nats.url();
    let (admin, stop, server) = admin_applies_and_server_runs(&url, &["default"]).await;
    let ax = Client::new(admin.clone());
    let task = eventually(Duration::from_secs(10), "a submit to succeed", || async {
        ax.submit(
            "default",
            TaskSpec::new("t").delay(Duration::from_millis(100)),
        )
        .await
        .ok()
    })
    .await;
    // Several index-consumer requests time out (2 s each) meanwhile.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        !server.is_finished(),
        "the server stopped when its delayed index could not start: {:?}",
        server.await
    );
    // Grant the right again and reload the config.
    reload_unedited(&nats, &dir);
    let worker = Worker::builder("default")
        .handler(|_t: Task| async { Ok(()) })
        .build()
        .unwrap();
    let wstop = CancellationToken::new();
    let wh = tokio::spawn(worker.run(admin.clone(), wstop.clone()));
    eventually(
        Duration::from_secs(30),
        "the delayed task to run once its index starts",
        || async {
            let (rec, _) = ax.task(&task.id).await.ok()??;
            (rec.state == TaskState::Succeeded).then_some(())
        },
    )
    .await;
    wstop.cancel();
    wh.await.unwrap().unwrap();
    stop.cancel();
    server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_engine_denied_its_definitions_fires_once_a_reload_grants_them() {
    // The ax-server user may not follow the trigger definitions (no consumer on
    // KV_AX_TRIGGERS), so the trigger engine's leader fails as it starts to lead, again
    // and again, and fires nothing; once a config reload grants the bucket, cron fires.
    // (An engine whose start failed used to stay stopped, silent, until the process
    // exited.)
    const ALLOWED: &str = r#""$KV.AX_FLOWS.>", "$KV.AX_FLOW_RUNS.>", "$KV.AX_LIMITS.>"
          ] }"#;
    const DENIED: &str =
        r#""$JS.API.CONSUMER.CREATE.KV_AX_TRIGGERS", "$JS.API.CONSUMER.CREATE.KV_AX_TRIGGERS.>""#;
    let (nats, dir) = auth_server_with(|text| {
        assert!(
            text.contains(ALLOWED),
            "deploy/nats-auth.conf: the server's grants end so"
        );
        text.replace(
            ALLOWED,
            &format!("{}, deny: [{DENIED}] }}", &ALLOWED[..ALLOWED.len() - 2]),
        )
    });
    let url = nats.url();
    let (admin, stop, server) = admin_applies_and_server_runs(&url, &["default"]).await;
    let ax = Client::new(admin.clone());
    let def: ax_sdk::trigger::TriggerDef = serde_json::from_value(serde_json::json!({
        "name": "beat", "kind": "interval", "every_ms": 1000, "overlap": "allow",
        "tasks": [{"name": "beat-task", "queue": "default"}],
    }))
    .unwrap();
    eventually(Duration::from_secs(10), "the trigger stored", || async {
        ax.put_trigger(&def).await.ok()
    })
    .await;
    // The fires made so far. (A read here once failed with no responders for the admin's
    // bucket lookup, 1 run in 6: read again.)
    let fires = || async {
        eventually(Duration::from_secs(10), "the task records", || async {
            let recs = ax.list(&Default::default()).await.ok()?;
            Some(
                recs.iter()
                    .filter(|r| r.trigger.as_deref() == Some("beat"))
                    .count(),
            )
        })
        .await
    };
    // Each start's consumer request is refused (it times out in 2 s).
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(fires().await, 0, "the engine fired without its definitions");
    assert!(
        !server.is_finished(),
        "the server stopped: {:?}",
        server.await
    );

    reload_unedited(&nats, &dir);
    eventually(
        Duration::from_secs(30),
        "two fires once the bucket is granted",
        || async { (fires().await >= 2).then_some(()) },
    )
    .await;
    stop.cancel();
    server.await.unwrap().unwrap();
}

/// A direct-submitting producer (`producer-direct-default`) stores its own queue's tasks,
/// immediate and delayed, and they run; it cannot publish into another queue, not even
/// by a raw publish on its ready subject, and a message with forged headers on its own
/// subject is dead-lettered by the worker, never run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_producer_publishes_only_its_own_queue() {
    let (nats, _dir) = auth_server();
    let url = nats.url();
    let (admin, stop, server) = admin_applies_and_server_runs(&url, &["default", "reports"]).await;
    let conn = connect(&url, "producer-direct-default", "pw-producer")
        .await
        .unwrap();
    let direct = Client::new(conn.clone()).direct_submits(true);
    let now = eventually(Duration::from_secs(10), "a direct submit", || async {
        direct.submit("default", TaskSpec::new("t")).await.ok()
    })
    .await;
    let later = direct
        .submit(
            "default",
            TaskSpec::new("t").delay(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    // Another queue: refused before anything is stored, and a raw publish is not stored.
    assert!(direct.submit("reports", TaskSpec::new("t")).await.is_err());
    let js = async_nats::jetstream::new(conn.clone());
    // A delayed task published again (its first answer lost) is found stored, with the
    // producer's own rights (a direct get of its own subject): stored once.
    let waiting = direct
        .submit(
            "default",
            TaskSpec::new("t").delay(Duration::from_secs(3600)),
        )
        .await
        .unwrap();
    let subject = ax_core::names::delayed_subject("default", ax_sdk::Priority::Normal, &waiting.id);
    let stored = async_nats::jetstream::new(admin.clone())
        .get_stream("AX_DELAYED")
        .await
        .unwrap()
        .get_last_raw_message_by_subject(&subject)
        .await
        .unwrap();
    let meta = ax_core::task::TaskMeta::from_headers(&stored.headers).unwrap();
    let again = ax_core::admit::publish_task(&js, subject, &meta, stored.payload).await;
    assert_eq!(
        again.ok(),
        Some(stored.sequence),
        "found where it is stored"
    );
    // That look-up reaches its own queue's delayed tasks only: another queue's is refused.
    let theirs = Client::new(admin.clone())
        .submit(
            "reports",
            TaskSpec::new("t").delay(Duration::from_secs(3600)),
        )
        .await
        .unwrap();
    let theirs = ax_core::names::delayed_subject("reports", ax_sdk::Priority::Normal, &theirs.id);
    let read = tokio::time::timeout(
        Duration::from_secs(5),
        js.get_stream_no_info("AX_DELAYED")
            .await
            .unwrap()
            .direct_get_last_for_subject(&theirs),
    )
    .await;
    assert!(
        !matches!(read, Ok(Ok(_))),
        "a direct producer of default read a delayed task of reports"
    );
    let raw = js.publish("ax.ready.reports.normal", "x".into()).await;
    let stored = match raw {
        Ok(ack) => tokio::time::timeout(Duration::from_secs(3), ack)
            .await
            .is_ok_and(|a| a.is_ok()),
        Err(_) => false,
    };
    assert!(
        !stored,
        "a direct producer of default stored into queue reports"
    );
    // A forged message on its own subject (no task headers): never run, dead-lettered.
    let forged = js
        .publish("ax.ready.default.normal", "forged".into())
        .await
        .unwrap()
        .await;
    assert!(
        forged.is_ok(),
        "its own subject takes the publish: {forged:?}"
    );
    // Forged task headers on its own subject, each checked again by the worker: a task
    // naming another queue, a payload that is not the JSON its headers say, one past the
    // payload bound (the client would have refused the last two).
    let forge = |queue: &str| {
        let req = ax_sdk::SubmitRequest {
            name: "t".into(),
            ..Default::default()
        };
        let (meta, _) =
            ax_core::task::TaskMeta::from_request(queue, req, &Default::default()).unwrap();
        ax_core::admit::unrecorded(meta).to_headers()
    };
    let big = format!("\"{}\"", "x".repeat(300 * 1024));
    for (queue, payload) in [
        ("reports", "null".to_string()),
        ("default", "{not json".to_string()),
        ("default", big),
    ] {
        let stored = js
            .publish_with_headers("ax.ready.default.normal", forge(queue), payload.into())
            .await
            .unwrap()
            .await;
        assert!(stored.is_ok(), "its own subject takes it: {stored:?}");
    }
    let ran = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let worker_conn = connect(&url, "worker-default", "pw-worker").await.unwrap();
    let worker = Worker::builder("default")
        .handler({
            let ran = ran.clone();
            move |_t: Task| {
                ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async { Ok(()) }
            }
        })
        .build()
        .unwrap();
    let wstop = CancellationToken::new();
    let wh = tokio::spawn(worker.run(worker_conn, wstop.clone()));
    let admin_view = Client::new(admin.clone());
    for id in [&now.id, &later.id] {
        eventually(
            Duration::from_secs(10),
            "the direct task to run",
            || async {
                let (rec, _) = admin_view.task(id).await.ok()??;
                (rec.state == TaskState::Succeeded).then_some(())
            },
        )
        .await;
    }
    let admin_js = async_nats::jetstream::new(admin);
    eventually(
        Duration::from_secs(10),
        "the forged message dead-lettered",
        || {
            let admin_js = admin_js.clone();
            async move {
                let mut dead = admin_js.get_stream("AX_DEAD").await.ok()?;
                (dead.info().await.ok()?.state.messages >= 4).then_some(())
            }
        },
    )
    .await;
    let dead = admin_js.get_stream("AX_DEAD").await.unwrap();
    let mut why = Vec::new();
    for seq in 1..=4 {
        let m = dead.get_raw_message(seq).await.unwrap();
        let h = |name| m.headers.get(name).map(|v| v.as_str().to_string());
        assert_eq!(
            h(ax_core::task::header::ERROR_CLASS).as_deref(),
            Some("bad_message")
        );
        why.push(h(ax_core::task::header::ERROR_MESSAGE).unwrap_or_default());
    }
    for expected in ["no headers", "queue reports", "not JSON", "payload is"] {
        assert!(
            why.iter().any(|w| w.contains(expected)),
            "a dead letter says {expected:?}: {why:?}"
        );
    }
    assert_eq!(
        ran.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "only the two tasks ran"
    );
    eventually(
        Duration::from_secs(10),
        "nothing stored for queue reports, nothing left",
        || {
            let admin_js = admin_js.clone();
            async move {
                let mut ready = admin_js.get_stream("AX_READY_NORMAL").await.ok()?;
                (ready.info().await.ok()?.state.messages == 0).then_some(())
            }
        },
    )
    .await;
    wstop.cancel();
    wh.await.unwrap().unwrap();
    stop.cancel();
    server.await.unwrap().unwrap();
}

/// A direct producer granted some priorities of its queue only (deploy/nats-auth.conf with
/// `ax.ready.default.high` taken out): a task of a priority it was not granted fails its
/// submit and is not stored; the priorities it was granted go in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_producer_publishes_only_the_priorities_it_was_granted() {
    let (nats, _dir) = auth_server_with(|text| {
        let edited = text.replace("\"ax.ready.default.high\", ", "");
        assert_ne!(
            edited, text,
            "the grant to take out is in deploy/nats-auth.conf"
        );
        edited
    });
    let url = nats.url();
    let (admin, stop, server) = admin_applies_and_server_runs(&url, &["default"]).await;
    let conn = connect(&url, "producer-direct-default", "pw-producer")
        .await
        .unwrap();
    let direct = Client::new(conn).direct_submits(true);
    eventually(Duration::from_secs(10), "a direct submit", || async {
        direct.submit("default", TaskSpec::new("t")).await.ok()
    })
    .await;
    let low = TaskSpec::new("t").priority(ax_sdk::Priority::Low);
    assert!(direct.submit("default", low).await.is_ok());
    let high = TaskSpec::new("t").priority(ax_sdk::Priority::High);
    let refused = direct.submit("default", high).await;
    assert!(refused.is_err(), "a priority not granted: {refused:?}");
    let admin_js = async_nats::jetstream::new(admin);
    let count = |name: &'static str| {
        let admin_js = admin_js.clone();
        async move {
            let mut stream = admin_js.get_stream(name).await.unwrap();
            stream.info().await.unwrap().state.messages
        }
    };
    assert_eq!(count("AX_READY_HIGH").await, 0, "nothing stored");
    assert_eq!(count("AX_READY_LOW").await, 1);
    stop.cancel();
    server.await.unwrap().unwrap();
}
