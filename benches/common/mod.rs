//! Helpers shared by the benchmarks.
#![allow(dead_code)]

use std::time::{SystemTime, UNIX_EPOCH};

/// A numeric setting from the environment, or its default.
pub fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// (p50, p99, max) of the samples.
pub fn percentiles(mut v: Vec<f64>) -> (f64, f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99), *v.last().unwrap())
}

/// (CPU seconds, resident memory in KiB) of a process, from /proc.
pub fn usage(pid: u32) -> (f64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    ((tick(11) + tick(12)) / 100.0, rss)
}

pub mod deployed;
pub mod raw;

/// A nats-server for a bench: `AX_BENCH_SYNC=always` has it fsync every write (as
/// deploy/nats-server.conf runs it); unset, the default (fsync every 2 minutes). Answers
/// the server and whether it fsyncs every write; keep the config file alive as long.
pub fn nats_from_env(conf: &tempfile::NamedTempFile) -> (ax_testkit::LocalNats, bool) {
    let sync = std::env::var("AX_BENCH_SYNC").unwrap_or_default();
    let nats = match sync.as_str() {
        "" | "default" => ax_testkit::LocalNats::start(),
        "always" => {
            std::fs::write(conf.path(), "jetstream { sync_interval: always }\n").unwrap();
            ax_testkit::LocalNats::start_with_args(vec![
                "-c".into(),
                conf.path().display().to_string(),
            ])
        }
        other => panic!("AX_BENCH_SYNC is `always` or unset, not {other:?}"),
    }
    .expect("nats-server (run via ./dev bench)");
    (nats, sync == "always")
}

/// This machine's cores and CPU model.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown cpu".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} cores, {cpu}")
}
