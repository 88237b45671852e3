//! The fault campaign (issue 7 §3): mixed load while a seeded nemesis kills and restarts
//! real processes, then a checker over what was observed.
//!
//! Load: immediate tasks, delayed ones, bursts at one due time beyond the servers' read-ahead
//! horizon, retries, dead letters, refused submits (bad input, a full queue), triggers with
//! each overlap policy and fixed-delay, manual runs. Nemesis: `kill -9` of one or two of the
//! three ax servers, `kill -9` of a worker, `SIGSTOP` of a worker past the ack wait, and the
//! nats-server (single node: kill and restart; R3: one node at a time). Handlers append every
//! invocation with its fencing token to a journal file (`ax worker --example --journal`).
//!
//! The checker: every accepted task reached a final state; no task has two recorded
//! outcomes; a success is backed by a successful invocation under its token; per task,
//! tokens only grow and no attempt ran twice; every scheduled trigger time in the window was
//! fired exactly once (or accounted as skipped by its overlap policy); no fire was stored
//! twice; every refused submit stored nothing (no idempotency key left), unless an earlier
//! attempt with its key went unanswered or was `unavailable`.
//!
//! `AX_CAMPAIGN_SECS` (default 40) sets the load time, `AX_CAMPAIGN_SEED` replays a run; the
//! seed is printed first. A long run: `AX_CAMPAIGN_SECS=600 ./dev test --test campaign --
//! --nocapture`.

mod checker;
#[allow(dead_code)]
#[path = "../../src/natsd.rs"]
mod natsd;
#[allow(dead_code)]
#[path = "../it/procs.rs"]
mod procs;
#[allow(dead_code)]
#[path = "../it/support.rs"]
mod support;

use ax::state::TaskState;
use ax::time::now_ms;
use ax::{Client, ClientError, TaskRecord, TaskSpec};
use checker::{Histories, TriggerRun};
use futures::StreamExt;
use procs::AxProc;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const ACK_WAIT: &str = "2s";
const SERVERS: usize = 3;
const WORKERS: usize = 3;

enum Nats {
    Single(natsd::LocalNats),
    Cluster(natsd::LocalCluster),
}

impl Nats {
    fn url(&self) -> String {
        match self {
            Nats::Single(n) => n.url(),
            Nats::Cluster(c) => c.urls().join(","),
        }
    }
}

/// The processes under test, restarted under new ids.
struct Procs {
    url: String,
    journal: PathBuf,
    replicas: &'static str,
    servers: Vec<Option<AxProc>>,
    workers: Vec<Option<AxProc>>,
    generation: usize,
}

impl Procs {
    fn server(&mut self, i: usize) -> AxProc {
        self.generation += 1;
        let id = format!("s{i}g{}", self.generation);
        AxProc::spawn(
            &self.url,
            &[
                "server",
                "--queue",
                "q",
                "--queue",
                "hot",
                "--ack-wait",
                ACK_WAIT,
                "--capacity",
                "20,5000,10000",
                "--dispatch-horizon",
                "3s",
                "--replicas",
                self.replicas,
                "--id",
                &id,
            ],
        )
    }

    fn worker(&mut self, i: usize) -> AxProc {
        self.generation += 1;
        let id = format!("w{i}g{}", self.generation);
        let journal = self.journal.display().to_string();
        // Worker 0 also serves the small queue `hot` (a second process).
        AxProc::spawn(
            &self.url,
            &[
                "worker",
                "--example",
                "--queue",
                "q",
                "--fail-rate",
                "0",
                "--concurrency",
                "32",
                "--journal",
                &journal,
                "--id",
                &id,
            ],
        )
    }

    fn hot_worker(&self) -> AxProc {
        let journal = self.journal.display().to_string();
        AxProc::spawn(
            &self.url,
            &[
                "worker",
                "--example",
                "--queue",
                "hot",
                "--fail-rate",
                "0",
                "--concurrency",
                "2",
                "--journal",
                &journal,
                "--id",
                "hot",
            ],
        )
    }

    fn all_up(&mut self) {
        for i in 0..SERVERS {
            if self.servers[i]
                .as_mut()
                .is_none_or(|p| p.0.try_wait().unwrap().is_some())
            {
                self.servers[i] = Some(self.server(i));
            }
        }
        for i in 0..WORKERS {
            if self.workers[i]
                .as_mut()
                .is_none_or(|p| p.0.try_wait().unwrap().is_some())
            {
                self.workers[i] = Some(self.worker(i));
            }
        }
    }
}

/// What the producer saw.
#[derive(Default)]
struct Log {
    accepted: HashSet<String>,
    /// (queue, idempotency key, code, clean) of each refused submit; `clean` when no
    /// earlier attempt with that key went unanswered or was `unavailable` (such an attempt
    /// may have stored the key, or the task).
    refused: Vec<(String, String, String, bool)>,
    manual_answered: Vec<String>,
    manual_refused: usize,
    manual_unanswered: usize,
    unanswered_retries: usize,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

type Answer = Result<ax::protocol::SubmitAccepted, ax::protocol::WireError>;

/// Submits until answered (same idempotency key on every retry): the answer (`None` if no
/// answer came within a minute), and whether every attempt before it was answered and not
/// `unavailable`.
async fn submit_until_answered(
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
                if e.code.is_retryable() && e.code != ax::protocol::ErrorCode::Busy =>
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

const TRIGGERS: [(&str, &str); 4] = [
    ("t-allow", "allow"),
    ("t-skip", "skip"),
    ("t-buffer", "buffer_one"),
    ("t-delay", "fixed_delay"),
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
    let lanes = (0..12).map(|lane| {
        let (ax, log, n) = (ax.clone(), log.clone(), n.clone());
        async move {
            let mut rng = StdRng::seed_from_u64(seed ^ ((lane as u64 + 1) * 0x9e37_79b9));
            let mut next_burst = Instant::now() + Duration::from_secs(3);
            while Instant::now() < until {
                let k = n.fetch_add(1, Ordering::Relaxed);
                let key = format!("c-{seed}-{k}");
                let roll: u32 = rng.random_range(0..100);
                let retry = |s: TaskSpec| s.max_attempts(5).backoff(Duration::from_millis(100), Duration::from_secs(1), 0.2);
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
                    _ => ("hot", TaskSpec::new("hot").json(&serde_json::json!({"sleep_ms": 300})).priority(ax::Priority::High)),
                };
                let spec = spec.idempotency_key(key.clone());
                match submit_until_answered(&ax, queue, spec, &log).await {
                    (Some(Ok(a)), _) => {
                        log.lock().unwrap().accepted.insert(a.id);
                    }
                    (Some(Err(e)), clean) => log.lock().unwrap().refused.push((queue.into(), key.clone(), e.code.as_str().into(), clean)),
                    (None, _) => {}
                }
                if lane == 0 && Instant::now() >= next_burst {
                    // A burst at one due time beyond the 3 s horizon.
                    next_burst = Instant::now() + Duration::from_secs(8);
                    let at = ax::time::format_rfc3339_ms(now_ms() + 5000);
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
                        Err(ClientError::Refused(e)) if e.code == ax::protocol::ErrorCode::Running => {
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

#[derive(Debug, Default)]
struct Kills {
    one_server: usize,
    two_servers: usize,
    worker_kill: usize,
    worker_stop: usize,
    nats: usize,
}

async fn nemesis(
    procs: Arc<Mutex<Procs>>,
    nats: Arc<tokio::sync::Mutex<Nats>>,
    seed: u64,
    until: Instant,
) -> Kills {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut kills = Kills::default();
    tokio::time::sleep(Duration::from_secs(3)).await;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(rng.random_range(1500..3500))).await;
        match rng.random_range(0..100) {
            0..=29 => {
                let i = rng.random_range(0..SERVERS);
                if let Some(mut p) = procs.lock().unwrap().servers[i].take() {
                    p.kill9();
                }
                kills.one_server += 1;
                tokio::time::sleep(Duration::from_millis(rng.random_range(100..1000))).await;
                let mut procs = procs.lock().unwrap();
                procs.servers[i] = Some(procs.server(i));
            }
            30..=39 => {
                let a = rng.random_range(0..SERVERS);
                let b = (a + 1 + rng.random_range(0..SERVERS - 1)) % SERVERS;
                for i in [a, b] {
                    if let Some(mut p) = procs.lock().unwrap().servers[i].take() {
                        p.kill9();
                    }
                }
                kills.two_servers += 1;
                tokio::time::sleep(Duration::from_millis(rng.random_range(200..1500))).await;
                let mut procs = procs.lock().unwrap();
                for i in [a, b] {
                    procs.servers[i] = Some(procs.server(i));
                }
            }
            40..=59 => {
                let i = rng.random_range(0..WORKERS);
                if let Some(mut p) = procs.lock().unwrap().workers[i].take() {
                    p.kill9();
                }
                kills.worker_kill += 1;
                tokio::time::sleep(Duration::from_millis(rng.random_range(100..1000))).await;
                let mut procs = procs.lock().unwrap();
                procs.workers[i] = Some(procs.worker(i));
            }
            60..=79 => {
                let i = rng.random_range(0..WORKERS);
                let stopped = procs.lock().unwrap().workers[i]
                    .as_ref()
                    .map(|p| p.signal("-STOP"))
                    .is_some();
                if stopped {
                    kills.worker_stop += 1;
                    // Past the 2 s ack wait: its tasks go to other workers meanwhile.
                    tokio::time::sleep(Duration::from_millis(rng.random_range(2500..4000))).await;
                    if let Some(p) = procs.lock().unwrap().workers[i].as_ref() {
                        p.signal("-CONT");
                    }
                }
            }
            _ => {
                let mut nats = nats.lock().await;
                match &mut *nats {
                    Nats::Single(n) => {
                        n.kill();
                        tokio::time::sleep(Duration::from_millis(rng.random_range(300..1500)))
                            .await;
                        n.restart().unwrap();
                    }
                    Nats::Cluster(c) => {
                        let i = rng.random_range(0..c.nodes.len());
                        c.nodes[i].kill();
                        tokio::time::sleep(Duration::from_millis(rng.random_range(1000..3000)))
                            .await;
                        c.nodes[i].restart().unwrap();
                    }
                }
                kills.nats += 1;
            }
        }
    }
    kills
}

/// Every revision of every task record, read once through an ordered consumer. A broker
/// that is still settling after the nemesis (an R3 election) is asked again.
async fn histories(js: &async_nats::jetstream::Context) -> Histories {
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
) -> Result<Histories, async_nats::Error> {
    let stream = js.get_stream("KV_AX_TASKS").await?;
    let last = stream.cached_info().state.last_sequence;
    let mut out: Histories = Histories::new();
    if last == 0 {
        return Ok(out);
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
            out.entry(key).or_default().push((seq, rec));
        }
        if seq >= last {
            break;
        }
    }
    Ok(out)
}

/// The two campaigns run one after the other: each alone loads both cores.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn campaign(cluster: bool) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let seed: u64 = std::env::var("AX_CAMPAIGN_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    let secs: u64 = std::env::var("AX_CAMPAIGN_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let kind = if cluster { "R3 cluster" } else { "single node" };
    println!(
        "fault campaign ({kind}): seed {seed}, {secs} s of load (replay: AX_CAMPAIGN_SEED={seed})"
    );
    let nats = if cluster {
        Nats::Cluster(natsd::LocalCluster::start(3).unwrap())
    } else {
        Nats::Single(natsd::LocalNats::start().unwrap())
    };
    let url = nats.url();
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal.jsonl");
    let mut procs = Procs {
        url: url.clone(),
        journal: journal.clone(),
        replicas: if cluster { "3" } else { "1" },
        servers: (0..SERVERS).map(|_| None).collect(),
        workers: (0..WORKERS).map(|_| None).collect(),
        generation: 0,
    };
    // One server first, so the topology is created once with these settings.
    procs.servers[0] = Some(procs.server(0));
    let addrs: Vec<async_nats::ServerAddr> = url.split(',').map(|u| u.parse().unwrap()).collect();
    let client = async_nats::ConnectOptions::new()
        .request_timeout(Some(Duration::from_secs(3)))
        .connect(addrs.as_slice())
        .await
        .unwrap();
    procs::wait_ready(&client).await;
    procs.all_up();
    let _hot = procs.hot_worker();
    let ax = Client::new(client.clone());
    let js = async_nats::jetstream::new(client.clone());
    for (name, policy) in TRIGGERS {
        ax.trigger("put", &trigger_def(name, policy)).await.unwrap();
    }
    let manual = serde_json::json!({"name": "t-manual", "kind": "interval", "every_ms": 3_600_000,
        "tasks": [{"name": "tick", "queue": "q", "priority": "low", "payload": {"sleep_ms": 300}}]});
    ax.trigger("put", &manual).await.unwrap();

    let procs = Arc::new(Mutex::new(procs));
    let nats = Arc::new(tokio::sync::Mutex::new(nats));
    let log: Arc<Mutex<Log>> = Arc::default();
    let until = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let (kills, ()) = tokio::join!(
        nemesis(procs.clone(), nats.clone(), seed, until),
        produce(ax.clone(), log.clone(), seed, until),
    );
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
    // Quiesce: every record final (accepted tasks and trigger tasks alike).
    let quiet = tokio::time::timeout(Duration::from_secs(150), async {
        loop {
            let h = histories(&js).await;
            let open = h
                .values()
                .filter(|v| v.last().is_some_and(|(_, r)| !r.state.is_terminal()))
                .count();
            let accepted = log.lock().unwrap().accepted.clone();
            let missing = accepted.iter().filter(|id| !h.contains_key(*id)).count();
            if open == 0 && missing == 0 {
                return h;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
    .await;
    let mut violations: Vec<String> = Vec::new();
    let histories = match quiet {
        Ok(h) => h,
        Err(_) => {
            violations.push("the system did not quiesce within 150 s".into());
            histories(&js).await
        }
    };
    let journal_text = std::fs::read_to_string(&journal).unwrap_or_default();
    let invocations = checker::parse_journal(&journal_text);
    let log = std::mem::take(&mut *log.lock().unwrap());
    violations.extend(checker::check_tasks(
        &log.accepted,
        &histories,
        &invocations,
    ));
    violations.extend(checker::check_tokens(&invocations));
    // Triggers.
    let records: Vec<&TaskRecord> = histories
        .values()
        .filter_map(|h| h.last().map(|(_, r)| r))
        .collect();
    let mut fired_report = Vec::new();
    for (name, policy) in TRIGGERS {
        let got = ax
            .trigger("get", &serde_json::json!({"name": name}))
            .await
            .unwrap();
        let state = &got["state"];
        violations.extend(checker::check_trigger(
            &TriggerRun {
                name,
                policy,
                state,
                paused_ms,
            },
            &records,
        ));
        fired_report.push(format!(
            "{name}: fired {} skipped {}",
            state["fires"].as_u64().unwrap_or(0) - state["manual"].as_u64().unwrap_or(0),
            state["skipped"]
        ));
    }
    let trigger_tasks = records.iter().filter(|r| r.trigger.is_some()).count() as u64;
    let mut low = js.get_stream("AX_READY_LOW").await.unwrap();
    let stored_fires = low.info().await.unwrap().state.last_sequence;
    if stored_fires != trigger_tasks {
        violations.push(format!(
            "{stored_fires} trigger task messages stored for {trigger_tasks} trigger tasks: a fire was stored twice"
        ));
    }
    // Manual runs: each answered run made its task; nothing more than the runs sent.
    let manual_made: Vec<&str> = records
        .iter()
        .filter(|r| r.trigger_source.as_deref() == Some("manual"))
        .map(|r| r.id.as_str())
        .collect();
    for id in &log.manual_answered {
        if !manual_made.contains(&id.as_str()) {
            violations.push(format!("manual run {id} answered but never made"));
        }
    }
    if manual_made.len() > log.manual_answered.len() + log.manual_unanswered {
        violations.push(format!(
            "{} manual tasks made for {} answered and {} unanswered runs",
            manual_made.len(),
            log.manual_answered.len(),
            log.manual_unanswered
        ));
    }
    // Refused submits stored nothing.
    let idem = js.get_key_value("AX_IDEMPOTENCY").await.unwrap();
    let mut busy = 0;
    for (queue, key, code, clean) in &log.refused {
        busy += usize::from(code == "busy");
        if !clean {
            // An earlier attempt with this key went unanswered or was `unavailable`: it
            // may have stored the key (and the task, which a later retry finishes).
            continue;
        }
        let kv_key = format!("{queue}.{}", hex(key.as_bytes()));
        if let Ok(Some(v)) = idem.get(&kv_key).await {
            violations.push(format!(
                "refused submit ({code}) left its idempotency key, task {}",
                String::from_utf8_lossy(&v)
            ));
        }
    }
    let outcomes = |s: TaskState| {
        histories
            .values()
            .filter(|h| h.last().is_some_and(|(_, r)| r.state == s))
            .count()
    };
    let runs: usize = invocations.values().map(Vec::len).sum();
    println!(
        "fault campaign ({kind}) seed {seed}: {:?} of load; kills {kills:?}; {} tasks accepted \
         ({} succeeded, {} dead in all records), {} refused ({busy} busy), {} submit retries; \
         {runs} handler invocations; manual runs {} answered / {} refused running / {} unanswered; \
         triggers {fired_report:?}, {stored_fires} fire messages stored; violations {}",
        until.duration_since(started),
        log.accepted.len(),
        outcomes(TaskState::Succeeded),
        outcomes(TaskState::Dead),
        log.refused.len(),
        log.unanswered_retries,
        log.manual_answered.len(),
        log.manual_refused,
        log.manual_unanswered,
        violations.len()
    );
    for v in violations.iter().take(30) {
        println!("  violation: {v}");
    }
    assert!(
        violations.is_empty(),
        "seed {seed}: {} violations",
        violations.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_campaign_single_node() {
    campaign(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_campaign_r3_cluster() {
    campaign(true).await;
}
