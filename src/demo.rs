//! `ax demo`: everything in one process so a newcomer sees tasks flow, retry and finish.

use crate::conn::Conn;
use crate::worker::example_worker;
use anyhow::{Context, Result};
use ax_core::state::ListFilter;
use ax_sdk::{Client, Priority, TaskSpec, TaskState};
use ax_server::Server;
use ax_testkit::LocalNats;
use clap::Args;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

#[derive(Args)]
pub(crate) struct DemoArgs {
    /// Use the NATS server at --url instead of starting a local one.
    #[arg(long)]
    external_nats: bool,
    /// Tasks to submit.
    #[arg(long, default_value_t = 24)]
    tasks: usize,
    /// Serve Prometheus metrics here during the demo ("off" to disable).
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_addr: String,
}

pub(crate) async fn run(args: DemoArgs, conn: &Conn) -> Result<()> {
    println!("• ax demo: the server, a worker and a producer in this process (their logs: warnings only; RUST_LOG=info for all)");
    let local = if args.external_nats {
        None
    } else {
        let server = LocalNats::start().context("starting a local nats-server")?;
        println!(
            "• nats-server with JetStream at {} (store {})",
            server.url(),
            server.store_dir().display()
        );
        Some(server)
    };
    let client = match &local {
        Some(server) => async_nats::connect(server.url()).await?,
        None => conn.connect().await?,
    };
    crate::metrics_at(&args.metrics_addr)?;
    if args.metrics_addr != "off" {
        println!("• metrics at http://{}/metrics", args.metrics_addr);
    }
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(
        Server::builder()
            .task_index(true)
            .queues(["demo"])
            .ack_wait(Duration::from_secs(5))
            .build()
            .run(client.clone(), shutdown.clone()),
    );
    let producer = Client::new(client.clone());
    // Wait until the server answers (it applies the streams first).
    let started = Instant::now();
    loop {
        match producer.submit("demo", TaskSpec::new("warmup")).await {
            Ok(_) => break,
            Err(e) if started.elapsed() < Duration::from_secs(15) => {
                tracing::debug!(cause = %e, "server not ready yet");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e).context("ax server did not come up"),
        }
    }
    println!("• ax server up; starting a worker (concurrency 4, 25% flaky failures)");
    let worker = tokio::spawn(
        example_worker("demo", 4, 0.25, None, None, None)
            .build()?
            .run(client.clone(), shutdown.clone()),
    );

    let mut ids = Vec::new();
    for i in 0..args.tasks {
        let priority = Priority::ALL[i % 3];
        let mut spec = TaskSpec::new(if i == 5 { "poison" } else { "resize_image" })
            .json(&serde_json::json!({ "image": i }))
            .priority(priority)
            .max_attempts(4)
            .backoff(Duration::from_millis(200), Duration::from_secs(2), 0.2);
        if i % 4 == 3 {
            spec = spec.delay(Duration::from_millis(500 * (i as u64 % 7 + 1)));
        }
        let accepted = producer.submit("demo", spec).await?;
        println!(
            "  submitted {} ({priority}, {})",
            accepted.id, accepted.state
        );
        ids.push(accepted.id);
    }
    let dup = producer
        .submit(
            "demo",
            TaskSpec::new("invoice").idempotency_key("invoice:2026-11"),
        )
        .await?;
    let again = producer
        .submit(
            "demo",
            TaskSpec::new("invoice").idempotency_key("invoice:2026-11"),
        )
        .await?;
    println!(
        "  idempotency: second submit of key invoice:2026-11 -> {} (duplicate: {})",
        again.id, again.duplicate
    );
    ids.push(dup.id);
    let tick = serde_json::json!({
        "name": "demo-tick", "kind": "interval", "every_ms": 2000, "overlap": "skip",
        "tasks": [{"name": "tick", "queue": "demo"}],
    });
    producer.trigger("put", &tick).await?;
    println!(
        "  trigger demo-tick: an interval trigger firing every 2 s (ax trigger get demo-tick)"
    );

    let mut last: HashMap<String, (TaskState, u32)> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let records = producer
            .list(&ListFilter {
                queue: Some("demo".into()),
                ..ListFilter::default()
            })
            .await?;
        let mut counts: HashMap<TaskState, usize> = HashMap::new();
        for rec in records.iter().filter(|r| ids.contains(&r.id)) {
            *counts.entry(rec.state).or_default() += 1;
            let now = (rec.state, rec.attempt);
            if last.get(&rec.id) != Some(&now) {
                let error = rec
                    .last_error
                    .as_ref()
                    .map(|e| format!(" — last error {}: {}", e.class, e.message))
                    .unwrap_or_default();
                println!(
                    "  {} {:<9} attempt {}{}",
                    rec.id,
                    rec.state.to_string(),
                    rec.attempt,
                    error
                );
                last.insert(rec.id.clone(), now);
            }
        }
        let finished = counts.get(&TaskState::Succeeded).copied().unwrap_or(0)
            + counts.get(&TaskState::Dead).copied().unwrap_or(0);
        if finished == ids.len() {
            println!(
                "• all {} tasks finished: {} succeeded, {} dead (see `ax task get <id> --history`)",
                ids.len(),
                counts.get(&TaskState::Succeeded).copied().unwrap_or(0),
                counts.get(&TaskState::Dead).copied().unwrap_or(0)
            );
            break;
        }
        if Instant::now() > deadline {
            println!("• gave up waiting after 60 s: {counts:?}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let tick = producer
        .trigger("get", &serde_json::json!({ "name": "demo-tick" }))
        .await?;
    println!(
        "• trigger demo-tick fired {} time(s); next fires {}",
        tick["state"]["fires"], tick["next"]
    );
    shutdown.cancel();
    worker.await??;
    server.await??;
    println!("• stopped cleanly");
    Ok(())
}
