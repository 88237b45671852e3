//! The processes under test (nats-server, ax servers, workers) and the nemesis that kills,
//! pauses and restarts them. Every fault is written to a [`Timeline`] the checker reads:
//! a `SIGSTOP`ped worker's handlers cannot run, a killed worker's never end.

use crate::procs::AxProc;
use ax_core::time::now_ms;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const ACK_WAIT: &str = "2s";
pub const SERVERS: usize = 3;
pub const WORKERS: usize = 3;
/// Workers of queue `x` (flows, limits, operations).
pub const X_WORKERS: usize = 2;

pub enum Nats {
    Single(ax_testkit::LocalNats),
    Cluster(ax_testkit::LocalCluster),
}

impl Nats {
    pub fn url(&self) -> String {
        match self {
            Nats::Single(n) => n.url(),
            Nats::Cluster(c) => c.urls().join(","),
        }
    }
}

/// Faults as they happened, ms since the epoch (the journal's clock: same host).
#[derive(Debug, Default, Clone)]
pub struct Timeline {
    /// (worker id, `SIGSTOP` at, `SIGCONT` at).
    pub stops: Vec<(String, u64, u64)>,
    /// (worker id, `kill -9` at).
    pub kills: Vec<(String, u64)>,
    /// (nats-server or node killed at, restarted at).
    pub nats: Vec<(u64, u64)>,
    /// (ax server slot, `kill -9` at): for reading a failure, no rule uses them.
    pub servers: Vec<(usize, u64)>,
}

/// The processes under test, restarted under new ids.
pub struct Procs {
    pub url: String,
    pub journal: PathBuf,
    pub replicas: &'static str,
    pub servers: Vec<Option<AxProc>>,
    /// Workers of queue `q`, with their ids.
    pub workers: Vec<Option<(AxProc, String)>>,
    /// Workers of queue `x`, with their ids.
    pub x_workers: Vec<Option<(AxProc, String)>>,
    pub generation: usize,
}

impl Procs {
    pub fn new(url: &str, journal: PathBuf, cluster: bool) -> Procs {
        Procs {
            url: url.to_string(),
            journal,
            replicas: if cluster { "3" } else { "1" },
            servers: (0..SERVERS).map(|_| None).collect(),
            workers: (0..WORKERS).map(|_| None).collect(),
            x_workers: (0..X_WORKERS).map(|_| None).collect(),
            generation: 0,
        }
    }

    pub fn server(&mut self, i: usize) -> AxProc {
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
                "--queue",
                "x",
                "--queue",
                "xl",
                "--queue",
                crate::fairness::FQ,
                "--ack-wait",
                ACK_WAIT,
                "--capacity",
                "20,5000,10000",
                "--dispatch-horizon",
                "3s",
                // Every trigger read back from the store at each of its due times (the
                // path of a trigger due later than the default hold), under the faults.
                "--trigger-hold",
                "0s",
                "--replicas",
                self.replicas,
                "--id",
                &id,
            ],
        )
    }

    /// An example worker with a journal: `prefix` `w` (queue `q`, 32 at once) or `x`
    /// (queue `x`, 16 at once).
    fn spawn_worker(&mut self, prefix: &str, i: usize) -> (AxProc, String) {
        self.generation += 1;
        let id = format!("{prefix}{i}g{}", self.generation);
        let journal = self.journal.display().to_string();
        let (queue, concurrency) = if prefix == "x" {
            ("x", "16")
        } else {
            ("q", "32")
        };
        let proc = AxProc::spawn(
            &self.url,
            &[
                "worker",
                "--example",
                "--queue",
                queue,
                "--fail-rate",
                "0",
                "--concurrency",
                concurrency,
                "--journal",
                &journal,
                "--id",
                &id,
            ],
        );
        (proc, id)
    }

    pub fn worker(&mut self, i: usize) -> (AxProc, String) {
        self.spawn_worker("w", i)
    }

    pub fn x_worker(&mut self, i: usize) -> (AxProc, String) {
        self.spawn_worker("x", i)
    }

    /// Queue `fq`'s one worker (the fairness load's; never faulted), with priority aging.
    pub fn fq_worker(&self) -> AxProc {
        let journal = self.journal.display().to_string();
        let slots = crate::fairness::FQ_SLOTS.to_string();
        let aging = format!("{}ms", crate::fairness::AGING_MS);
        // Its aging follower's debug lines (a look that failed) beside the children's
        // filter: an aging violation's path (RELIABILITY rule 16) is then in the log.
        let log = std::env::var("AX_PROC_LOG").unwrap_or_else(|_| "warn".into());
        let log = format!("{log},ax_sdk::worker::aging=debug");
        AxProc::spawn_env(
            &self.url,
            &[
                "worker",
                "--example",
                "--queue",
                crate::fairness::FQ,
                "--fail-rate",
                "0",
                "--concurrency",
                &slots,
                "--aging",
                &aging,
                "--journal",
                &journal,
                "--id",
                "f",
            ],
            &[("RUST_LOG", &log)],
        )
    }

    /// The small queue `hot`'s one worker.
    pub fn hot_worker(&self) -> AxProc {
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

    /// Starts whatever is not running.
    pub fn all_up(&mut self) {
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
                .is_none_or(|(p, _)| p.0.try_wait().unwrap().is_some())
            {
                self.workers[i] = Some(self.worker(i));
            }
        }
        for i in 0..X_WORKERS {
            if self.x_workers[i]
                .as_mut()
                .is_none_or(|(p, _)| p.0.try_wait().unwrap().is_some())
            {
                self.x_workers[i] = Some(self.x_worker(i));
            }
        }
    }
}

#[derive(Debug, Default)]
pub struct Kills {
    pub one_server: usize,
    pub two_servers: usize,
    pub worker_kill: usize,
    pub worker_stop: usize,
    pub nats: usize,
    /// Of queue `x`'s workers (a second nemesis).
    pub x_worker_kill: usize,
    pub x_worker_stop: usize,
}

/// Kills `-9` worker `slot` (if up), notes it, waits, starts a new one there.
async fn kill_worker(
    procs: &Mutex<Procs>,
    timeline: &Mutex<Timeline>,
    x: bool,
    i: usize,
    rng: &mut StdRng,
) {
    let taken = {
        let mut procs = procs.lock().unwrap();
        if x {
            procs.x_workers[i].take()
        } else {
            procs.workers[i].take()
        }
    };
    if let Some((mut p, id)) = taken {
        p.kill9();
        timeline.lock().unwrap().kills.push((id, now_ms()));
    }
    tokio::time::sleep(Duration::from_millis(rng.random_range(100..1000))).await;
    let mut procs = procs.lock().unwrap();
    if x {
        procs.x_workers[i] = Some(procs.x_worker(i));
    } else {
        procs.workers[i] = Some(procs.worker(i));
    }
}

/// `SIGSTOP`s worker `i` past the 2 s ack wait, then `SIGCONT`s it; true if it was up.
async fn stop_worker(
    procs: &Mutex<Procs>,
    timeline: &Mutex<Timeline>,
    x: bool,
    i: usize,
    rng: &mut StdRng,
) -> bool {
    let slot = |procs: &Procs| -> Option<(u32, String)> {
        let w = if x {
            &procs.x_workers[i]
        } else {
            &procs.workers[i]
        };
        w.as_ref().map(|(p, id)| (p.0.id(), id.clone()))
    };
    let Some((pid, id)) = slot(&procs.lock().unwrap()) else {
        return false;
    };
    signal(pid, "-STOP");
    let stopped_at = now_ms();
    // Past the 2 s ack wait: its tasks go to other workers meanwhile.
    tokio::time::sleep(Duration::from_millis(rng.random_range(2500..4000))).await;
    signal(pid, "-CONT");
    timeline
        .lock()
        .unwrap()
        .stops
        .push((id, stopped_at, now_ms()));
    true
}

fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status();
}

/// The nemesis: every 1.5–3.5 s one of: `kill -9` of one ax server (30 %), of
/// two (10 %), of a `q` worker (20 %), `SIGSTOP` of a `q` worker (20 %), the nats-server
/// (20 %; R3: one node). Its random choices are those of earlier versions of the campaign
/// for the same seed.
pub async fn nemesis(
    procs: Arc<Mutex<Procs>>,
    nats: Arc<tokio::sync::Mutex<Nats>>,
    timeline: Arc<Mutex<Timeline>>,
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
                timeline.lock().unwrap().servers.push((i, now_ms()));
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
                    timeline.lock().unwrap().servers.push((i, now_ms()));
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
                kill_worker(&procs, &timeline, false, i, &mut rng).await;
                kills.worker_kill += 1;
            }
            60..=79 => {
                let i = rng.random_range(0..WORKERS);
                if stop_worker(&procs, &timeline, false, i, &mut rng).await {
                    kills.worker_stop += 1;
                }
            }
            _ => {
                let mut nats = nats.lock().await;
                let down = now_ms();
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
                timeline.lock().unwrap().nats.push((down, now_ms()));
                kills.nats += 1;
            }
        }
    }
    kills
}

/// A second nemesis, for queue `x`'s workers (its own random stream, so the first one's
/// choices stay those of earlier campaigns): every 2.5–5 s, `kill -9` of one (50 %) or
/// `SIGSTOP` past the ack wait (50 %).
pub async fn x_nemesis(
    procs: Arc<Mutex<Procs>>,
    timeline: Arc<Mutex<Timeline>>,
    seed: u64,
    until: Instant,
) -> Kills {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5851_f42d_4c95_7f2d);
    let mut kills = Kills::default();
    tokio::time::sleep(Duration::from_secs(4)).await;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(rng.random_range(2500..5000))).await;
        let i = rng.random_range(0..X_WORKERS);
        if rng.random_bool(0.5) {
            kill_worker(&procs, &timeline, true, i, &mut rng).await;
            kills.x_worker_kill += 1;
        } else if stop_worker(&procs, &timeline, true, i, &mut rng).await {
            kills.x_worker_stop += 1;
        }
    }
    kills
}
