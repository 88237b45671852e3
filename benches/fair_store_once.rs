//! Would storing a fair task once reach issue 41's 0.9 × (docs/ARCHITECTURE.md, "Fair
//! shares")? ax stores a task with a fair key twice (held in `AX_FAIR`, released to its
//! ready subject); this measures, on raw JetStream with no ax in the way, the design that
//! stores it once: each tenant's tasks on a subject of their own in the work-queue
//! stream, a pull consumer per tenant, and the worker taking turns over the tenants in
//! deficit round robin (`QUANTUM` × weight messages a turn, a tenant with nothing ready
//! skipped). Against it, the same tasks on one subject and one consumer (a queue without
//! fair keys). Each drains the same backlogs (tenant `a` 100,000 at weight 1, `c` 50,000
//! at weight 2) while tenant `b` (weight 1) sends one task every 50 ms, two ways: a fetch
//! a turn (a round trip each), and pulls kept outstanding on every consumer
//! (`AX_BENCH_PREFETCH` turns' worth, 4 by default), each turn taking what has arrived.
//! Printed: tasks per second until both backlogs are drained, CPU per 10,000 tasks of this
//! process and of nats-server (a store of its own, started here), `c`'s tasks over `a`'s
//! when the first backlog ran out, and `b`'s waits. `./dev bench fair_store_once`
//! (AX_BENCH_RUNS rounds, 3); printed, not asserted (docs/PERFORMANCE.md, "Fair shares").

mod common;

use async_nats::jetstream::{self, consumer::pull, stream};
use futures::{FutureExt, StreamExt};
use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Tenants: name, weight, backlog.
const TENANTS: [(&str, usize, usize); 3] = [("a", 1, 100_000), ("b", 1, 0), ("c", 2, 50_000)];
/// `b`'s tasks, one every 50 ms from the start of the drain.
const B_TASKS: usize = 20;
/// Messages a tenant of weight 1 gets a turn.
const QUANTUM: usize = 32;
const STREAM: &str = "FX";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Design {
    /// Every tenant's tasks on one subject, one consumer.
    OneSubject,
    /// A subject and a consumer per tenant, taken in turns.
    StoreOnce,
}

/// How many turns' messages an outstanding pull asks for (`AX_BENCH_PREFETCH`, 4).
fn prefetch() -> usize {
    std::env::var("AX_BENCH_PREFETCH")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(4)
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

fn subject(design: Design, tenant: &str) -> String {
    match design {
        Design::OneSubject => "fx.ready".into(),
        Design::StoreOnce => format!("fx.t.{tenant}"),
    }
}

type Consumers = HashMap<String, jetstream::consumer::Consumer<pull::Config>>;

/// A fresh work-queue stream with the backlogs stored, and its consumers by tenant (one,
/// `all`, under `OneSubject`).
async fn prepare(js: &jetstream::Context, design: Design) -> Result<Consumers, async_nats::Error> {
    let _ = js.delete_stream(STREAM).await;
    let stream = js
        .create_stream(stream::Config {
            name: STREAM.into(),
            subjects: vec!["fx.>".into()],
            retention: stream::RetentionPolicy::WorkQueue,
            ..Default::default()
        })
        .await?;
    // Stored interleaved, as producers of several tenants would.
    let mut acks = Vec::new();
    let most = TENANTS.iter().map(|t| t.2).max().unwrap_or(0);
    for i in 0..most {
        for (name, _, backlog) in TENANTS {
            if i < backlog {
                let body = format!("{name} {}", now_us());
                acks.push(js.publish(subject(design, name), body.into()).await?);
            }
        }
        if acks.len() >= 1_000 {
            for ack in acks.drain(..) {
                ack.await?;
            }
        }
    }
    for ack in acks {
        ack.await?;
    }
    let names: Vec<&str> = match design {
        Design::OneSubject => vec!["all"],
        Design::StoreOnce => TENANTS.iter().map(|t| t.0).collect(),
    };
    let mut consumers = HashMap::new();
    for name in names {
        let consumer = stream
            .create_consumer(pull::Config {
                durable_name: Some(name.into()),
                filter_subject: subject(design, name),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                max_ack_pending: 10_000,
                ..Default::default()
            })
            .await?;
        consumers.insert(name.to_string(), consumer);
    }
    Ok(consumers)
}

/// What one drain measured.
struct Drained {
    /// Until both backlogs were drained, and their tasks.
    secs: f64,
    tasks: usize,
    own_cpu: f64,
    nats_cpu: f64,
    /// `c`'s tasks over `a`'s when the first backlog ran out.
    share: f64,
    /// `b`'s waits, ms, sorted.
    b_waits: Vec<f64>,
}

async fn drain(
    js: &jetstream::Context,
    design: Design,
    prefetched: bool,
    nats_pid: u32,
) -> Result<Drained, async_nats::Error> {
    let consumers = prepare(js, design).await?;
    let total: usize = TENANTS.iter().map(|t| t.2).sum::<usize>() + B_TASKS;
    let trickle = tokio::spawn({
        let js = js.clone();
        async move {
            for _ in 0..B_TASKS {
                let body = format!("b {}", now_us());
                if let Ok(ack) = js.publish(subject(design, "b"), body.into()).await {
                    let _ = ack.await;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    let (own0, nats0, t0) = (
        common::usage(std::process::id()).0,
        common::usage(nats_pid).0,
        Instant::now(),
    );
    let mut done: HashMap<String, usize> = HashMap::new();
    let mut b_waits = Vec::new();
    let mut share = None;
    let mut taken = 0;
    // When the two backlogs were drained, and the CPU spent until then.
    let mut drained = None;
    let mut backlog_cpu = (0.0, 0.0);
    let turns: Vec<(String, usize)> = match design {
        Design::OneSubject => vec![("all".into(), 2 * QUANTUM)],
        Design::StoreOnce => TENANTS
            .iter()
            .map(|(n, w, _)| (n.to_string(), QUANTUM * w))
            .collect(),
    };
    let mut pulls = Vec::new();
    for (name, quantum) in &turns {
        let messages = match prefetched {
            true => Some(
                consumers[name]
                    .stream()
                    .max_messages_per_batch(prefetch() * quantum)
                    .messages()
                    .await?,
            ),
            false => None,
        };
        pulls.push((name.clone(), *quantum, messages));
    }
    while taken < total {
        let mut got = 0;
        for (name, quantum, messages) in pulls.iter_mut() {
            let mut turn = Vec::new();
            match messages {
                // What has arrived for the outstanding pulls, up to the turn.
                Some(messages) => {
                    while turn.len() < *quantum {
                        match messages.next().now_or_never() {
                            Some(Some(msg)) => turn.push(msg?),
                            _ => break,
                        }
                    }
                }
                // A fetch of the turn: what is there, at once.
                None => {
                    let mut batch = consumers[name.as_str()]
                        .fetch()
                        .max_messages(*quantum)
                        .messages()
                        .await?;
                    while let Some(msg) = batch.next().await {
                        turn.push(msg?);
                    }
                }
            }
            for msg in turn {
                let body = String::from_utf8_lossy(&msg.payload).to_string();
                let (tenant, at) = body.split_once(' ').unwrap_or(("?", "0"));
                if tenant == "b" {
                    let at: u64 = at.parse().unwrap_or(0);
                    b_waits.push(now_us().saturating_sub(at) as f64 / 1000.0);
                }
                *done.entry(tenant.to_string()).or_default() += 1;
                msg.ack().await?;
                got += 1;
            }
        }
        taken += got;
        let (a, c) = (
            done.get("a").copied().unwrap_or(0),
            done.get("c").copied().unwrap_or(0),
        );
        if share.is_none() && (a >= TENANTS[0].2 || c >= TENANTS[2].2) {
            share = Some(c as f64 / a.max(1) as f64);
        }
        if drained.is_none() && a >= TENANTS[0].2 && c >= TENANTS[2].2 {
            drained = Some(Instant::now());
            backlog_cpu = (
                common::usage(std::process::id()).0 - own0,
                common::usage(nats_pid).0 - nats0,
            );
        }
        if got == 0 {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }
    trickle.await?;
    let drained = drained.unwrap_or_else(Instant::now);
    b_waits.sort_by(f64::total_cmp);
    Ok(Drained {
        secs: (drained - t0).as_secs_f64(),
        tasks: TENANTS.iter().map(|t| t.2).sum(),
        own_cpu: backlog_cpu.0,
        nats_cpu: backlog_cpu.1,
        share: share.unwrap_or(0.0),
        b_waits,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), async_nats::Error> {
    let nats = ax_testkit::LocalNats::start()?;
    let nats_pid = nats.pid().expect("nats-server runs");
    let rounds: usize = std::env::var("AX_BENCH_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    for round in 1..=rounds {
        for prefetched in [false, true] {
            let pulls = match prefetched {
                false => "a fetch a turn".to_string(),
                true => format!("pulls outstanding, {} turns", prefetch()),
            };
            let mut rates = Vec::new();
            for design in [Design::OneSubject, Design::StoreOnce] {
                let d = drain(&js, design, prefetched, nats_pid).await?;
                let per = |cpu: f64| cpu / d.tasks as f64 * 10_000.0;
                let pick = |q: f64| {
                    let i = ((d.b_waits.len() as f64 * q).ceil() as usize).saturating_sub(1);
                    d.b_waits.get(i).copied().unwrap_or(f64::NAN)
                };
                let rate = d.tasks as f64 / d.secs;
                rates.push(rate);
                println!(
                    "round {round}, {pulls}, {design:?}: {rate:.0} tasks/s; CPU per 10,000: \
                     this process {:.2} s, nats-server {:.2} s; c/a while both backlogs last \
                     {:.2}; b waited p50 {:.1} ms, max {:.1} ms ({} tasks)",
                    per(d.own_cpu),
                    per(d.nats_cpu),
                    d.share,
                    pick(0.5),
                    pick(1.0),
                    d.b_waits.len()
                );
            }
            println!(
                "round {round}, {pulls}: store once ÷ one subject {:.2}",
                rates[1] / rates[0]
            );
        }
    }
    let _ = js.delete_stream(STREAM).await;
    Ok(())
}
