//! The monitoring parts against real ones: the alerting rules and the Prometheus config
//! through `promtool` (check and unit tests), and a real Prometheus (Debian's
//! `prometheus`; `./dev test` installs it when missing) scraping a live `ax server` and
//! `ax worker` under load, through which every query of the Grafana dashboard is run.

use crate::browser::http;
use crate::procs::{free_port, AxProc};
use crate::support::{eventually, Env};
use ax_sdk::flow::{FlowDef, StepDef};
use ax_sdk::TaskSpec;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

fn tool(name: &str) -> String {
    for dir in ["/usr/bin", "/usr/local/bin"] {
        let path = format!("{dir}/{name}");
        if Path::new(&path).exists() {
            return path;
        }
    }
    panic!("{name} not found: install Debian's prometheus (./dev test does)")
}

#[test]
fn the_alerting_rules_and_the_prometheus_config_pass_promtool() {
    let promtool = tool("promtool");
    for args in [
        vec!["check", "config", "prometheus.yml"],
        vec!["check", "rules", "ax-alerts.yml"],
        vec!["test", "rules", "ax-alerts.test.yml"],
    ] {
        let out = std::process::Command::new(&promtool)
            .args(&args)
            .current_dir(deploy())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Every byte but unreserved characters percent-encoded (a query parameter).
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The queries of the Grafana dashboard, with the queue variable matching every queue.
fn dashboard_queries() -> Vec<String> {
    let text = std::fs::read_to_string(deploy().join("grafana/dashboards/ax.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    let mut out = Vec::new();
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(map) => {
                if let Some(Value::String(expr)) = map.get("expr") {
                    out.push(expr.replace("$queue", ".*"));
                }
                map.values().for_each(|v| walk(v, out));
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    walk(&dashboard, &mut out);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_ax_and_runs_every_dashboard_query() {
    let env = Env::nats_only().await;
    let url = env.nats.url();
    let (server_port, worker_port, prom_port) = (free_port(), free_port(), free_port());
    let _server = AxProc::spawn_with_metrics(
        &url,
        &["server", "--queue", "q"],
        &format!("127.0.0.1:{server_port}"),
    );
    let _worker = AxProc::spawn_with_metrics(
        &url,
        &["worker", "--example", "--queue", "q", "--fail-rate", "0.3"],
        &format!("127.0.0.1:{worker_port}"),
    );
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
             rule_files: [{:?}]\n\
             scrape_configs:\n\
             - job_name: ax-server\n  static_configs: [{{targets: ['127.0.0.1:{server_port}']}}]\n\
             - job_name: ax-worker\n  static_configs: [{{targets: ['127.0.0.1:{worker_port}']}}]\n",
            deploy().join("ax-alerts.yml").display().to_string()
        ),
    )
    .unwrap();
    let _prometheus = tokio::process::Command::new(tool("prometheus"))
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("prometheus starts");
    let api = format!("http://127.0.0.1:{prom_port}/api/v1");
    let query = |q: String| {
        let api = api.clone();
        async move {
            let (status, body) = http(
                "GET",
                &format!("{api}/query?query={}", encode(&q)),
                &[],
                None,
            )
            .await;
            (status, body)
        }
    };
    // Load: immediate and delayed tasks, some failing and retried (fail rate 0.3), some
    // with one attempt (dead), some timing out, a refused submit, flow runs, and tasks
    // under a rate limit and a concurrency cap.
    let ax = env.ax.clone().wait_for_server(Duration::from_secs(30));
    ax.limits(
        "put",
        &json!({"name": "paced", "queue": "q", "task": "limited",
        "rate": 5.0, "burst": 1, "concurrency": 1, "adaptive": {"min": 1.0}}),
    )
    .await
    .unwrap();
    let flow = FlowDef::new("pair")
        .step(StepDef::new(
            "a",
            "q",
            TaskSpec::new("job").json(&json!({"sleep_ms": 10})),
        ))
        .step(
            StepDef::new(
                "b",
                "q",
                TaskSpec::new("job").json(&json!({"sleep_ms": 10})),
            )
            .needs(["a"]),
        );
    ax.put_flow(&flow).await.unwrap();
    for i in 0..60 {
        let mut spec = TaskSpec::new("job").json(&json!({"sleep_ms": 20, "i": i}));
        if i % 3 == 0 {
            spec = spec.delay(Duration::from_secs(1));
        }
        if i % 5 == 0 {
            spec = spec.max_attempts(1);
        }
        ax.submit("q", spec).await.unwrap();
    }
    for _ in 0..5 {
        let slow = TaskSpec::new("job")
            .json(&json!({"sleep_ms": 3000}))
            .timeout(Duration::from_millis(200));
        ax.submit("q", slow.max_attempts(1)).await.unwrap();
        ax.run_flow("pair", json!({})).await.unwrap();
    }
    for _ in 0..8 {
        ax.submit("q", TaskSpec::new("limited").json(&json!({"sleep_ms": 50})))
            .await
            .unwrap();
    }
    assert!(ax.submit("q", TaskSpec::new("bad name!")).await.is_err());
    // Both processes scraped, and enough samples for the dashboard's rates.
    eventually(
        Duration::from_secs(60),
        "prometheus to scrape both processes",
        || async {
            let (status, body) = query("sum(up)".into()).await;
            (status == 200 && body["data"]["result"][0]["value"][1] == "2").then_some(())
        },
    )
    .await;
    // Every panel shows data once the load has gone through, but two that need a fault
    // this load does not make: a worker without a handler for a name (unserved) and a
    // late result refused (stale).
    let quiet = ["ax_worker_unserved_total", "ax_stale_results_total"];
    let queries = dashboard_queries();
    assert!(queries.len() >= 25, "{} queries", queries.len());
    let mut empty: Vec<String> = Vec::new();
    for _ in 0..90 {
        empty.clear();
        for q in queries
            .iter()
            .filter(|q| !quiet.iter().any(|m| q.contains(m)))
        {
            let (_, body) = query(q.clone()).await;
            if body["data"]["result"].as_array().is_none_or(Vec::is_empty) {
                empty.push(q.clone());
            }
        }
        if empty.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(empty.is_empty(), "panels without data: {empty:#?}");
    // Every query of the dashboard is valid PromQL over the real series.
    for q in &queries {
        let (status, body) = query(q.clone()).await;
        assert_eq!(
            (status, body["status"].as_str()),
            (200, Some("success")),
            "{q}: {body}"
        );
    }
    // The alerting rules are loaded and evaluate without error.
    let (_, rules) = http("GET", &format!("{api}/rules"), &[], None).await;
    let loaded: Vec<&Value> = rules["data"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .collect();
    assert_eq!(loaded.len(), 8, "{rules}");
    eventually(Duration::from_secs(10), "every rule evaluated", || async {
        let (_, rules) = http("GET", &format!("{api}/rules"), &[], None).await;
        let all_ok = rules["data"]["groups"][0]["rules"]
            .as_array()?
            .iter()
            .all(|r| r["health"] == "ok");
        all_ok.then_some(())
    })
    .await;
}
