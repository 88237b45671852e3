//! The fault campaign : mixed load while a seeded nemesis kills and
//! restarts real processes, then a checker over what was observed.
//!
//! Load: immediate tasks, delayed ones (half of both with a fair key, four tenants), bursts
//! at one due time beyond the servers' read-ahead horizon, retries, dead letters, refused
//! submits (bad input, a full queue), triggers with each overlap policy and fixed-delay,
//! manual runs (queues `q`, `hot`); flows with fan-out,
//! gather, chains, failures, cancels and re-runs (`flows`), a per-key rate, a per-key cap and
//! a singleton (`limits`), singleton keys and a rate that drops its excess (`admission`),
//! and cancels, retries, "run now", pause and resume (`ops`), on queue `x`; tenants'
//! backlogs under fair shares and a `normal` backlog with `low` tasks behind it
//! (`fairness`), on queue `fq`. Nemesis (`cluster`): `kill -9` of one or two of the three ax servers, `kill -9`
//! of a worker, `SIGSTOP` of a worker past the ack wait, and the nats-server (single node:
//! kill and restart; R3: one node at a time); a second one kills and pauses queue `x`'s
//! workers. Handlers append every start and end with its fencing token to a journal file
//! (`ax worker --example --journal`).
//!
//! The checker (`checker*.rs`, `verdict`): every accepted task reached a final state; no
//! task has two recorded outcomes; a success is backed by a successful invocation under its
//! token; per task, tokens only grow, no attempt ran twice and no start is one its record
//! does not count; every scheduled trigger time in the window was fired exactly once (or
//! accounted as skipped by its overlap policy); no fire was stored twice; every refused
//! submit stored nothing; flow runs end as their policy says and step tasks run once per
//! epoch, after their parents; limits hold (starts per window, holders at once) as the
//! journals count them; singleton keys refuse only for a task that had not ended and never
//! let two tasks of a key live at once, and a dropping rate admits no more than its bound
//! (`checker_admission`); a small tenant passes a big one's backlog and an aged `low`
//! task is not starved (`checker_fairness`); operations take effect (nothing starts after its cancel was
//! acknowledged, nor in a paused queue).
//!
//! Which seeds run: the fixed list of [`seeds`] (what `./dev test`, and so CI, replays:
//! a landing never depends on a seed a clock picked), or `AX_CAMPAIGN_SEED` — one seed or
//! several, comma-separated, to replay, or `random` for a new one (`./dev campaign`). Each
//! run prints its seed first. `AX_CAMPAIGN_SECS` (default 40) sets the load time of each
//! run. A long run: `./dev campaign 600`.

mod admission;
mod approvals;
mod checker;
mod checker_admission;
mod checker_approvals;
mod checker_batches;
mod checker_children;
mod checker_fairness;
mod checker_flows;
mod checker_limits;
mod checker_ops;
mod checker_waits;
mod cluster;
mod fairness;
mod flows;
mod journal;
mod limits;
mod ops;
#[allow(dead_code, unused_imports)]
#[path = "../it/procs.rs"]
mod procs;
mod seeds;
mod trace;
use ax_testkit::env as support;
mod verdict;

use ax_core::time::now_ms;
use ax_sdk::{Client, ClientError, TaskRecord, TaskSpec};
use checker::{Histories, StoredAt};
use cluster::{Kills, Nats, Procs, Timeline};
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the producer saw.
#[derive(Default)]
pub struct Log {
    pub accepted: HashSet<String>,
    /// How many of `accepted` the producer stored itself (direct submits, no key).
    pub direct_accepted: usize,
    /// (queue, idempotency key, code, clean) of each refused submit; `clean` when no
    /// earlier attempt with that key went unanswered or was `unavailable` (such an attempt
    /// may have stored the key, or the task).
    pub refused: Vec<(String, String, String, bool)>,
    /// Debounced submits, in each lane's order (its keys are its own).
    pub debounced: Vec<crate::checker_limits::Debounced>,
    /// Batched submits (items), answered or not.
    pub batched: Vec<crate::checker_batches::Batched>,
    pub manual_answered: Vec<String>,
    pub manual_refused: usize,
    pub manual_unanswered: usize,
    pub unanswered_retries: usize,
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

type Answer = Result<ax_core::protocol::SubmitAccepted, ax_core::protocol::WireError>;

/// Submits until answered (same idempotency key on every retry): the answer (`None` if no
/// answer came within a minute), and whether every attempt before it was answered and not
/// `unavailable`.
pub async fn submit_until_answered(
    ax: &Client,
    queue: &str,
    spec: TaskSpec,
    log: &Mutex<Log>,
) -> (Option<Answer>, bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut clean = true;
    while Instant::now() < deadline {
        match ax.submit(queue, spec.clone()).await {
            Ok(a) => return (Some(Ok(a)), clean),
            Err(ClientError::Refused(e))
                if e.code.is_retryable() && e.code != ax_core::protocol::ErrorCode::Busy =>
            {
                clean = false;
                log.lock().unwrap().unanswered_retries += 1;
            }
            Err(ClientError::Refused(e)) => return (Some(Err(e)), clean),
            Err(_) => {
                clean = false;
                log.lock().unwrap().unanswered_retries += 1
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (None, false)
}

pub const TRIGGERS: [(&str, &str); 5] = [
    ("t-allow", "allow"),
    ("t-skip", "skip"),
    ("t-buffer", "buffer_one"),
    ("t-delay", "fixed_delay"),
    ("t-cancel", "cancel_in_progress"),
];

fn trigger_def(name: &str, policy: &str) -> serde_json::Value {
    // Runs of 1.5 s every second make skip and buffer_one act; allow's are short.
    let sleep = if policy == "allow" { 50 } else { 1500 };
    let mut def = serde_json::json!({
        "name": name, "kind": "interval", "every_ms": 1000, "max_catch_up": 60,
        "tasks": [{"name": "tick", "queue": "q", "priority": "low",
                   "payload": {"sleep_ms": sleep}, "max_attempts": 10,
                   "backoff": {"base_ms": 100, "max_ms": 1000}}],
    });
    match policy {
        "fixed_delay" => def["mode"] = "fixed_delay".into(),
        other => def["overlap"] = other.into(),
    }
    def
}

async fn produce(ax: Client, log: Arc<Mutex<Log>>, seed: u64, until: Instant) {
    let n = Arc::new(std::sync::atomic::AtomicU64::new(0));
    // A quarter of the plain tasks and a fifth of the delayed ones go without a key, stored
    // by the producer itself (direct submits, docs/PROTOCOL.md §2).
    let direct = ax.clone().direct_submits(true);
    let lanes = (0..12).map(|lane| {
        let (ax, direct, log, n) = (ax.clone(), direct.clone(), log.clone(), n.clone());
        async move {
            let mut rng = StdRng::seed_from_u64(seed ^ ((lane as u64 + 1) * 0x9e37_79b9));
            let mut next_burst = Instant::now() + Duration::from_secs(3);
            while Instant::now() < until {
                let k = n.fetch_add(1, Ordering::Relaxed);
                let key = format!("c-{seed}-{k}");
                let roll: u32 = rng.random_range(0..100);
                let retry = |s: TaskSpec| s.max_attempts(5).backoff(Duration::from_millis(100), Duration::from_secs(1), 0.2);
                if (35..=37).contains(&roll) {
                    debounce_burst(&ax, &log, lane, &mut rng).await;
                    continue;
                }
                if (38..=39).contains(&roll) {
                    batch_burst(&ax, &log, lane, &key, &mut rng).await;
                    continue;
                }
                let (queue, spec) = match roll {
                    0..=39 => ("q", retry(TaskSpec::new("plain").json(&serde_json::json!({"sleep_ms": 20})))),
                    40..=54 => ("q", retry(TaskSpec::new("flaky").json(&serde_json::json!({"sleep_ms": 10, "fail_attempts": rng.random_range(1..=2)})))),
                    55..=59 => ("q", retry(TaskSpec::new("poison").json(&serde_json::json!({"permanent": true})))),
                    60..=84 => ("q", retry(TaskSpec::new("later").json(&serde_json::json!({"sleep_ms": 20}))
                        .delay(Duration::from_millis(rng.random_range(100..3000))))),
                    85..=89 => {
                        // Bad input: refused, stores nothing.
                        let bad = TaskSpec::new("bad").idempotency_key(format!("{key}\r\nX: 1"));
                        if let (Some(Err(e)), clean) = submit_until_answered(&ax, "q", bad, &log).await {
                            log.lock().unwrap().refused.push(("q".into(), format!("{key}\r\nX: 1"), e.code.as_str().into(), clean));
                        }
                        continue;
                    }
                    // A small, slow queue (capacity 20 at high): some of these are `busy`.
                    _ => ("hot", TaskSpec::new("hot").json(&serde_json::json!({"sleep_ms": 300})).priority(ax_sdk::Priority::High)),
                };
                // Half the plain and delayed tasks have one of four tenants as fair key:
                // held in AX_FAIR and released by the fair dispatcher (a leader that
                // servers are killed under), so the rules on accepted tasks cover it.
                let spec = match roll {
                    0..=39 | 60..=84 if roll.is_multiple_of(2) => spec.fair_key(format!("t{}", roll % 8 / 2)),
                    _ => spec,
                };
                let (by, spec) = match roll {
                    0..=9 | 60..=64 => (&direct, spec),
                    _ => (&ax, spec.idempotency_key(key.clone())),
                };
                match submit_until_answered(by, queue, spec, &log).await {
                    (Some(Ok(a)), _) => {
                        let mut log = log.lock().unwrap();
                        log.direct_accepted += usize::from(std::ptr::eq(by, &direct));
                        log.accepted.insert(a.id);
                    }
                    (Some(Err(e)), clean) => log.lock().unwrap().refused.push((queue.into(), key.clone(), e.code.as_str().into(), clean)),
                    (None, _) => {}
                }
                if lane == 0 && Instant::now() >= next_burst {
                    // A burst at one due time beyond the 3 s horizon.
                    next_burst = Instant::now() + Duration::from_secs(8);
                    let at = ax_core::time::format_rfc3339_ms(now_ms() + 5000);
                    let burst: Vec<_> = (0..300)
                        .map(|b| {
                            let (ax, log, at) = (ax.clone(), log.clone(), at.clone());
                            let key = format!("{key}-burst-{b}");
                            async move {
                                let spec = TaskSpec::new("burst").run_at(at).idempotency_key(key);
                                if let (Some(Ok(a)), _) = submit_until_answered(&ax, "q", spec, &log).await {
                                    log.lock().unwrap().accepted.insert(a.id);
                                }
                            }
                        })
                        .collect();
                    futures::stream::iter(burst).buffer_unordered(32).collect::<Vec<()>>().await;
                }
                if lane == 1 && rng.random_bool(0.03) {
                    let force = rng.random_bool(0.5);
                    let body = serde_json::json!({"name": "t-manual", "force": force});
                    match ax.trigger("run", &body).await {
                        Ok(v) => log.lock().unwrap().manual_answered.extend(
                            v["task_ids"].as_array().into_iter().flatten().filter_map(|i| i.as_str().map(String::from)),
                        ),
                        Err(ClientError::Refused(e)) if e.code == ax_core::protocol::ErrorCode::Running => {
                            log.lock().unwrap().manual_refused += 1
                        }
                        Err(_) => log.lock().unwrap().manual_unanswered += 1,
                    }
                }
                tokio::time::sleep(Duration::from_millis(rng.random_range(20..80))).await;
            }
        }
    });
    futures::future::join_all(lanes).await;
}

/// A burst of 1-6 debounced submits of one of the lane's two keys, 20-400 ms apart (a gap
/// over the period may end the window; a long burst meets `max_wait`).
async fn debounce_burst(ax: &Client, log: &Mutex<Log>, lane: usize, rng: &mut StdRng) {
    use crate::checker_limits::{Debounced, DEBOUNCE_MAX_WAIT_MS, DEBOUNCE_PERIOD_MS};
    let key = format!("d{lane}-{}", rng.random_range(0..2));
    for _ in 0..rng.random_range(1..=6) {
        let spec = TaskSpec::new("plain")
            .json(&serde_json::json!({"sleep_ms": 20}))
            .debounce(key.clone(), Duration::from_millis(DEBOUNCE_PERIOD_MS))
            .debounce_max_wait(Duration::from_millis(DEBOUNCE_MAX_WAIT_MS));
        let sent_ms = now_ms();
        if let (Some(Ok(a)), _) = submit_until_answered(ax, "q", spec, log).await {
            let mut log = log.lock().unwrap();
            log.accepted.insert(a.id.clone());
            log.debounced.push(Debounced {
                key: key.clone(),
                id: a.id,
                sent_ms,
                answered_ms: now_ms(),
            });
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(20..400))).await;
    }
}

/// 1-9 items of one of the lane's two batch keys, 0-150 ms apart (a batch fills at
/// [`BATCH_SIZE`] or times out).
async fn batch_burst(ax: &Client, log: &Mutex<Log>, lane: usize, key: &str, rng: &mut StdRng) {
    use crate::checker_batches::{Batched, BATCH_SIZE, BATCH_TIMEOUT_MS};
    let batch_key = format!("b{lane}-{}", rng.random_range(0..2));
    for i in 0..rng.random_range(1..=9) {
        let item = format!("{key}-i{i}");
        let spec = TaskSpec::new("plain")
            .json(&serde_json::json!({"item": item, "sleep_ms": 20}))
            .batch(
                batch_key.clone(),
                BATCH_SIZE,
                Duration::from_millis(BATCH_TIMEOUT_MS),
            );
        // Every other item with an idempotency key: held once even when its submit is
        // sent again.
        let keyed = i % 2 == 0;
        let spec = match keyed {
            true => spec.idempotency_key(item.clone()),
            false => spec,
        };
        let answer = submit_until_answered(ax, "q", spec, log).await;
        {
            let mut log = log.lock().unwrap();
            let clean = answer.1;
            let id = match answer {
                (Some(Ok(a)), _) => {
                    log.accepted.insert(a.id.clone());
                    Some(a.id)
                }
                _ => None,
            };
            log.batched.push(Batched {
                item,
                id,
                clean,
                keyed,
            });
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..150))).await;
    }
}

/// Every revision of every task record, read once through an ordered consumer, and when
/// each revision was stored. A broker that is still settling after the nemesis (an R3
/// election) is asked again.
pub async fn histories(js: &async_nats::jetstream::Context) -> (Histories, StoredAt) {
    let mut tries = 0;
    loop {
        match try_histories(js).await {
            Ok(h) => return h,
            Err(e) if tries < 120 => {
                tries += 1;
                eprintln!("reading the task records failed ({e}); retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("cannot read the task records: {e}"),
        }
    }
}

async fn try_histories(
    js: &async_nats::jetstream::Context,
) -> Result<(Histories, StoredAt), async_nats::Error> {
    let stream = js.get_stream("KV_AX_TASKS").await?;
    let last = stream.cached_info().state.last_sequence;
    let mut out: Histories = Histories::new();
    let mut stored = StoredAt::new();
    if last == 0 {
        return Ok((out, stored));
    }
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig::default())
        .await?;
    let mut msgs = consumer.messages().await?;
    while let Some(msg) = msgs.next().await {
        let msg = msg?;
        let info = msg.info()?;
        let seq = info.stream_sequence;
        let key = msg.subject.trim_start_matches("$KV.AX_TASKS.").to_string();
        if let Ok(rec) = serde_json::from_slice::<TaskRecord>(&msg.payload) {
            stored.insert(
                seq,
                (info.published.unix_timestamp_nanos() / 1_000_000) as u64,
            );
            out.entry(key).or_default().push((seq, rec));
        }
        if seq >= last {
            break;
        }
    }
    Ok((out, stored))
}

/// The two campaigns run one after the other: each alone loads both cores.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Puts a definition through an API, retrying while servers come up.
async fn put(what: &str, f: impl AsyncFn() -> Result<serde_json::Value, ClientError>) {
    support::eventually(Duration::from_secs(30), what, || async { f().await.ok() }).await;
}

/// Runs the campaign once per chosen seed ([`seeds::chosen`]: the fixed list unless
/// `AX_CAMPAIGN_SEED` names seeds or `random`), every seed even after one failed, then
/// fails naming each seed that found violations.
async fn campaign(cluster: bool) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let secs: u64 = std::env::var("AX_CAMPAIGN_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let chosen = seeds::chosen(cluster, std::env::var("AX_CAMPAIGN_SEED").ok().as_deref())
        .unwrap_or_else(|e| panic!("{e}"));
    let mut failed = Vec::new();
    for seed in chosen {
        let violations = run(cluster, seed, secs).await;
        if violations > 0 {
            failed.push(format!(
                "seed {seed}: {violations} violations (replay: AX_CAMPAIGN_SEED={seed})"
            ));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("; "));
}

/// One campaign of `secs` of load under `seed`; the number of violations (each printed).
async fn run(cluster: bool, seed: u64, secs: u64) -> usize {
    let kind = if cluster { "R3 cluster" } else { "single node" };
    println!(
        "fault campaign ({kind}): seed {seed}, {secs} s of load (replay: AX_CAMPAIGN_SEED={seed}; AX_CAMPAIGN_EXTENDED=0 leaves out flows, limits and operations)"
    );
    let nats = if cluster {
        Nats::Cluster(ax_testkit::LocalCluster::start(3).unwrap())
    } else {
        Nats::Single(ax_testkit::LocalNats::start().unwrap())
    };
    let url = nats.url();
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal.jsonl");
    let mut procs = Procs::new(&url, journal.clone(), cluster);
    // One server first, so the topology is created once with these settings.
    procs.servers[0] = Some(procs.server(0));
    let addrs: Vec<async_nats::ServerAddr> = url.split(',').map(|u| u.parse().unwrap()).collect();
    let client = async_nats::ConnectOptions::new()
        .request_timeout(Some(Duration::from_secs(3)))
        .connect(addrs.as_slice())
        .await
        .unwrap();
    // A fresh cluster elects its leaders and the first server creates the whole topology
    // with three replicas before it answers: on a loaded CI machine that outlasted 20 s.
    let first_answer = Duration::from_secs(if cluster { 90 } else { 20 });
    ax_testkit::net::wait_ready_within(&client, first_answer).await;
    procs.all_up();
    let _hot = procs.hot_worker();
    let _fq = procs.fq_worker();
    let ax = Client::new(client.clone());
    let js = async_nats::jetstream::new(client.clone());
    for (name, policy) in TRIGGERS {
        ax.trigger("put", &trigger_def(name, policy)).await.unwrap();
    }
    let manual = serde_json::json!({"name": "t-manual", "kind": "interval", "every_ms": 3_600_000,
        "tasks": [{"name": "tick", "queue": "q", "priority": "low", "payload": {"sleep_ms": 300}}]});
    ax.trigger("put", &manual).await.unwrap();
    for def in limits::defs().into_iter().chain([admission::drop_def()]) {
        put("a limit to be stored", async || {
            ax.limits("put", &def).await
        })
        .await;
    }
    put("the fair shares of fq to be stored", async || {
        ax.limits("fair_put", &fairness::fair_def()).await
    })
    .await;
    for def in flows::defs() {
        put("a flow to be stored", async || ax.flow("put", &def).await).await;
    }
    let lister_stop = tokio_util::sync::CancellationToken::new();
    let lister = tokio::spawn(
        flows::lister(journal::Journal::open(&journal)).run(client.clone(), lister_stop.clone()),
    );

    let procs = Arc::new(Mutex::new(procs));
    let nats = Arc::new(tokio::sync::Mutex::new(nats));
    let timeline: Arc<Mutex<Timeline>> = Arc::default();
    let log: Arc<Mutex<Log>> = Arc::default();
    let flow_log: Arc<Mutex<flows::FlowLog>> = Arc::default();
    let limit_log: Arc<Mutex<limits::LimitLog>> = Arc::default();
    let ops_log: Arc<Mutex<ops::OpsLog>> = Arc::default();
    let admission_log: Arc<Mutex<admission::AdmissionLog>> = Arc::default();
    let fairness_log: Arc<Mutex<fairness::FairnessLog>> = Arc::default();
    let until = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    // The load on queue `x` (flows, limits, operations) and its nemesis run by default;
    // `AX_CAMPAIGN_EXTENDED=0` leaves them out (the campaign of tasks and triggers alone,
    // as the first campaigns did).
    let extended = std::env::var("AX_CAMPAIGN_EXTENDED").map_or(true, |v| v != "0");
    let (kills, x_kills, ..) = tokio::join!(
        cluster::nemesis(procs.clone(), nats.clone(), timeline.clone(), seed, until),
        async {
            if extended {
                cluster::x_nemesis(procs.clone(), timeline.clone(), seed, until).await
            } else {
                Kills::default()
            }
        },
        produce(ax.clone(), log.clone(), seed, until),
        async {
            if extended {
                flows::load(ax.clone(), client.clone(), flow_log.clone(), seed, until).await
            }
        },
        async {
            if extended {
                limits::load(ax.clone(), log.clone(), limit_log.clone(), seed, until).await
            }
        },
        async {
            if extended {
                ops::load(ax.clone(), log.clone(), ops_log.clone(), seed, until).await
            }
        },
        async {
            if extended {
                admission::load(ax.clone(), log.clone(), admission_log.clone(), seed, until).await
            }
        },
        async {
            if extended {
                fairness::load(ax.clone(), log.clone(), fairness_log.clone(), seed, until).await
            }
        },
    );
    let loaded = started.elapsed();
    procs.lock().unwrap().all_up();
    // Faults have stopped: the system must recover and handle scheduled times again
    // before the window closes (an R3 cluster whose node came back in the last seconds
    // may take longer than the checker's 10 s to elect and answer). If it does not
    // within 60 s, the window closes anyway and the checker reports the stall.
    let healed_ms = now_ms();
    let _ = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let mut recovered = true;
            for (name, _) in TRIGGERS.iter().filter(|t| t.1 != "fixed_delay") {
                let last = ax
                    .trigger("get", &serde_json::json!({"name": name}))
                    .await
                    .ok()
                    .and_then(|got| got["state"]["last_scheduled_ms"].as_u64());
                recovered &= last.is_some_and(|l| l > healed_ms + 2_000);
            }
            if recovered {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
    // Close the window: stop the triggers (retrying while servers come back).
    for name in TRIGGERS.iter().map(|t| t.0).chain(["t-manual"]) {
        support::eventually(Duration::from_secs(60), "a trigger to pause", || async {
            ax.trigger("pause", &serde_json::json!({"name": name}))
                .await
                .ok()
        })
        .await;
    }
    let paused_ms = now_ms();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Quiesce: every record final (accepted tasks, trigger and step tasks alike), every
    // flow run ended.
    let quiet = tokio::time::timeout(Duration::from_secs(150), async {
        loop {
            let (h, stored) = histories(&js).await;
            let open = h
                .values()
                .filter(|v| v.last().is_some_and(|(_, r)| !r.state.is_terminal()))
                .count();
            let accepted = log.lock().unwrap().accepted.clone();
            let missing = accepted.iter().filter(|id| !h.contains_key(*id)).count();
            if open == 0 && missing == 0 && flows::all_ended(&ax, &flow_log).await {
                return (h, stored);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
    .await;
    let mut verdict = verdict::Verdict::default();
    let (histories, stored_at) = match quiet {
        Ok(h) => h,
        Err(_) => {
            verdict.add(
                "quiesce",
                vec!["the system did not quiesce within 150 s".into()],
            );
            histories(&js).await
        }
    };
    lister_stop.cancel();
    let _ = lister.await;
    let seen = verdict::Seen {
        journal: checker::parse_journal(&std::fs::read_to_string(&journal).unwrap_or_default()),
        histories,
        stored_at,
        timeline: timeline.lock().unwrap().clone(),
        log: std::mem::take(&mut *log.lock().unwrap()),
        flows: std::mem::take(&mut *flow_log.lock().unwrap()),
        limits: std::mem::take(&mut *limit_log.lock().unwrap()),
        ops: std::mem::take(&mut *ops_log.lock().unwrap()),
        admission: std::mem::take(&mut *admission_log.lock().unwrap()),
        fairness: std::mem::take(&mut *fairness_log.lock().unwrap()),
        cluster,
        paused_ms,
    };
    let accepted_ids = seen.log.accepted.clone();
    let seen_histories: std::collections::HashSet<String> =
        seen.histories.keys().cloned().collect();
    let unfinished: Vec<String> = accepted_ids
        .iter()
        .filter(|id| {
            seen.histories
                .get(*id)
                .and_then(|h| h.last())
                .is_some_and(|(_, r)| !r.state.is_terminal())
        })
        .cloned()
        .collect();
    let mut report = verdict::check_core(&ax, &js, &seen, &mut verdict).await;
    report.extend(verdict::check_new(&ax, &seen, &mut verdict).await);
    let seen_keys = seen.limits.keyed;
    let violations = verdict.violations;
    println!(
        "fault campaign ({kind}) seed {seed}: {loaded:?} of load; kills {kills:?}, queue x workers \
         killed {} / stopped {}; {}; violations {} {:?}",
        x_kills.x_worker_kill,
        x_kills.x_worker_stop,
        report.join("; "),
        violations.len(),
        verdict.by_rule
    );
    for v in violations.iter().take(40) {
        println!("  violation: {v}");
    }
    if !violations.is_empty() {
        // Kept for a look: the journal, and the faults with their times.
        let kept = std::env::temp_dir().join(format!("ax-campaign-{seed}.jsonl"));
        if std::fs::copy(&journal, &kept).is_ok() {
            println!("  journal kept in {}", kept.display());
        }
        let keys: std::collections::BTreeMap<&String, &(&str, String)> = seen_keys.iter().collect();
        let kept = std::env::temp_dir().join(format!("ax-campaign-{seed}.keys.json"));
        if std::fs::write(&kept, serde_json::to_vec(&keys).unwrap_or_default()).is_ok() {
            println!("  limited tasks' keys kept in {}", kept.display());
        }
        let missing: Vec<String> = accepted_ids
            .iter()
            .filter(|id| !seen_histories.contains(*id))
            .cloned()
            .collect();
        if !missing.is_empty() {
            println!(
                "  where the {} accepted tasks without a record are:",
                missing.len()
            );
            for line in trace::messages(&js, &missing).await {
                println!("    {line}");
            }
        }
        if !unfinished.is_empty() {
            println!(
                "  where the {} accepted tasks whose record is not final are:",
                unfinished.len()
            );
            for line in trace::messages(&js, &unfinished).await {
                println!("    {line}");
            }
            for line in trace::ready_consumers(&js).await {
                println!("    {line}");
            }
        }
        let t = timeline.lock().unwrap();
        println!(
            "  faults: stops {:?}; kills {:?}; nats {:?}; ax servers killed {:?}; queue x paused {:?}",
            t.stops, t.kills, t.nats, t.servers, seen.ops.pauses
        );
    }
    violations.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_campaign_single_node() {
    campaign(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_campaign_r3_cluster() {
    campaign(true).await;
}
