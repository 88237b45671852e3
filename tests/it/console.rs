//! The web console in a real headless Chromium, driven over WebDriver (Debian's `chromium`
//! and `chromium-driver`; `./dev test` installs them when missing). With
//! AX_SCREENSHOTS=1 the tests save the screenshots the README shows (docs/console-*.png).

use crate::procs::free_port;
use crate::support::{within, Env};
use ax::flow::{FlowDef, StepDef};
use ax::worker::{Task, TaskError, Worker};
use ax::{TaskSpec, TaskState};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One HTTP request (a fresh connection each time); answers the status and the body.
async fn http(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (u16, Value) {
    let uri: http::Uri = url.parse().unwrap();
    let addr = format!("{}:{}", uri.host().unwrap(), uri.port_u16().unwrap());
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::builder()
        .method(method)
        .uri(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header("host", &addr)
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let body = body.map_or(Bytes::new(), |b| Bytes::from(b.to_string()));
    let resp = sender
        .send_request(req.body(Full::new(body)).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// A chromedriver process and one headless browser session.
struct Browser {
    _driver: tokio::process::Child,
    base: String,
}

fn driver_binary() -> String {
    for c in ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"] {
        if std::path::Path::new(c).exists() {
            return c.to_string();
        }
    }
    panic!(
        "chromedriver not found: install Debian's chromium and chromium-driver (./dev test does)"
    );
}

impl Browser {
    async fn start() -> Browser {
        let port = free_port();
        let driver = tokio::process::Command::new(driver_binary())
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("chromedriver starts");
        let url = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        loop {
            let up = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok();
            if up
                && http("GET", &format!("{url}/status"), &[], None).await.1["value"]["ready"]
                    == true
            {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "chromedriver did not start"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--window-size=1280,900"]}
        }}});
        let (status, session) = http("POST", &format!("{url}/session"), &[], Some(caps)).await;
        assert_eq!(status, 200, "a browser session: {session}");
        let id = session["value"]["sessionId"].as_str().unwrap();
        Browser {
            _driver: driver,
            base: format!("{url}/session/{id}"),
        }
    }

    async fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (status, v) = http(method, &format!("{}{path}", self.base), &[], body).await;
        assert_eq!(status, 200, "{method} {path}: {v}");
        v["value"].clone()
    }

    async fn go(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({ "url": url }))).await;
    }

    /// The first element matching `css`, waiting up to 15 s for it.
    async fn find(&self, css: &str) -> String {
        let started = Instant::now();
        loop {
            let (status, v) = http(
                "POST",
                &format!("{}/element", self.base),
                &[],
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
            if status == 200 {
                return v["value"]
                    .as_object()
                    .and_then(|o| o.values().next())
                    .and_then(Value::as_str)
                    .unwrap()
                    .to_string();
            }
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "no element {css}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Runs an element command, finding the element again if the page re-rendered it
    /// meanwhile (live updates redraw the view).
    async fn on_element(&self, css: &str, what: &str, body: Value) {
        let started = Instant::now();
        loop {
            let e = self.find(css).await;
            let url = format!("{}/element/{e}/{what}", self.base);
            let (status, v) = http("POST", &url, &[], Some(body.clone())).await;
            if status == 200 {
                return;
            }
            assert!(
                v["value"]["error"] == "stale element reference"
                    && started.elapsed() < Duration::from_secs(15),
                "{what} {css}: {v}"
            );
        }
    }

    async fn click(&self, css: &str) {
        self.on_element(css, "click", json!({})).await;
    }

    async fn type_in(&self, css: &str, text: &str) {
        self.on_element(css, "value", json!({ "text": text })).await;
    }

    async fn script(&self, js: &str) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            Some(json!({"script": js, "args": []})),
        )
        .await
    }

    /// Waits (up to `secs`) until the script returns true.
    async fn until(&self, what: &str, secs: u64, js: &str) {
        let started = Instant::now();
        while self.script(js).await != Value::Bool(true) {
            assert!(
                started.elapsed() < Duration::from_secs(secs),
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Opens the console and logs in with the admin token.
    async fn login(&self, site: &str) {
        self.go(site).await;
        self.type_in("#token", "s3cret-admin").await;
        self.click("#login button").await;
        self.until(
            "the overview",
            15,
            "return document.querySelector('h1')?.textContent === 'Overview'",
        )
        .await;
    }

    async fn screenshot(&self, name: &str) {
        if std::env::var("AX_SCREENSHOTS").is_err() {
            return;
        }
        use base64::Engine;
        let png = self.cmd("GET", "/screenshot", None).await;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().unwrap())
            .unwrap();
        let path = format!("{}/docs/{name}", env!("CARGO_MANIFEST_DIR"));
        std::fs::write(path, bytes).unwrap();
    }
}

/// A worker on `q` whose tasks named `name` fail for good with `class` until `fixed` is
/// set; every other task succeeds.
fn failing_until_fixed(name: &'static str, class: &'static str) -> (Worker, Arc<AtomicBool>) {
    let fixed = Arc::new(AtomicBool::new(false));
    let flag = fixed.clone();
    let w = Worker::builder("q")
        .handler(move |task: Task| {
            let fixed = flag.clone();
            async move {
                if task.name == name && !fixed.load(Ordering::SeqCst) {
                    return Err(TaskError::permanent(class, "failed until fixed"));
                }
                Ok(())
            }
        })
        .build()
        .unwrap();
    (w, fixed)
}

fn console_env_server(port: u16) -> ax::ServerBuilder {
    Env::server().console(
        ax::console::ConsoleConfig::new(format!("127.0.0.1:{port}").parse().unwrap())
            .token("s3cret-admin")
            .readonly_token("viewer-token"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn find_a_dead_task_by_error_class_retry_it_and_watch_it_succeed() {
    within(Duration::from_secs(120), "console: dead task", async {
        let port = free_port();
        let env = Env::start(console_env_server(port)).await;
        let site = format!("http://127.0.0.1:{port}");
        let (w, fixed) = failing_until_fixed("charge", "card_declined");
        let _w = env.spawn_worker(w);
        for i in 0..30 {
            env.ax.submit("q", TaskSpec::new("send").json(&i)).await.unwrap();
        }
        let dead = env
            .ax
            .submit("q", TaskSpec::new("charge").max_attempts(1))
            .await
            .unwrap()
            .id;
        env.wait_state(&dead, TaskState::Dead, Duration::from_secs(10)).await;

        // The API refuses without a token, and the read-only token may not act.
        let (status, _) = http("POST", &format!("{site}/api/task/list"), &[], Some(json!({}))).await;
        assert_eq!(status, 401);
        let viewer = [("authorization", "Bearer viewer-token")];
        let (status, found) = http("POST", &format!("{site}/api/task/list"), &viewer, Some(json!({"state": "dead"}))).await;
        assert_eq!((status, found["ok"]["total"].as_u64()), (200, Some(1)), "{found}");
        let (status, _) = http("POST", &format!("{site}/api/task/retry"), &viewer, Some(json!({"id": dead}))).await;
        assert_eq!(status, 403);

        let b = Browser::start().await;
        b.login(&site).await;
        b.screenshot("console-overview.png").await;

        b.go(&format!("{site}/#/tasks")).await;
        b.until("the task search", 15, "return !!document.querySelector('#filters select[name=state]')").await;
        b.script(
            "const s = document.querySelector('#filters select[name=state]'); s.value = 'dead'; \
             s.dispatchEvent(new Event('change', {bubbles: true}));",
        )
        .await;
        b.type_in("#filters input[name=error_class]", "card_declined").await;
        b.click("#search").await;
        let link = format!("#results a[href='#/task/{dead}']");
        b.until("the dead task in the results", 15, &format!(
            "return document.querySelectorAll('#results tr').length === 2 && !!document.querySelector(\"{link}\")"
        ))
        .await;
        b.screenshot("console-tasks.png").await;
        b.click(&link).await;
        b.until("the task page", 15, "return document.querySelector('#state')?.textContent === 'dead'").await;
        let attempts = b.script("return document.querySelectorAll('#attempts tr').length").await;
        assert_eq!(attempts, json!(2), "one attempt row");

        fixed.store(true, Ordering::SeqCst);
        b.click("[data-act=retry]").await;
        // No reload: the page follows the change through the live updates.
        b.until("the retried task to succeed on the page", 20,
            "return document.querySelector('#state')?.textContent === 'succeeded'").await;
        b.screenshot("console-task.png").await;
        let rec = env.record(&dead).await;
        assert_eq!((rec.state, rec.attempt), (TaskState::Succeeded, 2));
        assert_eq!(rec.op.unwrap().by, "console");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_flow_step_shows_red_and_is_re_run() {
    within(Duration::from_secs(120), "console: flow", async {
        let port = free_port();
        let env = Env::start(console_env_server(port)).await;
        let site = format!("http://127.0.0.1:{port}");
        let (w, fixed) = failing_until_fixed("boom", "boom");
        let _w = env.spawn_worker(w);
        let def = FlowDef::new("pipeline")
            .step(StepDef::new("extract", "q", TaskSpec::new("ok")))
            .step(StepDef::new("transform", "q", TaskSpec::new("boom").max_attempts(1)).needs(["extract"]))
            .step(StepDef::new("load", "q", TaskSpec::new("ok")).needs(["transform"]));
        env.ax.put_flow(&def).await.unwrap();
        let run = env.ax.run_flow("pipeline", json!({})).await.unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(30), env.ax.wait_flow(&run))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ended.state, ax::flow::RunState::Failed);

        let b = Browser::start().await;
        b.login(&site).await;
        b.go(&format!("{site}/#/run/{run}")).await;
        b.until("the failed step drawn red", 15,
            "const g = document.querySelector('g[data-step=transform]'); \
             return !!g && g.dataset.state === 'failed' && g.querySelector('rect').getAttribute('fill') === '#fda29b'").await;
        let load = b.script("return document.querySelector('g[data-step=load]').dataset.state").await;
        assert_eq!(load, json!("upstream_failed"));
        b.screenshot("console-flow.png").await;

        fixed.store(true, Ordering::SeqCst);
        b.click("[data-act=rerun]").await;
        b.until("the re-run dialog", 10, "return !!document.querySelector('#rerun-dialog[open]')").await;
        b.click("#rerun-go").await;
        b.until("the run to succeed on the page", 30,
            "return document.querySelector('#run-state')?.textContent === 'succeeded' && \
             document.querySelector('g[data-step=transform]').dataset.state === 'succeeded'").await;
        let done = env.ax.flow_run(&run).await.unwrap().unwrap();
        assert_eq!(done.0.state, ax::flow::RunState::Succeeded);
    })
    .await
}
