//! Limits at their pace: a saturated cap keeps its slots busy (a
//! freed slot reaches a waiting delivery at once), a rate is met (a denied delivery books
//! the next token and starts when it is due) and never exceeded in handler starts, and a
//! raised rate reaches tasks already handed back. Counted from the workers' journals.

use crate::limits::{
    all_done, change, max_in_window, max_overlap, runs, runs_started, set, submit_keyed, workers,
    workers_env,
};
use crate::support::Env;
use serde_json::json;
use std::time::{Duration, Instant};

/// Busy slot-time over capacity-time, from the first start to the last end.
fn utilisation(intervals: &[(u64, u64)], cap: usize) -> f64 {
    let busy: u64 = intervals.iter().map(|(s, e)| e - s).sum();
    let first = intervals.iter().map(|r| r.0).min().unwrap();
    let last = intervals.iter().map(|r| r.1).max().unwrap();
    busy as f64 / (cap as f64 * (last - first).max(1) as f64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_cap_keeps_its_slots_busy() {
    // A delivery waits for a freed slot up to half the ack wait (at most 10 s).
    let env = Env::start(Env::server().ack_wait(Duration::from_secs(4))).await;
    set(
        &env,
        json!({"name": "five", "queue": "q", "task": "t", "concurrency": 5}),
    )
    .await;
    // Workers started after the definitions load them before they claim.
    let w = workers(&env.nats.url(), 2, 16);
    let ids = submit_keyed(&env, 40, "t", "x", 300).await;
    all_done(&env, &ids, Duration::from_secs(60)).await;
    let r = runs(&w.journals);
    let intervals: Vec<(u64, u64)> = ids.iter().filter_map(|id| r.get(id).copied()).collect();
    assert_eq!(intervals.len(), 40);
    assert_eq!(
        max_overlap(intervals.iter().copied()),
        5,
        "never above the cap"
    );
    let used = utilisation(&intervals, 5);
    println!("cap 5, 40 × 300 ms on 2 workers of 16: utilisation {used:.2}");
    // Handed back for 250 ms × deliveries it was 0.23–0.30; woken by the
    // release, with the waiting deliveries within the workers' hold budget (half their
    // concurrency), it is about 0.9 (./dev bench limits). The bound leaves room for a
    // loaded machine, twice the old figure.
    assert!(
        used >= 0.6,
        "the cap of 5 was used at {used:.2} of its capacity"
    );
    drop(w);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_is_met_and_its_handler_starts_stay_within_the_bound() {
    let env = Env::start(Env::server()).await;
    let (rate, burst, n) = (100.0, 1usize, 400usize);
    set(
        &env,
        json!({"name": "r", "queue": "q", "task": "t", "rate": rate, "burst": burst}),
    )
    .await;
    // Workers started after the definitions load them before they claim.
    let w = workers(&env.nats.url(), 4, 16);
    let ids = submit_keyed(&env, n, "t", "x", 0).await;
    all_done(&env, &ids, Duration::from_secs(60)).await;
    let r = runs(&w.journals);
    let mut starts: Vec<u64> = ids.iter().filter_map(|id| r.get(id).map(|r| r.0)).collect();
    assert_eq!(starts.len(), n);
    starts.sort_unstable();
    let span = (starts[n - 1] - starts[0]).max(1) as f64 / 1000.0;
    let achieved = (n - 1) as f64 / span / rate;
    let most = max_in_window(starts.clone(), 1000);
    println!("rate 100/s, burst 1, 400 tasks on 4 workers: achieved/configured {achieved:.3}, most handler starts in 1 s {most}");
    // Before reservations: 0.83 at 100/s. Alone ≥ 0.98 (./dev bench limits).
    assert!(achieved >= 0.9, "achieved {achieved:.3} of the rate");
    // Token due times are exact (gcra unit tests); a handler starts when its token is due,
    // late by the process's scheduling delay (a token missed by more than 10 ms is given
    // up), so any window w holds at most burst + rate × (w + that delay). Alone: ≤ 102 in
    // 1 s. Beside the whole suite on 2 cores a process can be 100 ms late: allowed here.
    assert!(
        most as f64 <= burst as f64 + rate * 1.1,
        "{most} handler starts in one second at {rate}/s, burst {burst}"
    );
    drop(w);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_slower_than_the_lead_never_start_ahead_of_their_tokens() {
    // Every claim takes 300 ms more (a slow broker): past the longest lead (250 ms), so
    // each claimed delivery finds its token gone by and takes another; with the workers'
    // holds booking the tokens of the next second, often none is due within the horizon.
    let env = Env::start(Env::server()).await;
    let (rate, burst, n) = (10.0, 1usize, 40usize);
    set(
        &env,
        json!({"name": "slow", "queue": "q", "task": "t", "rate": rate, "burst": burst}),
    )
    .await;
    let w = workers_env(&env.nats.url(), 2, 16, &[("AX_TEST_CLAIM_DELAY_MS", "300")]);
    let ids = submit_keyed(&env, n, "t", "x", 0).await;
    all_done(&env, &ids, Duration::from_secs(60)).await;
    let r = runs(&w.journals);
    let starts: Vec<u64> = ids.iter().filter_map(|id| r.get(id).map(|r| r.0)).collect();
    assert_eq!(starts.len(), n);
    let most = max_in_window(starts, 1000);
    println!(
        "rate 10/s, burst 1, claims 300 ms slower than usual: most handler starts in 1 s {most}"
    );
    // Started late without a token when none was due within the horizon, it was 13 (twice,
    // 2026-12-01); a claimed delivery now waits for one: 9.
    assert!(
        most as f64 <= burst as f64 + rate * 1.1,
        "{most} handler starts in one second at {rate}/s, burst {burst}"
    );
    drop(w);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rated_delivery_claimed_before_a_pause_waits_it_out() {
    // Claims take 300 ms longer than usual, so a delivery whose pause check passed is
    // still claiming when the pause lands; under a rate it is held for its token anyway
    // and must wait out the pause rather than start in it.
    let env = Env::start(Env::server()).await;
    set(
        &env,
        json!({"name": "p", "queue": "q", "task": "t", "rate": 5.0, "burst": 1}),
    )
    .await;
    let w = workers_env(&env.nats.url(), 2, 8, &[("AX_TEST_CLAIM_DELAY_MS", "300")]);
    let ids = submit_keyed(&env, 30, "t", "x", 0).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    env.ax.pause_queue("q", None).await.unwrap();
    let paused = ax_core::time::now_ms();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let resumed = ax_core::time::now_ms();
    env.ax.resume_queue("q").await.unwrap();
    all_done(&env, &ids, Duration::from_secs(60)).await;
    let r = runs(&w.journals);
    // The workers see the pause within milliseconds here (one node); 150 ms of slack.
    let inside: Vec<u64> = ids
        .iter()
        .filter_map(|id| r.get(id).map(|r| r.0))
        .filter(|&at| at > paused + 150 && at < resumed)
        .map(|at| at - paused)
        .collect();
    assert!(
        inside.is_empty(),
        "handlers started this long (ms) into the pause: {inside:?}"
    );
    drop(w);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raised_rate_reaches_tasks_already_handed_back() {
    let env = Env::start(Env::server()).await;
    set(
        &env,
        json!({"name": "slow", "queue": "q", "key": "k", "rate": 0.2, "burst": 1}),
    )
    .await;
    // Workers started after the definitions load them before they claim.
    let w = workers(&env.nats.url(), 2, 8);
    let queued = submit_keyed(&env, 20, "u", "k", 5).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let early = runs_started(&w.journals)
        .iter()
        .filter(|id| queued.contains(id))
        .count();
    assert!(early <= 2, "{early} started at 0.2/s in 2 s");
    change(
        &env,
        &w,
        json!({"name": "slow", "queue": "q", "key": "k", "rate": 1000.0}),
    )
    .await;
    let raised = Instant::now();
    all_done(&env, &queued, Duration::from_secs(30)).await;
    // A handed-back task comes back when the next token is due plus a spread of at most
    // the hold horizon: one interval of the old rate (5 s) and a little. Before: up to
    // four intervals of spread (the last of 20 started 16 s after the raise).
    let took = raised.elapsed();
    assert!(
        took < Duration::from_secs(8),
        "the last queued task started {took:?} after the raise"
    );
    drop(w);
}

/// A downstream that takes at most `per_s` calls a second (burst 5) and refuses the rest.
struct Downstream {
    per_s: f64,
    tat: f64,
}

impl Downstream {
    fn call(&mut self, now: f64) -> bool {
        let interval = 1.0 / self.per_s;
        let tat = self.tat.max(now);
        if tat - now > 4.0 * interval {
            return false;
        }
        self.tat = tat + interval;
        true
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adaptive_rate_settles_at_what_the_downstream_takes_and_climbs_back() {
    use ax_sdk::worker::{Task, TaskError, Worker};
    use std::sync::{Arc, Mutex};
    let env = Env::start(Env::server()).await;
    set(
        &env,
        json!({"name": "api", "queue": "q", "task": "call", "rate": 500.0, "burst": 1,
               "adaptive": {"min": 5.0, "increase": 25.0}}),
    )
    .await;
    let t0 = Instant::now();
    let down = Arc::new(Mutex::new(Downstream {
        per_s: 50.0,
        tat: 0.0,
    }));
    // (seconds since t0, accepted?) per handler call.
    let calls: Arc<Mutex<Vec<(f64, bool)>>> = Arc::default();
    let mut stops = Vec::new();
    for _ in 0..2 {
        let (down, calls) = (down.clone(), calls.clone());
        let worker = Worker::builder("q")
            .concurrency(32)
            .handler(move |_task: Task| {
                let now = t0.elapsed().as_secs_f64();
                let ok = down.lock().unwrap().call(now);
                calls.lock().unwrap().push((now, ok));
                async move {
                    if ok {
                        Ok(())
                    } else {
                        Err(TaskError::pressure("the downstream answered 429"))
                    }
                }
            })
            .build()
            .unwrap();
        stops.push(env.spawn_worker(worker));
    }
    let ax = env.ax.clone();
    let producer = tokio::spawn(async move {
        use futures::StreamExt;
        let submits = futures::stream::iter(0..4000).map(|_| {
            let ax = ax.clone();
            async move {
                ax.submit("q", ax_sdk::TaskSpec::new("call").max_attempts(20))
                    .await
            }
        });
        let mut s = submits.buffer_unordered(64);
        while s.next().await.is_some() {}
    });
    let window = |from: f64, to: f64| {
        let c = calls.lock().unwrap();
        let inside: Vec<bool> = c
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .map(|c| c.1)
            .collect();
        let ok = inside.iter().filter(|o| **o).count();
        (
            ok as f64 / (to - from),
            (inside.len() - ok) as f64 / inside.len().max(1) as f64,
        )
    };
    // Overloaded: 500/s offered to a downstream of 50/s.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let (served, refused) = window(6.0, 12.0);
    let status = env.ax.limit_status(Some("q")).await.unwrap();
    let rate_now = status[0].rate_now.unwrap();
    println!(
        "downstream 50/s: served {served:.1}/s, refused {:.0} % of calls, rate now {rate_now:.1}",
        refused * 100.0
    );
    assert!(
        served >= 30.0,
        "served {served:.1}/s of the downstream's 50"
    );
    assert!(refused <= 0.25, "{:.0} % of calls refused", refused * 100.0);
    assert!(rate_now < 150.0, "the rate in force stayed at {rate_now}");
    // Recovered: the rate climbs back (25/s per calm second).
    down.lock().unwrap().per_s = 5000.0;
    let back = t0.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(8)).await;
    let (served, _) = window(back + 6.0, back + 8.0);
    println!("downstream recovered: served {served:.1}/s 6–8 s later");
    assert!(
        served >= 120.0,
        "served {served:.1}/s after the downstream recovered"
    );
    producer.abort();
    // The CLI sets one, says the rate in force, and refuses a bad factor by its option.
    let cli = |args: &'static [&'static str]| crate::limits::ax_cli(&env, args);
    let set = cli(&[
        "limits",
        "set",
        "db",
        "--queue",
        "q",
        "--rate",
        "100",
        "--adaptive-min",
        "2",
        "--decrease",
        "0.5",
        "--pressure-class",
        "db_slow",
    ])
    .await;
    assert!(
        set.status.success(),
        "{}",
        String::from_utf8_lossy(&set.stderr)
    );
    let status = cli(&["-o", "json", "limits", "status", "--queue", "q"]).await;
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let db = status
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["limit"]["name"] == "db")
        .unwrap();
    assert_eq!(db["limit"]["adaptive"]["on"], json!(["db_slow"]));
    assert_eq!(db["rate_now"], json!(100.0));
    let bad = cli(&[
        "limits",
        "set",
        "db",
        "--queue",
        "q",
        "--rate",
        "100",
        "--adaptive-min",
        "2",
        "--decrease",
        "2",
    ])
    .await;
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && err.contains("--decrease"), "{err}");
    for (stop, handle) in stops {
        stop.cancel();
        let _ = handle.await;
    }
}
